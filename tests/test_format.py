"""The .cflow container: writer/reader round trips, fused groups, the expert table, atomic writes."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings, strategies as st

from cflow.cli import main as cli
from cflow.config import ModelConfig
from cflow.errors import CflowError, CflowFormatError, UnsupportedError
from cflow.format import CflowFile, CflowWriter, decode_order, fuse_rows
from cflow.format import quant
from cflow.format.spec import ALIGN, TENSOR_ALIGN, fused_row_order
from cflow.format.tiles import BLOCK_TYPES, block_type, pack_tiles

CFG = ModelConfig(arch="llama", vocab_size=300, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96,
                  n_expert=4, top_k=2, d_expert=32)
TYPES = sorted(BLOCK_TYPES)


def encoded_rows(name: str, rows: int, cols: int, rng) -> np.ndarray:
    """GGUF-encoded rows of block type `name`: quantized by gguf-py where it can, else random
    blocks with finite f16 scales (q4_k, q5_k, q6_k: gguf-py has no quantizer for them)."""
    bt = block_type(name)
    if quant.can_encode(bt) and name not in quant.TERNARY:
        return quant.encode(rng.standard_normal((rows, cols)).astype(np.float32), bt)
    # random codes (tq2_0: code 3 too, which no quantizer writes) and finite scales
    blocks = rng.integers(0, 256, size=(rows * cols // bt.block_elems, bt.block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((blocks.shape[0], 2)) * 0.01).astype("<f2").view(np.uint8)
    if name in ("q4_k", "q5_k"):  # d, dmin: bytes 0..3
        blocks[:, 0:4] = scales
    else:  # q6_k, tq1_0, tq2_0: d in the last two bytes
        blocks[:, -2:] = scales[:, :2]
    return blocks.reshape(rows, -1)


def test_gguf_py_quantizers_are_what_quant_says():
    # every encodable type is gguf-py's bytes, but Q4_0 and Q4_1: cflow's fitted scales (below)
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    for name in TYPES:
        bt = block_type(name)
        if name in quant.FITTED:
            assert np.array_equal(quant.encode(x, bt), quant.encode_fit(x, name))
        elif quant.can_encode(bt):
            assert np.array_equal(quant.encode(x, bt), np.asarray(gguf_quantize(x, GGMLQuantizationType(bt.code))).view(np.uint8).reshape(2, -1))
        else:
            with pytest.raises(UnsupportedError, match="GGUF-encoded"):
                quant.encode(x, bt)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dist=st.sampled_from(["normal", "t2", "uniform", "spiky", "zeros", "shifted"]),
       scale=st.sampled_from([1e-4, 1.0, 300.0]), name=st.sampled_from(["q4_0", "q4_1"]))
def test_fitted_q4_is_plain_q4_and_never_worse_than_gguf_py(seed, dist, scale, name):
    # cflow's own Q4_0 and Q4_1 (quant.encode: the writer, convert, export): plain blocks that
    # gguf-py decodes, each with at most the squared error of gguf-py's own quantizer on the same
    # block, and less overall
    rng = np.random.default_rng(seed)
    shape = (6, 128)
    x = {"normal": lambda: rng.standard_normal(shape), "t2": lambda: rng.standard_t(2, shape),
         "uniform": lambda: rng.uniform(-1, 1, shape), "zeros": lambda: np.zeros(shape),
         "spiky": lambda: rng.standard_normal(shape) * (rng.random(shape) < 0.05) * 20,
         "shifted": lambda: rng.standard_normal(shape) + 3.0}[dist]()
    # within the fp16 scales' reach: Q4_1 keeps a block's minimum as an fp16 (at most 65504), so at
    # scale 300 the values stay within +-200 (a t2 draw reaches 1000; too-large blocks: the test below)
    x = (np.clip(x, -200, 200) * scale).astype(np.float32)
    x[0, :32] = 0.0  # a block of zeros stays zeros
    x[1, :32] = 0.5 * scale  # so does a constant block
    q = GGMLQuantizationType.Q4_0 if name == "q4_0" else GGMLQuantizationType.Q4_1
    ours = quant.encode(x, block_type(name))
    ref = np.asarray(gguf_quantize(x, q)).view(np.uint8).reshape(shape[0], -1)
    assert ours.shape == ref.shape and ours.dtype == np.uint8
    got = np.asarray(gguf_dequantize(ours, q)).reshape(shape)
    e_ours = ((got - x).astype(np.float64) ** 2).reshape(-1, 32).sum(1)
    e_ref = ((np.asarray(gguf_dequantize(ref, q)).reshape(shape) - x).astype(np.float64) ** 2).reshape(-1, 32).sum(1)
    assert np.all(e_ours <= e_ref * (1 + 1e-5) + 1e-30)
    assert np.all(got[0, :32] == 0)
    if name == "q4_1":  # a constant: d = 0 and m exact up to fp16
        assert np.all(got[1, :32] == np.float16(0.5 * scale).astype(np.float32))
    if dist in ("normal", "uniform", "shifted"):
        assert e_ours.sum() < 0.97 * e_ref.sum()


@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_fitted_q4_is_the_same_on_any_number_of_threads(name):
    # the native search splits the blocks over a pool of its own: each block's bytes are its own
    from cflow._native import core

    x = np.random.default_rng(3).standard_t(3, (300, 1024)).astype(np.float32)  # 9600 blocks: split
    one = core.quantize_fit(name, x, 1)
    assert np.array_equal(one, core.quantize_fit(name, x, 3))
    assert np.array_equal(one, quant.encode(x, block_type(name)))
    with pytest.raises(ValueError, match="multiple of 32"):
        core.quantize_fit(name, np.zeros((2, 48), np.float32), 1)
    with pytest.raises(ValueError, match="q4_0' or 'q4_1"):
        core.quantize_fit("q5_0", x, 1)


@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_values_beyond_the_fp16_scale_are_a_clear_error(name):
    # Q4_0's scale is |extreme| / 8, Q4_1's the range / 15: an fp16 holds at most 65504
    x = np.zeros((2, 64), np.float32)
    x[1, 40] = 3e6
    with pytest.raises(CflowFormatError, match=f"1 block.*too large for {name}'s fp16 scale"):
        quant.encode(x, block_type(name))
    x[1, 40] = 3e5 if name == "q4_0" else 6e5  # within reach: encodes
    assert quant.encode(x, block_type(name)).shape == (2, quant.row_bytes(block_type(name), 64))


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
def test_quantizing_nan_or_infinity_is_a_clear_error_and_writes_nothing(tmp_path, name):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    x[2, 5] = np.nan if name != "q4_1" else np.inf
    with pytest.raises(CflowFormatError, match="NaN or infinity"):
        quant.encode(x, block_type(name))
    out = tmp_path / "m.cflow"
    with pytest.raises(CflowFormatError, match="tensor 'w'.*NaN or infinity"):
        with CflowWriter(str(out), ModelConfig(arch="llama", vocab_size=8, d_model=64, n_layer=1, n_head=1,
                                               n_kv_head=1, d_ff=64)) as w:
            w.add_tensor("w", name, x)
    assert not out.exists() and not list(tmp_path.iterdir())


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(TYPES), rows=st.integers(1, 300), nblk=st.integers(1, 5),
       tile=st.sampled_from([(128, 256), (64, 512), (32, 256), (16, 1024)]), interleave=st.sampled_from([1, 4, 16]),
       from_float=st.booleans())
def test_round_trip_every_block_type(tmp_path_factory, name, rows, nblk, tile, interleave, from_float):
    bt = block_type(name)
    qk = bt.block_elems
    cols = nblk * 256 + (37 if qk == 1 else 0)  # ragged last column tile; f32/f16/bf16: not a multiple of 32
    rng = np.random.default_rng(rows * 7 + nblk)
    path = tmp_path_factory.mktemp("rt") / "m.cflow"
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    from_float = from_float and quant.can_encode(bt)
    enc = quant.encode(x, bt) if from_float else encoded_rows(name, rows, cols, rng)
    with CflowWriter(path, CFG, tokenizer_json='{"model": {}}', chat_template="{{ x }}") as w:
        t = w.add_tensor("w", name, x if from_float else enc, tile=tile, interleave=interleave)
    assert (t.shape, t.tile, t.interleave) == ((rows, cols), tile, interleave)
    with CflowFile(path, verify=True) as f:
        t = f.tensors["w"]
        assert (t.type, t.shape, t.tile, t.interleave) == (bt, (rows, cols), tile, interleave)
        assert np.array_equal(f.tensor_bytes("w"), pack_tiles(enc, bt, cols, tile, interleave))
        assert np.array_equal(f.row_blocks("w"), enc)  # bit-identical to GGUF's row encoding
        want = gguf_dequantize(enc, GGMLQuantizationType(bt.code)) if name not in ("f32", "f16") else \
            enc.view("<f4" if name == "f32" else "<f2").astype(np.float32)
        assert np.array_equal(f.dequantize("w"), want)
        if name == "f32" and from_float:
            assert np.array_equal(f.dequantize("w"), x)


def test_header_fields_round_trip(tmp_path):
    path = tmp_path / "m.cflow"
    cfg = ModelConfig(arch="pnt", vocab_size=300, d_model=64, n_layer=4, n_head=4, n_kv_head=4, n_expert=4,
                      top_k=2, d_expert=32, delta_d=1, delta_e=2, combine="async_experts", act="gelu_tanh")
    tok = '{"version": "1.0", "model": {"type": "BPE", "vocab": {"é": 0}}}'
    with CflowWriter(path, cfg, tokenizer_json=tok, chat_template="{% for m in messages %}{{ m }}{% endfor %}",
                     special_tokens={"bos_token_id": 1, "eos_token_ids": [2, 3], "add_bos": True}, metadata={"source": "x.gguf", "quant": "q4_0"},
                     generation={"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}) as w:
        w.add_tensor("output_norm", "f32", np.arange(64, dtype=np.float32))
    with CflowFile(path) as f:
        assert f.config == cfg and f.config.delta_e == 2 and f.config.combine == "async_experts"
        assert f.tokenizer_json == tok and f.chat_template.startswith("{% for")
        assert f.special_tokens == {"bos_token_id": 1, "eos_token_ids": [2, 3], "add_bos": True} and f.metadata["quant"] == "q4_0"
        assert f.generation == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
        assert f.tensors["output_norm"].shape == (64,)
        assert np.array_equal(f.dequantize("output_norm"), np.arange(64, dtype=np.float32))


def test_layout_alignment_and_zero_copy(tmp_path):
    path = tmp_path / "m.cflow"
    rng = np.random.default_rng(1)
    with CflowWriter(path, CFG) as w:
        w.add_tensor("a", "q4_0", rng.standard_normal((3, 64)))
        w.add_tensor("b", "f32", rng.standard_normal(5))
        w.add_tensor("c", "q8_0", rng.standard_normal((130, 96)), section="other")
    with CflowFile(path) as f:
        assert [s.offset % ALIGN for s in f.sections.values()] == [0, 0]
        assert all(s.length % ALIGN == 0 for s in f.sections.values())
        assert all(t.offset % TENSOR_ALIGN == 0 for t in f.tensors.values())
        assert f.preamble.header_offset % ALIGN == 0 and f.preamble.header_offset + f.preamble.header_length == f.size
        v = f.tensor_bytes("c")
        assert np.shares_memory(v, f.buffer) and not v.flags.writeable
        assert f.tensors["c"].section == "other" and f.sections["other"].offset <= f.tensors["c"].offset


def test_tile_offsets_follow_the_documented_formula(tmp_path):
    path = tmp_path / "m.cflow"
    rows, cols = 200, 600
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    with CflowWriter(path, CFG) as w:
        w.add_tensor("w", "f32", x, tile=(128, 256), interleave=8)
    with CflowFile(path) as f:
        t = f.tensors["w"]
        for s in range(2):
            for tt in range(3):
                o = t.tile_offset(s, tt)
                assert f.buffer[o:o + 4].view("<f4")[0] == x[s * 128, tt * 256]


def test_fused_groups(tmp_path):
    path = tmp_path / "m.cflow"
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((n, 64)).astype(np.float32) for n in (64, 32, 32))
    g, u = (rng.standard_normal((150, 64)).astype(np.float32) for _ in range(2))
    with CflowWriter(path, CFG) as w:
        w.add_fused("blk.0.attn_qkv", "f32", [("blk.0.attn_q", q), ("blk.0.attn_k", k), ("blk.0.attn_v", v)], "stack")
        w.add_fused("blk.0.ffn_gate_up", "f32", [("blk.0.ffn_gate", g), ("blk.0.ffn_up", u)], "stripe", tile=(128, 256))
        w.add_fused("blk.1.ffn_gate_up", "q8_0", [("g", quant.encode(g, block_type("q8_0"))),
                                                  ("u", quant.encode(u, block_type("q8_0")))], "stripe", stripe_rows=32)
    with CflowFile(path, verify=True) as f:
        t = f.tensors["blk.0.attn_qkv"]
        assert t.fuse == "stack" and [(p.name, p.rows) for p in t.parts] == [("blk.0.attn_q", 64), ("blk.0.attn_k", 32), ("blk.0.attn_v", 32)]
        assert np.array_equal(f.dequantize("blk.0.attn_qkv"), np.concatenate([q, k, v]))
        t = f.tensors["blk.0.ffn_gate_up"]
        assert t.fuse == "stripe" and t.stripe_rows == 64  # TR / 2: one tile stripe = 64 gate + 64 up rows
        fused = f.dequantize("blk.0.ffn_gate_up")
        assert np.array_equal(fused[:64], g[:64]) and np.array_equal(fused[64:128], u[:64])
        assert np.array_equal(fused[256:278], g[128:]) and np.array_equal(fused[278:], u[128:])  # ragged stripe
        parts = f.unfuse("blk.0.ffn_gate_up")
        assert np.array_equal(parts["blk.0.ffn_gate"], g) and np.array_equal(parts["blk.0.ffn_up"], u)
        assert f.tensors["blk.1.ffn_gate_up"].stripe_rows == 32
        want = quant.decode(quant.encode(g, block_type("q8_0")), block_type("q8_0"), 64)
        assert np.array_equal(f.unfuse("blk.1.ffn_gate_up")["g"], want)


def test_fused_row_order_small_example():
    assert fused_row_order([5, 5], "stripe", 2).tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9]
    assert fused_row_order([2, 1, 1], "stack").tolist() == [0, 1, 2, 3]
    a = np.arange(6).reshape(3, 2)
    assert fuse_rows([a, a + 10], "stripe", 2)[:, 0].tolist() == [0, 2, 10, 12, 4, 14]


def test_stripe_fusion_is_the_order_the_glu_kernel_consumes():
    from cflow.format.tiles import fuse_rows as kernel_fuse_rows

    rng = np.random.default_rng(5)
    for ff, tr in ((300, 128), (64, 128), (130, 64)):
        g, u = rng.standard_normal((ff, 32)), rng.standard_normal((ff, 32))
        assert np.array_equal(fuse_rows([g, u], "stripe", tr // 2), kernel_fuse_rows([g, u], "glu", tr)[0])
    assert np.array_equal(fuse_rows([g, u, g], "stack"), kernel_fuse_rows([g, u, g], "stack")[0])


def test_expert_table(tmp_path):
    path = tmp_path / "m.cflow"
    rng = np.random.default_rng(3)
    want = {}
    with CflowWriter(path, CFG) as w:
        w.add_tensor("blk.0.ffn_gate_inp", "f32", rng.standard_normal((4, 64)))
        for layer in range(2):
            for e in range(4):
                gu = [rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2)]
                down = rng.standard_normal((64, 32)).astype(np.float32)
                want[(layer, e)] = (gu, down)
                p = f"blk.{layer}.exp.{e}."
                w.add_expert(layer, e, {
                    p + "ffn_gate_up": {"type": "q8_0", "data": [(p + "ffn_gate", gu[0]), (p + "ffn_up", gu[1])], "fuse": "stripe"},
                    p + "ffn_down": ("f32", down),
                })
    with CflowFile(path, verify=True) as f:
        assert sorted(f.experts) == [(l, e) for l in range(2) for e in range(4)]
        ranges = []
        for (layer, e), x in f.experts.items():
            assert x.section == "experts" and x.offset % ALIGN == 0
            assert x.offset + -(-x.length // ALIGN) * ALIGN <= f.sections["experts"].end  # O_DIRECT read stays inside
            p = f"blk.{layer}.exp.{e}."
            assert x.tensors == (p + "ffn_gate_up", p + "ffn_down")
            blob = f.expert_bytes(layer, e)
            assert np.array_equal(f.read_expert(layer, e), blob)  # one aligned (O_DIRECT) read
            assert np.array_equal(f.read_expert(layer, e, direct=False), blob)
            for n in x.tensors:
                t = f.tensors[n]
                assert np.array_equal(blob[t.offset - x.offset:t.end - x.offset], f.tensor_bytes(n))
            assert np.array_equal(f.dequantize(p + "ffn_down"), want[(layer, e)][1])
            assert f.unfuse(p + "ffn_gate_up")[p + "ffn_up"].shape == (32, 64)
            ranges.append((x.offset, x.offset + x.length))
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    path = tmp_path / "m.cflow"
    with pytest.raises(RuntimeError):
        with CflowWriter(path, CFG) as w:
            w.add_tensor("a", "q4_0", np.ones((64, 64), np.float32))
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []
    # an existing file survives a failed rewrite untouched
    with CflowWriter(path, CFG) as w:
        w.add_tensor("a", "f32", np.ones((2, 3), np.float32))
    before = path.read_bytes()
    with pytest.raises(CflowError, match="already added"):
        with CflowWriter(path, CFG) as w:
            w.add_tensor("a", "f32", np.zeros((2, 3), np.float32))
            w.add_tensor("a", "f32", np.zeros((2, 3), np.float32))
    assert os.listdir(tmp_path) == ["m.cflow"] and path.read_bytes() == before


def test_writer_rejects_bad_input_clearly(tmp_path):
    for bad, match in (({"temperature": "hot"}, "must be a number"), ({"top_p": 0}, r"outside \(0, 1\]"),
                       ({"top_k": 1.5}, "must be an integer"), ({"do_sample": 1}, "must be a boolean")):
        with pytest.raises(CflowFormatError, match=match):
            CflowWriter(tmp_path / "g.cflow", CFG, generation=bad)
    assert not list(tmp_path.iterdir())
    with CflowWriter(tmp_path / "m.cflow", CFG) as w:
        with pytest.raises(UnsupportedError, match="GGUF-encoded"):
            w.add_tensor("k", "q4_k", np.ones((2, 256), np.float32))
        with pytest.raises(CflowError, match="multiple of"):
            w.add_tensor("x", "q4_0", np.ones((2, 40), np.float32))
        with pytest.raises(CflowError, match="interleave"):
            w.add_tensor("x", "f32", np.ones((2, 40), np.float32), interleave=3)
        with pytest.raises(CflowError, match="not hold"):
            w.add_tensor("x", "q8_0", np.zeros((2, 35), np.uint8), shape=(2, 64))
        with pytest.raises(UnsupportedError, match="supported"):
            w.add_tensor("x", "q3_k", np.ones((2, 256), np.float32))
        w.add_tensor("a", "f32", np.ones(4, np.float32), section="s1")
        w.add_tensor("b", "f32", np.ones(4, np.float32), section="s2")
        with pytest.raises(CflowError, match="already written"):
            w.add_tensor("c", "f32", np.ones(4, np.float32), section="s1")
    with CflowFile(tmp_path / "m.cflow", verify=True) as f:
        assert list(f.tensors) == ["a", "b"] and list(f.sections) == ["s1", "s2"]


def test_decode_order():
    names = ["output", "blk.1.ffn_down", "blk.0.exp.1.ffn_down", "tok_embd", "blk.0.ffn_gate_up", "blk.10.attn_qkv",
             "output_norm", "blk.0.attn_qkv", "blk.0.attn_norm", "blk.1.attn_qkv"]
    assert decode_order(names) == ["tok_embd", "blk.0.attn_norm", "blk.0.attn_qkv", "blk.0.ffn_gate_up",
                                   "blk.0.exp.1.ffn_down", "blk.1.attn_qkv", "blk.1.ffn_down", "blk.10.attn_qkv",
                                   "output_norm", "output"]


def test_cli_verify_and_inspect(tmp_path, capsys):
    import dataclasses

    from cflow import models

    path = tmp_path / "m.cflow"
    dense = dataclasses.replace(CFG, n_expert=0, top_k=0, d_expert=0)
    with CflowWriter(path, dense) as w:  # every tensor the config implies: verify checks the config against them
        for name, shape in models.get(dense.arch).expected_tensors(dense, {}).items():
            w.add_tensor(name, "q4_0" if name == "blk.0.ffn_down" else "f32", np.ones(shape, np.float32))
    assert cli(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert "arch=llama" in out and "q4_0: 1" in out and out.strip().endswith("OK")
    assert cli(["inspect", str(path)]) == 0
    assert "blk.0.ffn_down" in capsys.readouterr().out
    raw = bytearray(path.read_bytes())
    raw[ALIGN + 5] ^= 1
    path.write_bytes(bytes(raw))
    assert cli(["verify", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cflow verify: error:") and "section 'weights': checksum mismatch" in err
    with CflowWriter(path, dense) as w:  # a sound container, but not the model its config describes
        w.add_tensor("blk.0.ffn_down", "q4_0", np.ones((64, 96), np.float32))
    assert cli(["verify", str(path)]) == 2
    assert "the model has no tensor 'tok_embd'" in capsys.readouterr().err


def _f16(b, i):
    return float(np.frombuffer(bytes(b[i:i + 2]), "<f2")[0])


def documented_dequantize(name: str, b: bytes) -> list[float]:
    """One block, decoded by the formulas of docs/FORMAT.md ("Block types"), element by element."""
    if name == "bf16":
        return [float(np.frombuffer(bytes(2) + bytes(b), "<f4")[0])]
    if name in ("q4_0", "q4_1", "q5_0", "q5_1"):
        d = _f16(b, 0)
        qs = b[{"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[name]:]
        q = [qs[j] & 0xF for j in range(16)] + [qs[j] >> 4 for j in range(16)]
        if name == "q4_1":
            return [d * q[j] + _f16(b, 2) for j in range(32)]
        if name == "q5_0":
            qh = int.from_bytes(bytes(b[2:6]), "little")
            return [d * ((q[j] | ((qh >> j) & 1) << 4) - 16) for j in range(32)]
        if name == "q5_1":
            qh = int.from_bytes(bytes(b[4:8]), "little")
            return [d * (q[j] | ((qh >> j) & 1) << 4) + _f16(b, 2) for j in range(32)]
        return [d * (q[j] - 8) for j in range(32)]
    if name == "q8_0":
        return [_f16(b, 0) * (v - 256 if v > 127 else v) for v in b[2:34]]
    if name in ("q4_k", "q5_k"):
        d, dmin, s = _f16(b, 0), _f16(b, 2), b[4:16]
        qh, qs = (b[16:48], b[48:176]) if name == "q5_k" else ([0] * 32, b[16:144])
        sc = [s[j] & 63 if j < 4 else (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4) for j in range(8)]
        mn = [s[j + 4] & 63 if j < 4 else (s[j + 4] >> 4) | ((s[j] >> 6) << 4) for j in range(8)]
        y = [0.0] * 256
        for i in range(4):
            for l in range(32):
                lo = (qs[32 * i + l] & 0xF) | ((qh[l] >> (2 * i)) & 1) << 4
                hi = (qs[32 * i + l] >> 4) | ((qh[l] >> (2 * i + 1)) & 1) << 4
                y[64 * i + l] = d * sc[2 * i] * lo - dmin * mn[2 * i]
                y[64 * i + 32 + l] = d * sc[2 * i + 1] * hi - dmin * mn[2 * i + 1]
        return y
    if name == "q6_k":
        ql, qh, d = b[0:128], b[128:192], _f16(b, 208)
        sc = [v - 256 if v > 127 else v for v in b[192:208]]
        y = [0.0] * 256
        for h in range(2):
            for l in range(32):
                a, c, hb, s = ql[64 * h + l], ql[64 * h + l + 32], qh[32 * h + l], 8 * h + l // 16
                y[128 * h + l] = d * sc[s] * (((a & 0xF) | ((hb >> 0) & 3) << 4) - 32)
                y[128 * h + l + 32] = d * sc[s + 2] * (((c & 0xF) | ((hb >> 2) & 3) << 4) - 32)
                y[128 * h + l + 64] = d * sc[s + 4] * (((a >> 4) | ((hb >> 4) & 3) << 4) - 32)
                y[128 * h + l + 96] = d * sc[s + 6] * (((c >> 4) | ((hb >> 6) & 3) << 4) - 32)
        return y
    if name == "tq2_0":
        d = _f16(b, 64)
        return [d * (((b[32 * h + m] >> (2 * l)) & 3) - 1) for h in range(2) for l in range(4) for m in range(32)]
    if name == "tq1_0":
        d = _f16(b, 52)

        def t(byte: int, n: int) -> int:
            return ((byte * 3**n % 256) * 3) >> 8

        return ([d * (t(b[m], n) - 1) for n in range(5) for m in range(32)]
                + [d * (t(b[32 + m], n) - 1) for n in range(5) for m in range(16)]
                + [d * (t(b[48 + j], n) - 1) for n in range(4) for j in range(4)])
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "tq1_0",
                                  "tq2_0"])
def test_documented_block_layouts_match_gguf(name):
    bt = block_type(name)
    rows = encoded_rows(name, 1, 512, np.random.default_rng(4))
    want = quant.decode(rows, bt, 512)[0]
    blocks = rows.reshape(-1, bt.block_bytes)
    got = np.concatenate([np.float32(documented_dequantize(name, blk.tobytes())) for blk in blocks])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_importance_weighted_fit(name):
    # weights of one change nothing; real weights trade the error of light columns for that of
    # heavy ones, never worse in the weighted error than gguf-py's rounding (one of the candidates)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((200, 256)).astype(np.float32)
    bt = block_type(name)
    plain = quant.encode(x, bt)
    assert np.array_equal(plain, quant.encode(x, bt, np.ones(256, np.float32)))
    imp = np.exp(rng.standard_normal(256) * 1.5).astype(np.float32)  # heavy-tailed, as activations are
    weighted = quant.encode(x, bt, imp)
    ref = np.asarray(gguf_quantize(x, GGMLQuantizationType(bt.code))).view(np.uint8).reshape(200, -1)

    def werr(rows):
        return (((quant.decode(rows, bt, 256) - x) ** 2) * imp).reshape(200, 8, 32).sum(-1)

    assert np.all(werr(weighted) <= werr(ref) * (1 + 1e-6) + 1e-12)
    assert werr(weighted).sum() < 0.9 * werr(plain).sum()
    for bad, msg in [(np.ones(255, np.float32), "255 values for 256 columns"),
                     (np.zeros(256, np.float32), "positive and finite"),
                     (np.full(256, np.nan, np.float32), "positive and finite")]:
        with pytest.raises(CflowFormatError, match=msg):
            quant.encode(x, bt, bad)
