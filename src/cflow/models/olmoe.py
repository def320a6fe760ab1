"""OLMoE: the llama decoder with a mixture of experts for every FFN and an RMSNorm over the whole
of q (n_head * head_dim) and the whole of k (n_kv_head * head_dim), before rope (not per head as
Qwen 3's: the Attention op applies a norm of that size over all of q or k).

HF: model_type "olmoe", experts of intermediate_size, the top_k gates renormalised when
norm_topk_prob (default false); GGUF: "olmoe" (llama.cpp never renormalises them; an
expert_weights_norm key overrides). clip_qkv (q, k and v clamped) is refused.
"""

from __future__ import annotations

from cflow.errors import UnsupportedError
from cflow.models.base import (GGUF_MOE_NAMES, GGUF_NAMES, HF_MOE_NAMES, HF_NAMES, Architecture, boolean, gguf_moe,
                               gguf_value, hf_moe, hf_value)


class Olmoe(Architecture):
    name = "olmoe"
    summary = "OLMoE: every FFN a mixture of experts, RMSNorm over the whole of q and of k"
    hf_model_types = ("olmoe",)
    gguf_archs = ("olmoe",)
    hf_names = dict(HF_NAMES, **HF_MOE_NAMES)
    gguf_names = dict(GGUF_NAMES, **GGUF_MOE_NAMES)
    fixed = dict(qk_norm=True)

    def hf_fields(self, c):
        if hf_value(c, "clip_qkv", None) is not None:
            raise UnsupportedError("OLMoE's clip_qkv (q, k and v clamped) is not supported")
        renorm = boolean(hf_value(c, "norm_topk_prob", False), "config.json norm_topk_prob")
        return dict(super().hf_fields(c), **hf_moe(c, "intermediate_size", renorm))

    def gguf_fields(self, m):
        if gguf_value(m, "attention.clamp_kqv", None) is not None:
            raise UnsupportedError("OLMoE's clip_qkv (attention.clamp_kqv: q, k and v clamped) is not supported")
        return dict(super().gguf_fields(m), **gguf_moe(m, renorm=False, required=True))

    def expected_tensors(self, cfg, present):
        need = super().expected_tensors(cfg, present)
        for layer in range(cfg.n_layer):  # the norms span all heads of q and of k
            need.update({f"blk.{layer}.attn_q_norm": (cfg.q_dim,), f"blk.{layer}.attn_k_norm": (cfg.kv_dim,)})
        return need


ARCH = Olmoe()
