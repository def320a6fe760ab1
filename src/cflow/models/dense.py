"""The llama-shaped decoder in PyTorch, for training: `cflow train --arch llama|bitnet`.

One layer, as models/decoder.py runs it (a ModelConfig of arch "llama" or "bitnet"):

    h = x + Wo @ sub_norm?( attn( rope( Wqkv @ rms(x) ) ) )
    x = h + Wd @ sub_norm?( act(Wg @ rms(h)) * (Wu @ rms(h)) )

llama: SwiGLU, no sub-norms; bitnet (BitNet b1.58's shape): squared-ReLU GLU and the sub-norms.
GQA attention with rope over whole heads (neox), untied embeddings. Under ternary QAT
(`Dense(cfg, ternary=True)`, `cflow train --ternary`) every layer matrix meets its input as
absmean ternary weights and per-token int8 activations, straight through (models/pnt.py's
`linear`); the embeddings and the head stay full precision, as BitNet keeps them.

Parameters are named as the engine's tensors (`tensors()`), so export is a Checkpoint of them
written by `cflow.convert.write_cflow`; `--type tq2_0` then stores a ternary-trained model's
matrices without loss. The forward returns (logits, 0): the trainer's load-balancing term is the
experts', and this model has none.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cflow.config import ModelConfig
from cflow.models.pnt import RMSNorm, apply_rope, linear, rope_cache, ternary_values

ACT = {"silu": F.silu, "relu2": lambda g: F.relu(g).square(), "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.attn_norm, self.ffn_norm = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.attn_qkv = nn.Parameter(torch.randn(cfg.q_dim + 2 * cfg.kv_dim, d) * d ** -0.5)
        self.attn_output = nn.Parameter(torch.randn(d, cfg.q_dim) * (cfg.q_dim * 2 * cfg.n_layer) ** -0.5)
        self.ffn_gate = nn.Parameter(torch.randn(cfg.d_ff, d) * d ** -0.5)
        self.ffn_up = nn.Parameter(torch.randn(cfg.d_ff, d) * d ** -0.5)
        self.ffn_down = nn.Parameter(torch.randn(d, cfg.d_ff) * (cfg.d_ff * 2 * cfg.n_layer) ** -0.5)
        if cfg.sub_norms:
            self.attn_sub_norm, self.ffn_sub_norm = RMSNorm(cfg.q_dim, cfg.norm_eps), RMSNorm(cfg.d_ff, cfg.norm_eps)
        self.ternary = False  # set by Dense

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, t = self.cfg, self.ternary
        B, T, _ = x.shape
        q, k, v = linear(self.attn_norm(x), self.attn_qkv, t).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        q = apply_rope(q.view(B, T, c.n_head, c.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2), cos, sin)
        v = v.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(B, T, -1)
        if c.sub_norms:
            y = self.attn_sub_norm(y)
        x = x + linear(y, self.attn_output, t)
        hn = self.ffn_norm(x)
        g = ACT[c.act](linear(hn, self.ffn_gate, t)) * linear(hn, self.ffn_up, t)
        if c.sub_norms:
            g = self.ffn_sub_norm(g)
        return x + linear(g, self.ffn_down, t)


class Dense(nn.Module):
    def __init__(self, cfg: ModelConfig, ternary: bool = False):
        super().__init__()
        self.cfg, self.ternary = cfg, ternary
        self.tok_embd = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        for lay in self.layers:
            lay.ternary = ternary
        self.output_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * cfg.d_model ** -0.5)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cache(self.cfg, torch.arange(ids.shape[1]))
        x = F.embedding(ids, self.tok_embd)
        for lay in self.layers:
            x = lay(x, cos, sin)
        return F.linear(self.output_norm(x), self.output), torch.zeros(())

    def n_params(self, active: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights under the engine's names, the layer matrices as the model computes with them
        (ternary values under QAT)."""
        out = {}
        for name, p in self.state_dict().items():
            n = name.replace("layers.", "blk.").replace(".weight", "")
            if self.ternary and n.startswith("blk.") and p.dim() == 2:
                p = ternary_values(p)
            out[n] = p.detach().float()
        return out
