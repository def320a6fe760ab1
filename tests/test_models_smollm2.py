"""SmolLM2-135M-Instruct (the real Q4_1 GGUF, fetched with `cflow pull`) on the native engine
against Hugging Face transformers, which loads the same GGUF dequantized to fp32: teacher-forced
logits over 256 tokens (fp32-activation path within 1e-3, fast int8 path's top-1 agreement), and
the greedy 64-token continuation of a fixed prompt (fp32 path).

The reference's greedy continuation is checked with one teacher-forced forward over prompt +
cflow's 64 tokens: the two greedy sequences are equal exactly when the reference's argmax at
every step is the token cflow chose (64 separate generate() steps of the fp32 reference would
cost minutes on a 2-core CI machine)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from cflow import hub

TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. For forty years "
    "Margaret had climbed its spiral stairs every evening to light the lamp, even after the ships stopped coming. "
    "The village below had grown quiet; the fishermen had moved to the city, and the school had closed. Still, she "
    "believed that somewhere out on the dark water a sailor might need the light. One stormy night in November, "
    "she saw a small boat struggling against the waves. Its sail was torn and its mast was bent. Margaret grabbed "
    "her lantern and ran down to the harbor, where she rang the old bell as loudly as she could. The sound carried "
    "over the wind, and slowly the boat turned toward the shore. When it finally reached the dock, a young girl "
    "stepped out, soaked and shivering. She said her name was Lucy and that she had been trying to reach the "
    "island to find her grandfather. Margaret wrapped her in a blanket and made her a cup of hot chocolate. They "
    "talked until the sun came up, and by morning Margaret knew that her light had mattered after all. "
)


@pytest.fixture(scope="module")
def gguf_path():
    return hub.pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="module")
def reference(gguf_path):
    return tf.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                   torch_dtype=torch.float32).eval()


def ref_logits(reference, ids) -> np.ndarray:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def fp32(gguf_path):
    from cflow.llm import LLM

    return LLM(str(gguf_path), engine="native", fast=False, quiet=True)


@pytest.fixture(scope="module")
def text_ids(fp32):
    ids = fp32.tokenizer.encode(TEXT + TEXT)[:256]  # the text is 222 tokens
    assert len(ids) == 256
    return ids


@pytest.fixture(scope="module")
def text_ref(reference, text_ids):
    return ref_logits(reference, text_ids)


def test_fp32_path_logits_within_1e_3(fp32, text_ids, text_ref):
    ours = fp32.logits(text_ids)
    err = np.abs(ours - text_ref).max(-1) / np.abs(text_ref).max(-1)
    assert err.max() < 1e-3, f"max relative error {err.max():.2e} at position {err.argmax()}"
    assert (ours.argmax(-1) == text_ref.argmax(-1)).all()


# One-level int8 activations (--activations int8, as llama.cpp's q8 activations) measured 97.7%
# here: quantizing activations to int8 flips near-ties (docs/MODELS.md, "Parity"). The bound
# guards against regressions; the default two-level path below carries the 98% acceptance.
FAST_TOP1_MIN = 0.95


def test_one_level_int8_top1_agreement(gguf_path, text_ids, text_ref):
    from cflow.llm import LLM

    fast = LLM(str(gguf_path), engine="native", fast=True, precise=False, quiet=True)
    assert fast.engine.activations == "int8"
    ours = fast.logits(text_ids)
    agree = (ours.argmax(-1) == text_ref.argmax(-1)).mean()
    assert agree >= FAST_TOP1_MIN, f"top-1 agreement {agree:.3f}"
    err = np.abs(ours - text_ref).max(-1) / np.abs(text_ref).max(-1)
    assert 1e-4 < err.max() < 0.2  # int8 activations really ran, and stayed close


def test_default_fast_path_top1_agreement(gguf_path, text_ids, text_ref):
    """Two-level int8 activations (the default): every weight's input carries ~14 bits, prefill
    (planes GEMM, both levels in one pass) and decode (planes GEMV, likewise) alike."""
    from cflow.llm import LLM

    fast = LLM(str(gguf_path), engine="native", quiet=True)
    assert fast.engine.activations == "int8x2"
    ours = fast.logits(text_ids)
    assert (ours.argmax(-1) == text_ref.argmax(-1)).mean() >= 0.98
    st = fast.engine.new_state()
    dec = np.stack([fast.engine.forward(st, [t]) for t in text_ids[:64]])
    assert (dec.argmax(-1) == text_ref[:64].argmax(-1)).mean() >= 0.98
    err = np.abs(ours - text_ref).max(-1) / np.abs(text_ref).max(-1)
    assert err.max() < 0.02


def test_default_path_at_least_as_faithful_as_llama_cpp(gguf_path, text_ids, text_ref):
    """The acceptance: on the same file and the same token ids, the default path's top-1
    agreement with transformers is at least llama.cpp's: 100% against 96.5% on these 256 tokens
    (96.9% on the built-in text of `cflow bench fidelity`, docs/MODELS.md)."""
    from cflow.bench.fidelity import cflow_logits, compare

    ours, setting = cflow_logits(str(gguf_path), text_ids, "int8x2", threads=2)  # the GGUF's cached conversion
    assert setting == "int8x2"
    ours = compare(ours, text_ref)
    assert ours["top1"] >= 0.98
    pytest.importorskip("llama_cpp")
    from cflow.bench.fidelity import llama_cpp_logits

    logits, ran = llama_cpp_logits(str(gguf_path), text_ids, threads=2)
    assert ran["flash_attn"] is True  # as llama.cpp's own tools run it on a CPU
    theirs = compare(logits, text_ref)
    assert theirs["top1"] > 0.9  # llama.cpp saw the same tokens (a shifted sequence agrees far less)
    assert ours["top1"] >= theirs["top1"], (ours, theirs)
    assert ours["rel_err_mean"] <= theirs["rel_err_mean"]


def test_bench_fidelity_command(gguf_path, reference, capsys, monkeypatch):
    """`cflow bench fidelity --json` end to end on a few positions: a row per setting over the same
    positions, and llama.cpp reported as skipped where llama-cpp-python is missing (made so here).
    The reference is this module's transformers model, already loaded: loading it a second time
    costs most of a minute on a 2-core machine."""
    import json

    from cflow.bench import fidelity
    from cflow.cli import main

    monkeypatch.setattr(fidelity, "llama_cpp_available", lambda: False)
    monkeypatch.setattr(fidelity, "reference_logits",
                        lambda gguf, ids, threads=None: (ref_logits(reference, ids),
                                                         {"transformers": tf.__version__, "attn_implementation": "sdpa"}))
    assert main(["bench", "fidelity", "-m", str(gguf_path), "--tokens", "24", "--settings",
                 "fp32,int8x2,int8x2:head,int8x2@q8_0", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["positions"] == 24 and rec["quant_mix"] == {"Q4_1": 210, "Q8_0": 1} and not rec["bos_first"]
    assert [(r["engine"], r["setting"], r["pass"], r["default"]) for r in rec["rows"]] == [
        ("cflow", "fp32", "prefill", False), ("cflow", "int8x2", "prefill", True),
        ("cflow", "int8x2:head", "prefill", False), ("cflow", "int8x2@q8_0", "prefill", False)]
    assert rec["rows"][0]["top1"] == 1.0 and rec["rows"][0]["rel_err_mean"] < 1e-4
    # a q8_0 KV cache: near the f16 cache's logits, not equal to them
    assert rec["rows"][3]["top1"] >= 0.9 and rec["rows"][1]["rel_err_mean"] < rec["rows"][3]["rel_err_mean"] < 0.05
    assert any("llama.cpp skipped" in n for n in rec["notes"])
    assert fidelity.report(rec).count("\n") >= 6


def test_greedy_64_tokens_equal_the_reference(fp32, reference):
    prompt = fp32.tokenizer.encode("Once upon a time")
    got = [t for c in fp32.complete(prompt, max_tokens=64, temperature=0) for t in c.token_ids]
    assert len(got) == 64
    ref = ref_logits(reference, prompt + got[:-1])[len(prompt) - 1:]
    assert ref.argmax(-1).tolist() == got


def test_tokenizer_matches_the_reference_tokenizer(fp32, gguf_path):
    ref = tf.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for s in (TEXT[:300], "In 2024, 1234567 cats 🤗 said héllo!\n\n  ok", "<|im_start|>user\nhi<|im_end|>"):
        assert fp32.tokenizer.encode(s) == ref.encode(s, add_special_tokens=False)


def test_bench_decode_vs_llama_cpp(gguf_path):
    """The comparison itself, where the optional extra (llama-cpp-python) is installed: both
    engines' figures, per-run ratios and llama.cpp's per-step times from its own counters."""
    pytest.importorskip("llama_cpp")
    from cflow.bench.decode import run
    from cflow.engine import Engine
    from cflow.llm import load_model

    src = load_model(str(gguf_path), quiet=True)
    eng = Engine(src, threads=1, n_ctx=1024)
    exact = lambda: Engine(src, threads=1, n_ctx=1024, fast=False)  # noqa: E731
    rec = run(eng, name="smollm2-135m", threads=1, gguf=str(gguf_path), runs=2, tokens=4, prompt_len=32,
              agreement=16, exact=exact, log=lambda *a: None)
    vs = rec["vs"]["llama.cpp"]
    # teacher-forced greedy picks: each engine against the other and against cflow's fp32 path
    assert vs["agreement_positions"] == 16
    for a in (vs["top1_agreement"], vs["top1_agreement_with_cflow_fp32"], rec["top1_agreement_with_fp32"]):
        assert 0 <= a <= 1 and a * 16 == pytest.approx(round(a * 16))
    assert rec["top1_agreement_with_fp32"] >= 0.9  # two int8 levels against exact arithmetic
    assert len(vs["decode_runs"]) == len(vs["prefill_runs"]) == len(vs["ratio_decode_runs"]) == 2
    assert vs["decode_tok_s"] > 0 and vs["prefill_tok_s"] > 0 and vs["decode_step_ms_median"] > 0
    assert vs["ratio_decode"] == pytest.approx(rec["decode_tok_s"] / vs["decode_tok_s"], rel=0.01)
    assert vs["ratio_decode_step"] == pytest.approx(vs["decode_step_ms_median"] / rec["decode_step_ms_median"],
                                                    rel=0.01)
    # llama.cpp with flash attention, as its own tools run it on a CPU, unless asked otherwise
    assert vs["flash_attn"] is True and vs["kv_cache"] == "f16"
    rec = run(eng, name="smollm2-135m", threads=1, gguf=str(gguf_path), runs=1, tokens=4, prompt_len=32,
              log=lambda *a: None, flash_attn=False)
    assert rec["vs"]["llama.cpp"]["flash_attn"] is False


def test_llama_cpp_runs_sequences_side_by_side(gguf_path):
    """`bench decode --batch N --vs llama.cpp` times llama.cpp's own steps of N sequences: each
    sequence of a batch gets its own logits (those it gets alone, up to llama.cpp's rounding), so
    the step is N real sequences."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from cflow.bench.decode import LlamaCppRunner
    from cflow.errors import CflowError

    runner = LlamaCppRunner(str(gguf_path), 1, 1024, n_seq=4)
    # each sequence its own KV cells, a quarter of the context (as llama-server's slots): in one
    # unified buffer each sequence's attention would span all four sequences' cells
    assert llama_cpp.llama_n_ctx_seq(runner.ctx) == 256 and llama_cpp.llama_n_ctx(runner.ctx) == 1024
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(100, 5000, 3 + 4 * i)] for i in range(4)]
    together = runner.batched_logits(prompts)
    alone = [runner.batched_logits([p])[0] for p in prompts]
    for i, got in enumerate(together):
        # Its own sequence's logits, not another's. llama.cpp's kernels may round a batch's rows
        # differently from one sequence's (an AVX2 host, llama-cpp-python 0.3.36: one of the four
        # off by 1.3% of the largest logit, the others exact), while another sequence's logits
        # are 40-90% away.
        off = [float(np.abs(got - a).max() / np.abs(a).max()) for a in alone]
        assert int(np.argmin(off)) == i and off[i] < 0.05, off
        assert got.argmax() == alone[i].argmax()
    assert len({int(x.argmax()) for x in together}) > 1  # four different sequences, not one four times
    steps = runner.batched_steps(prompts[-1], 4, 3)
    assert len(steps) == 3 and min(steps) > 0
    # Four prompts of 200 tokens (`--depth 200 --batch 4`) exceed the tokens one llama_decode takes
    # (llama.cpp aborts the process there): they go in pieces, the last tokens together, and each
    # sequence's logits are again its own.
    long_ = [[int(t) for t in rng.integers(100, 5000, 200)] for _ in range(4)]
    together, alone = runner.batched_logits(long_), [runner.batched_logits([p])[0] for p in long_]
    for i, got in enumerate(together):
        off = [float(np.abs(got - a).max() / np.abs(a).max()) for a in alone]
        assert int(np.argmin(off)) == i and off[i] < 0.05, off
    assert len(runner.batched_steps(long_[0], 4, 2)) == 2
    with pytest.raises(CflowError, match="opened for 4"):
        runner.batched_steps(prompts[-1], 5, 1)
    most = llama_cpp.llama_max_parallel_sequences()
    with pytest.raises(CflowError, match=f"at most {most} sequences"):
        LlamaCppRunner(str(gguf_path), 1, 1024, n_seq=most + 1)


def test_bench_decode_batch_vs_llama_cpp(gguf_path):
    pytest.importorskip("llama_cpp")
    from cflow.bench.decode import report, run
    from cflow.engine import Engine
    from cflow.llm import load_model

    eng = Engine(load_model(str(gguf_path), quiet=True), threads=1, n_ctx=1024)
    rec = run(eng, name="smollm2-135m", threads=1, gguf=str(gguf_path), runs=2, tokens=3, prompt_len=16, batch=2,
              log=lambda *a: None)
    ours, theirs = rec["batch"], rec["vs"]["llama.cpp"]["batch"]
    for b in (ours, theirs):
        assert b["sequences"] == 2 and b["step_ms_median"] > 0 and b["one_step_ms_median"] > 0
        assert b["x_one"] == pytest.approx(2 * b["one_step_ms_median"] / b["step_ms_median"], rel=0.01)
    assert theirs["ratio_step"] == pytest.approx(theirs["step_ms_median"] / ours["step_ms_median"], rel=0.01)
    assert "llama.cpp: 2 sequences: median step" in report(rec)
