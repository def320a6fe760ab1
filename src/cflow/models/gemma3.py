"""Gemma 3 (text): four norms per layer, QK-norm, sliding-window layers, embedding scale, GeGLU.

Norms: HF stores gemma's RMSNorm weights as w with the scale (1 + w) (norm_offset 1); llama.cpp
stores them with the +1 folded in (norm_offset 0 for GGUF sources).
"""

from __future__ import annotations

from cflow.errors import UnsupportedError
from cflow.models.base import HF_NAMES, Architecture, gguf_common, gguf_float, gguf_int, hf_common, hf_rope_theta


class Gemma3(Architecture):
    name = "gemma3"
    summary = "Gemma 3: four norms per layer, QK-norm, sliding-window layers, embedding scale, GeGLU"
    hf_model_types = ("gemma3_text", "gemma3")
    gguf_archs = ("gemma3",)
    hf_names = dict(HF_NAMES, **{
        "model.layers.{l}.post_attention_layernorm.weight": "blk.{l}.attn_post_norm",
        "model.layers.{l}.pre_feedforward_layernorm.weight": "blk.{l}.ffn_norm",
        "model.layers.{l}.post_feedforward_layernorm.weight": "blk.{l}.ffn_post_norm",
    })
    fixed = dict(qk_norm=True, post_norms=True)
    add_bos = True
    # Gemma's turns: user and model; a system message opens the first user turn (BOS comes from
    # the tokenizer, not the template)
    chat_template = (
        "{% set ns = namespace(system='') %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
        "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
        "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    end_of_turn = ("<end_of_turn>",)

    def hf_fields(self, c):
        import numpy as np

        if "text_config" in c:  # Gemma3ForConditionalGeneration: the text model's config
            c = c["text_config"]
        if c.get("attn_logit_softcapping"):
            raise UnsupportedError("attention logit softcapping is not supported")
        kw = hf_common(c)
        kw.update(
            norm_offset=1.0, embed_scale=float(np.float32(kw["d_model"] ** 0.5)),
            attn_scale=float(c.get("query_pre_attn_scalar", kw["head_dim"])) ** -0.5,
            sliding_window=int(c.get("sliding_window") or 0),
            layer_types=["sliding" if t == "sliding_attention" else "global" for t in c.get("layer_types") or []],
            rope_theta=hf_rope_theta(c, "full_attention", 1e6),
            rope_local_theta=hf_rope_theta(c, "sliding_attention", 1e4),
            final_logit_softcap=float(c.get("final_logit_softcapping") or 0.0),
        )
        return kw

    def gguf_fields(self, m):
        import numpy as np

        kw = gguf_common(m)
        pattern = gguf_int(m, "attention.sliding_window_pattern", 6)
        kw.update(
            act="gelu_tanh", embed_scale=float(np.sqrt(kw["d_model"])), attn_scale=kw["head_dim"] ** -0.5,
            sliding_window=gguf_int(m, "attention.sliding_window", 512, lo=0), rope_local_theta=10000.0,
            layer_types=["sliding" if (i + 1) % pattern else "global" for i in range(kw["n_layer"])],
            final_logit_softcap=gguf_float(m, "final_logit_softcapping", 0.0),
        )
        return kw


ARCH = Gemma3()
