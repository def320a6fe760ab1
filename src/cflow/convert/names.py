"""Checkpoint tensor names -> cflow tensor names: one table per source, shared by all archs.

Our names (GGUF-style, per layer l):
  tok_embd, output_norm, output (absent when tied to tok_embd)
  blk.{l}.attn_norm, blk.{l}.attn_q / attn_k / attn_v (+ .bias, qwen2) -> fused blk.{l}.attn_qkv
  blk.{l}.attn_q_norm, blk.{l}.attn_k_norm (qwen3, gemma3), blk.{l}.attn_output,
  blk.{l}.attn_post_norm (gemma3), blk.{l}.ffn_norm, blk.{l}.ffn_gate / ffn_up -> fused
  blk.{l}.ffn_gate_up, blk.{l}.ffn_down, blk.{l}.ffn_post_norm (gemma3)
Fusion happens after renaming (cflow.convert.fuse_layers).
"""

from __future__ import annotations

import re

# Hugging Face (LlamaForCausalLM, Qwen2/3ForCausalLM, Gemma3ForCausalLM / Gemma3TextModel)
HF_NAMES = {
    "model.embed_tokens.weight": "tok_embd",
    "model.norm.weight": "output_norm",
    "lm_head.weight": "output",
    "model.layers.{l}.input_layernorm.weight": "blk.{l}.attn_norm",
    "model.layers.{l}.self_attn.q_proj.weight": "blk.{l}.attn_q",
    "model.layers.{l}.self_attn.k_proj.weight": "blk.{l}.attn_k",
    "model.layers.{l}.self_attn.v_proj.weight": "blk.{l}.attn_v",
    "model.layers.{l}.self_attn.q_proj.bias": "blk.{l}.attn_q.bias",
    "model.layers.{l}.self_attn.k_proj.bias": "blk.{l}.attn_k.bias",
    "model.layers.{l}.self_attn.v_proj.bias": "blk.{l}.attn_v.bias",
    "model.layers.{l}.self_attn.q_norm.weight": "blk.{l}.attn_q_norm",
    "model.layers.{l}.self_attn.k_norm.weight": "blk.{l}.attn_k_norm",
    "model.layers.{l}.self_attn.o_proj.weight": "blk.{l}.attn_output",
    # llama/qwen: post_attention_layernorm is the pre-FFN norm; gemma3 has both (see GEMMA_HF_NAMES)
    "model.layers.{l}.post_attention_layernorm.weight": "blk.{l}.ffn_norm",
    "model.layers.{l}.mlp.gate_proj.weight": "blk.{l}.ffn_gate",
    "model.layers.{l}.mlp.up_proj.weight": "blk.{l}.ffn_up",
    "model.layers.{l}.mlp.down_proj.weight": "blk.{l}.ffn_down",
}
GEMMA_HF_NAMES = dict(
    HF_NAMES,
    **{
        "model.layers.{l}.post_attention_layernorm.weight": "blk.{l}.attn_post_norm",
        "model.layers.{l}.pre_feedforward_layernorm.weight": "blk.{l}.ffn_norm",
        "model.layers.{l}.post_feedforward_layernorm.weight": "blk.{l}.ffn_post_norm",
    },
)

# GGUF (llama.cpp's names)
GGUF_NAMES = {
    "token_embd.weight": "tok_embd",
    "output_norm.weight": "output_norm",
    "output.weight": "output",
    "blk.{l}.attn_norm.weight": "blk.{l}.attn_norm",
    "blk.{l}.attn_q.weight": "blk.{l}.attn_q",
    "blk.{l}.attn_k.weight": "blk.{l}.attn_k",
    "blk.{l}.attn_v.weight": "blk.{l}.attn_v",
    "blk.{l}.attn_q.bias": "blk.{l}.attn_q.bias",
    "blk.{l}.attn_k.bias": "blk.{l}.attn_k.bias",
    "blk.{l}.attn_v.bias": "blk.{l}.attn_v.bias",
    "blk.{l}.attn_q_norm.weight": "blk.{l}.attn_q_norm",
    "blk.{l}.attn_k_norm.weight": "blk.{l}.attn_k_norm",
    "blk.{l}.attn_output.weight": "blk.{l}.attn_output",
    "blk.{l}.post_attention_norm.weight": "blk.{l}.attn_post_norm",
    "blk.{l}.ffn_norm.weight": "blk.{l}.ffn_norm",
    "blk.{l}.ffn_gate.weight": "blk.{l}.ffn_gate",
    "blk.{l}.ffn_up.weight": "blk.{l}.ffn_up",
    "blk.{l}.ffn_down.weight": "blk.{l}.ffn_down",
    "blk.{l}.post_ffw_norm.weight": "blk.{l}.ffn_post_norm",
}
# tensors a checkpoint may carry that inference does not use
IGNORED = (re.compile(r"rope_freqs\.weight|.*rotary_emb\.inv_freq"),)


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(k).replace(r"\{l\}", r"(?P<l>\d+)") + "$"), v) for k, v in table.items()]


_COMPILED = {id(t): _compile(t) for t in (HF_NAMES, GEMMA_HF_NAMES, GGUF_NAMES)}


def rename(name: str, table: dict[str, str]) -> str | None:
    """Our name for a checkpoint tensor; None for ignored ones; raises KeyError for unknown."""
    if any(p.match(name) for p in IGNORED):
        return None
    for pat, ours in _COMPILED[id(table)]:
        m = pat.match(name)
        if m:
            return ours.replace("{l}", m.group("l")) if "l" in pat.groupindex else ours
    raise KeyError(name)
