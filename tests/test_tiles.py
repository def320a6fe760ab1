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
