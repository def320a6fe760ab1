"""llama and mistral: the plain pre-norm decoder (SwiGLU, rope over whole heads, no biases).

GGUF: llama.cpp's converter permutes the rows of llama's Q and K weights so that its interleaved
rope (pairs 2i, 2i+1) equals HF's rotate-half rope; the rows are put back here, so every source
runs rope "neox" (rotate halves), as Hugging Face does.
"""

from __future__ import annotations

import dataclasses

from cflow.models.base import Architecture, unpermute_rope_rows


class Llama(Architecture):
    name = "llama"
    summary = "SmolLM2, Llama 2/3, Mistral, TinyLlama"
    hf_model_types = ("llama", "mistral")
    gguf_archs = ("llama",)

    def adapt(self, name, t, cfg, source):
        if source == "gguf" and name.endswith(("attn_q", "attn_k")):
            import numpy as np

            heads = cfg.n_head if name.endswith("attn_q") else cfg.n_kv_head
            t = dataclasses.replace(t, data=unpermute_rope_rows(np.asarray(t.data), heads))
        return {name: t}


ARCH = Llama()
