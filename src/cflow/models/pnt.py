"""Pipeline-native transformer (PNT) in PyTorch: the reference model for training and decode.

Every layer runs attention, a dense GeGLU FFN and a sparse top-k MoE block side by side.
The dependency graph is set by PNTConfig (models/pipeline_native.py; docs/ARCHITECTURES.md
has the equations):
- delta_d: the dense FFN of layer l reads the residual stream h[l - delta_d] (ring buffer);
- delta_e: the experts routed at layer l are added to the stream at layer l + delta_e (queue);
- routing_anchor: experts read h[l] ("pre_dense") or h[l] + dense output ("post_dense");
- combine: how the three contributions join the stream (parallel_sqrt2, delayed_sum,
  async_experts);
- residual "decoupled": experts keep their own stream m (arch1);
- post_norms: each block's output passes an RMSNorm "register" before it joins (arch3);
- n_iter: the n_layer unique layers are applied n_iter times with shared weights (arch5).

Ternary quantization-aware training (`PNT(cfg, ternary=True)`, `cflow train --ternary`), as
BitNet b1.58 trains: every weight matrix that the engine quantizes (attention, dense FFN,
experts; not the router, embeddings or head) meets its input as absmean ternary weights
(w / mean|w| rounded to -1, 0, +1, times mean|w|, per matrix and per expert) and per-token absmax
int8 activations; gradients pass both roundings straight through to the fp32 weights. Export
writes the ternarized weights (`ternarized`), so the file holds exactly what the model trained.

One code path serves full-sequence training (no cache) and token-by-token decode (KV cache):
the ring buffer and the pending-expert queue live only inside one call, because every delay
is between layers of the same token. Config, weights and state are apart: PNTConfig, the
nn.Module parameters, and DecodeState (KV cache, position).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from cflow.errors import CflowError
from cflow.models.pipeline_native import PNTConfig


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(d) - offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


def rope_cache(cfg: PNTConfig, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, head_dim) for integer positions pos (T,), neox layout."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos.float()[:, None] * inv[None, :]  # (T, hd/2)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); rotate halves (neox)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def ternary_values(w: torch.Tensor) -> torch.Tensor:
    """w as absmean ternary values (BitNet b1.58): mean|w| * round(w / mean|w|) clipped to -1..1."""
    s = w.abs().mean().clamp(min=1e-8)
    return (w / s).round().clamp(-1, 1) * s


def ternary_weight(w: torch.Tensor) -> torch.Tensor:
    """ternary_values(w), the gradient passing straight through to w."""
    return w + (ternary_values(w) - w).detach()


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x with each token's (last-axis) values rounded to 127 levels of its absmax; straight-through."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return x + ((x / s).round().clamp(-127, 127) * s - x).detach()


def linear(x: torch.Tensor, w: torch.Tensor, ternary: bool = False) -> torch.Tensor:
    """x @ w.T, or under ternary QAT int8_per_token(x) @ ternary_weight(w).T."""
    return F.linear(int8_per_token(x), ternary_weight(w)) if ternary else F.linear(x, w)


def geglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ternary: bool = False) -> torch.Tensor:
    """GeGLU FFN. x (N, d); w_gate_up (2h, d) = [W_gate; W_up]; w_down (d, h)."""
    g, u = linear(x, w_gate_up, ternary).chunk(2, dim=-1)
    return linear(F.gelu(g, approximate="tanh") * u, w_down, ternary)


class Attention(nn.Module):
    def __init__(self, cfg: PNTConfig):
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim, bias=False)  # fused [Wq; Wk; Wv]
        self.wo = nn.Linear(cfg.q_dim, cfg.d_model, bias=False)
        self.ternary = False  # set by PNT

    def forward(self, x, cos, sin, kv: list | None, pos0: int) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = linear(x, self.wqkv.weight, self.ternary).split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
        q = q.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:  # decode: append to this layer's cache
            if kv[0] is not None:
                k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
            kv[0], kv[1] = k, v
        S = k.shape[2]
        if pos0 == 0 and S == T:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # queries at pos0..pos0+T-1 see keys 0..their own position
            qpos = torch.arange(pos0, pos0 + T)[:, None]
            mask = torch.arange(S)[None, :] <= qpos  # (T, S)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return linear(y.transpose(1, 2).reshape(B, T, cfg.q_dim), self.wo.weight, self.ternary)


class MoE(nn.Module):
    """Top-k router with softmax gating (renormalised over the chosen k) and GeGLU experts."""

    def __init__(self, cfg: PNTConfig):
        super().__init__()
        self.cfg = cfg
        E, d, h = cfg.n_expert, cfg.d_model, cfg.d_expert
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * h, d))  # per expert [W_gate; W_up]
        self.w_down = nn.Parameter(torch.empty(E, d, h))
        self.ternary = False  # set by PNT

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d) -> (y (B, T, d), load-balancing loss (scalar))."""
        cfg = self.cfg
        xs = x.reshape(-1, x.shape[-1])  # (N, d)
        probs = F.softmax(self.router(xs).float(), dim=-1)  # (N, E)
        top_p, top_i = probs.topk(cfg.top_k, dim=-1)  # (N, k)
        gates = (top_p / top_p.sum(-1, keepdim=True)).to(xs.dtype)
        y = torch.zeros_like(xs)
        for e in range(cfg.n_expert):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            out = geglu(xs[rows], self.w_gate_up[e], self.w_down[e], self.ternary)
            y.index_add_(0, rows, out * gates[rows, slot, None])
        # Switch-style balance: E * sum_e (fraction of routed slots) * (mean router probability)
        frac = F.one_hot(top_i, cfg.n_expert).float().sum((0, 1)) / top_i.numel()
        lb = cfg.n_expert * (frac * probs.mean(0)).sum()
        return y.view_as(x), lb


class Layer(nn.Module):
    """Weights of one unique layer; the wiring between layers lives in PNT.forward."""

    def __init__(self, cfg: PNTConfig):
        super().__init__()
        d, eps, off = cfg.d_model, cfg.norm_eps, cfg.norm_offset
        self.attn_norm, self.attn = RMSNorm(d, eps, off), Attention(cfg)
        self.ffn_norm = RMSNorm(d, eps, off)
        self.ffn_gate_up = nn.Parameter(torch.empty(2 * cfg.d_ff, d))
        self.ffn_down = nn.Parameter(torch.empty(d, cfg.d_ff))
        self.exp_norm, self.moe = RMSNorm(d, eps, off), MoE(cfg)
        if cfg.post_norms:  # arch3's pipeline registers
            self.attn_post_norm = RMSNorm(d, eps, off)
            self.ffn_post_norm = RMSNorm(d, eps, off)
            self.exp_post_norm = RMSNorm(d, eps, off)
        if cfg.combine == "async_experts":  # per-channel gain on the late expert output
            self.exp_gain = nn.Parameter(torch.ones(d))


@dataclass
class DecodeState:
    """Per-sequence decode state: one KV cache per layer application, and the next position."""

    kv: list = field(default_factory=list)  # [[k (B, Hkv, S, hd), v], ...] per applied layer
    pos: int = 0


def check_pnt_config(cfg: PNTConfig) -> None:
    if not isinstance(cfg, PNTConfig):
        raise CflowError(f"PNT model needs a PNTConfig (arch='pnt'), got arch {cfg.arch!r}")
    if cfg.n_expert <= 0 or cfg.d_ff <= 0:
        raise CflowError("PNT layers need a dense FFN (d_ff > 0) and experts (n_expert > 0)")
    if cfg.act != "gelu_tanh":
        raise CflowError("PNT FFNs are GeGLU: act must be 'gelu_tanh'")
    if cfg.head_dim % 2:
        raise CflowError("head_dim must be even for RoPE")


class PNT(nn.Module):
    """The pipeline-native transformer. forward(idx) -> (logits, load-balancing loss).
    ternary: quantization-aware training with ternary weights and int8 activations (above)."""

    def __init__(self, cfg: PNTConfig, ternary: bool = False):
        super().__init__()
        check_pnt_config(cfg)
        self.cfg = cfg
        self.ternary = ternary
        self.tok_embd = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.output_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for lay in self.layers:
            lay.attn.ternary = lay.moe.ternary = ternary
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        out_std = std / math.sqrt(2 * self.cfg.n_layer_eff)  # projections back into the stream
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            small = name.endswith(("wo.weight", "ffn_down", "w_down"))
            nn.init.normal_(p, 0.0, out_std if small else std)

    def n_params(self, active: bool = False) -> int:
        """Parameter count; active=True counts only top_k of n_expert experts (per token)."""
        n = sum(p.numel() for p in self.parameters())
        if active:
            cfg = self.cfg
            per_exp = 3 * cfg.d_model * cfg.d_expert
            n -= cfg.n_layer * (cfg.n_expert - cfg.top_k) * per_exp
        return n

    def _scales(self) -> tuple[float, float]:
        # (dense scale, expert scale) of the combine style
        if self.cfg.combine == "parallel_sqrt2":
            return 1 / math.sqrt(2), 1 / math.sqrt(2)
        return 1.0, 1.0

    def _land(self, arrivals, h, m, c_e):
        """Add expert outputs that arrive now: to m if the streams are decoupled, else to h."""
        for src, e in arrivals:
            if self.cfg.combine == "async_experts":
                e = e * src.exp_gain
            if m is not None:
                m = m + c_e * e
            else:
                h = h + c_e * e
        return h, m

    def forward(self, idx: torch.Tensor, state: DecodeState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """idx (B, T) token ids -> logits (B, T, V), mean load-balancing loss.

        Without state: a full sequence from position 0. With state: continue at state.pos,
        appending to its KV caches (T=1 is a decode step; T>1 a prefill chunk).
        """
        cfg = self.cfg
        B, T = idx.shape
        pos0 = state.pos if state is not None else 0
        if pos0 + T > cfg.max_seq_len:
            raise CflowError(f"sequence of {pos0 + T} tokens exceeds max_seq_len={cfg.max_seq_len}")
        cos, sin = rope_cache(cfg, torch.arange(pos0, pos0 + T))
        L = cfg.n_layer_eff
        if state is not None and not state.kv:
            state.kv = [[None, None] for _ in range(L)]
        c_f, c_e = self._scales()
        decoupled = cfg.residual == "decoupled"

        h = self.tok_embd(idx)  # (B, T, d): the main residual stream
        m = h if decoupled else None  # arch1: the experts' own stream
        ring = deque([h], maxlen=cfg.delta_d + 1)  # h[j - delta_d] .. h[j]
        pending: dict[int, list[tuple[Layer, torch.Tensor]]] = {}  # target layer -> expert outputs
        lb_total = h.new_zeros((), dtype=torch.float32)
        for j in range(L):
            lay = self.layers[j % cfg.n_layer]
            x_attn = h + m if decoupled else h
            a = lay.attn(lay.attn_norm(x_attn), cos, sin, state.kv[j] if state is not None else None, pos0)
            f = geglu(lay.ffn_norm(ring[0]), lay.ffn_gate_up, lay.ffn_down, self.ternary)  # ring[0] = h[j - delta_d]
            x_exp = m if decoupled else h
            if cfg.routing_anchor == "post_dense":
                x_exp = x_exp + f
            e, lb = lay.moe(lay.exp_norm(x_exp))
            lb_total = lb_total + lb
            if cfg.post_norms:
                a, f, e = lay.attn_post_norm(a), lay.ffn_post_norm(f), lay.exp_post_norm(e)
            pending.setdefault(min(j + cfg.delta_e, L), []).append((lay, e))
            h = h + a + c_f * f
            h, m = self._land(pending.pop(j, []), h, m, c_e)  # experts routed at j - delta_e
            ring.append(h)
        h, m = self._land(pending.pop(L, []), h, m, c_e)  # experts due past the last layer
        out = self.output_norm(h + m if decoupled else h)
        logits = F.linear(out, self.tok_embd.weight) if self.output is None else self.output(out)
        if state is not None:
            state.pos = pos0 + T
        return logits, lb_total / L


# The state-dict entries ternary QAT quantizes: (name suffix, per expert).
TERNARY_WEIGHTS = (("attn.wqkv.weight", False), ("attn.wo.weight", False), ("ffn_gate_up", False),
                   ("ffn_down", False), ("moe.w_gate_up", True), ("moe.w_down", True))


def ternarized(sd: dict) -> dict:
    """A copy of a PNT state dict with the matrices ternary QAT trains replaced by the ternary values
    the model computed with (ternary_values, per matrix; per expert for the experts' stacks)."""
    out = dict(sd)
    for name, t in sd.items():
        for suffix, per_expert in TERNARY_WEIGHTS:
            if name.endswith(suffix):
                with torch.no_grad():
                    w = t.float()
                    out[name] = torch.stack([ternary_values(x) for x in w]) if per_expert else ternary_values(w)
    return out
