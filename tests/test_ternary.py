"""Ternary weights end to end: GGUF's TQ1_0 / TQ2_0 blocks in the kernels (bit-identical to
gguf-py), the ternarizer, `cflow convert --quant tq2_0`, BitNet b1.58 against transformers, and the
BitNet-shaped benchmark GGUF in cflow and llama.cpp."""

import json
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants

from cflow import kernels as K
from cflow.cli import main
from cflow.engine import Engine
from cflow.format import CflowFile
from cflow.format.quant import ternarize
from cflow.format.tiles import block_type, pack_tiles

TERNARY = {"tq1_0": GT.TQ1_0, "tq2_0": GT.TQ2_0}
ISAS = [i for i in ("scalar", "avx2", "avx512") if K.core.isa_supported(i)]


def random_blocks(name, rows, cols, rng):
    """Every code (tq2_0's 3, which no quantizer writes, included), finite scales."""
    bt = block_type(name)
    b = rng.integers(0, 256, size=(rows * cols // 256, bt.block_bytes), dtype=np.uint8)
    b[:, -2:] = rng.uniform(-0.05, 0.05, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(TERNARY))
def test_kernels_dequantize_bit_identically_to_gguf(name):
    """The scalar fp32 GEMV times a one-hot x is column j of the matrix as the core decodes it: equal,
    bit for bit, to gguf-py's dequantization, at every position of a block (and in a second block)."""
    rng = np.random.default_rng(3)
    rows, cols = 40, 512
    rm = random_blocks(name, rows, cols, rng)
    want = quants.dequantize(rm, TERNARY[name]).reshape(rows, cols).astype(np.float32)
    tiles = pack_tiles(rm, block_type(name), cols, (32, 256), 1, "blocks")
    for j in list(range(256)) + [256, 300, 511]:
        x = np.zeros(cols, np.float32)
        x[j] = 1.0
        y = K.gemv(name, tiles, x, rows, cols, (32, 256), 1, act="f32", isa="scalar")
        assert np.array_equal(y, want[:, j]), j


@pytest.mark.parametrize("name", sorted(TERNARY))
def test_int8_and_masked_kernels_against_the_weights(name):
    """Every ISA's int8 path within the int8 bound of x's rounding, the multiplication-free fp32 path
    within fp32 rounding, at interleaves 1 and 4 and tiles narrower than the row."""
    rng = np.random.default_rng(5)
    rows, cols = 133, 1024
    rm = random_blocks(name, rows, cols, rng)
    W = quants.dequantize(rm, TERNARY[name]).reshape(rows, cols).astype(np.float64)
    x = rng.standard_normal(cols).astype(np.float32)
    exact = W @ x
    scale = np.abs(W) @ np.abs(x.astype(np.float64))
    d = np.repeat(np.abs(x.reshape(-1, 256)).max(axis=1) / 127.0, 8)  # q8_K: one scale per 256
    bound = (np.abs(W).reshape(rows, -1, 32).sum(axis=2) * (d / 2)).sum(axis=1) + 1e-5 * scale
    for g, tile in ((1, (128, 256)), (4, (64, 512)), (1, (128, 1024))):
        tiles = pack_tiles(rm, block_type(name), cols, tile, g, "blocks")
        for isa in ISAS:
            assert K.gemv_isa(name, "q8", isa) == isa and K.gemv_isa(name, "f32", isa) == isa
            for threads in (1, 2):
                y = K.gemv(name, tiles, x, rows, cols, tile, g, act="q8", isa=isa, threads=threads)
                assert np.all(np.abs(y - exact) <= bound), (isa, g, tile)
                y = K.gemv(name, tiles, x, rows, cols, tile, g, act="f32", isa=isa, threads=threads)
                assert np.all(np.abs(y - exact) <= 1e-5 * scale + 1e-30), (isa, g, tile)


def test_ternarize_keeps_ternary_values_and_rounds_by_absmean():
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, size=(4, 512)).astype(np.float32)
    s = np.repeat(np.float32([0.5, 0.25, 0.125, 2.0]), 512).reshape(4, 512)
    assert np.array_equal(ternarize(t * s), t * s)  # one scale per block: unchanged
    w = rng.standard_normal((3, 256)).astype(np.float32)
    tw = ternarize(w)
    for row, out in zip(w, tw):
        code = np.clip(np.rint(row / np.abs(row).mean()), -1, 1)
        d = np.abs(row[code != 0]).mean()
        np.testing.assert_allclose(out, code * d, rtol=1e-6)
    assert np.array_equal(ternarize(np.zeros((1, 256), np.float32)), np.zeros((1, 256), np.float32))
    # the ternary encoders then store the values exactly (the scale rounded to f16: here exact)
    for name, qt in TERNARY.items():
        assert np.array_equal(quants.dequantize(quants.quantize(t * s, qt), qt).reshape(4, 512), t * s), name


# ---------------------------------------------------------------- BitNet b1.58, ternary-valued

@pytest.fixture(scope="module")
def bitnet(tmp_path_factory):
    """A tiny BitNet whose layer matrices are ternary with a power-of-two scale per matrix (so f16
    holds it exactly), d_model and d_ff multiples of 256 (the ternary block)."""
    torch = pytest.importorskip("torch")
    import transformers as tf
    from models_tiny import train_tokenizer

    d = tmp_path_factory.mktemp("bitnet")
    torch.manual_seed(0)
    cfg = tf.BitNetConfig(vocab_size=301, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="relu2", tie_word_embeddings=False,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "layers" in name:
                p.copy_(torch.randint(-1, 2, p.shape).float() * 2.0 ** -4)
            else:
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(d, safe_serialization=True)
    train_tokenizer(d)
    return d, model


def logits_of(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rel_err(a, b) -> float:
    return float((np.abs(a - b).max(-1) / np.abs(b).max(-1)).max())


def test_convert_tq2_0_is_lossless_for_a_ternary_model(bitnet, tmp_path, capsys):
    d, model = bitnet
    out = tmp_path / "b.cflow"
    assert main(["convert", str(d), "-o", str(out), "--quant", "tq2_0", "--quiet"]) == 0
    printed = capsys.readouterr().out
    # the layers lose nothing; the text's greedy tokens move only by the q8_0 embedding and head
    assert "moved by 0.0%" in printed, printed
    assert float(re.search(r"the same at ([\d.]+)% of positions", printed).group(1)) >= 95, printed
    with CflowFile(out) as f:
        types = {n: t.type.name for n, t in f.tensors.items()}
        assert {types[n] for n in types if n.startswith("blk.") and n.endswith(("qkv", "output", "gate_up", "down"))} \
            == {"tq2_0"}
        assert types["tok_embd"] == types["output"] == "q8_0"
        # transformers with the embedding table and head the file holds (q8_0), every other weight as it is
        sd = model.state_dict()
        emb, head = f.dequantize("tok_embd"), f.dequantize("output")
    import torch

    ref_model = type(model)(model.config).eval()
    ref_model.load_state_dict(dict(sd, **{"model.embed_tokens.weight": torch.from_numpy(emb),
                                         "lm_head.weight": torch.from_numpy(head)}))
    ids = [int(i) for i in np.random.default_rng(1).integers(3, 301, 64)]
    ref = logits_of(ref_model, ids)
    e = Engine(str(out), threads=2, fast=False)  # fp32 activations
    assert rel_err(e.forward(e.new_state(), ids, all_logits=True), ref) <= 1e-3
    e = Engine(str(out), threads=2)  # the default: int8 activations
    got = e.forward(e.new_state(), ids, all_logits=True)
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.95 and rel_err(got, ref) <= 5e-2


def test_packed_hf_bitnet_checkpoints_are_refused_clearly(bitnet, tmp_path, capsys):
    import shutil

    d, _ = bitnet
    packed = tmp_path / "packed"
    shutil.copytree(d, packed)
    c = json.loads((packed / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "bitnet", "linear_class": "autobitlinear"}
    (packed / "config.json").write_text(json.dumps(c))
    assert main(["convert", str(packed), "-o", str(tmp_path / "x.cflow"), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "packed ternary weights" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.cflow").exists()


# ---------------------------------------------------------------- the benchmark GGUF

@pytest.fixture(scope="module")
def bench_models(tmp_path_factory):
    from cflow.bench.ternary_model import Geometry, write

    d = tmp_path_factory.mktemp("tmodel")
    g = Geometry(n_layer=2, d_model=512, n_head=8, n_head_kv=2, d_ff=1024, vocab=1024)
    return {t: write(d / f"{t}.gguf", g, t, seed=7, progress=False)["path"] for t in ("tq2_0", "tq1_0", "q4_0")}


def test_bench_model_is_one_model_in_three_types(bench_models, tmp_path):
    """The same seed writes the same weights in TQ2_0, TQ1_0 and Q4_0: fp32-activation logits equal
    to fp32 rounding; llama.cpp (where installed) picks the same greedy tokens."""
    ids = [int(i) for i in np.random.default_rng(0).integers(300, 1000, 24)]
    got = {}
    for t, path in bench_models.items():
        out = tmp_path / f"{t}.cflow"
        assert main(["convert", path, "-o", str(out), "--quiet"]) == 0
        with CflowFile(out) as f:
            assert f.tensors["blk.0.ffn_down"].type.name == t
        e = Engine(str(out), threads=2, fast=False)
        got[t] = e.forward(e.new_state(), ids, all_logits=True)
    for t in ("tq1_0", "q4_0"):
        assert rel_err(got[t], got["tq2_0"]) <= 1e-5, t
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=bench_models["tq2_0"], n_threads=2, n_ctx=64, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    assert np.mean(theirs.argmax(1) == got["tq2_0"].argmax(1)) >= 0.95
