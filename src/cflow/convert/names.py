"""Checkpoint tensor names -> cflow tensor names, by the tables of each architecture.

Our names (GGUF-style, per layer l):
  tok_embd, output_norm, output (absent when tied to tok_embd)
  blk.{l}.attn_norm, blk.{l}.attn_q / attn_k / attn_v (+ .bias) -> fused blk.{l}.attn_qkv
  blk.{l}.attn_q_norm, blk.{l}.attn_k_norm, blk.{l}.attn_output, blk.{l}.attn_post_norm,
  blk.{l}.ffn_norm, blk.{l}.ffn_gate / ffn_up -> fused blk.{l}.ffn_gate_up, blk.{l}.ffn_down,
  blk.{l}.ffn_post_norm
  mixture-of-experts layers: blk.{l}.ffn_gate_inp (the router), blk.{l}.exp.{e}.ffn_gate / ffn_up
  -> fused blk.{l}.exp.{e}.ffn_gate_up, blk.{l}.exp.{e}.ffn_down; a checkpoint's packed experts
  (blk.{l}.ffn_gate_exps, ... experts on the outer axis) are split into those by
  cflow.convert.split_experts
The tables are the architectures' (Architecture.hf_names / gguf_names, cflow.models; the
llama-style ones in cflow.models.base). Fusion happens after renaming (cflow.convert.fuse_layers).
"""

from __future__ import annotations

import re

# tensors a checkpoint may carry that inference does not use
IGNORED = (re.compile(r"rope_freqs\.weight|.*rotary_emb\.inv_freq"),)

_COMPILED: dict[int, tuple[dict, list]] = {}  # id(table) -> (table, patterns); the table keeps its id


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    hit = _COMPILED.get(id(table))
    if hit is None or hit[0] is not table:
        pats = [(re.compile("^" + re.escape(k).replace(r"\{l\}", r"(?P<l>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
                            + "$"), v) for k, v in table.items()]
        hit = _COMPILED[id(table)] = (table, pats)
    return hit[1]


def rename(name: str, table: dict[str, str]) -> str | None:
    """Our name for a checkpoint tensor; None for ignored ones; raises KeyError for unknown."""
    if any(p.match(name) for p in IGNORED):
        return None
    for pat, ours in _compile(table):
        m = pat.match(name)
        if m:
            for key in pat.groupindex:  # "{l}": the layer, "{e}": the expert
                ours = ours.replace("{" + key + "}", m.group(key))
            return ours
    raise KeyError(name)
