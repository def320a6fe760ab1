"""numpy-friendly access to the native tile GEMV kernels, the fused variants and the probe.

Weights are the tiled payload of cflow.format.tiles (uint8, 1-D); x is float32 (cols,).
act="q8" (default for quantized types) quantizes x once per call to int8 blocks and uses
integer dot products; act="f32" is the parity path. isa=None picks the best ISA of this CPU
(capped by the CFLOW_ISA environment variable); "scalar" | "avx2" | "avx512" force a path
(every type has a kernel on each ISA; where the CPU lacks one, the next lower runs: see gemv_isa).
pack="planes" reads Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K payloads written with the planes pack
(tiles.pack_tiles).
"""

from __future__ import annotations

import numpy as np

from cflow._native import core
from cflow.errors import CflowError
from cflow.format.tiles import DEFAULT_TILE, block_type, tiled_nbytes

__all__ = ["gemv", "gemv_qkv", "gemv_glu", "gemv_isa", "default_act", "probe_read", "best_isa",
           "set_num_threads", "num_threads"]


def default_act(wtype: str) -> str:
    """"q8" for the quantized types (the fast path), "f32" for f32/f16/bf16."""
    return "q8" if block_type(wtype).block_elems > 1 else "f32"


def _args(wtype, tiles, x, rows, cols, tile, interleave, act):
    bt = block_type(wtype)
    tiles = np.ascontiguousarray(tiles, dtype=np.uint8).reshape(-1)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if x.size != cols:
        raise CflowError(f"gemv: x has {x.size} values, expected cols={cols}")
    if tiles.size != tiled_nbytes(bt, rows, cols):
        raise CflowError(f"gemv: {tiles.size} weight bytes, expected {tiled_nbytes(bt, rows, cols)} for {bt.name} ({rows}, {cols})")
    return bt.name, tiles, x, (int(tile[0]), int(tile[1])), int(interleave), act or default_act(bt.name)


def _call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except ValueError as e:
        raise CflowError(str(e)) from None


def gemv(wtype, tiles, x, rows, cols, tile=DEFAULT_TILE, interleave=1, act=None, isa=None, threads=1, pack="blocks"):
    """y (rows,) float32 = W x, W the tiled (rows, cols) matrix of block type `wtype`."""
    name, tiles, x, tile, g, act = _args(wtype, tiles, x, rows, cols, tile, interleave, act)
    return _call(core.gemv, name, tiles, x, rows, cols, tile, g, act, isa, threads, pack)


def gemv_qkv(wtype, tiles, x, row_counts, cols, tile=DEFAULT_TILE, interleave=1, act=None, isa=None, threads=1,
             pack="blocks"):
    """One pass over a stacked [Wq; Wk; Wv] (fuse_rows(..., "stack")); returns (q, k, v, ...)."""
    y = gemv(wtype, tiles, x, int(sum(row_counts)), cols, tile, interleave, act, isa, threads, pack)
    offs = np.cumsum([0] + list(row_counts))
    return tuple(y[offs[i] : offs[i + 1]] for i in range(len(row_counts)))


def gemv_glu(wtype, tiles, x, ff, cols, glu="silu", tile=DEFAULT_TILE, interleave=1, act=None, isa=None, threads=1,
             pack="blocks"):
    """h (ff,) = glu(gate x) * (up x), one pass over fuse_rows([gate, up], "glu") tiled."""
    name, tiles, x, tile, g, act = _args(wtype, tiles, x, 2 * ff, cols, tile, interleave, act)
    return _call(core.gemv_glu, name, tiles, x, ff, cols, tile, g, glu, act, isa, threads, pack)


def gemv_isa(wtype, act=None, isa=None, pack="blocks") -> str:
    """The ISA of the kernel that runs for (wtype, act, pack) when `isa` (default: best) is allowed."""
    name = block_type(wtype).name
    return _call(core.gemv_isa, name, act or default_act(name), isa, pack)


def probe_read(mib=1024.0, threads=1, repeats=5, isa=None) -> list[float]:
    """Read bandwidth (GB/s) of each of `repeats` passes over a `mib` MiB buffer."""
    return list(_call(core.probe_read, float(mib), int(threads), int(repeats), isa))


def best_isa() -> str:
    return core.best_isa()


def kernels_name() -> str:
    """The kernel path decode runs here: the ISA, and "+amx" where batched decode steps (several
    sequences) use the AMX tile unit (CFLOW_AMX=0 turns it off)."""
    return core.best_isa() + ("+amx" if core.amx_usable() else "")


def set_num_threads(n: int) -> None:
    _call(core.set_num_threads, int(n))


def num_threads() -> int:
    return core.num_threads()
