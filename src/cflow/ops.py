"""The small native ops (RMSNorm, RoPE, softmax, activations, top-k, attention) on numpy arrays.

Thin wrappers over ``cflow._core.ops``: each converts its inputs to contiguous float32, allocates
the result, and calls the C++ kernel with the GIL released. Formulas and layouts are in
docs/KERNELS.md, section "Ops". Bad shapes or indices raise :class:`cflow.errors.CflowError`.

``isa`` (``"scalar"``, ``"avx2"``, ``"avx512"`` or None for the best this CPU has) picks the
kernel path explicitly; it exists so the tests can compare every path.
"""

from __future__ import annotations

import math

import numpy as np

from cflow._native import core
from cflow.errors import CflowError

_ops = core.ops
RopeTable = _ops.RopeTable

__all__ = [
    "RopeTable", "rope_table", "rmsnorm", "rope", "softmax", "log_softmax", "silu", "gelu_tanh",
    "swiglu", "geglu", "topk", "attn_decode", "attn_prefill", "add", "scale", "f32_to_f16",
    "f16_to_f32",
]


def _call(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except (ValueError, TypeError) as e:
        raise CflowError(str(e)) from None


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def rope_table(rot_dim: int, max_pos: int, theta: float = 10000.0, inv_freq=None) -> RopeTable:
    """cos/sin table for RoPE over positions [0, max_pos).

    Frequencies are ``theta ** (-2i / rot_dim)`` unless ``inv_freq`` (rot_dim/2 values, e.g.
    llama3- or linear-scaled) is given. Build it once per model.
    """
    if inv_freq is not None:
        f = _f32(inv_freq)
        if f.ndim != 1 or 2 * f.shape[0] != rot_dim:
            raise CflowError(f"rope_table: inv_freq must have rot_dim/2 = {rot_dim // 2} values")
        return _call(RopeTable.from_freqs, f, int(max_pos))
    return _call(RopeTable, int(rot_dim), int(max_pos), float(theta))


def rmsnorm(x, w, eps: float = 1e-6, offset: float = 0.0, *, isa=None) -> np.ndarray:
    """``x / sqrt(mean(x**2, -1) + eps) * (offset + w)`` over the last axis (offset 1 for gemma).

    For QK-norm pass q of shape (n_head, head_dim) and the (head_dim,) weight.
    """
    x = _f32(x)
    y = np.empty_like(x)
    _call(_ops.rmsnorm, y, x, _f32(w), float(eps), float(offset), isa)
    return y


def rope(x, pos, table: RopeTable, style: str = "neox", *, isa=None) -> np.ndarray:
    """Rotate q or k by RoPE; returns a new array.

    x: (n_head, head_dim) with an int ``pos``, or (T, n_head, head_dim) with ``pos`` of T
    positions. style "neox" pairs (i, i + rot_dim/2) (HF llama/qwen/gemma); "interleaved" pairs
    (2i, 2i+1) (GPT-J, GGUF llama).
    """
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    single = y.ndim == 2
    if single:
        y = y[None]
    p = np.ascontiguousarray(np.atleast_1d(np.asarray(pos)), dtype=np.int64)
    if p.size and (p.min() < 0 or p.max() >= 2**31):
        raise CflowError(f"rope: position out of range: {p.min()}..{p.max()}")
    _call(_ops.rope, y, p.astype(np.int32), table, style, isa)
    return y[0] if single else y


def softmax(x, *, isa=None) -> np.ndarray:
    """Numerically stable softmax over the last axis."""
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    _call(_ops.softmax, y, isa)
    return y


def log_softmax(x, *, isa=None) -> np.ndarray:
    """``x - max - log(sum(exp(x - max)))`` over the last axis."""
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    _call(_ops.log_softmax, y, isa)
    return y


def _unary(fn, x, isa):
    x = _f32(x)
    y = np.empty_like(x)
    _call(fn, y, x, isa)
    return y


def _binary(fn, a, b, isa):
    a, b = _f32(a), _f32(b)
    y = np.empty_like(a)
    _call(fn, y, a, b, isa)
    return y


def silu(x, *, isa=None) -> np.ndarray:
    """``x * sigmoid(x)``."""
    return _unary(_ops.silu, x, isa)


def gelu_tanh(x, *, isa=None) -> np.ndarray:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (GELU, tanh approximation)."""
    return _unary(_ops.gelu_tanh, x, isa)


def swiglu(g, u, *, isa=None) -> np.ndarray:
    """``silu(g) * u``."""
    return _binary(_ops.swiglu, g, u, isa)


def geglu(g, u, *, isa=None) -> np.ndarray:
    """``gelu_tanh(g) * u``."""
    return _binary(_ops.geglu, g, u, isa)


def add(a, b, *, isa=None) -> np.ndarray:
    """``a + b`` (the residual add)."""
    return _binary(_ops.add, a, b, isa)


def scale(x, s: float, *, isa=None) -> np.ndarray:
    """``s * x``."""
    x = _f32(x)
    y = np.empty_like(x)
    _call(_ops.scale, y, x, float(s), isa)
    return y


def f32_to_f16(x, *, isa=None) -> np.ndarray:
    """fp32 -> IEEE fp16 (round to nearest even, like ``astype(np.float16)``)."""
    x = _f32(x)
    y = np.empty(x.shape, dtype=np.uint16)
    _call(_ops.f32_to_f16, y, x, isa)
    return y.view(np.float16)


def f16_to_f32(h, *, isa=None) -> np.ndarray:
    """IEEE fp16 -> fp32 (exact)."""
    h = np.ascontiguousarray(h)
    if h.dtype != np.float16:
        raise CflowError(f"f16_to_f32: expects float16, got {h.dtype}")
    y = np.empty(h.shape, dtype=np.float32)
    _call(_ops.f16_to_f32, y, h.view(np.uint16), isa)
    return y


def topk(x, k: int, *, isa=None) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values of a 1-D array, sorted descending, ties broken by the lower index
    (NaN ranks below every number). Returns (indices int32, values float32)."""
    x = _f32(x)
    if x.ndim != 1:
        raise CflowError(f"topk: x must be 1-D, got shape {x.shape}")
    if not 1 <= int(k) <= x.shape[0]:
        raise CflowError(f"topk: k={k} outside [1, n={x.shape[0]}]")
    idx = np.empty(int(k), dtype=np.int32)
    val = np.empty(int(k), dtype=np.float32)
    _call(_ops.topk, idx, val, x, isa)
    return idx, val


def _cache(c):
    c = np.ascontiguousarray(c)
    if c.dtype == np.float16:
        return c.view(np.uint16)
    return c.astype(np.float32, copy=False)


def _attn(fn, q, k, v, p, scale_, window, softcap, heads, isa):
    q = _f32(q)
    k, v = _cache(k), _cache(v)
    if k.dtype != v.dtype:
        raise CflowError(f"attention: K and V caches differ in dtype ({k.dtype} vs {v.dtype})")
    hd = q.shape[-1] if q.ndim else 0
    scale_ = 1.0 / math.sqrt(hd) if scale_ is None and hd else scale_
    n_head = q.shape[-2] if q.ndim >= 2 else 0
    hb, he = (0, n_head) if heads is None else heads
    out = np.zeros_like(q)
    _call(fn, out, q, k, v, int(p), float(scale_ if scale_ is not None else 1.0), int(window),
          float(softcap), int(hb), int(he), isa)
    return out


def attn_decode(q, k, v, pos: int, scale: float | None = None, window: int = 0,
                softcap: float = 0.0, heads: tuple[int, int] | None = None, *,
                isa=None) -> np.ndarray:
    """Attention of one new token at position ``pos`` over the KV cache.

    q: (n_head, head_dim); k, v: (n_kv_head, max_ctx, head_dim) float32 or float16, holding
    positions 0..pos. Query head h reads KV head h // (n_head // n_kv_head). scale defaults to
    1/sqrt(head_dim); window > 0 attends only the last ``window`` positions; softcap > 0 applies
    ``softcap * tanh(logit / softcap)``. heads=(begin, end) computes only those heads (the
    others stay zero). Returns (n_head, head_dim).
    """
    return _attn(_ops.attn_decode, q, k, v, pos, scale, window, softcap, heads, isa)


def attn_prefill(q, k, v, p0: int, scale: float | None = None, window: int = 0,
                 softcap: float = 0.0, heads: tuple[int, int] | None = None, *,
                 isa=None) -> np.ndarray:
    """Causal attention of T new tokens at positions p0..p0+T-1; q: (T, n_head, head_dim), the
    cache already holding positions 0..p0+T-1. Otherwise as :func:`attn_decode`."""
    return _attn(_ops.attn_prefill, q, k, v, p0, scale, window, softcap, heads, isa)
