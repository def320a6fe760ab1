"""The small native ops against numpy references (float64) and torch, on every ISA path this
CPU has, with random shapes (hypothesis) including ragged SIMD tails."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cflow import ops
from cflow._native import core
from cflow.errors import CflowError

ISAS = [i for i in ("scalar", "avx2", "avx512") if core.isa_supported(i)]
RTOL = 1e-5
fast = settings(max_examples=15, deadline=None)


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


def ref_rope(x, pos, theta, style):
    """x (T, H, D) float64; the textbook rotation of pairs by pos * theta^(-2i/D)."""
    x = x.astype(np.float64).copy()
    d = x.shape[-1]
    # The frequencies are fp32 (as in HF and in the table); angles and cos/sin in float64.
    inv = (theta ** (-np.arange(0, d, 2) / d)).astype(np.float32).astype(np.float64)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if style == "neox":
        a, b = x[..., : d // 2].copy(), x[..., d // 2:].copy()
        x[..., : d // 2], x[..., d // 2:] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0::2].copy(), x[..., 1::2].copy()
        x[..., 0::2], x[..., 1::2] = a * c - b * s, b * c + a * s
    return x


def ref_attn(q, k, v, p0, scale, window=0, softcap=0.0):
    """q (T, H, D); k, v (KV, C, D); token t at p0 + t attends positions <= p0 + t (and within
    the window)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    T, H, D = q.shape
    g = H // k.shape[0]
    out = np.zeros((T, H, D))
    for t in range(T):
        p = p0 + t
        lo = max(0, p + 1 - window) if window else 0
        for h in range(H):
            s = k[h // g, lo:p + 1] @ q[t, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[h // g, lo:p + 1]
    return out


def ref_topk(x, k):
    """Sorted by value descending, then index ascending; NaN last."""
    key = np.where(np.isnan(x), -np.inf, x).astype(np.float64)
    nan = np.isnan(x)
    order = np.lexsort((np.arange(len(x)), -key, nan))
    return order[:k]


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
    close(ops.silu(x, isa=isa), ref_silu(x), atol=1e-30)
    close(ops.gelu_tanh(x, isa=isa), ref_gelu(x), atol=1e-30)
    close(ops.swiglu(x, u, isa=isa), ref_silu(x) * u, atol=1e-30)
    close(ops.geglu(x, u, isa=isa), ref_gelu(x) * u, atol=1e-30)
    tx, tu = torch.from_numpy(x), torch.from_numpy(u)
    close(ops.silu(x, isa=isa), F.silu(tx).numpy(), atol=1e-6)
    close(ops.gelu_tanh(x, isa=isa), F.gelu(tx, approximate="tanh").numpy(), atol=1e-6)
    close(ops.geglu(x, u, isa=isa), (F.gelu(tx, approximate="tanh") * tu).numpy(), atol=1e-6)
    np.testing.assert_array_equal(ops.add(x, u, isa=isa), x + u)
    np.testing.assert_array_equal(ops.scale(x, 0.3, isa=isa), np.float32(0.3) * x)


@pytest.mark.parametrize("isa", ISAS)
def test_activations_extremes(isa):
    x = np.array([-1e4, -200, -104, -88.5, -30, -1e-30, 0, 1e-30, 30, 88.5, 200, 1e4], np.float32)
    for got, want in ((ops.silu(x, isa=isa), ref_silu(x)), (ops.gelu_tanh(x, isa=isa), ref_gelu(x))):
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
    lp = ops.log_softmax(x, isa=isa)
    close(lp, np.log(ref_softmax(x)), atol=1e-5)
    close(lp, F.log_softmax(torch.from_numpy(x), -1).numpy(), atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_f16_round_trip_matches_numpy(isa):
    x = rng(0).normal(size=5000).astype(np.float32) * np.logspace(-9, 5, 5000).astype(np.float32)
    x[:6] = [65504, 65519.99, 65520, -np.inf, 0.0, -0.0]
    h = ops.f32_to_f16(x, isa=isa)
    np.testing.assert_array_equal(h.view(np.uint16), x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(ops.f16_to_f32(h, isa=isa), h.astype(np.float32))
    nan = ops.f32_to_f16(np.array([np.nan], np.float32), isa=isa)
    assert np.isnan(nan[0])


# ---- RoPE -----------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@fast
@given(hd=st.sampled_from([2, 6, 16, 34, 64, 80, 128, 256]), nh=st.integers(1, 5),
       T=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_rope(isa, style, hd, nh, T, seed):
    r = rng(seed)
    theta = 10000.0
    table = ops.rope_table(hd, 4096, theta)
    x = r.normal(size=(T, nh, hd)).astype(np.float32)
    pos = r.integers(0, 4096, size=T)
    got = ops.rope(x, pos, table, style, isa=isa)
    # Table entries are fp32 roundings of cos/sin: absolute error ~1e-7 times |x|.
    close(got, ref_rope(x, pos, theta, style), rtol=1e-5, atol=1e-6 * np.abs(x).max())
    one = ops.rope(x[0], int(pos[0]), table, style, isa=isa)
    np.testing.assert_array_equal(one, got[0])


def test_rope_neox_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hd, T, nh = 64, 7, 3
    r = rng(1)
    q = r.normal(size=(T, nh, hd)).astype(np.float32)
    k = r.normal(size=(T, 1, hd)).astype(np.float32)
    pos = np.arange(100, 100 + T)
    # HF's own fp32 frequencies, given to the table; HF's rotation done in float64.
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    ang = torch.from_numpy(pos.astype(np.float64))[:, None] * inv.double()[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[None], emb.sin()[None]  # (1, T, hd)
    tq, tk = (torch.from_numpy(a).double().transpose(0, 1)[None] for a in (q, k))
    wq, wk = apply_rotary_pos_emb(tq, tk, cos, sin)
    table = ops.rope_table(hd, 256, inv_freq=inv.numpy())
    close(ops.rope(q, pos, table, "neox"), wq[0].transpose(0, 1).numpy(), atol=1e-5)
    close(ops.rope(k, pos, table, "neox"), wk[0].transpose(0, 1).numpy(), atol=1e-5)


def test_rope_table_from_freqs():
    inv = np.array([1.0, 0.5, 0.25], np.float32)
    table = ops.rope_table(6, 10, inv_freq=inv)
    x = np.zeros((1, 1, 6), np.float32)
    x[0, 0, :3] = 1.0
    got = ops.rope(x, [3], table, "neox")
    close(got[0, 0, :3], np.cos(3 * inv.astype(np.float64)), atol=1e-7)
    close(got[0, 0, 3:], np.sin(3 * inv.astype(np.float64)), atol=1e-7)


# ---- top-k ----------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@fast
@given(n=st.integers(1, 2000), k=st.integers(1, 70), seed=st.integers(0, 2**31),
       ties=st.booleans(), nans=st.booleans())
def test_topk(isa, n, k, seed, ties, nans):
    k = min(k, n)
    r = rng(seed)
    x = r.normal(size=n).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2
    if nans:
        x[r.integers(0, n, size=max(1, n // 10))] = np.nan
    idx, val = ops.topk(x, k, isa=isa)
    want = ref_topk(x, k)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(val, x[want])


@pytest.mark.parametrize("isa", ISAS)
def test_topk_vocab_size_matches_torch(isa):
    x = rng(3).normal(size=262144).astype(np.float32)  # distinct values: torch's order is defined
    for k in (1, 8, 40):
        idx, val = ops.topk(x, k, isa=isa)
        tv, ti = torch.topk(torch.from_numpy(x), k)
        np.testing.assert_array_equal(idx, ti.numpy())
        np.testing.assert_array_equal(val, tv.numpy())


# ---- attention ------------------------------------------------------------------------------

attn_shapes = st.sampled_from([(4, 4, 64), (9, 3, 64), (4, 1, 256), (8, 2, 80), (2, 1, 17),
                               (6, 2, 128)])


@pytest.mark.parametrize("isa", ISAS)
@fast
@given(shape=attn_shapes, ctx=st.integers(1, 300), seed=st.integers(0, 2**31),
       window=st.sampled_from([0, 1, 7, 64]), softcap=st.sampled_from([0.0, 20.0]),
       f16=st.booleans())
def test_attn_decode(isa, shape, ctx, seed, window, softcap, f16):
    nh, nkv, hd = shape
    r = rng(seed)
    max_ctx = ctx + 3
    k = r.normal(size=(nkv, max_ctx, hd)).astype(np.float32) * 2
    v = r.normal(size=(nkv, max_ctx, hd)).astype(np.float32)
    if f16:
        k, v = k.astype(np.float16), v.astype(np.float16)
    q = r.normal(size=(nh, hd)).astype(np.float32)
    pos = ctx - 1
    scale = 1 / math.sqrt(hd)
    got = ops.attn_decode(q, k, v, pos, scale, window, softcap, isa=isa)
    want = ref_attn(q[None], k.astype(np.float32), v.astype(np.float32), pos, scale, window,
                    softcap)[0]
    close(got, want, atol=1e-5)
    # Heads split in two ranges give the same result.
    half = nh // 2
    a = ops.attn_decode(q, k, v, pos, scale, window, softcap, heads=(0, half), isa=isa)
    b = ops.attn_decode(q, k, v, pos, scale, window, softcap, heads=(half, nh), isa=isa)
    np.testing.assert_array_equal(a[:half] + 0, got[:half])
    np.testing.assert_array_equal(b[half:], got[half:])
    assert not a[half:].any() and not b[:half].any()


@pytest.mark.parametrize("isa", ISAS)
@fast
@given(shape=attn_shapes, p0=st.integers(0, 100), T=st.integers(1, 12), seed=st.integers(0, 2**31),
       window=st.sampled_from([0, 5]))
def test_attn_prefill(isa, shape, p0, T, seed, window):
    nh, nkv, hd = shape
    r = rng(seed)
    k = r.normal(size=(nkv, p0 + T, hd)).astype(np.float32)
    v = r.normal(size=(nkv, p0 + T, hd)).astype(np.float32)
    q = r.normal(size=(T, nh, hd)).astype(np.float32)
    got = ops.attn_prefill(q, k, v, p0, window=window, isa=isa)
    close(got, ref_attn(q, k, v, p0, 1 / math.sqrt(hd), window), atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_attn_matches_torch_sdpa(isa):
    """Causal GQA prefill of a whole prompt (p0 = 0) and one decode step, against torch."""
    nh, nkv, hd, T = 8, 2, 64, 40
    r = rng(5)
    q = r.normal(size=(T + 1, nh, hd)).astype(np.float32)
    k = r.normal(size=(nkv, T + 1, hd)).astype(np.float32)
    v = r.normal(size=(nkv, T + 1, hd)).astype(np.float32)
    tq = torch.from_numpy(q).transpose(0, 1)[None]  # (1, H, T, D)
    tk, tv = torch.from_numpy(k)[None], torch.from_numpy(v)[None]
    want = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    want = want[0].transpose(0, 1).numpy()  # (T+1, H, D)
    got = ops.attn_prefill(q[:T], k, v, 0, isa=isa)
    close(got, want[:T], atol=1e-5)
    step = ops.attn_decode(q[T], k, v, T, isa=isa)
    close(step, want[T], atol=1e-5)


# ---- errors ---------------------------------------------------------------------------------

def test_bad_input_raises_cflow_error():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(CflowError, match="w must be"):
        ops.rmsnorm(x, np.ones(7, np.float32))
    with pytest.raises(CflowError, match="shapes differ"):
        ops.swiglu(x, np.ones((2, 9), np.float32))
    with pytest.raises(CflowError, match="k=9"):
        ops.topk(np.ones(8, np.float32), 9)
    with pytest.raises(CflowError, match="unknown ISA"):
        ops.silu(x, isa="neon")
    table = ops.rope_table(8, 16)
    with pytest.raises(CflowError, match="outside the table"):
        ops.rope(np.ones((1, 2, 8), np.float32), [16], table)
    with pytest.raises(CflowError, match="exceeds head_dim"):
        ops.rope(np.ones((1, 2, 4), np.float32), [0], table)
    with pytest.raises(CflowError, match="style"):
        ops.rope(np.ones((1, 2, 8), np.float32), [0], table, "gptj")
    with pytest.raises(CflowError, match="rot_dim must be even"):
        ops.rope_table(7, 16)
    kv = np.zeros((2, 10, 8), np.float32)
    with pytest.raises(CflowError, match="multiple of n_kv_head"):
        ops.attn_decode(np.ones((3, 8), np.float32), kv, kv, 0)
    with pytest.raises(CflowError, match="outside the cache"):
        ops.attn_decode(np.ones((4, 8), np.float32), kv, kv, 10)
    with pytest.raises(CflowError, match="outside the cache"):
        ops.attn_prefill(np.ones((3, 4, 8), np.float32), kv, kv, 8)
    with pytest.raises(CflowError, match="head range"):
        ops.attn_decode(np.ones((4, 8), np.float32), kv, kv, 0, heads=(2, 5))
    with pytest.raises(CflowError, match="head_dim"):
        ops.attn_decode(np.ones((4, 6), np.float32), kv, kv, 0)
    with pytest.raises(CflowError, match="differ in dtype"):
        ops.attn_decode(np.ones((4, 8), np.float32), kv, kv.astype(np.float16), 0)
