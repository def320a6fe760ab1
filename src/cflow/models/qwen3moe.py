"""Qwen3-MoE: the Qwen 3 decoder (an RMSNorm over each head of q and k) whose every FFN is a
mixture of experts.

HF: model_type "qwen3_moe", experts of moe_intermediate_size, the top_k gates renormalised when
norm_topk_prob; GGUF: "qwen3moe", experts of expert_feed_forward_length, renormalised (llama.cpp
always renormalises Qwen3-MoE's gates; an expert_weights_norm key overrides). Dense layers
(mlp_only_layers, decoder_sparse_step other than 1: no released Qwen3-MoE has them) are refused.
"""

from __future__ import annotations

from cflow.models.base import (GGUF_MOE_NAMES, GGUF_NAMES, HF_MOE_NAMES, HF_NAMES, Architecture, gguf_moe,
                               hf_qwen_moe)


class Qwen3Moe(Architecture):
    name = "qwen3moe"
    summary = "Qwen3-MoE: QK-norm, every FFN a mixture of experts (gates renormalised with norm_topk_prob)"
    hf_model_types = ("qwen3_moe",)
    gguf_archs = ("qwen3moe",)
    hf_names = dict(HF_NAMES, **HF_MOE_NAMES)
    gguf_names = dict(GGUF_NAMES, **GGUF_MOE_NAMES)
    fixed = dict(qk_norm=True)

    def hf_fields(self, c):
        return dict(super().hf_fields(c), **hf_qwen_moe(c, "Qwen3-MoE"))

    def gguf_fields(self, m):
        return dict(super().gguf_fields(m), **gguf_moe(m, renorm=True, required=True))


ARCH = Qwen3Moe()
