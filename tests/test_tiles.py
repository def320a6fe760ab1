"""Tile packing is a permutation of GGUF blocks: round trip, ragged edges, interleave."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cflow.errors import CflowFormatError
from cflow.format.tiles import BLOCK_TYPES, block_type, pack_tiles, unpack_tiles


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(BLOCK_TYPES)),
    rows=st.integers(1, 300),
    nblk=st.integers(1, 12),
    tile=st.sampled_from([(128, 256), (64, 512), (16, 256)]),
    interleave=st.sampled_from([1, 4, 8, 16]),
)
def test_pack_unpack_round_trip(name, rows, nblk, tile, interleave):
    bt = block_type(name)
    cols = nblk * max(bt.block_elems, 32 if bt.block_elems == 1 else bt.block_elems) + (3 if bt.block_elems == 1 else 0)
    data = np.random.default_rng(rows).integers(0, 256, size=(rows, cols // bt.block_elems * bt.block_bytes), dtype=np.uint8)
    packed = pack_tiles(data, bt, cols, tile, interleave)
    assert packed.size == data.size
    assert np.array_equal(unpack_tiles(packed, bt, rows, cols, tile, interleave), data)


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
