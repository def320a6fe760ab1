"""The small native ops the engine calls against numpy references (float64) and torch, on every
ISA path this CPU has, with random shapes (hypothesis) including ragged SIMD tails."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cflow import ops
from cflow._native import core
from cflow.errors import CflowError

ISAS = [i for i in ("scalar", "avx2", "avx512") if core.isa_supported(i)]
RTOL = 1e-5
fast = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rng(seed):
    return np.random.default_rng(seed)


def close(got, want, rtol=RTOL, atol=1e-6):
    np.testing.assert_allclose(got, np.asarray(want, dtype=np.float64), rtol=rtol, atol=atol)


# ---- numpy references (float64) -------------------------------------------------------------

def ref_rmsnorm(x, w, eps, off):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (off + w.astype(np.float64))


def ref_gelu(x):
    """0.5 x (1 + tanh(u)) as x * sigmoid(2u): equal, without cancellation for x < 0."""
    x = x.astype(np.float64)
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-2 * u))


def ref_silu(x):
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-x))


def ref_softmax(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


sizes = st.integers(1, 300)


# ---- element-wise ---------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@fast
@given(rows=st.integers(1, 4), n=sizes, seed=st.integers(0, 2**31), off=st.sampled_from([0.0, 1.0]))
def test_rmsnorm(isa, rows, n, seed, off):
    r = rng(seed)
    x = r.normal(size=(rows, n)).astype(np.float32) * 3
    w = r.normal(size=n).astype(np.float32)
    y = ops.rmsnorm(x, w, 1e-6, off, isa=isa)
    close(y, ref_rmsnorm(x, w, 1e-6, off))
    if off == 0.0:
        t = F.rms_norm(torch.from_numpy(x), (n,), torch.from_numpy(w), eps=1e-6).numpy()
        close(y, t, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@fast
@given(n=sizes, seed=st.integers(0, 2**31))
def test_activations(isa, n, seed):
    r = rng(seed)
    x = (r.normal(size=n) * 5).astype(np.float32)
    u = r.normal(size=n).astype(np.float32)
    close(ops.swiglu(x, u, isa=isa), ref_silu(x) * u, atol=1e-30)
    close(ops.geglu(x, u, isa=isa), ref_gelu(x) * u, atol=1e-30)
    tx, tu = torch.from_numpy(x), torch.from_numpy(u)
    close(ops.swiglu(x, u, isa=isa), (F.silu(tx) * tu).numpy(), atol=1e-6)
    close(ops.geglu(x, u, isa=isa), (F.gelu(tx, approximate="tanh") * tu).numpy(), atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_activations_extremes(isa):
    x = np.array([-1e4, -200, -104, -88.5, -30, -1e-30, 0, 1e-30, 30, 88.5, 200, 1e4], np.float32)
    one = np.ones_like(x)
    for got, want in ((ops.swiglu(x, one, isa=isa), ref_silu(x)), (ops.geglu(x, one, isa=isa), ref_gelu(x))):
        assert np.all(np.isfinite(got))
        close(got, want, atol=1e-30)


@pytest.mark.parametrize("isa", ISAS)
@fast
@given(rows=st.integers(1, 3), n=sizes, seed=st.integers(0, 2**31), spread=st.sampled_from([1, 30]))
def test_softmax(isa, rows, n, seed, spread):
    x = (rng(seed).normal(size=(rows, n)) * spread).astype(np.float32)
    p = ops.softmax(x, isa=isa)
    close(p, ref_softmax(x), atol=1e-30)
    close(p, F.softmax(torch.from_numpy(x), -1).numpy(), atol=1e-7)


# ---- the sampler's top-k --------------------------------------------------------------------

def ref_top_k_ids(x, k):
    """The k largest of x and every value equal to the k-th, in id order (sampling.top_k_filter's set)."""
    kth = np.sort(x)[x.size - k]
    return np.flatnonzero(x >= kth).tolist()


@pytest.mark.parametrize("isa", ISAS)
@fast
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), data=st.data(),
       kind=st.sampled_from(["normal", "rounded", "peaked", "infinities"]))
def test_top_k_ids(isa, n, seed, data, kind):
    # ragged tails, k from 1 to n, many ties (rounded), a few tokens far above the rest (a real
    # model's logits): always top_k_filter's set, in id order; values that are not finite: None
    # (the sampler then takes its numpy path)
    k = data.draw(st.integers(1, n))
    r = rng(seed)
    x = (r.standard_normal(n) * 3).astype(np.float32)
    if kind == "rounded":
        x = np.round(x)
    elif kind == "peaked":
        x[r.integers(0, n, size=3)] += 40
    elif kind == "infinities":
        x[r.integers(0, n)] = r.choice([np.inf, -np.inf])
    got = core.ops.top_k_ids(x, k, isa)
    if kind == "infinities":
        assert got is None
    else:
        assert got.dtype == np.int32 and got.tolist() == ref_top_k_ids(x, k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [49152, 151936, 262144 + 77])
def test_top_k_ids_over_a_vocabulary(isa, n):
    # runs of 256 values (R = n // 256 maxima, a ragged tail past them): logits with a long
    # tail of unlikely tokens, a few far above the rest, many ties at the k-th, the largest value
    # in the tail, every k from 1 to the whole vocabulary
    r = rng(n)
    x = (r.standard_normal(n) * 2 - 8 * (r.random(n) < 0.5)).astype(np.float32)
    x[r.integers(0, n, size=5)] += 30
    x[n - 3] = x.max() + 1
    for k in (1, 40, 41, 256, 1000, n // 256, n // 256 + 1, n - 1, n):
        assert core.ops.top_k_ids(x, k, isa).tolist() == ref_top_k_ids(x, k)
    y = np.round(x)  # ties
    for k in (1, 40, 1000):
        assert core.ops.top_k_ids(y, k, isa).tolist() == ref_top_k_ids(y, k)


@pytest.mark.parametrize("isa", ISAS)
def test_top_k_ids_refuses_values_not_finite_and_bad_k(isa):
    x = np.arange(100, dtype=np.float32)
    for at in (0, 50, 99):  # in a block, in the tail past the blocks (7 blocks of 14)
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[at] = bad
            assert core.ops.top_k_ids(y, 7, isa) is None
    for k in (0, 101):
        with pytest.raises(ValueError, match="k must be"):
            core.ops.top_k_ids(x, k, isa)


# ---- the KV cache's q8_0 blocks ---------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@fast
@given(blocks=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([1e-2, 1.0, 300.0]))
def test_kv_q8_0_blocks_are_ggml_s(isa, blocks, seed, spread):
    # the cache's q8_0 blocks are the bytes gguf's reference quantizer (ggml's bit for bit) writes,
    # ties of half a step rounded away from zero as its roundf; a block of zeros has scale 0;
    # every ISA widens them to the same floats, d * q exactly
    from gguf import GGMLQuantizationType, quants

    x = (rng(seed).standard_normal(32 * blocks) * spread).astype(np.float32)
    x[:32] = np.array([127, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5] + [0] * 24, np.float32)  # scale 1: exact ties
    if blocks > 1:
        x[32:64] = 0
    got = ops.quantize_q8_0(x)
    want = quants.quantize(x.reshape(1, -1), GGMLQuantizationType.Q8_0).reshape(-1)
    np.testing.assert_array_equal(got, want)
    assert got[2:10].view(np.int8).tolist() == [127, 3, -3, 1, -1, 2, -2, 127]
    back = ops.dequantize_q8_0(got, isa=isa)
    np.testing.assert_array_equal(back, quants.dequantize(want, GGMLQuantizationType.Q8_0).reshape(-1))
    # within half a step, plus what the half scale's rounding (2^-11 of it) moves 127 steps
    d = np.abs(x.reshape(-1, 32)).max(1, keepdims=True) / 127
    assert (np.abs(back.reshape(-1, 32) - x.reshape(-1, 32)) <= d * (0.5 + 127 * 2.0**-11) * (1 + 1e-6)).all()


def test_kv_q8_0_block_with_a_value_not_finite_reads_as_nan():
    # attention then carries the NaN to the logits, where the engine refuses them
    x = np.ones(96, np.float32)
    x[40] = np.inf
    back = ops.dequantize_q8_0(ops.quantize_q8_0(x))
    assert np.isnan(back[32:64]).all() and np.isfinite(back[:32]).all() and np.isfinite(back[64:]).all()
    with pytest.raises(CflowError, match="multiple of 32"):
        ops.quantize_q8_0(np.ones(40, np.float32))
    with pytest.raises(CflowError, match="34 bytes each"):
        ops.dequantize_q8_0(np.zeros(33, np.uint8))


# ---- errors ---------------------------------------------------------------------------------

def test_bad_input_raises_cflow_error():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(CflowError, match="w must be"):
        ops.rmsnorm(x, np.ones(7, np.float32))
    with pytest.raises(CflowError, match="shapes differ"):
        ops.swiglu(x, np.ones((2, 9), np.float32))
    with pytest.raises(CflowError, match="unknown ISA"):
        ops.softmax(x, isa="neon")


def test_core_never_writes_into_a_converted_copy():
    """An output of the wrong dtype is refused, not silently converted (the result would be lost)."""
    x = np.ones(8, np.float32)
    with pytest.raises(TypeError):
        core.ops.swiglu(np.empty(8, np.float64), x, x)
    with pytest.raises(TypeError):
        core.ops.softmax(np.ones((2, 8), np.float64))
