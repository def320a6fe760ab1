"""Pipeline-native models on the native engine: every preset against the torch model, both
schedules, the byte counters, the critical path against `cflow analyze`, and bad plans."""

import numpy as np
import pytest
import torch

from cflow._native import core
from cflow.analysis.bandwidth import critical_paths, layer_bytes
from cflow.engine import Engine
from cflow.engine_ref import RefEngine
from cflow.errors import CflowError, CflowFormatError
from cflow.models.presets import PRESETS
from pnt_util import N_POS, N_PROMPT, TINY, make, tok  # noqa: F401 (tok: a fixture)

def run(eng, ids):
    """Logits of every position: a prefill of N_PROMPT tokens, then one decode step per token."""
    st = eng.new_state()
    pre = eng.forward(st, ids[:N_PROMPT], all_logits=True)
    return np.concatenate([pre, np.stack([eng.forward(st, [t]) for t in ids[N_PROMPT:]])])


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_runs_natively_as_the_torch_model(tmp_path, tok, name):
    m, path = make(tmp_path, tok, name)
    ids = torch.randint(0, TINY["vocab_size"], (1, N_POS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids)[0][0].numpy()
    ids = ids[0].tolist()
    got = {}
    for sched in ("sequential", "pipeline"):
        eng = Engine(path, threads=2, fast=False, schedule=sched)
        got[sched] = run(eng, ids)
        rel = np.linalg.norm(got[sched] - ref) / np.linalg.norm(ref)
        assert rel <= 1e-4, (sched, rel)
        np.testing.assert_array_equal(got[sched].argmax(-1), ref.argmax(-1))
    assert len(Engine(path, threads=2, schedule="pipeline").teams) == 2  # the lanes really ran apart
    np.testing.assert_array_equal(got["sequential"], got["pipeline"])  # the schedules: the same logits
    ref_eng = RefEngine(path)
    rel = np.linalg.norm(ref_eng.forward(ref_eng.new_state(), ids[:64], all_logits=True) - ref[:64]) / np.linalg.norm(ref[:64])
    assert rel <= 1e-4


@pytest.mark.parametrize("name", ["arch2_4_combined", "arch1"])
def test_schedules_agree_on_the_int8_path_and_in_batches(tmp_path, tok, name):
    """Fast (two-level int8) logits: identical across schedules, and a sequence batched with
    others gets exactly what it gets alone (the expert groups hold rows of several sequences)."""
    _, path = make(tmp_path, tok, name, "q8_0")
    ids = [list(range(3 + i, 40 + 2 * i)) for i in range(3)]
    out = {}
    for sched in ("sequential", "pipeline"):
        eng = Engine(path, threads=2, schedule=sched)
        sts = [eng.new_state() for _ in ids]
        alone = [eng.forward(s, x, all_logits=True) for s, x in zip(sts, ids)]
        sts2 = [eng.new_state() for _ in ids]
        together = eng.forward(sts2, ids, all_logits=True)
        for a, b in zip(alone, together):
            np.testing.assert_array_equal(a, b)
        step = eng.forward(sts2, [[5], [6], [7]])
        for s, t, b in zip(sts, [5, 6, 7], step):
            np.testing.assert_array_equal(eng.forward(s, [t]), b)
        out[sched] = together
    for a, b in zip(out["sequential"], out["pipeline"]):
        np.testing.assert_array_equal(a, b)


def test_byte_counters_read_top_k_of_the_experts(tmp_path, tok):
    m, path = make(tmp_path, tok, "arch4_async_experts", "q8_0")
    cfg = m.cfg
    normal = Engine(path, threads=2)
    every = Engine(path, threads=2, all_experts=True)
    f = normal.file
    all_expert_bytes = sum(f.tensor(n).nbytes for n in f.tensors if ".exp." in n)
    ids = list(range(10, 30))
    results = []
    for eng in (normal, every):
        st = eng.new_state()
        eng.forward(st, ids)
        before = eng.byte_counts()
        logits = [eng.forward(st, [t]) for t in (3, 4, 5, 6)]
        after = eng.byte_counts()
        steps = after["steps"] - before["steps"]
        per_token = {k: (after["bytes"][k] - before["bytes"][k]) / steps for k in after["bytes"]}
        results.append((per_token, logits))
    (norm, lg1), (alle, lg2) = results
    assert norm["experts"] == pytest.approx(all_expert_bytes * cfg.top_k / cfg.n_expert, rel=1e-9)
    assert alle["experts"] == all_expert_bytes
    assert norm["attention"] == sum(f.tensor(f"blk.{l}.{w}").nbytes for l in range(6) for w in ("attn_qkv", "attn_output"))
    assert norm["head"] == f.tensor("output").nbytes and norm["embed"] == f.tensor("tok_embd").nbytes // 320
    for a, b in zip(lg1, lg2):  # reading every expert changes nothing but the bytes
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_engine_critical_path_is_the_analysis(tmp_path, tok, name, wtype):
    m, path = make(tmp_path, tok, name, wtype)
    eng = Engine(path, threads=1)
    lp = critical_paths(m.cfg, layer_bytes(m.cfg, wtype))
    assert eng.critical_path_bytes == lp["longest_path"]
    assert eng._core.stream_bytes == lp["total"]


def test_cflow_analyze_reads_the_model(tmp_path, tok, capsys):
    import json

    from cflow.cli import main

    _, path = make(tmp_path, tok, "arch2_4_combined", "q8_0")
    assert main(["analyze", "--model", path, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["longest_path_mb_per_token"] == round(Engine(path).critical_path_bytes / 2**20, 4)
    assert main(["analyze"]) == 2


def plan_and_file(path):
    eng = Engine(path, threads=1)
    return eng.plan, eng.file.buffer, eng


def core_engine(plan, buf):
    try:
        return core.EngineCore(buf, buf, plan, 64, 1, True)
    except RuntimeError as e:
        raise CflowFormatError(str(e)) from None


def test_bad_expert_tables_and_routes_are_clear_errors(tmp_path, tok):
    _, path = make(tmp_path, tok, "arch2_4_sync", "q8_0")
    plan, buf, eng = plan_and_file(path)
    experts = plan.experts  # copies: each plan.experts is a new list of new entries
    bad = plan.experts
    bad[3].offset = len(buf)  # past the end of the file
    plan.experts = bad
    with pytest.raises(CflowFormatError, match=r"expert \(layer 0, expert 3\): byte range .* outside the mapped file"):
        core_engine(plan, buf)
    plan.experts = experts
    bad = plan.experts
    bad[5].offset += 4096  # its tensors no longer inside its range
    plan.experts = bad
    with pytest.raises(CflowFormatError, match=r"expert \(layer 1, expert 1\): tensor blk.1.exp.1.ffn_gate_up .* outside"):
        core_engine(plan, buf)
    plan.experts = experts[:-1]  # layer 5 lost its expert 3
    with pytest.raises(CflowFormatError, match="the expert table has no entry for layer 5, expert 3"):
        core_engine(plan, buf)
    plan.experts = experts
    ops = plan.ops
    i = next(k for k, o in enumerate(ops) if type(o).__name__ == "Router")
    ops[i].top_k = 5  # of 4 experts
    plan.ops = ops
    with pytest.raises(CflowFormatError, match=r"top_k 5 must be in 1..n_expert \(4\)"):
        core_engine(plan, buf)
    ops[i].top_k = 2
    j = next(k for k, o in enumerate(ops) if type(o).__name__ == "Experts")
    ops[j].n_expert = 3  # the router still picks among 4: expert 3 is out of this op's range
    plan.ops = ops
    ce = core_engine(plan, buf)
    st = ce.new_state()
    with pytest.raises(RuntimeError, match=r"routed expert id 3(\.0+)? is not a distinct expert of 0..2"):
        for t in range(40):  # until some token routes to expert 3
            ce.forward([st], [np.array([t], np.int32)], False, np.empty((1, 320), np.float32))
    assert st.pos < 40  # the failing step added nothing


def test_unknown_schedule(tmp_path, tok):
    _, path = make(tmp_path, tok, "arch1")
    with pytest.raises(CflowError, match="schedule must be one of sequential, pipeline"):
        Engine(path, schedule="vertical")


def test_teams_of_several_threads_give_the_same_logits(tmp_path, tok):
    """With more threads than lanes, teams have several threads (and meet at their own barriers);
    with one thread the pipeline schedule is the sequential one."""
    _, path = make(tmp_path, tok, "arch2_4_combined", "q8_0")
    ids = [list(range(3, 50)), list(range(7, 20))]
    outs = []
    for threads, sched in ((1, "pipeline"), (2, "sequential"), (3, "pipeline"), (5, "pipeline")):
        eng = Engine(path, threads=threads, schedule=sched)
        if sched == "pipeline":
            assert sum(t["threads"] for t in eng.teams) == threads
            assert len(eng.teams) == min(threads, 3)
        sts = [eng.new_state(), eng.new_state()]
        out = [np.concatenate(eng.forward(sts, ids, all_logits=True))]
        out += [np.stack(eng.forward(sts, [[1], [2]])) for _ in range(3)]
        outs.append(np.concatenate(out))
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o)
