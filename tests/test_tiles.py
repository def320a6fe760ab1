"""Tile packing is a permutation of GGUF blocks: round trip, ragged edges, interleave."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cflow.errors import CflowFormatError
from cflow.format.tiles import BLOCK_TYPES, PLANES_HEADER, block_type, pack_tiles, unpack_tiles


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(BLOCK_TYPES)),
    rows=st.integers(1, 300),
    nblk=st.integers(1, 12),
    tile=st.sampled_from([(128, 256), (64, 512), (16, 256)]),
    interleave=st.sampled_from([1, 4, 8, 16]),
    pack=st.sampled_from(["blocks", "planes"]),
)
def test_pack_unpack_round_trip(name, rows, nblk, tile, interleave, pack):
    bt = block_type(name)
    if name not in PLANES_HEADER:
        pack = "blocks"
    cols = nblk * max(bt.block_elems, 32 if bt.block_elems == 1 else bt.block_elems) + (3 if bt.block_elems == 1 else 0)
    data = np.random.default_rng(rows).integers(0, 256, size=(rows, cols // bt.block_elems * bt.block_bytes), dtype=np.uint8)
    packed = pack_tiles(data, bt, cols, tile, interleave, pack)
    assert packed.size == data.size
    assert np.array_equal(unpack_tiles(packed, bt, rows, cols, tile, interleave, pack), data)


def test_q5_0_planes_chunk_by_hand():
    """Q5_0 in the planes pack (docs/FORMAT.md 5.1): a chunk of g rows holds their g d words, then
    4-byte slice 0 of every row (its qh: the fifth bits), then slices 1..4 (the nibbles, as Q4_0's)."""
    bt = block_type("q5_0")
    rows = np.stack([np.arange(22, dtype=np.uint8) + 100 * i for i in range(3)])  # 3 rows, 1 block each
    p = pack_tiles(rows, bt, 32, (3, 32), 3, "planes")
    want = [b for i in range(3) for b in (100 * i, 100 * i + 1)]
    for k in range(5):
        want += [b for i in range(3) for b in range(100 * i + 2 + 4 * k, 100 * i + 6 + 4 * k)]
    assert p.tolist() == want
    assert np.array_equal(unpack_tiles(p, bt, 3, 32, (3, 32), 3, "planes"), rows)


def test_q5_1_planes_chunk_by_hand():
    """Q5_1 in the planes pack: Q5_0's chunk with a second header word, m: the g d words, the g m
    words, then slice 0 of every row (its qh), then slices 1..4 (the nibbles)."""
    bt = block_type("q5_1")
    rows = np.stack([np.arange(24, dtype=np.uint8) + 100 * i for i in range(3)])  # 3 rows, 1 block each
    p = pack_tiles(rows, bt, 32, (3, 32), 3, "planes")
    want = [b for w in range(2) for i in range(3) for b in (100 * i + 2 * w, 100 * i + 2 * w + 1)]
    for k in range(5):
        want += [b for i in range(3) for b in range(100 * i + 4 + 4 * k, 100 * i + 8 + 4 * k)]
    assert p.tolist() == want
    assert np.array_equal(unpack_tiles(p, bt, 3, 32, (3, 32), 3, "planes"), rows)


def test_tile_order_is_stripe_major_then_group_block_column_major():
    bt = block_type("f32")
    rows, cols = 3, 5
    data = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    packed = pack_tiles(data.view(np.uint8), bt, cols, tile=(2, 4), interleave=2).view(np.float32)
    # stripe 0 (rows 0-1): tile cols 0-3 as (col, row) pairs, then tile col 4; stripe 1: row 2.
    expected = [0, 5, 1, 6, 2, 7, 3, 8, 4, 9, 10, 11, 12, 13, 14]
    assert packed.tolist() == expected


def test_bad_shapes_are_format_errors():
    with pytest.raises(CflowFormatError):
        pack_tiles(np.zeros((2, 18), np.uint8), block_type("q4_0"), 32, tile=(128, 100))
    with pytest.raises(CflowFormatError):
        unpack_tiles(np.zeros(10, np.uint8), block_type("q4_0"), 2, 32)
    with pytest.raises(Exception, match="supported"):
        block_type("q3_k")


def _planes_chunk_weights(name: str, c: np.ndarray, g: int) -> np.ndarray:
    """The (g, 256) weights of one q4_k / q5_k / q6_k planes chunk c (g blocks), read as
    docs/FORMAT.md 5.1 describes the chunk (not by undoing the permutation): plane p is slice p of
    every row, dword i of it row i's (as uint32 (g,) after the header)."""
    h = 2 if name == "q6_k" else 4
    f16 = c[:h * g].view("<f2").astype(np.float32)
    planes = c[h * g:].view("<u4").reshape(-1, g)  # (slices, g)
    byte = lambda p, j: ((planes[p] >> (8 * j)) & 255).astype(np.int64)  # byte j of plane p, per row
    w = np.empty((g, 256), np.float32)
    if name in ("q4_k", "q5_k"):
        d, dmin = f16[:g], f16[g:]
        qs0 = 11 if name == "q5_k" else 3  # q5_k: its 8 qh planes (3..10) come before qs
        a, b, s = planes[0].astype(np.int64), planes[1].astype(np.int64), planes[2].astype(np.int64)
        for j in range(8):  # sub-block j's scale and min from planes 0..2
            if j < 4:
                sc, m = (a >> (8 * j)) & 63, (b >> (8 * j)) & 63
            else:
                k = 8 * (j - 4)
                sc = ((s >> k) & 15) | (((a >> (k + 6)) & 3) << 4)
                m = ((s >> (k + 4)) & 15) | (((b >> (k + 6)) & 3) << 4)
            for l in range(32):  # qs plane qs0 + 8 * (j // 2) + l // 4, low nibble for even j
                q = (byte(qs0 + 8 * (j // 2) + l // 4, l % 4) >> (4 * (j % 2))) & 15
                if name == "q5_k":  # bit j of byte l % 4 of qh plane 3 + l // 4
                    q |= ((byte(3 + l // 4, l % 4) >> j) & 1) << 4
                w[:, 32 * j + l] = (d * sc.astype(np.float32)) * q.astype(np.float32) - dmin * m.astype(np.float32)
        return w
    d = f16[:g]
    for n in range(256):  # weight n = 128 hf + 32 t + l: group 2 hf + l // 16 at plane 4 + 12 (2 hf + l // 16)
        hf, t, l = n // 128, (n // 32) % 4, n % 32
        p = 4 + 12 * (2 * hf + l // 16) + (l % 16) // 4  # its qh plane; its ql planes 4 and 8 further
        lo = (byte(p + 4 + 4 * (t % 2), l % 4) >> (4 * (t // 2))) & 15
        hi = (byte(p, l % 4) >> (2 * t)) & 3
        sc = byte(n // 64, (n // 16) % 4)
        sc = np.where(sc > 127, sc - 256, sc)
        w[:, n] = (d * sc.astype(np.float32)) * ((lo | hi << 4) - 32).astype(np.float32)
    return w


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("g", [16, 5])
def test_k_quant_planes_chunk_dequantizes_as_gguf(name, g):
    """A K-quant planes chunk read by its documented layout gives gguf-py's weights, bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    bt = block_type(name)
    rng = np.random.default_rng(g)
    rows = rng.integers(0, 256, size=(g, bt.block_bytes), dtype=np.uint8)  # one block per row
    scales = (rng.standard_normal((g, 2)) * 0.01).astype("<f2").view(np.uint8)
    if name in ("q4_k", "q5_k"):
        rows[:, 0:4] = scales
    else:
        rows[:, 208:210] = scales[:, :2]
    chunk = pack_tiles(rows, bt, 256, (g, 256), g, "planes")
    want = gguf_dequantize(rows, GGMLQuantizationType(bt.code)).reshape(g, 256)
    got = _planes_chunk_weights(name, chunk, g)
    assert np.array_equal(got, want)
