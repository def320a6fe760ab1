"""The expert tier (docs/ENGINE.md, "Experts on disk"): models run with a RAM budget below their
size under every policy give the tokens and logits they give fully in RAM, with experts really read
from the file into fewer slots than the model has experts; a damaged expert on disk is a clear
error naming it; budgets and policies that cannot work are refused before anything runs."""

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cflow.cli import main  # noqa: E402
from cflow.engine import EXPERT_POLICIES, Engine, parse_size  # noqa: E402
from cflow.errors import CflowError, CflowFormatError  # noqa: E402
from cflow.format import CflowFile  # noqa: E402
from pnt_util import make, tok  # noqa: E402,F401 (tok: a fixture)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok):
    """{name: .cflow path}: a pipeline-native model with an expert delay of 2 (reads issued at the
    router of layer l, used at l + 2) and one without delays, q8_0."""
    d = tmp_path_factory.mktemp("tier")
    return {name: make(d, tok, name, "q8_0")[1] for name in ("arch2_4_combined", "arch1")}


def budget_of(path, experts_cached: int) -> int:
    """A RAM budget that leaves room for that many experts besides the mapped weights."""
    f = CflowFile(path)
    slot = max((e.length + 4095) // 4096 * 4096 for e in f.experts.values())
    expert_bytes = sum((e.length + 4095) // 4096 * 4096 for e in f.experts.values())
    return f.size - expert_bytes + experts_cached * slot


def run(eng, ids, steps=12):
    """Logits of a prefill (every position) and `steps` greedy decode steps, and the tokens."""
    st = eng.new_state()
    pre = eng.forward(st, ids, all_logits=True)
    toks, outs = [int(pre[-1].argmax())], []
    for _ in range(steps):
        outs.append(eng.forward(st, [toks[-1]]))
        toks.append(int(outs[-1].argmax()))
    return np.concatenate([pre, np.stack(outs)]), toks


@pytest.mark.parametrize("name", ["arch2_4_combined", "arch1"])
@pytest.mark.parametrize("policy", EXPERT_POLICIES + ("staged-uring",))
def test_every_policy_under_a_small_budget_gives_the_same_tokens(models, name, policy):
    policy, _, io = policy.partition("-")
    path = models[name]
    ids = list(range(3, 60))
    ref, ref_toks = run(Engine(path, threads=2), ids)
    n_experts = len(CflowFile(path).experts)
    budget = budget_of(path, 9)  # 9 of the 24 experts: most reads are misses
    assert budget < os.path.getsize(path)
    for schedule in ("sequential", "pipeline"):
        eng = Engine(path, threads=2, ram_budget=budget, expert_policy=policy, schedule=schedule,
                     io_backend=io or "pread")
        got, toks = run(eng, ids)
        np.testing.assert_array_equal(got, ref)
        assert toks == ref_toks
        r = eng.tier_report()
        if policy == "mmap":
            assert r["slots"] == 0 and r["reads"] == 0
            continue
        assert 0 < r["slots"] < n_experts
        assert r["reads"] > n_experts  # experts left the cache and were read again
        assert r["bytes_read"] >= r["reads"] * 4096
        assert r["misses"] > 0 and r["hits"] + r["misses"] >= r["reads"] - r["hinted_reads"]
        assert r["io"] == (io or "pread") or (io == "uring" and r["io"] == "pread")  # a kernel may refuse io_uring
        if policy == "staged":
            assert r["predicted"] > 0 and 0 <= r["prediction_accuracy"] <= 1
            assert r["hinted_reads"] > 0
        else:
            assert r["predicted"] == 0 and r["hinted_reads"] == 0


def test_a_budget_beyond_the_model_runs_from_the_mapping(models):
    path = models["arch1"]
    eng = Engine(path, threads=1, ram_budget=os.path.getsize(path) + 1)
    assert eng.expert_policy == "mmap"
    assert Engine(path, threads=1, ram_budget=budget_of(path, 12)).expert_policy == "staged"


def test_batched_sequences_through_the_tier_match_alone(models):
    """Several sequences (prompts and decode rows) in one step share each expert read."""
    path = models["arch2_4_combined"]
    eng = Engine(path, threads=2, ram_budget=budget_of(path, 8), expert_policy="staged")
    ref = Engine(path, threads=2)
    prompts = [list(range(3 + i, 30 + 3 * i)) for i in range(3)]
    a = [ref.forward(ref.new_state(), p, all_logits=True) for p in prompts]
    sts = [eng.new_state() for _ in prompts]
    b = eng.forward(sts, prompts, all_logits=True)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def damaged_copy(path, dst, layer, expert):
    """A copy of path with one byte of expert (layer, expert)'s range flipped."""
    shutil.copy(path, dst)
    e = CflowFile(path).experts[(layer, expert)]
    with open(dst, "r+b") as fh:
        fh.seek(e.offset + e.length // 2)
        b = fh.read(1)
        fh.seek(e.offset + e.length // 2)
        fh.write(bytes([b[0] ^ 0x10]))
    return dst


@pytest.mark.parametrize("policy", ["sync", "staged", "staged-uring"])
def test_a_damaged_expert_is_an_error_naming_it(models, tmp_path, policy):
    policy, _, io = policy.partition("-")
    path = damaged_copy(models["arch1"], tmp_path / "damaged.cflow", 1, 2)
    eng = Engine(path, threads=2, expert_policy=policy, ram_budget=budget_of(path, 10), io_backend=io or "pread")
    st = eng.new_state()
    with pytest.raises(CflowError, match=r"expert \(layer 1, expert 2\).*checksum mismatch"):
        for t in range(3, 200):  # until a token routes to it
            eng.forward(st, [t])
    with pytest.raises(CflowFormatError, match=r"checksum mismatch"):
        CflowFile(path).verify()


def test_cli_generate_under_a_budget_prints_the_same_text(models, capsys):
    path = models["arch2_4_combined"]
    args = ["generate", "-m", path, "once upon a time", "-n", "12", "--temperature", "0", "-t", "2"]
    assert main(args) == 0
    ref = capsys.readouterr().out
    assert main(args + ["--ram-budget", str(budget_of(path, 9)), "--expert-policy", "staged"]) == 0
    assert capsys.readouterr().out == ref


def test_budgets_and_policies_that_cannot_work_are_refused(models, tmp_path):
    path = models["arch1"]
    f = CflowFile(path)
    resident = f.size - sum((e.length + 4095) // 4096 * 4096 for e in f.experts.values())
    with pytest.raises(CflowError, match="below the .* GiB of weights that stay mapped"):
        Engine(path, ram_budget=resident)
    with pytest.raises(CflowFormatError, match="raise the RAM budget"):
        Engine(path, ram_budget=budget_of(path, 1), expert_policy="staged")  # fewer slots than top_k x layers in flight
    with pytest.raises(CflowError, match="expert_policy must be one of"):
        Engine(path, expert_policy="fast")
    with pytest.raises(CflowError, match="io_threads"):
        Engine(path, expert_policy="staged", io_threads=0)
    with pytest.raises(CflowError, match="io_backend"):
        Engine(path, expert_policy="staged", io_backend="aio")
    for bad in ("", "8Q", "-1G", "0", True):
        with pytest.raises(CflowError, match="size"):
            parse_size(bad)
    assert parse_size("8G") == 8 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1.5k") == 1536
    assert parse_size(4096) == 4096


def test_a_dense_model_has_no_expert_tier(tiny_cflow):
    with pytest.raises(CflowError, match="no mixture-of-experts layers"):
        Engine(str(tiny_cflow), expert_policy="sync")
    assert Engine(str(tiny_cflow), ram_budget="1k").expert_policy == "mmap"  # nothing to move: the mapping
