"""Tiny random-weight models of every supported architecture, converted from safetensors, against
Hugging Face transformers itself: teacher-forced logits and greedy continuations, on the native
engine and on the numpy reference engine."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from models_tiny import build  # noqa: E402

from cflow.convert import load_source  # noqa: E402
from cflow.llm import LLM  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "bitnet"]
ENGINES = ["native", "ref"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, build(request.param, d)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position: max |ours - ref| / max |ref|."""
    return np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)


def test_config_maps_the_architecture(tiny):
    arch, d, _ = tiny
    c = load_source(d).config
    assert c.arch == arch and (c.d_model, c.d_ff, c.n_head, c.n_kv_head, c.head_dim) == (72, 136, 6, 2, 12)
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch in ("qwen3", "gemma3"))
    assert c.sub_norms == (arch == "bitnet") and (c.act == "relu2") == (arch == "bitnet")
    if arch == "gemma3":
        assert c.layer_types == ["sliding", "global", "sliding"] and c.sliding_window == 5


@pytest.mark.parametrize("engine", ENGINES)
def test_teacher_forced_logits_match_transformers(tiny, engine):
    arch, d, model = tiny
    ids = [int(i) for i in np.random.default_rng(1).integers(3, 301, 64)]  # longer than gemma's window
    eng = LLM(str(d), engine=engine, fast=False, quiet=True, cache=d / "cache").engine
    ours = eng.forward(eng.new_state(), ids, all_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    assert ours.shape == ref.shape
    assert rel_err(ours, ref).max() < 1e-3
    # token by token through the KV cache gives the same logits as the batch
    st = eng.new_state()
    step = np.stack([eng.forward(st, [t]) for t in ids[:20]])
    assert rel_err(step, ours[:20]).max() < 1e-4


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_continuation_matches_transformers(tiny, engine):
    arch, d, model = tiny
    llm = LLM(str(d), engine=engine, fast=False, quiet=True, cache=d / "cache")
    prompt = llm.tokenizer.encode("Once upon a time", add_special_tokens=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    chunks = list(llm.complete(prompt, max_tokens=24, temperature=0))
    got = [t for c in chunks for t in c.token_ids]
    eos = llm.tokenizer.eos_token_ids
    n = next((i for i, t in enumerate(ref) if t in eos), len(ref))  # we stop at EOS, HF was told not to
    assert got == ref[:n]
    assert chunks[-1].usage.completion_tokens == n
