"""The numpy reference engine: slow, readable, fp32, dequantized weights.

It implements the Engine interface (API.md) for the dense architectures llama, qwen2, qwen3
and gemma3, and is the second opinion the native engine is checked against. One decoder
layer (pre-norm residual block), with the per-architecture switches of ModelConfig:

    h = x + post_attn_norm?( Wo @ attn( rope( qk_norm?( Wqkv @ rms(x) + b? ) ) ) )
    x = h + post_ffn_norm?( Wd @ ( act(Wg @ rms(h)) * (Wu @ rms(h)) ) )

Rope is "neox" (rotate halves) for every source: the GGUF converter undoes llama.cpp's Q/K
row permutation. Sliding-window layers (gemma3) attend to keys with q_pos - k_pos < window and
use rope_local_theta.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from cflow.config import ModelConfig
from cflow.errors import CflowError, UnsupportedError


def open_weights(src):
    """A path (.cflow, .gguf, HF directory) or an already open CflowFile / Checkpoint."""
    if not isinstance(src, (str, os.PathLike)):
        return src
    from cflow.convert import load_source, source_kind

    if source_kind(src) == "cflow":
        from cflow.format import CflowFile

        return CflowFile(src)
    return load_source(src)


@dataclass
class Layer:
    attn_norm: np.ndarray  # (d,)
    wq: np.ndarray  # (q_dim, d)
    wk: np.ndarray  # (kv_dim, d)
    wv: np.ndarray  # (kv_dim, d)
    bqkv: np.ndarray | None  # (q_dim + 2 kv_dim,)
    q_norm: np.ndarray | None  # (head_dim,)
    k_norm: np.ndarray | None
    wo: np.ndarray  # (d, q_dim)
    attn_post_norm: np.ndarray | None
    ffn_norm: np.ndarray
    wg: np.ndarray  # (d_ff, d)
    wu: np.ndarray  # (d_ff, d)
    wd: np.ndarray  # (d, d_ff)
    ffn_post_norm: np.ndarray | None


def _parts(src, name: str, part_names: tuple[str, ...]) -> list[np.ndarray]:
    """The parts of a fused tensor, or the separate tensors when the file stores them unfused."""
    if name in src.tensors:
        p = src.unfuse(name)
        return [p[n] for n in part_names]
    return [src.dequantize(n) for n in part_names]


def load_layers(src, cfg: ModelConfig) -> list[Layer]:
    def opt(name):
        return src.dequantize(name) if name in src.tensors else None

    layers = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        wq, wk, wv = _parts(src, b + "attn_qkv", (b + "attn_q", b + "attn_k", b + "attn_v"))
        wg, wu = _parts(src, b + "ffn_gate_up", (b + "ffn_gate", b + "ffn_up"))
        bias = opt(b + "attn_qkv.bias")
        if bias is None and b + "attn_q.bias" in src.tensors:
            bias = np.concatenate([src.dequantize(b + n + ".bias") for n in ("attn_q", "attn_k", "attn_v")])
        layers.append(Layer(
            src.dequantize(b + "attn_norm"), wq, wk, wv, bias, opt(b + "attn_q_norm"), opt(b + "attn_k_norm"),
            src.dequantize(b + "attn_output"), opt(b + "attn_post_norm"), src.dequantize(b + "ffn_norm"),
            wg, wu, src.dequantize(b + "ffn_down"), opt(b + "ffn_post_norm"),
        ))
    return layers


class RefState:
    """KV cache of one sequence: k, v (n_layer, n_ctx, n_kv_head, head_dim); pos tokens filled."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        shape = (cfg.n_layer, n_ctx, cfg.n_kv_head, cfg.head_dim)
        self.k = np.zeros(shape, np.float32)  # pages are committed only as they fill
        self.v = np.zeros(shape, np.float32)
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.pos:
            raise CflowError(f"cannot truncate a state of {self.pos} tokens to {n}")
        self.pos = n


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, offset: float) -> np.ndarray:
    """x (..., n) normalized over the last axis, times (offset + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w)


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """neox rope: x (T, H, hd) at positions pos (T,); rotates the halves (x1, x2)."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # (hd/2,)
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # (T, hd/2)
    cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class RefEngine:
    """Engine interface over numpy; `fast` is accepted and ignored (always the fp32 path)."""

    def __init__(self, path_or_cflowfile, *, threads: int | None = None, n_ctx: int | None = None, fast: bool = True):
        src = open_weights(path_or_cflowfile)
        cfg = src.config
        from cflow import models

        if cfg.arch not in (runs := models.supported("ref")) or cfg.n_expert:
            raise UnsupportedError(f"the reference engine runs dense {', '.join(runs)}; this model is {cfg.arch}"
                                   + (f" with {cfg.n_expert} experts" if cfg.n_expert else ""))
        self.config = cfg
        self.n_ctx = int(n_ctx or min(cfg.max_seq_len, 8192))
        if self.n_ctx <= 0:
            raise CflowError(f"n_ctx must be positive, got {self.n_ctx}")
        self.fast = False
        self.tok_embd = src.dequantize("tok_embd")  # (vocab, d)
        self.output = self.tok_embd if cfg.tie_embeddings else src.dequantize("output")
        self.output_norm = src.dequantize("output_norm")
        self.layers = load_layers(src, cfg)
        self.bytes_per_token = sum(int(_nbytes(src, n)) for n in src.tensors if n != "tok_embd" or cfg.tie_embeddings)
        self.src = src

    def new_state(self) -> RefState:
        return RefState(self.config, self.n_ctx)

    def forward(self, state: RefState, token_ids: list[int], *, all_logits: bool = False) -> np.ndarray:
        c = self.config
        ids = np.asarray(token_ids, dtype=np.int64)
        T = len(ids)
        if T == 0:
            raise CflowError("forward needs at least one token")
        if state.pos + T > self.n_ctx:
            raise CflowError(f"context full: {state.pos} tokens in the cache + {T} new > n_ctx={self.n_ctx}")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise CflowError(f"token id out of range 0..{c.vocab_size - 1}")
        p0 = state.pos
        pos = np.arange(p0, p0 + T)
        x = self.tok_embd[ids] * np.float32(c.embed_scale)  # (T, d)
        hd, nh, nkv = c.head_dim, c.n_head, c.n_kv_head
        scale = np.float32(c.attn_scale or hd**-0.5)
        act = gelu_tanh if c.act == "gelu_tanh" else silu
        for li, L in enumerate(self.layers):
            sliding = c.layer_type(li) == "sliding"
            h = rms_norm(x, L.attn_norm, c.norm_eps, c.norm_offset)
            q, k, v = h @ L.wq.T, h @ L.wk.T, h @ L.wv.T  # (T, q_dim), (T, kv_dim) x2
            if L.bqkv is not None:
                q, k, v = q + L.bqkv[: c.q_dim], k + L.bqkv[c.q_dim : c.q_dim + c.kv_dim], v + L.bqkv[c.q_dim + c.kv_dim :]
            q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
            if L.q_norm is not None:
                q = rms_norm(q, L.q_norm, c.norm_eps, c.norm_offset)
                k = rms_norm(k, L.k_norm, c.norm_eps, c.norm_offset)
            theta = c.rope_local_theta if sliding and c.rope_local_theta else c.rope_theta
            q, k = rope(q, pos, theta), rope(k, pos, theta)
            state.k[li, p0 : p0 + T] = k
            state.v[li, p0 : p0 + T] = v
            K, V = state.k[li, : p0 + T], state.v[li, : p0 + T]  # (S, nkv, hd)
            qg = q.reshape(T, nkv, nh // nkv, hd)  # query heads grouped by their KV head
            s = np.einsum("tgqd,sgd->gqts", qg, K) * scale  # (nkv, group, T, S)
            kpos = np.arange(p0 + T)
            mask = kpos[None, :] > pos[:, None]  # (T, S) future keys
            if sliding and c.sliding_window:
                mask |= pos[:, None] - kpos[None, :] >= c.sliding_window
            s = np.where(mask, -np.inf, s)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            o = np.einsum("gqts,sgd->tgqd", s, V).reshape(T, c.q_dim)
            o = o @ L.wo.T
            if L.attn_post_norm is not None:
                o = rms_norm(o, L.attn_post_norm, c.norm_eps, c.norm_offset)
            x = x + o
            h = rms_norm(x, L.ffn_norm, c.norm_eps, c.norm_offset)
            f = (act(h @ L.wg.T) * (h @ L.wu.T)) @ L.wd.T
            if L.ffn_post_norm is not None:
                f = rms_norm(f, L.ffn_post_norm, c.norm_eps, c.norm_offset)
            x = x + f
        state.pos = p0 + T
        if not all_logits:
            x = x[-1:]
        logits = rms_norm(x, self.output_norm, c.norm_eps, c.norm_offset) @ self.output.T
        if c.final_logit_softcap:
            logits = np.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        logits = logits.astype(np.float32, copy=False)
        return logits if all_logits else logits[0]


def _nbytes(src, name: str) -> int:
    t = src.tensors[name]
    n = getattr(t, "nbytes", None)
    return int(n) if n is not None else int(np.asarray(t.data).nbytes)
