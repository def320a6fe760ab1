"""Row encodings of each block type, bit-identical to GGUF's (a thin wrapper over gguf-py).

encode: float32 (R, C) -> uint8 (R, C/QK * block_bytes), each row GGUF-encoded.
decode: uint8 (R, C/QK * block_bytes) -> float32 (R, C).

gguf-py (0.19) quantizes f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, tq1_0 and tq2_0; it
dequantizes all of them plus q4_k, q5_k and q6_k. For the K-quants, writers pass already-encoded
row blocks (uint8), which is what GGUF conversion does; `can_encode` says which types take float
input.

Ternary types: GGUF's quantizer (gguf-py's, llama.cpp's quantize_row_tq*_ref) takes d = max |w| per
block of 256, which keeps ternary values (a model trained ternary) exactly and zeroes most of any
other matrix. `ternarize` is the step before it for a model that was not trained ternary: BitNet
b1.58's absmean rounding per block, with the scale refit by least squares.
"""

from __future__ import annotations

import numpy as np

from cflow.errors import CflowFormatError, UnsupportedError
from cflow.format.tiles import BlockType, block_type

# Types gguf-py can quantize from floats (checked against gguf-py 0.19; q4_k/q5_k/q6_k raise
# NotImplementedError there).
_ENCODABLE = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "tq1_0", "tq2_0")
TERNARY = ("tq1_0", "tq2_0")


def _qtype(bt: BlockType):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(bt.code)


def can_encode(bt: BlockType) -> bool:
    """True when float input can be encoded into `bt` here (else pass GGUF-encoded bytes)."""
    return bt.name in _ENCODABLE


def row_bytes(bt: BlockType, cols: int) -> int:
    """Bytes of one encoded row of `cols` weights."""
    if cols % bt.block_elems:
        raise CflowFormatError(f"{bt.name}: {cols} columns is not a multiple of the block size {bt.block_elems}")
    return cols // bt.block_elems * bt.block_bytes


def encode(x: np.ndarray, bt: BlockType, importance: np.ndarray | None = None) -> np.ndarray:
    """float (R, C) -> uint8 (R, row_bytes(C)): GGUF's row encoding of block type `bt`, by
    gguf-py's quantizers except Q4_0 and Q4_1, whose scales are fitted (encode_fit, which takes
    `importance`, a weight per column; the other types' quantizers have no use for one)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise CflowFormatError(f"encode: expected a 2-D array, got shape {x.shape}")
    row_bytes(bt, x.shape[1])
    if bt.name == "f32":
        return x.astype("<f4").view(np.uint8)
    if bt.name == "f16":
        return x.astype("<f2").view(np.uint8)
    if bt.name != "bf16" and not np.isfinite(x).all():
        raise CflowFormatError(f"cannot quantize to {bt.name}: the values include NaN or infinity")
    if not can_encode(bt):
        raise UnsupportedError(
            f"cannot quantize floats to {bt.name} (gguf-py has no {bt.name} quantizer); "
            f"pass GGUF-encoded row blocks as uint8 (R, C/{bt.block_elems}*{bt.block_bytes})"
        )
    if bt.name in FITTED:
        return encode_fit(x, bt.name, importance)
    from gguf.quants import quantize

    return np.ascontiguousarray(quantize(x, _qtype(bt))).view(np.uint8).reshape(x.shape[0], -1)


# Q4_0 and Q4_1 with fitted scales. gguf-py's (and llama.cpp's, without an importance matrix)
# Q4_0 takes d = (the block's signed extreme) / -8, which maps that one value exactly and leaves
# the other 31 on a coarser grid than they need; its Q4_1 spreads min .. max over 15 steps, which
# maps the two extremes exactly. encode_fit tries other grids per block of 32: Q4_0 the scales
# that put the extreme at -s (s = 7 .. 9 in steps of 0.2), Q4_1 the grids of 14 .. 16 steps over
# the range (in steps of 0.1), and for each the least-squares scale (Q4_1: scale and offset) of
# its integers; every candidate rounded to fp16 first, its integers refitted to it, the one of
# least squared error kept. gguf-py's own choice is among them, so no block comes out worse. Same
# bytes, same decoder: any reader runs the result. The search runs in the native core
# (csrc/kernels/quantize.cpp) on default_threads() threads (CFLOW_THREADS, else every core).
# With an importance per column (float (C,) > 0; llama.cpp's importance matrix: the mean square of
# the activations that column meets, models/calibrate.py) the squared errors and the fits are
# weighted by it: a matrix's output error is sum_j x_j (w_j - q_j), so the columns that meet
# large activations matter most.
FITTED = ("q4_0", "q4_1")


def encode_fit(x: np.ndarray, type_name: str, importance: np.ndarray | None = None) -> np.ndarray:
    """float (R, C), C % 32 == 0 -> uint8 (R, C / 32 * block bytes): blocks of `type_name` (q4_0
    or q4_1) of least (importance-weighted) squared error among the candidates above."""
    from cflow._native import core
    from cflow.engine import default_threads

    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise CflowFormatError(f"encode: expected a 2-D array, got shape {x.shape}")
    row_bytes(block_type(type_name), x.shape[1])
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=np.float32)
        if importance.ndim != 1:
            raise CflowFormatError(f"importance: expected one value per column, got shape {importance.shape}")
    try:
        return core.quantize_fit(type_name, x, default_threads(), importance)
    except ValueError as e:  # values beyond what the type's fp16 scale can cover
        raise CflowFormatError(f"cannot quantize to {type_name}: {e}") from None


def decode(rows: np.ndarray, bt: BlockType, cols: int) -> np.ndarray:
    """uint8 (R, row_bytes(C)) -> float32 (R, C): GGUF's dequantization of block type `bt`."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    if rows.ndim != 2 or rows.shape[1] != row_bytes(bt, cols):
        raise CflowFormatError(f"decode: expected uint8 (R, {row_bytes(bt, cols)}) for {bt.name}, got {rows.shape}")
    if bt.name == "f32":
        return rows.view("<f4").astype(np.float32)
    if bt.name == "f16":
        return rows.view("<f2").astype(np.float32)
    from gguf.quants import dequantize

    return np.asarray(dequantize(rows, _qtype(bt)), dtype=np.float32).reshape(rows.shape[0], cols)


def ternarize(x: np.ndarray, block: int = 256) -> np.ndarray:
    """float (R, C) -> the nearest ternary values, d * t with t in {-1, 0, 1} and one d per block of
    `block` weights along a row (C % block == 0): t = clip(round(w / mean|w|), -1, 1) (BitNet b1.58's
    absmean rule), then d = mean |w| over the non-zero t, the least-squares scale for those t. Values
    already ternary with one scale per block come back unchanged; encode() then stores them exactly
    but for d's rounding to f16."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % block:
        raise CflowFormatError(f"ternarize: expected (R, C) with C a multiple of {block}, got {x.shape}")
    b = x.reshape(-1, block)
    mean = np.abs(b).mean(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(mean > 0, np.clip(np.rint(b / mean), -1, 1), 0).astype(np.float32)
        nz = np.count_nonzero(t, axis=1)[:, None]
        d = np.where(nz > 0, (np.abs(b) * (t != 0)).sum(axis=1, keepdims=True) / np.maximum(nz, 1), 0)
    return (t * d.astype(np.float32)).reshape(x.shape)
