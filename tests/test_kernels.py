"""Native tile GEMVs against GGML's block definitions (gguf-py) and against each other.

The scalar fp32-activation kernel is the reference: it is anchored to gguf.quants.dequantize
here, and every other kernel (ISA path, int8 path, fused variant) is compared with it.
Errors are measured against s_i = sum_j |w_ij x_j| (the scale of fp32 rounding in a dot
product): fp32 paths within 1e-5 * s_i; int8 paths within the bound of docs/KERNELS.md,
sum_b (d_b / 2) sum_{j in b} |w_ij| + 1e-5 * s_i, d_b = max|x_b| / 127 the activation scale.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st

from cflow import kernels as K
from cflow.errors import CflowError
from cflow.format.tiles import PLANES_HEADER, block_type, fuse_rows, pack_tiles, unpack_tiles

GGML = {"f32": GT.F32, "f16": GT.F16, "bf16": GT.BF16, "q4_0": GT.Q4_0, "q4_1": GT.Q4_1,
        "q5_0": GT.Q5_0, "q5_1": GT.Q5_1, "q8_0": GT.Q8_0, "q4_k": GT.Q4_K, "q5_k": GT.Q5_K, "q6_k": GT.Q6_K,
        "tq1_0": GT.TQ1_0, "tq2_0": GT.TQ2_0}
TYPES = list(GGML)
QUANT = [t for t in TYPES if block_type(t).block_elems > 1]
ISAS = [i for i in ("scalar", "avx2", "avx512") if K.core.isa_supported(i)]


def random_rows(name, rows, cols, rng):
    """Row-major encoded (rows, cols): random blocks with sane scales (K-quants: gguf-py cannot
    quantize them; ternary types: every code, TQ2_0's 3 included; so their bytes are random too,
    and decoded by gguf-py below)."""
    bt = block_type(name)
    if name in ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        enc = quants.quantize(w, GGML[name])
        return np.ascontiguousarray(enc.view(np.uint8).reshape(rows, -1))
    b = rng.integers(0, 256, size=(rows * cols // bt.block_elems, bt.block_bytes), dtype=np.uint8)
    scales = lambda n, s: (rng.uniform(-s, s, n).astype(np.float16)).view(np.uint8).reshape(n, 2)
    if name in ("q4_k", "q5_k"):
        b[:, 0:2], b[:, 2:4] = scales(len(b), 1e-2), scales(len(b), 1e-2)
    else:  # q6_k, tq1_0, tq2_0: d in the last two bytes
        b[:, -2:] = scales(len(b), 1e-2)
    return b.reshape(rows, -1)


def dequant(name, rm, rows, cols):
    return quants.dequantize(rm.reshape(rows, -1), GGML[name]).astype(np.float64).reshape(rows, cols)


def int8_bound(W, x):
    """Per-row bound on |W x - W xq| for x quantized in blocks of 32 (d = max|x_b| / 127)."""
    d = np.abs(x.reshape(-1, 32)).max(axis=1) / 127.0  # (cols/32,)
    return (np.abs(W).reshape(W.shape[0], -1, 32).sum(axis=2) * (d / 2)).sum(axis=1)


def setup(name, rows, cols, tile, g, seed=0, pack="blocks"):
    rng = np.random.default_rng(seed)
    rm = random_rows(name, rows, cols, rng)
    tiles = pack_tiles(rm, block_type(name), cols, tile, g, pack)
    W = dequant(name, rm, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    return tiles, W, x


@pytest.mark.parametrize("name", TYPES)
def test_scalar_reference_matches_gguf_dequantize(name):
    qk = block_type(name).block_elems
    rows, cols = 131, 768 if qk == 256 else 288  # ragged stripe (131 = 128 + 3) and column tile
    tiles, W, x = setup(name, rows, cols, (128, 256), 4)
    y = K.gemv(name, tiles, x, rows, cols, interleave=4, act="f32", isa="scalar")
    yref = W @ x.astype(np.float64)
    scale = np.abs(W) @ np.abs(x.astype(np.float64))
    assert np.all(np.abs(y - yref) <= 1e-5 * scale)


@pytest.mark.parametrize("name", QUANT)
def test_scalar_kernel_dequantizes_bit_identically_to_gguf(name):
    """The scalar fp32 GEMV times a one-hot x is column j of the matrix as the core decodes it:
    equal, bit for bit, to gguf-py's dequantization at every position of a block (and of a second
    block), in whole blocks and in the layout `cflow convert` writes (the planes pack at
    interleave 16, for the types that have it), ragged groups included."""
    from cflow.convert.write import tensor_layout

    bt = block_type(name)
    rows, cols = 37, 2 * max(bt.block_elems, 256)
    rm = random_rows(name, rows, cols, np.random.default_rng(13))
    want = quants.dequantize(rm, GGML[name]).reshape(rows, cols).astype(np.float32)
    lay = tensor_layout(name, 2)
    layouts = {(1, "blocks"), (lay["interleave"], lay["pack"])}
    for g, pack in sorted(layouts):
        tiles = pack_tiles(rm, bt, cols, (32, 256), g, pack)
        for j in list(range(bt.block_elems)) + [bt.block_elems + 5, cols - 1]:
            x = np.zeros(cols, np.float32)
            x[j] = 1.0
            y = K.gemv(name, tiles, x, rows, cols, (32, 256), g, act="f32", isa="scalar", pack=pack)
            assert np.array_equal(y, want[:, j]), (g, pack, j)


@pytest.mark.parametrize("g", [1, 8])
@pytest.mark.parametrize("name", QUANT)
def test_int8_paths_within_derived_bound(name, g):
    qk = block_type(name).block_elems
    rows, cols = 200, 1280 if qk == 256 else 608  # ragged stripe; 1280 and 608: ragged column tile
    tiles, W, x = setup(name, rows, cols, (128, 512 if qk == 256 else 256), g, seed=1)
    xd = x.astype(np.float64)
    yref = W @ xd
    scale = np.abs(W) @ np.abs(xd)
    # K-quants quantize x in blocks of 256 (one scale for 8 sub-blocks of 32): d over 256
    xb = np.repeat(np.abs(x.reshape(-1, qk)).max(axis=1), qk // 32) if qk == 256 else None
    if xb is None:
        bound = int8_bound(W, x)
    else:
        bound = (np.abs(W).reshape(rows, -1, 32).sum(axis=2) * (xb / 127.0 / 2)).sum(axis=1)
    for isa in ISAS:
        y = K.gemv(name, tiles, x, rows, cols, (128, 512 if qk == 256 else 256), g, act="q8", isa=isa)
        err = np.abs(y - yref)
        assert np.all(err <= bound + 1e-5 * scale), (isa, float((err / (bound + 1e-30)).max()))
        assert err.max() > 0  # the int8 path really quantized x


PAIRS = [(t, a) for t in TYPES for a in (("f32", "q8") if t in QUANT else ("f32",))]


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "scalar"])
@pytest.mark.parametrize("name,act", PAIRS)
def test_every_kernel_on_every_isa_matches_scalar(name, act, isa):
    """Each (type, activation) has its own kernel on each ISA (gemv_isa says so), and it agrees
    with the scalar kernel on random shapes with ragged rows (a partial stripe, and a partial
    group) and ragged columns (a partial column tile), at several interleaves."""
    assert K.gemv_isa(name, act, isa) == isa
    qk = block_type(name).block_elems
    tile = (128, 512 if qk == 256 else 256)
    rng = np.random.default_rng(sum(map(ord, name + act + isa)))
    for g in (1, 2, 4, 8, 16):
        rows = int(rng.integers(129, 300))
        while rows % 128 == 0 or (g > 1 and rows % g == 0):  # a partial stripe and group
            rows += 1
        if qk == 1:
            cols = int(rng.integers(257, 700))
            cols += cols % 256 == 0
        else:
            cols = qk * int(rng.choice([n for n in range(2, 30 if qk == 32 else 6) if (n * qk) % tile[1]]))
        tiles, W, x = setup(name, rows, cols, tile, g, seed=g)
        yr = K.gemv(name, tiles, x, rows, cols, tile, g, act=act, isa="scalar")
        y = K.gemv(name, tiles, x, rows, cols, tile, g, act=act, isa=isa)
        scale = np.abs(W) @ np.abs(x.astype(np.float64))
        err = np.abs(y - yr)
        assert np.all(err <= 1e-5 * scale + 1e-30), (g, rows, cols, float((err / scale).max()))


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(TYPES), rows=st.integers(1, 300), nblk=st.integers(1, 12),
       g=st.sampled_from([1, 2, 4, 8, 16, 32]), tc_blocks=st.sampled_from([1, 2, 8]),
       act=st.sampled_from(["f32", "q8"]), isa=st.sampled_from(ISAS), threads=st.sampled_from([1, 2]),
       pack=st.sampled_from(["blocks", "planes"]), seed=st.integers(0, 2**16))
def test_every_path_matches_scalar(name, rows, nblk, g, tc_blocks, act, isa, threads, pack, seed):
    bt = block_type(name)
    if act == "q8" and bt.block_elems == 1:
        act = "f32"
    if name not in PLANES or g > 16:
        pack = "blocks"
    qk = bt.block_elems if bt.block_elems > 1 else 32
    cols = qk * nblk if bt.block_elems > 1 else 32 * nblk + 7 * (seed % 2)
    tile = (128, qk * tc_blocks if bt.block_elems > 1 else 32 * tc_blocks)
    tiles, W, x = setup(name, rows, cols, tile, g, seed, pack)
    yr = K.gemv(name, tiles, x, rows, cols, tile, g, act=act, isa="scalar", pack=pack)
    y = K.gemv(name, tiles, x, rows, cols, tile, g, act=act, isa=isa, threads=threads, pack=pack)
    scale = np.abs(W) @ np.abs(x.astype(np.float64))
    assert np.all(np.abs(y - yr) <= 1e-5 * scale + 1e-30)


PLANES = sorted(PLANES_HEADER)  # the types with a planes pack


@pytest.mark.parametrize("name", PLANES)
def test_two_level_activations(name):
    """q8x2: every ISA matches the scalar definition (two one-level passes), and
    the error against fp32 activations falls far below the one-level bound."""
    k = block_type(name).block_elems == 256  # the K-quants: columns in super-blocks of 256
    small = 256 if k else 96
    for g, rows, cols in ((16, 301, 768 if k else 608), (8, 133, small)):
        tiles, W, x = setup(name, rows, cols, (128, 256), g, seed=g, pack="planes")
        args = (name, tiles, x, rows, cols, (128, 256), g)
        yr = K.gemv(*args, act="q8x2", isa="scalar", pack="planes")
        scale = np.abs(W) @ np.abs(x.astype(np.float64))
        for isa in ISAS:
            assert K.gemv_isa(name, "q8x2", isa, "planes") == isa
            for threads in (1, 2):
                y = K.gemv(*args, act="q8x2", isa=isa, threads=threads, pack="planes")
                assert np.all(np.abs(y - yr) <= 1e-5 * scale + 1e-30), (isa, g)
        exact = W @ x.astype(np.float64)
        bound = int8_bound(W, x)
        e1 = np.abs(K.gemv(*args, act="q8", pack="planes") - exact)
        e2 = np.abs(yr - exact)
        assert np.all(e2 <= bound / 100 + 1e-5 * scale)  # the residual's own step is d/127
        assert e2.max() < e1.max() / 20
    # whole blocks: two one-level passes, the same sum as the planes kernels' definition
    tiles_b, W, x = setup(name, 133, small, (128, 256), 8, seed=8)
    yb = K.gemv(name, tiles_b, x, 133, small, (128, 256), 8, act="q8x2", isa="scalar")
    tiles_p, _, _ = setup(name, 133, small, (128, 256), 8, seed=8, pack="planes")
    np.testing.assert_array_equal(yb, K.gemv(name, tiles_p, x, 133, small, (128, 256), 8, act="q8x2", isa="scalar",
                                             pack="planes"))
    scale = np.abs(W) @ np.abs(x.astype(np.float64))
    for isa in ISAS:
        assert K.gemv_isa(name, "q8x2", isa) == isa
        y = K.gemv(name, tiles_b, x, 133, small, (128, 256), 8, act="q8x2", isa=isa)
        assert np.all(np.abs(y - yb) <= 1e-5 * scale + 1e-30), isa


def test_planes_chunk_layout_by_hand():
    """Two Q4_1 blocks (rows 0 and 1 of one column block, interleave 2) in the planes pack: the
    two d words, the two m words, then 4-byte quant slices k = 0..3 of row 0 and row 1 in turn."""
    bt = block_type("q4_1")
    b0 = np.arange(20, dtype=np.uint8)  # d = bytes 0-1, m = 2-3, qs = 4..19
    b1 = np.arange(100, 120, dtype=np.uint8)
    rows = np.stack([b0, b1])  # (2 rows, 1 block each): cols = 32
    p = pack_tiles(rows, bt, 32, (2, 32), 2, "planes")
    want = [0, 1, 100, 101, 2, 3, 102, 103]
    for k in range(4):
        want += list(range(4 + 4 * k, 8 + 4 * k)) + list(range(104 + 4 * k, 108 + 4 * k))
    assert p.tolist() == want
    assert np.array_equal(unpack_tiles(p, bt, 2, 32, (2, 32), 2, "planes"), rows)


@pytest.mark.parametrize("name", PLANES)
def test_planes_pack_is_lossless(name):
    rng = np.random.default_rng(7)
    bt = block_type(name)
    shapes = ((300, 640, (128, 256), 16), (77, 96, (32, 64), 8), (50, 64, (48, 32), 12))
    if bt.block_elems == 256:  # the K-quants: columns in super-blocks
        shapes = ((300, 1024, (128, 512), 16), (77, 768, (32, 256), 8), (50, 256, (48, 256), 12))
    for rows, cols, tile, g in shapes:
        rm = random_rows(name, rows, cols, rng)
        p = pack_tiles(rm, bt, cols, tile, g, "planes")
        assert p.size == pack_tiles(rm, bt, cols, tile, g).size
        assert np.array_equal(unpack_tiles(p, bt, rows, cols, tile, g, "planes"), rm)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("name", PLANES)
def test_planes_kernels_match_the_whole_block_definition(name, act, isa):
    """The planes kernels on every ISA give the scalar whole-block kernel's result for the same
    matrix: full 16-row groups, and ragged ones (a partial stripe and group), 1 and 2 threads."""
    assert K.gemv_isa(name, act, isa, "planes") == isa
    rng = np.random.default_rng(sum(map(ord, name + act + isa)))
    shapes = ((16, 256, 512), (16, 301, 608), (8, 133, 96), (4, 7, 64), (1, 5, 32))
    if block_type(name).block_elems == 256:  # the K-quants: columns in super-blocks
        shapes = ((16, 256, 512), (16, 301, 768), (8, 133, 256), (4, 7, 256), (1, 5, 256))
    for g, rows, cols in shapes:
        tiles_b, W, x = setup(name, rows, cols, (128, 256), g, seed=g)
        tiles_p, _, _ = setup(name, rows, cols, (128, 256), g, seed=g, pack="planes")
        yr = K.gemv(name, tiles_b, x, rows, cols, (128, 256), g, act=act, isa="scalar")
        scale = np.abs(W) @ np.abs(x.astype(np.float64))
        for threads in (1, 2):
            y = K.gemv(name, tiles_p, x, rows, cols, (128, 256), g, act=act, isa=isa, threads=threads, pack="planes")
            assert np.all(np.abs(y - yr) <= 1e-5 * scale + 1e-30), (g, rows, cols, threads)
    if act == "q8":  # the fused GLU pass reads the planes pack too
        ff, cols = 200, 256
        gate, up = random_rows(name, ff, cols, rng), random_rows(name, ff, cols, rng)
        fused, _ = fuse_rows([gate, up], "glu")
        bt = block_type(name)
        x = rng.standard_normal(cols).astype(np.float32)
        hb = K.gemv_glu(name, pack_tiles(fused, bt, cols, (128, 256), 16), x, ff, cols, interleave=16, isa=isa)
        hp = K.gemv_glu(name, pack_tiles(fused, bt, cols, (128, 256), 16, "planes"), x, ff, cols, interleave=16,
                        isa=isa, pack="planes")
        np.testing.assert_allclose(hp, hb, rtol=1e-4, atol=1e-6 * np.abs(hb).max())


def test_row_major_is_the_same_kernel():
    rows, cols = 260, 1024
    rng = np.random.default_rng(3)
    rm = random_rows("q4_0", rows, cols, rng)
    x = rng.standard_normal(cols).astype(np.float32)
    bt = block_type("q4_0")
    y_t = K.gemv("q4_0", pack_tiles(rm, bt, cols, (128, 256), 16), x, rows, cols, (128, 256), 16)
    y_r = K.gemv("q4_0", pack_tiles(rm, bt, cols, (128, cols), 1), x, rows, cols, (128, cols), 1)
    np.testing.assert_allclose(y_t, y_r, rtol=1e-5, atol=1e-4)


def test_fused_qkv_equals_separate_gemvs():
    rng = np.random.default_rng(4)
    cols, counts = 576, [576, 192, 192]  # SmolLM2-135M: 9 query / 3 KV heads of 64
    mats = [random_rows("q4_1", n, cols, rng) for n in counts]
    fused, offs = fuse_rows(mats, "stack")
    assert offs == [0, 576, 768, 960]
    bt = block_type("q4_1")
    x = rng.standard_normal(cols).astype(np.float32)
    q, k, v = K.gemv_qkv("q4_1", pack_tiles(fused, bt, cols, (128, 256), 16), x, counts, cols, interleave=16)
    for m, y, n in zip(mats, (q, k, v), counts):
        np.testing.assert_allclose(y, K.gemv("q4_1", pack_tiles(m, bt, cols, (128, 256), 16), x, n, cols, interleave=16),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("glu", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("ff", [256, 1536, 200])  # 200: a ragged last half-stripe (200 = 3*64 + 8)
def test_fused_glu_equals_separate_gemvs(glu, ff):
    rng = np.random.default_rng(5)
    cols = 512
    gate, up = random_rows("q8_0", ff, cols, rng), random_rows("q8_0", ff, cols, rng)
    fused, _ = fuse_rows([gate, up], "glu")
    bt = block_type("q8_0")
    x = rng.standard_normal(cols).astype(np.float32)
    h = K.gemv_glu("q8_0", pack_tiles(fused, bt, cols, (128, 256), 8), x, ff, cols, glu, interleave=8, threads=2)
    g = K.gemv("q8_0", pack_tiles(gate, bt, cols), x, ff, cols).astype(np.float64)
    u = K.gemv("q8_0", pack_tiles(up, bt, cols), x, ff, cols).astype(np.float64)
    if glu == "silu":
        ref = g / (1 + np.exp(-g)) * u
    else:
        ref = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    np.testing.assert_allclose(h, ref, rtol=1e-4, atol=1e-5)


def test_fuse_rows_glu_order_and_errors():
    gate = np.arange(5)[:, None] * np.ones((1, 2))
    up = 100 + gate
    fused, _ = fuse_rows([gate, up], "glu", tile_rows=4)  # half-stripes of 2 rows
    assert fused[:, 0].tolist() == [0, 1, 100, 101, 2, 3, 102, 103, 4, 104]
    with pytest.raises(CflowError):
        fuse_rows([gate, up[:3]], "glu")
    with pytest.raises(CflowError):
        fuse_rows([gate], "zip")


def test_bad_arguments_give_clear_errors():
    x = np.zeros(64, np.float32)
    with pytest.raises(CflowError, match="weight bytes"):
        K.gemv("q4_0", np.zeros(10, np.uint8), x, 2, 64)
    with pytest.raises(CflowError, match="interleave"):
        K.gemv("q4_0", np.zeros(2 * 36, np.uint8), x, 2, 64, interleave=3)
    with pytest.raises(CflowError, match="int8"):
        K.gemv("f16", np.zeros(2 * 128, np.uint8), x, 2, 64, act="q8")
    with pytest.raises(CflowError, match="planes pack exists only for"):
        K.gemv("f16", np.zeros(2 * 128, np.uint8), x, 2, 64, pack="planes")
    with pytest.raises(CflowError, match="at most 16"):
        K.gemv("q4_0", np.zeros(64 * 36, np.uint8), x, 64, 64, tile=(64, 256), interleave=32, pack="planes")
    with pytest.raises(CflowError, match="pack must be"):
        K.gemv("q4_0", np.zeros(2 * 36, np.uint8), x, 2, 64, pack="soa")
    with pytest.raises(CflowError):
        K.gemv("q4_0", np.zeros(2 * 36, np.uint8), x, 2, 64, isa="neon")


def test_isa_fallback_is_reported():
    assert K.gemv_isa("q4_k", "q8", "scalar") == "scalar"
    for name, act in PAIRS:  # every pair has a kernel on every ISA
        assert K.gemv_isa(name, act) == K.best_isa()


def test_probe_and_bench_json():
    runs = K.probe_read(16, threads=2, repeats=3)
    assert len(runs) == 3 and all(r > 0 for r in runs)
    out = subprocess.run(
        [sys.executable, "-m", "cflow", "bench", "kernels", "--json", "--types", "q4_0,q5_0,f16", "--repeats", "1",
         "--probe-mib", "16", "--matrix-mb", "2", "--cols", "1024"],
        capture_output=True, text=True, check=True,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d["probe_gbps"] > 0
    got = {(k["type"], k["layout"], k["threads"]) for k in d["kernels"]}
    assert got == {(t, l, n) for t in ("q4_0", "q5_0", "f16") for l in ("tiled", "row_major") for n in (1, 2)} | \
        {(t, "tiled_blocks", n) for t in ("q4_0", "q5_0") for n in (1, 2)}
    tiled = {(k["type"], k["layout"]): (k["interleave"], k["pack"]) for k in d["kernels"]}
    assert tiled[("q4_0", "tiled")] == tiled[("q5_0", "tiled")] == (16, "planes")
    assert tiled[("f16", "tiled")] == (1, "blocks")
    assert all(k["gbps"] > 0 and k["pct_of_probe"] > 0 for k in d["kernels"])


def test_bench_resident_json():
    out = subprocess.run(
        [sys.executable, "-m", "cflow", "bench", "kernels", "--resident", "--json", "--types", "q4_1",
         "--threads", "1"],
        capture_output=True, text=True, check=True,
    )
    d = json.loads(out.stdout)
    assert d["resident"] is True and "probe_gbps" not in d
    assert {(k["layout"], k["threads"]) for k in d["kernels"]} == {("tiled", 1), ("tiled_blocks", 1), ("row_major", 1)}
    # by default the engine's decode activations: two int8 levels
    assert all(k["type"] == "q4_1" and k["act"] == "q8x2" and 0 < k["gbps"] <= k["max_gbps"] for k in d["kernels"])


def test_bench_one_level_activations_json():
    # --act q8 times one int8 level (--activations int8) on every layout; f16 keeps f32
    out = subprocess.run(
        [sys.executable, "-m", "cflow", "bench", "kernels", "--resident", "--json", "--types", "q4_k,f16",
         "--threads", "1", "--act", "q8"],
        capture_output=True, text=True, check=True,
    )
    d = json.loads(out.stdout)
    acts = {(k["type"], k["layout"]): k["act"] for k in d["kernels"]}
    assert {a for (t, _), a in acts.items() if t == "q4_k"} == {"q8"} and len(acts) == 5
    assert {a for (t, _), a in acts.items() if t == "f16"} == {"f32"}
    assert all(k["gbps"] > 0 for k in d["kernels"])
