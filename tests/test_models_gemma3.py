"""Gemma 3 270M (the real Q4_K_M GGUF from `cflow pull`): coherent text, and top-1 agreement with
Hugging Face transformers (fp32, same GGUF dequantized) on a teacher-forced sequence."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from cflow import hub  # noqa: E402
from test_models_smollm2 import TEXT  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path():
    return hub.pull("gemma3-270m", quiet=True)


@pytest.fixture(scope="module")
def llm(gguf_path):
    from cflow.llm import LLM

    return LLM(str(gguf_path), engine="ref", quiet=True, n_ctx=1024)


def test_writes_coherent_text(llm):
    text = llm.generate("Once upon a time", max_tokens=40)
    words = text.split()
    assert len(words) >= 20
    assert len(set(words)) > len(words) / 3  # not one token repeated
    assert sum(w.strip(".,!?\"'").isalpha() for w in words) > 0.8 * len(words)


def test_top1_agrees_with_transformers(llm, gguf_path):
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=True)[:128]
    ref_model = tf.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                        torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float().numpy()
    ours = llm.logits(ids)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.98


def test_kernels_on_the_real_tensors(gguf_path):
    """One tensor of each block type the model uses (Q5_0, Q4_K, Q6_K, Q8_0; the GGUF's row
    blocks as load_gguf keeps them) through every GEMV kernel and ISA, tiled at interleave 1 and
    16: fp32 paths within 1e-5 * sum|w x| of GGML's dequantization (gguf-py) times x, int8 paths
    within the bound of docs/KERNELS.md."""
    from gguf import GGMLQuantizationType as GT
    from gguf import quants

    from cflow import kernels as K
    from cflow.convert.gguf import load_gguf
    from cflow.format.tiles import block_type, pack_tiles

    isas = [i for i in ("scalar", "avx2", "avx512") if K.core.isa_supported(i)]
    picked = {}
    for t in load_gguf(gguf_path).tensors.values():
        if t.type in ("q5_0", "q4_k", "q6_k", "q8_0") and len(t.shape) == 2:
            picked.setdefault(t.type, t)
    assert set(picked) == {"q5_0", "q4_k", "q6_k", "q8_0"}
    rng = np.random.default_rng(0)
    for name, t in picked.items():
        rows, cols = 200, t.shape[1]  # the first 200 rows: one whole and one partial stripe
        rm = np.ascontiguousarray(t.data[:rows])
        W = quants.dequantize(rm, GT[name.upper()]).astype(np.float64).reshape(rows, cols)
        x = rng.standard_normal(cols).astype(np.float32)
        xd = x.astype(np.float64)
        yref, scale = W @ xd, np.abs(W) @ np.abs(xd)
        qk = block_type(name).block_elems
        d = np.repeat(np.abs(x.reshape(-1, qk)).max(axis=1), qk // 32) / 127.0  # per 32 columns
        bound = (np.abs(W).reshape(rows, -1, 32).sum(axis=2) * (d / 2)).sum(axis=1) + 1e-5 * scale
        tile = (128, 512 if qk == 256 else 256)
        for g in (1, 16):
            tiles = pack_tiles(rm, block_type(name), cols, tile, g)
            for isa in isas:
                yf = K.gemv(name, tiles, x, rows, cols, tile, g, act="f32", isa=isa)
                yq = K.gemv(name, tiles, x, rows, cols, tile, g, act="q8", isa=isa)
                assert np.all(np.abs(yf - yref) <= 1e-5 * scale), (name, g, isa)
                assert np.all(np.abs(yq - yref) <= bound), (name, g, isa)
