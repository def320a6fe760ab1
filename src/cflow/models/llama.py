"""llama, mistral and mixtral: the plain pre-norm decoder (SwiGLU, rope over whole heads, no biases);
Mixtral's FFN a mixture of experts.

GGUF: llama.cpp's converter permutes the rows of llama's Q and K weights so that its interleaved
rope (pairs 2i, 2i+1) equals HF's rotate-half rope; the rows are put back here, so every source
runs rope "neox" (rotate halves), as Hugging Face does.

Mixtral: HF model_type "mixtral" (block_sparse_moe.gate and experts.{e}.w1 / w3 / w2, gate, up and
down; transformers 5's mlp.* names too); llama.cpp writes it as GGUF architecture "llama" with
llama.expert_count / expert_used_count and packed ffn_*_exps. The router's softmax is taken over
all experts, and the top_k gates are renormalised to sum to 1. A sliding_window in the config
applies to every layer, as HF runs it.
"""

from __future__ import annotations

import dataclasses

from cflow.models.base import (GGUF_MOE_NAMES, GGUF_NAMES, HF_MOE_NAMES, HF_NAMES, Architecture, gguf_common, gguf_moe,
                               hf_int, hf_moe, unpermute_rope_rows)

MIXTRAL_NAMES = {
    "model.layers.{l}.block_sparse_moe.gate.weight": "blk.{l}.ffn_gate_inp",
    "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight": "blk.{l}.exp.{e}.ffn_gate",
    "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight": "blk.{l}.exp.{e}.ffn_up",
    "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight": "blk.{l}.exp.{e}.ffn_down",
}


class Llama(Architecture):
    name = "llama"
    summary = "SmolLM2, Llama 2/3, Mistral, TinyLlama; Mixtral (mixture of experts; GGUF arch llama)"
    hf_model_types = ("llama", "mistral", "mixtral")
    gguf_archs = ("llama",)
    hf_names = dict(HF_NAMES, **HF_MOE_NAMES, **MIXTRAL_NAMES)
    gguf_names = dict(GGUF_NAMES, **GGUF_MOE_NAMES)

    def hf_fields(self, c):
        if c.get("model_type") != "mixtral":
            return super().hf_fields(c)
        kw = dict(super().hf_fields(c), **hf_moe(c, "intermediate_size", renorm=True))
        if window := hf_int(c, "sliding_window", 0, lo=0):
            kw.update(sliding_window=window, layer_types=["sliding"] * kw["n_layer"])
        return kw

    def gguf_fields(self, m):
        return dict(gguf_common(m), **gguf_moe(m, renorm=True))

    def adapt(self, name, t, cfg, source):
        if source == "gguf" and name.endswith(("attn_q", "attn_k")):
            import numpy as np

            heads = cfg.n_head if name.endswith("attn_q") else cfg.n_kv_head
            t = dataclasses.replace(t, data=unpermute_rope_rows(np.asarray(t.data), heads))
        return {name: t}


ARCH = Llama()
