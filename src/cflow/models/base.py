"""What cflow knows about one architecture family, and the readers the family modules share.

A family module under cflow/models/ defines `ARCH`, an Architecture that states only what
differs from the llama-style decoder described here: its attributes, given to the constructor

    ARCH = Architecture(name="qwen3", summary="Qwen 3 (dense): QK-norm", hf_model_types=("qwen3",),
                        gguf_archs=("qwen3",), fixed=dict(qk_norm=True))

or, when a method differs too, set in a subclass (llama.py, gemma3.py).

The registry (cflow.models) finds it by that name: convert, both engines, the CLI's help and
the docs table read the registry, so adding a dense architecture is that one file.

What an Architecture answers:
- config_from_hf(config.json) / config_from_gguf(metadata) -> its ModelConfig (config_class);
  hf_fields / gguf_fields are the overridable parts, hf_common / gguf_common the shared readers;
- hf_names / gguf_names: checkpoint tensor name -> cflow's name ("{l}" stands for the layer);
- adapt(name, tensor, cfg, source): a tensor as loaded -> {cflow name: tensor} (llama's GGUF Q/K
  row un-permutation, a fused checkpoint tensor marked with its parts ...);
- expected_tensors(cfg, present) -> {name: shape}: what a converted checkpoint must hold (a layer's
  FFN a mixture of experts when cfg.n_expert: the router blk.{l}.ffn_gate_inp and the experts
  blk.{l}.exp.{e}.*, dense_tensors);
- build(b, cfg) -> Plan: the forward pass as ops (cflow.plan), by default the dense decoder.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from cflow.config import MAX_SIZE, ModelConfig, is_int
from cflow.errors import CflowFormatError, UnsupportedError

# Hugging Face names of the llama-style decoder (LlamaForCausalLM, Qwen2/3ForCausalLM, ...)
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
    "model.layers.{l}.post_attention_layernorm.weight": "blk.{l}.ffn_norm",  # the pre-FFN norm
    "model.layers.{l}.mlp.gate_proj.weight": "blk.{l}.ffn_gate",
    "model.layers.{l}.mlp.up_proj.weight": "blk.{l}.ffn_up",
    "model.layers.{l}.mlp.down_proj.weight": "blk.{l}.ffn_down",
}

# GGUF names (llama.cpp's) of the same decoder
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

# Mixture-of-experts layers, Hugging Face names (Qwen3-MoE, OLMoE; Mixtral under transformers 5's
# module names): the router, and the experts one matrix each, as save_pretrained writes them, or
# packed as 3-D parameters, experts on the outer axis: gate_up_proj (E, 2F, d) holding [gate; up]
# per expert, down_proj (E, d, F) (split by cflow.convert.split_experts)
HF_MOE_NAMES = {
    "model.layers.{l}.mlp.gate.weight": "blk.{l}.ffn_gate_inp",
    "model.layers.{l}.mlp.experts.{e}.gate_proj.weight": "blk.{l}.exp.{e}.ffn_gate",
    "model.layers.{l}.mlp.experts.{e}.up_proj.weight": "blk.{l}.exp.{e}.ffn_up",
    "model.layers.{l}.mlp.experts.{e}.down_proj.weight": "blk.{l}.exp.{e}.ffn_down",
    "model.layers.{l}.mlp.experts.gate_up_proj": "blk.{l}.ffn_gate_up_exps",
    "model.layers.{l}.mlp.experts.down_proj": "blk.{l}.ffn_down_exps",
    # a shared expert beside the routed ones, and its gate (Qwen2-MoE)
    "model.layers.{l}.mlp.shared_expert.gate_proj.weight": "blk.{l}.shexp.ffn_gate",
    "model.layers.{l}.mlp.shared_expert.up_proj.weight": "blk.{l}.shexp.ffn_up",
    "model.layers.{l}.mlp.shared_expert.down_proj.weight": "blk.{l}.shexp.ffn_down",
    "model.layers.{l}.mlp.shared_expert_gate.weight": "blk.{l}.shexp.gate",
}

# ... and llama.cpp's: the router, the experts packed per kind (gguf-py shape (E, rows, cols)), or,
# in Mixtral files written before llama.cpp packed them, one matrix per expert
GGUF_MOE_NAMES = {
    "blk.{l}.ffn_gate_inp.weight": "blk.{l}.ffn_gate_inp",
    "blk.{l}.ffn_gate_exps.weight": "blk.{l}.ffn_gate_exps",
    "blk.{l}.ffn_up_exps.weight": "blk.{l}.ffn_up_exps",
    "blk.{l}.ffn_down_exps.weight": "blk.{l}.ffn_down_exps",
    "blk.{l}.ffn_gate.{e}.weight": "blk.{l}.exp.{e}.ffn_gate",
    "blk.{l}.ffn_up.{e}.weight": "blk.{l}.exp.{e}.ffn_up",
    "blk.{l}.ffn_down.{e}.weight": "blk.{l}.exp.{e}.ffn_down",
    "blk.{l}.ffn_gate_shexp.weight": "blk.{l}.shexp.ffn_gate",
    "blk.{l}.ffn_up_shexp.weight": "blk.{l}.shexp.ffn_up",
    "blk.{l}.ffn_down_shexp.weight": "blk.{l}.shexp.ffn_down",
    "blk.{l}.ffn_gate_inp_shexp.weight": "blk.{l}.shexp.gate",
}

HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "relu2": "relu2"}
LAYER_TENSOR = re.compile(r"blk\.\d+\.")
_REQUIRED = object()


# ---------------------------------------------------------------------------- shared readers


def hf_rope_theta(c: dict, kind: str = "full_attention", default: float = 10000.0) -> float:
    """The rope base of config.json (rope_parameters, per layer kind where given, or rope_theta);
    UnsupportedError for any rope type but the default."""
    rp = c.get("rope_parameters") or {}
    if kind in rp and isinstance(rp[kind], dict):
        rp = rp[kind]
    scaling = c.get("rope_scaling") or {}
    if not isinstance(rp, dict) or not isinstance(scaling, dict):
        raise CflowFormatError("config.json rope_parameters / rope_scaling must be objects")
    rtype = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rtype != "default":
        raise UnsupportedError(f"rope type {rtype!r} is not supported yet (only the default rope)")
    if _number(rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)), "partial_rotary_factor") != 1.0:
        raise UnsupportedError("partial rotary embeddings are not supported (rope over the whole head only)")
    return _number(rp.get("rope_theta", c.get("rope_theta", default)), "rope_theta")


def _number(v: Any, where: str) -> float:
    """v as a float (an int or a float, not a boolean or text), or CflowFormatError naming `where`."""
    if not (is_int(v) or isinstance(v, float)):
        raise CflowFormatError(f"config.json {where}={str(v)[:60]!r} must be a number")
    return float(v)


def _count(v: Any, where: str, lo: int, hi: int) -> int:
    """v, an integer in lo..hi (booleans are not integers), or CflowFormatError naming `where`."""
    if not is_int(v) or not lo <= v <= hi:
        raise CflowFormatError(f"{where}={v!r} must be an integer in {lo}..{hi}")
    return v


def _number(v: Any, where: str) -> float:
    """v as a float (an int or a float), or CflowFormatError naming `where`."""
    if not (is_int(v) or isinstance(v, float)):
        raise CflowFormatError(f"{where}={v!r} must be a number")
    return float(v)


def hf_value(c: dict, key: str, default: Any = _REQUIRED) -> Any:
    """config.json's `key` (null counts as absent); CflowFormatError when absent without a default."""
    v = c.get(key)
    if v is None:
        if default is _REQUIRED:
            raise CflowFormatError(f"config.json lacks {key!r}")
        return default
    return v


def hf_int(c: dict, key: str, default: Any = _REQUIRED, lo: int = 1, hi: int = MAX_SIZE) -> int:
    """An integer of a config.json in lo..hi: counts are checked before anything divides by them
    or sizes a tensor with them."""
    return _count(hf_value(c, key, default), f"config.json {key}", lo, hi)


def hf_float(c: dict, key: str, default: float) -> float:
    """A number of a config.json; its range is ModelConfig.validate's to check."""
    return _number(hf_value(c, key, default), f"config.json {key}")


def hf_common(c: dict) -> dict[str, Any]:
    """ModelConfig fields every llama-style config.json states the same way."""
    d, nh = hf_int(c, "hidden_size"), hf_int(c, "num_attention_heads")
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise UnsupportedError(f"activation {act!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
    return dict(
        vocab_size=hf_int(c, "vocab_size"), d_model=d, n_layer=hf_int(c, "num_hidden_layers"), n_head=nh,
        n_kv_head=hf_int(c, "num_key_value_heads", nh), head_dim=hf_int(c, "head_dim", d // nh),
        d_ff=hf_int(c, "intermediate_size"), max_seq_len=hf_int(c, "max_position_embeddings", 2048),
        norm_eps=hf_float(c, "rms_norm_eps", 1e-6), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=bool(c.get("attention_bias", False)), act=HF_ACTIVATIONS[act],
    )


def boolean(v: Any, where: str) -> bool:
    """v, a boolean, or CflowFormatError naming `where`."""
    if not isinstance(v, bool):
        raise CflowFormatError(f"{where}={v!r} must be true or false")
    return v


def hf_moe(c: dict, d_expert_key: str, renorm: bool) -> dict[str, Any]:
    """ModelConfig fields of a config.json whose every layer's FFN is a mixture of experts: no dense
    FFN (d_ff 0), n_expert experts (num_experts, or num_local_experts, the name Mixtral's config and
    transformers 5's save_pretrained use) of width d_expert, num_experts_per_tok per token."""
    n = hf_int(c, "num_experts" if c.get("num_experts") is not None else "num_local_experts")
    return dict(n_expert=n, top_k=hf_int(c, "num_experts_per_tok", hi=n), d_expert=hf_int(c, d_expert_key), d_ff=0,
                expert_renorm=renorm)


def hf_qwen_moe(c: dict, family: str) -> dict[str, Any]:
    """hf_moe of the Qwen MoE families (experts of moe_intermediate_size, the top_k gates
    renormalised when norm_topk_prob, default false); dense layers (mlp_only_layers,
    decoder_sparse_step other than 1) are refused."""
    if hf_value(c, "mlp_only_layers", []) or hf_int(c, "decoder_sparse_step", 1) != 1:
        raise UnsupportedError(f"{family} with dense layers (mlp_only_layers, decoder_sparse_step other than 1) "
                               "is not supported: every layer's FFN must be a mixture of experts")
    renorm = boolean(hf_value(c, "norm_topk_prob", False), "config.json norm_topk_prob")
    return hf_moe(c, "moe_intermediate_size", renorm)


def _gguf_key(m: dict, key: str) -> str:
    return f"{m.get('general.architecture')}.{key}"


def gguf_value(m: dict, key: str, default: Any = _REQUIRED) -> Any:
    """Metadata `{general.architecture}.{key}`; CflowFormatError when absent without a default."""
    v = m.get(_gguf_key(m, key))
    if v is None:
        if default is _REQUIRED:
            raise CflowFormatError(f"GGUF metadata lacks {_gguf_key(m, key)}")
        return default
    return v


def gguf_int(m: dict, key: str, default: Any = _REQUIRED, lo: int = 1, hi: int = MAX_SIZE) -> int:
    """An integer of the metadata (gguf_value) in lo..hi: counts are checked before anything divides
    by them or sizes a tensor with them."""
    return _count(gguf_value(m, key, default), f"GGUF metadata {_gguf_key(m, key)}", lo, hi)


def gguf_float(m: dict, key: str, default: Any = _REQUIRED) -> float:
    """A number of the metadata (gguf_value); its range is ModelConfig.validate's to check."""
    return _number(gguf_value(m, key, default), f"GGUF metadata {_gguf_key(m, key)}")


def gguf_common(m: dict) -> dict[str, Any]:
    """ModelConfig fields from the GGUF metadata keys every llama-style architecture has."""
    d, n_head = gguf_int(m, "embedding_length"), gguf_int(m, "attention.head_count")
    if isinstance(gguf_value(m, "attention.head_count_kv", None), list):
        raise UnsupportedError("per-layer KV head counts are not supported")
    n_kv = gguf_int(m, "attention.head_count_kv", n_head)
    scaling = gguf_value(m, "rope.scaling.type", None)
    if scaling not in (None, "none") and gguf_float(m, "rope.scaling.factor", 1.0) != 1.0:
        raise UnsupportedError(f"rope scaling {scaling!r} is not supported yet")
    head_dim = gguf_int(m, "attention.key_length", d // n_head)
    if gguf_int(m, "rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedError("partial rotary embeddings are not supported (rope over the whole head only)")
    return dict(
        d_model=d, n_layer=gguf_int(m, "block_count"), n_head=n_head, n_kv_head=n_kv, head_dim=head_dim,
        d_ff=gguf_int(m, "feed_forward_length"), max_seq_len=gguf_int(m, "context_length", 2048),
        norm_eps=gguf_float(m, "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=gguf_float(m, "rope.freq_base", 10000.0), vocab_size=gguf_int(m, "vocab_size", 0, lo=0),
    )


def gguf_moe(m: dict, renorm: bool, required: bool = False) -> dict[str, Any]:
    """The mixture-of-experts fields of GGUF metadata (llama.cpp's keys), {} for a dense model (no
    expert_count, when not `required`). renorm: the family's renormalisation of the top_k gates,
    which llama.cpp fixes per architecture; expert_weights_norm overrides it where a file has it.
    Experts of a width apart (expert_feed_forward_length) or of the FFN's (feed_forward_length)."""
    n = gguf_int(m, "expert_count", _REQUIRED if required else 0, lo=1 if required else 0)
    if not n:
        return {}
    if gguf_int(m, "expert_shared_count", 0, lo=0):
        raise UnsupportedError("shared experts (expert_shared_count) are not supported")
    if gguf_int(m, "expert_gating_func", 1, lo=0) not in (0, 1):  # 0: unset, 1: softmax
        raise UnsupportedError("expert gating other than softmax (expert_gating_func) is not supported")
    if gguf_float(m, "expert_weights_scale", 1.0) != 1.0:
        raise UnsupportedError("scaled expert weights (expert_weights_scale) are not supported")
    ff = gguf_int(m, "feed_forward_length")
    return dict(n_expert=n, top_k=gguf_int(m, "expert_used_count", hi=n),
                d_expert=gguf_int(m, "expert_feed_forward_length", ff), d_ff=0,
                expert_renorm=boolean(gguf_value(m, "expert_weights_norm", renorm),
                                      f"GGUF metadata {_gguf_key(m, 'expert_weights_norm')}"))


def unpermute_rope_rows(data, n_head: int):
    """Undo llama.cpp's rope permutation of Q/K rows: (n_head, hd/2, 2) -> (n_head, 2, hd/2).
    Whole rows move, so quantized rows keep their blocks bit-identical."""
    rows = data.shape[0]
    hd = rows // n_head
    return data.reshape(n_head, hd // 2, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def with_parts(t, parts: list[tuple[str, int]]):
    """A checkpoint tensor that stacks several of ours by rows, marked with its parts [(name, rows)]."""
    if sum(r for _, r in parts) != t.shape[0]:
        raise CflowFormatError(f"fused tensor of {t.shape[0]} rows does not split into {parts}")
    return dataclasses.replace(t, parts=list(parts))


def gate_up_tensors(p: str, rows: int, d: int, present) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a gated FFN's gate and up weights (rows each) at prefix p: fused into
    {p}ffn_gate_up, or apart, as `present` has them."""
    if p + "ffn_gate_up" in present:
        return {p + "ffn_gate_up": (2 * rows, d)}
    return {p + "ffn_gate": (rows, d), p + "ffn_up": (rows, d)}


def expert_tensors(cfg: ModelConfig, layer: int, present) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a layer's mixture of experts: the router (n_expert, d), then per expert its
    gate/up (d_expert rows each) and its down (d, d_expert); a shared expert (blk.{l}.shexp.: gate/up,
    down and its gate vector (d,)) when cfg.d_shared."""
    c, b = cfg, f"blk.{layer}."
    need = {b + "ffn_gate_inp": (c.n_expert, c.d_model)}
    if c.d_shared:
        sh = b + "shexp."
        need.update(gate_up_tensors(sh, c.d_shared, c.d_model, present))
        need.update({sh + "ffn_down": (c.d_model, c.d_shared), sh + "gate": (c.d_model,)})
    for e in range(c.n_expert):
        x = f"{b}exp.{e}."
        need.update(gate_up_tensors(x, c.d_expert, c.d_model, present))
        need[x + "ffn_down"] = (c.d_model, c.d_expert)
    return need


def dense_tensors(cfg: ModelConfig, present) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the llama-style decoder; Q/K/V and gate/up fused or apart as `present` has
    them; the FFN of each layer a mixture of experts when cfg.n_expert (expert_tensors)."""
    c = cfg
    need = {"tok_embd": (c.vocab_size, c.d_model), "output_norm": (c.d_model,)}
    if not c.tie_embeddings:
        need["output"] = (c.vocab_size, c.d_model)
    for layer in range(c.n_layer):
        b = f"blk.{layer}."
        need[b + "attn_norm"] = (c.d_model,)
        need[b + "attn_output"] = (c.d_model, c.q_dim)
        need[b + "ffn_norm"] = (c.d_model,)
        if not c.n_expert:
            need[b + "ffn_down"] = (c.d_model, c.d_ff)
        qkv = {"attn_qkv": c.q_dim + 2 * c.kv_dim} if b + "attn_qkv" in present else \
            {"attn_q": c.q_dim, "attn_k": c.kv_dim, "attn_v": c.kv_dim}
        for part, rows in qkv.items():
            need[b + part] = (rows, c.d_model)
            if c.qkv_bias:
                need[b + part + ".bias"] = (rows,)
        need.update(expert_tensors(c, layer, present) if c.n_expert else gate_up_tensors(b, c.d_ff, c.d_model, present))
        if c.qk_norm:
            need.update({b + "attn_q_norm": (c.head_dim,), b + "attn_k_norm": (c.head_dim,)})
        if c.post_norms:
            need.update({b + "attn_post_norm": (c.d_model,), b + "ffn_post_norm": (c.d_model,)})
        if c.sub_norms:
            need.update({b + "attn_sub_norm": (c.q_dim,), b + "ffn_sub_norm": (c.d_ff,)})
    return need


# ---------------------------------------------------------------------------- the description


class Architecture:
    """One architecture family. Subclasses set the class attributes and override what differs."""

    name: str = ""  # ModelConfig.arch
    summary: str = ""  # models and traits, for the docs table and `cflow convert --help`
    hf_model_types: tuple[str, ...] = ()  # config.json model_type values it reads
    gguf_archs: tuple[str, ...] = ()  # GGUF general.architecture values it reads
    hf_names: dict[str, str] = HF_NAMES
    gguf_names: dict[str, str] = GGUF_NAMES
    fixed: dict[str, Any] = {}  # ModelConfig fields the family always sets (from every source)
    add_bos: bool = False  # an HF tokenizer_config without add_bos_token: prepend BOS?
    # The family's chat template (jinja2, as HF's), for a source that carries none (GGUF files
    # often do not); None: ChatML. end_of_turn: the tokens that close a turn in it, which end a
    # generation as the end-of-sequence token does.
    chat_template: str | None = None
    end_of_turn: tuple[str, ...] = ()
    engines: tuple[str, ...] = ("native", "ref")  # the engines that run it
    config_class: type[ModelConfig] = ModelConfig

    def __init__(self, **attrs: Any):
        """Class attributes may be given here instead (a family that only sets attributes)."""
        for k, v in attrs.items():
            if not hasattr(type(self), k):
                raise TypeError(f"Architecture has no attribute {k!r}")
            setattr(self, k, v)

    def __repr__(self) -> str:
        return f"<Architecture {self.name}>"

    # ---------------------------------------------------------------- configuration
    def config(self, **fields: Any) -> ModelConfig:
        return self.config_class(**dict(fields, arch=self.name, **self.fixed))

    def hf_fields(self, c: dict) -> dict[str, Any]:
        kw = hf_common(c)
        kw["rope_theta"] = hf_rope_theta(c)
        if c.get("sliding_window") and c.get("use_sliding_window"):
            raise UnsupportedError(f"sliding-window attention is not supported for {self.name}")
        return kw

    def gguf_fields(self, m: dict) -> dict[str, Any]:
        return gguf_common(m)

    def config_from_hf(self, c: dict) -> ModelConfig:
        """The ModelConfig of a Hugging Face config.json."""
        return self.config(**self.hf_fields(c))

    def config_from_gguf(self, m: dict) -> ModelConfig:
        """The ModelConfig of a GGUF file's metadata (vocab_size filled in by the loader when absent)."""
        return self.config(**self.gguf_fields(m))

    # ---------------------------------------------------------------- tensors
    def adapt(self, name: str, t, cfg: ModelConfig, source: str) -> dict:
        """One renamed checkpoint tensor -> {our name: Tensor}. source: "hf" or "gguf"."""
        return {name: t}

    def expected_tensors(self, cfg: ModelConfig, present) -> dict[str, tuple[int, ...]]:
        return dense_tensors(cfg, present)

    def check_tensors(self, cfg: ModelConfig, tensors: dict) -> None:
        """The config against the tensors ({name: entry with .shape}); see cflow.models.check_model.

        Each tensor the config implies is there with the implied shape, and no layer tensor is
        there that the config leaves unused (n_layer one short, qk_norm off while the file has
        the norms: the engine would run without them). A stripe-fused gate/up splits into
        pieces of whole interleave groups, as the engines read it."""
        # the fewest tensors a layer of experts has (attention norm, fused QKV, output, FFN norm, the
        # router, each expert's two): a config that needs more than the model has fails here, before
        # a count of layers times experts sizes any loop
        # (a dense layer has at least one tensor of its own: n_layer far above the tensor count is
        # refused before a loop over 2^24 layers builds their names; a small count goes on to name
        # the first missing tensor)
        per_layer = 5 + 2 * cfg.n_expert
        if cfg.n_expert and cfg.n_layer * per_layer > len(tensors) or cfg.n_layer > max(len(tensors), 1024):
            raise CflowFormatError(f"the config (arch {cfg.arch}, n_layer={cfg.n_layer}, n_expert={cfg.n_expert}) "
                                   f"needs at least {cfg.n_layer * (per_layer if cfg.n_expert else 1)} tensors; "
                                   f"the model has {len(tensors)}")
        need = self.expected_tensors(cfg, tensors)
        for name, shape in need.items():
            t = tensors.get(name)
            if t is None:
                raise CflowFormatError(f"the model has no tensor {name!r} (needed by arch {cfg.arch} with "
                                       f"n_layer={cfg.n_layer})")
            if tuple(t.shape) != shape:
                raise CflowFormatError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape} from the config "
                                       f"(n_head={cfg.n_head}, n_kv_head={cfg.n_kv_head}, head_dim={cfg.head_dim})")
        for name, t in tensors.items():
            if name not in need and LAYER_TENSOR.match(name):
                raise CflowFormatError(f"tensor {name!r} has no place in the model the config describes (arch {cfg.arch}, "
                                       f"n_layer={cfg.n_layer}): the config and the tensors disagree")
            g = getattr(t, "interleave", 1)
            if getattr(t, "fuse", None) == "stripe" and t.stripe_rows % g:
                raise CflowFormatError(f"tensor {name!r}: stripe_rows {t.stripe_rows} is not a multiple of the interleave {g}, "
                                       "so no engine can split its gate and up rows")

    # ---------------------------------------------------------------- the forward pass
    def build(self, b, cfg: ModelConfig):
        """The step plan of one forward (cflow.plan.PlanBuilder b)."""
        from cflow.models.decoder import build_decoder

        return build_decoder(b, cfg)

