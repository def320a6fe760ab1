"""Phi-3 (Phi3ForCausalLM): the llama decoder with Q/K/V and gate/up fused in the checkpoint.

HF stores self_attn.qkv_proj ([Wq; Wk; Wv] by rows) and mlp.gate_up_proj ([W_gate; W_up]);
llama.cpp's phi3 stores attn_qkv and an ffn_up of twice the FFN width, gate rows first. Both
are cflow's fused attn_qkv / ffn_gate_up as they are, marked with their parts here. A
sliding_window in the config applies to every layer. LongRoPE (the 128k models) is refused.
"""

from __future__ import annotations

from cflow.errors import UnsupportedError
from cflow.models.base import GGUF_NAMES, HF_NAMES, Architecture, gguf_int, with_parts


class Phi3(Architecture):
    name = "phi3"
    summary = "Phi-3 / Phi-3.5 mini: QKV and gate/up fused in the checkpoint, sliding window on every layer"
    hf_model_types = ("phi3",)
    gguf_archs = ("phi3",)
    hf_names = dict(HF_NAMES, **{"model.layers.{l}.self_attn.qkv_proj.weight": "blk.{l}.attn_qkv",
                                 "model.layers.{l}.mlp.gate_up_proj.weight": "blk.{l}.ffn_gate_up"})
    gguf_names = dict(GGUF_NAMES, **{"blk.{l}.attn_qkv.weight": "blk.{l}.attn_qkv",
                                     "blk.{l}.ffn_up.weight": "blk.{l}.ffn_gate_up",
                                     "rope_factors_long.weight": "rope_factors",
                                     "rope_factors_short.weight": "rope_factors"})

    def hf_fields(self, c):
        return self._window(super().hf_fields(c), c.get("sliding_window"))

    def gguf_fields(self, m):
        return self._window(super().gguf_fields(m), gguf_int(m, "attention.sliding_window", 0, lo=0))

    @staticmethod
    def _window(kw, window):
        if window:
            kw.update(sliding_window=int(window), layer_types=["sliding"] * kw["n_layer"])
        return kw

    def adapt(self, name, t, cfg, source):
        layer = name.rsplit(".", 1)[0] + "."
        if name.endswith("attn_qkv"):
            t = with_parts(t, [(layer + "attn_q", cfg.q_dim), (layer + "attn_k", cfg.kv_dim),
                               (layer + "attn_v", cfg.kv_dim)])
        elif name.endswith("ffn_gate_up"):
            t = with_parts(t, [(layer + "ffn_gate", cfg.d_ff), (layer + "ffn_up", cfg.d_ff)])
        elif name == "rope_factors":
            raise UnsupportedError("LongRoPE (rope_factors_long/short) is not supported yet")
        return {name: t}


ARCH = Phi3()
