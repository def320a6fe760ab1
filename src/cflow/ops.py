"""The small native ops the engine calls (RMSNorm, softmax, gated activations) on numpy arrays.

Thin wrappers over ``cflow._core.ops``: each converts its inputs to contiguous float32, allocates
the result, and calls the C++ kernel with the GIL released. Formulas and layouts are in
docs/KERNELS.md, section "Ops". Bad shapes or indices raise :class:`cflow.errors.CflowError`.

``isa`` (``"scalar"``, ``"avx2"``, ``"avx512"`` or None for the best this CPU has) picks the
kernel path explicitly; it exists so the tests can compare every path.
"""

from __future__ import annotations

import numpy as np

from cflow._native import core
from cflow.errors import CflowError

_ops = core.ops

__all__ = ["rmsnorm", "softmax", "swiglu", "geglu", "quantize_q8_0", "dequantize_q8_0"]


def _call(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except (ValueError, TypeError) as e:
        raise CflowError(str(e)) from None


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def rmsnorm(x, w, eps: float = 1e-6, offset: float = 0.0, *, isa=None) -> np.ndarray:
    """``x / sqrt(mean(x**2, -1) + eps) * (offset + w)`` over the last axis (offset 1 for gemma).

    For QK-norm pass q of shape (n_head, head_dim) and the (head_dim,) weight.
    """
    x = _f32(x)
    y = np.empty_like(x)
    _call(_ops.rmsnorm, y, x, _f32(w), float(eps), float(offset), isa)
    return y


def softmax(x, *, isa=None) -> np.ndarray:
    """Numerically stable softmax over the last axis."""
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    _call(_ops.softmax, y, isa)
    return y


def _binary(fn, a, b, isa):
    a, b = _f32(a), _f32(b)
    y = np.empty_like(a)
    _call(fn, y, a, b, isa)
    return y


def swiglu(g, u, *, isa=None) -> np.ndarray:
    """``silu(g) * u``."""
    return _binary(_ops.swiglu, g, u, isa)


def geglu(g, u, *, isa=None) -> np.ndarray:
    """``gelu_tanh(g) * u``."""
    return _binary(_ops.geglu, g, u, isa)


def quantize_q8_0(x) -> np.ndarray:
    """x (n,), n a multiple of 32, as the KV cache's q8_0 blocks store it (llama.cpp's block_q8_0:
    per 32 values a half scale d = max|x| / 127 and int8 round(x / d)): (n / 32 * 34,) uint8."""
    x = _f32(x)
    y = np.empty((x.size // 32 * 34 if x.ndim == 1 else 0,), np.uint8)
    _call(_ops.to_q8_0, y, x)
    return y


def dequantize_q8_0(b, *, isa=None) -> np.ndarray:
    """The floats q8_0 blocks (quantize_q8_0's bytes) hold: d * q, exact, as attention reads them."""
    b = np.ascontiguousarray(b, dtype=np.uint8)
    if b.ndim != 1 or b.size % 34:
        raise CflowError(f"q8_0 blocks take 34 bytes each: got {b.shape}")
    y = np.empty((b.size // 34 * 32,), np.float32)
    _call(_ops.from_q8, y, b, isa=isa)
    return y
