"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen 2 decoder (biases on Q, K and V) whose every
FFN is a mixture of experts plus a shared expert, which every token takes, scaled by a gate of
its own: x += sum_topk gate_i * expert_i(rms(h)) + sigmoid(g . rms(h)) * shared(rms(h)).

HF: model_type "qwen2_moe", experts of moe_intermediate_size, the shared expert of
shared_expert_intermediate_size (mlp.shared_expert.*, its gate mlp.shared_expert_gate (1, d)),
the top_k gates renormalised when norm_topk_prob (default false); GGUF: "qwen2moe"
(ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp (d,); expert_shared_feed_forward_length; llama.cpp
does not renormalise, an expert_weights_norm key overrides). Dense layers are refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cflow.models.base import (GGUF_MOE_NAMES, GGUF_NAMES, HF_MOE_NAMES, HF_NAMES, Architecture, gguf_int,
                               gguf_moe, hf_int, hf_qwen_moe)


class Qwen2Moe(Architecture):
    name = "qwen2moe"
    summary = "Qwen2-MoE: QKV bias, every FFN a mixture of experts and a gated shared expert"
    hf_model_types = ("qwen2_moe",)
    gguf_archs = ("qwen2moe",)
    hf_names = dict(HF_NAMES, **HF_MOE_NAMES)
    gguf_names = dict(GGUF_NAMES, **GGUF_MOE_NAMES)
    fixed = dict(qkv_bias=True)

    def hf_fields(self, c):
        return dict(super().hf_fields(c), **hf_qwen_moe(c, "Qwen2-MoE"),
                    d_shared=hf_int(c, "shared_expert_intermediate_size"))

    def gguf_fields(self, m):
        return dict(super().gguf_fields(m), **gguf_moe(m, renorm=False, required=True),
                    d_shared=gguf_int(m, "expert_shared_feed_forward_length"))

    def adapt(self, name, t, cfg, source):
        if name.endswith("shexp.gate") and len(t.shape) == 2 and t.shape[0] == 1:  # HF's (1, d): one row
            data = np.asarray(t.data)
            t = dataclasses.replace(t, shape=(t.shape[1],), data=data.reshape(-1) if data.dtype != np.uint8 else data)
        return {name: t}


ARCH = Qwen2Moe()
