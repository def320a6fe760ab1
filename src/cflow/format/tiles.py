"""Block types and the tile layout of a weight matrix (the contract between Python and C++).

A matrix W has R rows (outputs) and C columns (inputs); y = W @ x. Each row is encoded as
C / QK consecutive blocks of block type T, bit-identical to GGUF's row encoding (for F32,
F16 and BF16 a "block" is one element, QK = 1).

Tiling (docs/FORMAT.md, "Tile layout"), tile shape (TR, TC), default (128, 256):
  * row stripes s = 0 .. ceil(R/TR)-1 hold rows [s*TR, min(R, (s+1)*TR));
  * column tiles t = 0 .. ceil(C/TC)-1 hold columns [t*TC, min(C, (t+1)*TC));
  * payload order is stripe-major: for s: for t: tile(s, t); no padding between tiles;
  * inside a tile of nr rows and nb = ncols/QK blocks per row, rows are taken in groups of
    G = interleave rows (the last group of a ragged stripe may be shorter, g = min(G, nr - r0));
    a group stores its blocks block-column-major: for b in 0..nb-1: for i in 0..g-1:
    block(row r0 + i, block b). G = 1 is plain row-major inside the tile.
Ragged edges: the last stripe and the last column tile are simply smaller. TC is a multiple
of QK; for quantized types C must be a multiple of QK (as in GGUF).

Pack (docs/FORMAT.md, 5.1): "blocks" stores each group's chunk (the g blocks of one column block)
as g whole blocks, as above. "planes" (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K with G <= 16)
regroups the same bytes of each chunk: header word h of row i at 2*(h*g + i), quant bytes 4k..4k+3
(slice k) of row i at H*g + 4*(p*g + i), p = planes_slice_pos(k) (H = header bytes; the quant bytes
are the block's other bytes in order: the qh of Q5_0 and Q5_1 is their slice 0, Q4_K's scales its
slices 0..2, Q5_K's scales and qh its slices 0..2 and 3..10, and Q6_K's header d is its last two
bytes; p = k but for Q6_K, whose planes follow its kernels' reading order). Same size, same chunk
positions; lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cflow.errors import CflowFormatError, UnsupportedError

DEFAULT_TILE = (128, 256)


@dataclass(frozen=True)
class BlockType:
    name: str
    code: int  # GGML type id (ternary: a cflow code in the reserved range)
    block_elems: int  # QK: weights per block
    block_bytes: int  # bytes per block


# Codes are GGML's, so GGUF tensors convert by table lookup; 64..127 are reserved for cflow's
# own types (64: reserved for a ternary layout of cflow's own; GGUF's TQ1_0 / TQ2_0 measured fast
# enough as they are, docs/KERNELS.md).
BLOCK_TYPES: dict[str, BlockType] = {
    bt.name: bt
    for bt in (
        BlockType("f32", 0, 1, 4),
        BlockType("f16", 1, 1, 2),
        BlockType("q4_0", 2, 32, 18),
        BlockType("q4_1", 3, 32, 20),
        BlockType("q5_0", 6, 32, 22),
        BlockType("q5_1", 7, 32, 24),
        BlockType("q8_0", 8, 32, 34),
        BlockType("q4_k", 12, 256, 144),
        BlockType("q5_k", 13, 256, 176),
        BlockType("q6_k", 14, 256, 210),
        BlockType("bf16", 30, 1, 2),
        BlockType("tq1_0", 34, 256, 54),
        BlockType("tq2_0", 35, 256, 66),
    )
}
TERNARY_CODE = 64  # reserved: ternary weights
BLOCK_TYPES_BY_CODE = {bt.code: bt for bt in BLOCK_TYPES.values()}


def block_type(name_or_code: str | int) -> BlockType:
    """Look up a block type by name ("q4_0") or code (2); a clear error lists what exists."""
    table = BLOCK_TYPES_BY_CODE if isinstance(name_or_code, int) else BLOCK_TYPES
    key = name_or_code if isinstance(name_or_code, int) else str(name_or_code).lower()
    if key not in table:
        raise UnsupportedError(
            f"unsupported block type {name_or_code!r}; supported: {', '.join(BLOCK_TYPES)}"
        )
    return table[key]


def tiled_nbytes(bt: BlockType, rows: int, cols: int) -> int:
    """Bytes of a tiled matrix (tiling only reorders blocks, so this is R * C/QK * block_bytes)."""
    if cols % bt.block_elems:
        raise CflowFormatError(f"{bt.name}: {cols} columns is not a multiple of the block size {bt.block_elems}")
    return rows * (cols // bt.block_elems) * bt.block_bytes


def _tile_permutation(bt: BlockType, rows: int, cols: int, tile: tuple[int, int], interleave: int) -> np.ndarray:
    """perm[i] = index (in row-major block order) of the i-th block of the tiled payload."""
    tr, tc = tile
    qk = bt.block_elems
    if tr <= 0 or tc <= 0 or tc % qk or interleave <= 0 or tr % interleave:
        raise CflowFormatError(f"bad tile shape {tile} / interleave {interleave} for {bt.name} (QK={qk})")
    nbr = cols // qk  # blocks per row
    bpt = tc // qk  # blocks per full column tile
    # Position in the payload of block (row r, block b), computed for all blocks at once:
    # stripe start + earlier tiles of the stripe + earlier groups of the tile + (b, i) in the group.
    r = np.arange(rows, dtype=np.int64)[:, None]  # (R, 1)
    b = np.arange(nbr, dtype=np.int64)[None, :]  # (1, nbr)
    s0 = r // tr * tr  # first row of the stripe
    nr = np.minimum(tr, rows - s0)  # rows in the stripe
    t0 = b // bpt * bpt  # first block of the column tile
    nb = np.minimum(bpt, nbr - t0)  # blocks per row in the tile
    g0 = (r - s0) // interleave * interleave  # first row of the group, in the stripe
    g = np.minimum(interleave, nr - g0)  # rows in the group
    pos = s0 * nbr + nr * t0 + g0 * nb + (b - t0) * g + (r - s0 - g0)  # (R, nbr)
    perm = np.empty(rows * nbr, dtype=np.int64)
    perm[pos.reshape(-1)] = np.arange(rows * nbr, dtype=np.int64)
    return perm


PACKS = ("blocks", "planes")
PACK_CODES = {"blocks": 0, "planes": 1}  # the engine's and kernels' Pack values
# header bytes (fp16 d, and m / dmin) of the types with planes, and where they sit in a block
PLANES_HEADER = {"q4_0": 2, "q4_1": 4, "q5_0": 2, "q5_1": 4, "q8_0": 2, "q4_k": 4, "q5_k": 4, "q6_k": 2}
PLANES_HEADER_AT = {"q6_k": 208}  # the others: 0
PLANES_MAX_G = 16


def planes_slice_pos(name: str, k: int) -> int:
    """The plane of slice k (quant bytes 4k .. 4k+3 of a block) in a planes chunk: k, except for
    q6_k, whose planes lie in the order its kernels read them (docs/FORMAT.md 5.1, version 3): the 4
    scale planes, then per group q = 2h + e (h the half, e = 0, 1) its 4 qh planes (slices
    32 + 8h + 4e ..), its ql planes of quarters 0, 2 (slices 16h + 4e ..) and of quarters 1, 3
    (16h + 8 + 4e ..)."""
    if name != "q6_k":
        return k
    if k >= 48:
        return k - 48
    if k >= 32:
        return 4 + 12 * ((k - 32) // 4) + (k - 32) % 4
    return 4 + 12 * (2 * (k // 16) + k % 8 // 4) + 4 + 4 * (k % 16 // 8) + k % 4


def check_pack(bt: BlockType, interleave: int, pack: str) -> str | None:
    """None when `pack` is valid for (bt, interleave), else the reason."""
    if pack not in PACKS:
        return f"pack {pack!r} is not one of {PACKS}"
    if pack == "planes":
        if bt.name not in PLANES_HEADER:
            return f"the planes pack exists only for {', '.join(PLANES_HEADER)}, not {bt.name}"
        if interleave > PLANES_MAX_G:
            return f"the planes pack needs an interleave of at most {PLANES_MAX_G}, not {interleave}"
    return None


def _planes_perm(bt: BlockType, g: int) -> np.ndarray:
    """src[i] = byte of the whole-block chunk (g blocks) that lands at byte i of the planes chunk."""
    h, at, bb = PLANES_HEADER[bt.name], PLANES_HEADER_AT.get(bt.name, 0), bt.block_bytes
    src = np.empty(g * bb, dtype=np.int64)
    i = np.arange(g)
    for w in range(h // 2):  # header word w of every row
        for byte in range(2):
            src[2 * (w * g + i) + byte] = i * bb + at + 2 * w + byte
    for k in range((bb - h) // 4):  # quant slice k of every row: the block's bytes around the header
        q, p = 4 * k if 4 * k < at else 4 * k + h, planes_slice_pos(bt.name, k)
        for byte in range(4):
            src[h * g + 4 * (p * g + i) + byte] = i * bb + q + byte
    return src


def _chunk_runs(bt: BlockType, rows: int, cols: int, tile, interleave: int):
    """(byte offset, chunks, g) of each run of equal-size chunks in payload order: per stripe,
    column tile and group, that group's nb chunks of g blocks."""
    tr, tc = tile
    nbr, bpt, bb = cols // bt.block_elems, tc // bt.block_elems, bt.block_bytes
    off = 0
    for s0 in range(0, rows, tr):
        nr = min(tr, rows - s0)
        for cb0 in range(0, nbr, bpt):
            nb = min(bpt, nbr - cb0)
            for g0 in range(0, nr, interleave):
                g = min(interleave, nr - g0)
                yield off, nb, g
                off += nb * g * bb


def _planes(payload: np.ndarray, bt: BlockType, rows: int, cols: int, tile, interleave: int, inverse: bool) -> np.ndarray:
    """Whole-block payload -> planes payload (inverse: the way back)."""
    out = np.empty_like(payload)
    perms: dict[int, np.ndarray] = {}
    # Full stripes with full groups are one run each: reshape the whole stripe at once.
    tr, bb = tile[0], bt.block_bytes
    stripe_bytes = tr * (cols // bt.block_elems) * bb
    full = rows // tr if tr % interleave == 0 else 0
    if full:
        g = interleave
        p = perms.setdefault(g, _planes_perm(bt, g))
        a = payload[:full * stripe_bytes].reshape(-1, g * bb)
        o = out[:full * stripe_bytes].reshape(-1, g * bb)
        if inverse:
            o[:, p] = a
        else:
            o[:] = a[:, p]
    for off, nb, g in _chunk_runs(bt, rows - full * tr, cols, tile, interleave):
        off += full * stripe_bytes
        p = perms.setdefault(g, _planes_perm(bt, g))
        a = payload[off:off + nb * g * bb].reshape(nb, g * bb)
        o = out[off:off + nb * g * bb].reshape(nb, g * bb)
        if inverse:
            o[:, p] = a
        else:
            o[:] = a[:, p]
    return out


def pack_tiles(row_blocks: np.ndarray, bt: BlockType, cols: int, tile=DEFAULT_TILE, interleave: int = 1,
               pack: str = "blocks") -> np.ndarray:
    """Reorder a row-major encoded matrix into the tiled payload.

    row_blocks: uint8 (R, C/QK * block_bytes), each row GGUF-encoded. Returns uint8 (nbytes,).
    """
    rows = row_blocks.shape[0]
    if row_blocks.dtype != np.uint8 or row_blocks.ndim != 2 or row_blocks.shape[1] * bt.block_elems != cols * bt.block_bytes:
        raise CflowFormatError(f"pack_tiles: expected uint8 ({rows}, {cols // bt.block_elems * bt.block_bytes}), got {row_blocks.dtype} {row_blocks.shape}")
    if err := check_pack(bt, interleave, pack):
        raise CflowFormatError(f"pack_tiles: {err}")
    blocks = np.ascontiguousarray(row_blocks).reshape(-1, bt.block_bytes)
    perm = _tile_permutation(bt, rows, cols, tuple(tile), interleave)
    payload = blocks[perm].reshape(-1)
    return _planes(payload, bt, rows, cols, tuple(tile), interleave, False) if pack == "planes" else payload


def unpack_tiles(payload: np.ndarray, bt: BlockType, rows: int, cols: int, tile=DEFAULT_TILE, interleave: int = 1,
                 pack: str = "blocks") -> np.ndarray:
    """Inverse of pack_tiles: uint8 (nbytes,) -> uint8 (R, C/QK * block_bytes)."""
    n = tiled_nbytes(bt, rows, cols)
    if payload.size != n:
        raise CflowFormatError(f"unpack_tiles: payload of {payload.size} bytes, expected {n}")
    if err := check_pack(bt, interleave, pack):
        raise CflowFormatError(f"unpack_tiles: {err}")
    payload = np.asarray(payload, dtype=np.uint8).reshape(-1)
    if pack == "planes":
        payload = _planes(payload, bt, rows, cols, tuple(tile), interleave, True)
    blocks = payload.reshape(-1, bt.block_bytes)
    perm = _tile_permutation(bt, rows, cols, tuple(tile), interleave)
    out = np.empty_like(blocks)
    out[perm] = blocks
    return out.reshape(rows, -1)


def fuse_rows(mats, mode: str, tile_rows: int = DEFAULT_TILE[0]):
    """Order the rows of several matrices into one, so one tiled GEMV computes them all.

    mats: 2-D arrays with the same number of columns (encoded rows, uint8 (R_i, bytes), or any
    dtype). Rows are permuted as whole rows, so encode first or after: the result is the same.
      * "stack": [Wq; Wk; Wv] one below the other (fused QKV). Returns (fused, offsets) where
        outputs y[offsets[i]:offsets[i+1]] belong to mats[i].
      * "glu": mats = [gate, up] of equal shape (ff, C), interleaved by half-stripes of
        h = tile_rows // 2 rows: gate[0:h], up[0:h], gate[h:2h], up[h:2h], ... (the last
        chunk: the r = ff - k*h remaining gate rows, then the r up rows). Every stripe of
        tile_rows rows then holds a gate chunk and its up chunk, so the kernel applies the GLU
        per stripe (csrc gemv_glu). Returns (fused, None); fused has 2*ff rows.
    """
    mats = [np.asarray(m) for m in mats]
    if not mats or any(m.ndim != 2 for m in mats) or len({m.shape[1] for m in mats}) != 1:
        raise CflowFormatError("fuse_rows: expected 2-D matrices with the same number of columns")
    if mode == "stack":
        offsets = np.cumsum([0] + [m.shape[0] for m in mats]).tolist()
        return np.ascontiguousarray(np.concatenate(mats, axis=0)), offsets
    if mode == "glu":
        if len(mats) != 2 or mats[0].shape != mats[1].shape:
            raise CflowFormatError("fuse_rows(glu): expected [gate, up] of equal shape")
        if tile_rows <= 0 or tile_rows % 2:
            raise CflowFormatError(f"fuse_rows(glu): tile rows must be even, got {tile_rows}")
        return np.ascontiguousarray(np.concatenate(glu_chunks(mats[0], mats[1], tile_rows // 2), axis=0)), None
    raise CflowFormatError(f"fuse_rows: unknown mode {mode!r} (stack | glu)")


def glu_chunks(gate: np.ndarray, up: np.ndarray, h: int) -> list:
    """gate[0:h], up[0:h], gate[h:2h], up[h:2h], ... (the row order of fuse_rows "glu")."""
    parts = []
    for r in range(0, gate.shape[0], h):
        parts += [gate[r : r + h], up[r : r + h]]
    return parts
