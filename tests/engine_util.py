"""Tiny Hugging Face models with random weights, laid out as a `.cflow` model in memory.

The reference for the engine tests is HF transformers itself: the weights are quantized into
the tile layout (gguf-py encodes the blocks, tiles.pack_tiles orders them), then the dequantized
values are loaded back into the HF model, so both sides compute with identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from cflow.config import ModelConfig
from cflow.convert.hf import _rope_theta  # the RoPE bases as the converter reads them
from cflow.format.tiles import block_type, check_pack, pack_tiles

ALIGN = 64


@dataclass
class Entry:  # the fields of a .cflow tensor index entry the engine reads
    type: object
    rows: int
    cols: int
    tile: tuple
    interleave: int
    offset: int
    nbytes: int
    fuse: str | None = None
    stripe_rows: int = 0
    pack: str = "blocks"
    shape: tuple = ()  # the logical shape ((n,) for a vector, stored as one row); () -> (rows, cols)

    def __post_init__(self):
        self.shape = tuple(self.shape) or (self.rows, self.cols)


def _random_k_blocks(a: np.ndarray, bt) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K rows shaped as a's encoding, with weights about a's size (the tests that
    use them compare the engine with itself, so the weights need only be sane)."""
    rng = np.random.default_rng(a.size)
    rows, nb = a.shape[0], a.shape[1] // bt.block_elems
    b = rng.integers(0, 256, size=(rows * nb, bt.block_bytes), dtype=np.uint8)
    s = float(np.abs(a).mean()) or 1.0
    if bt.name == "q4_k":  # |w| <= d * 63 * 15 + dmin * 63
        b[:, 0:4] = np.array([s / 400, s / 40], "<f2").view(np.uint8)
    elif bt.name == "q5_k":  # |w| <= d * 63 * 31 + dmin * 63
        b[:, 0:4] = np.array([s / 800, s / 40], "<f2").view(np.uint8)
    else:  # |w| <= d * 128 * 32
        b[:, 208:210] = np.array([s / 2000], "<f2").view(np.uint8)
    return b.reshape(rows, -1)


def _encode(a: np.ndarray, bt) -> tuple[np.ndarray, np.ndarray]:
    """float (R, C) -> (GGUF-encoded rows uint8, dequantized float32 (R, C))."""
    from gguf import GGMLQuantizationType, quants

    if bt.name == "f32":
        a = a.astype(np.float32)
        return a.view(np.uint8).reshape(a.shape[0], -1), a
    qt = GGMLQuantizationType[bt.name.upper()]
    if bt.name in ("q4_k", "q5_k", "q6_k"):  # gguf-py has no K-quant quantizer: random blocks of a's size
        enc = _random_k_blocks(a, bt)
        return enc, quants.dequantize(enc, qt).reshape(a.shape).astype(np.float32)
    enc = quants.quantize(a.astype(np.float32), qt)
    return enc, quants.dequantize(enc, qt).reshape(a.shape).astype(np.float32)


class Builder:
    """Accumulates tiled tensors into one uint8 buffer."""

    def __init__(self, tile=(128, 256), interleave=1, pack="blocks"):
        self.chunks, self.tensors, self.pos = [], {}, 0
        self.tile, self.g, self.pack = tile, interleave, pack

    def add(self, name, a, type_="f32", stripe_rows=0):
        a = np.asarray(a, dtype=np.float32)
        a2 = a.reshape(1, -1) if a.ndim == 1 else a
        bt = block_type(type_ if a.ndim == 2 else "f32")
        enc, deq = _encode(a2, bt)
        pack = "planes" if self.pack == "planes" and check_pack(bt, self.g, "planes") is None else "blocks"
        payload = pack_tiles(enc, bt, a2.shape[1], self.tile, self.g, pack)
        pad = -self.pos % ALIGN
        self.chunks.append(np.zeros(pad, np.uint8))
        self.pos += pad
        self.tensors[name] = Entry(bt, a2.shape[0], a2.shape[1], self.tile, self.g, self.pos, payload.size,
                                   "stripe" if stripe_rows else None, stripe_rows, pack, a.shape)
        self.chunks.append(payload)
        self.pos += payload.size
        return deq.reshape(a.shape)

    def finish(self, cfg: ModelConfig):
        buf = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.uint8)
        return SimpleNamespace(config=cfg, buffer=buf, tensors=self.tensors)


HF_CONFIGS = {
    "llama": dict(cls="LlamaConfig", rope_theta=10000.0),
    "qwen2": dict(cls="Qwen2Config", rope_theta=10000.0),
    "qwen3": dict(cls="Qwen3Config", rope_theta=10000.0),
    "gemma3": dict(cls="Gemma3TextConfig", rope_theta=1000000.0),
}


def tiny_hf(arch: str, *, seed=0, d=64, n_layer=2, n_head=4, n_kv=2, hd=16, ffn=128, vocab=256, **kw):
    """A random-weight HF causal LM of `arch`, eval mode, fp32."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=n_layer,
                  num_attention_heads=n_head, num_key_value_heads=n_kv, head_dim=hd, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    spec = HF_CONFIGS[arch]
    cls = getattr(transformers, spec["cls"])
    extra = {"rope_theta": spec["rope_theta"]}
    if arch == "gemma3":
        extra.update(sliding_window=8, query_pre_attn_scalar=hd, rope_local_base_freq=10000.0,
                     layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layer)],
                     hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None)
    if arch == "llama":
        extra.update(tie_word_embeddings=False)
    extra.update(kw)
    conf = cls(**{**common, **extra})
    conf._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(conf).eval()
    # Random norms (HF initialises them to 1 or 0, which would hide a missing norm).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if arch != "gemma3" else 0.1 * torch.randn_like(p))
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def to_cflow(model, *, wtype="f32", embtype=None, tile=(128, 256), interleave=1, stripe_rows=None, split=None,
             pack="blocks"):
    """Lay out a tiny HF model as the engine's tensors; writes the dequantized weights back into
    `model` so HF computes with exactly the weights the engine reads. Returns the file-like object.

    split: {attn_q, attn_k, attn_v, ffn_gate, ffn_up: block type}: store Q/K/V and gate/up apart,
    each in its own type (as the converter does when their types differ), instead of fused.
    pack="planes": the matrices whose type has the planes pack are stored in it."""
    import torch

    c = model.config
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}[c.model_type]
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tied = bool(getattr(c, "tie_word_embeddings", False))
    layer_types = []
    if arch == "gemma3":
        layer_types = ["sliding" if t == "sliding_attention" else "global" for t in c.layer_types]
    cfg = ModelConfig(
        arch=arch, vocab_size=c.vocab_size, d_model=c.hidden_size, n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads, head_dim=hd, d_ff=c.intermediate_size,
        act="gelu_tanh" if arch == "gemma3" else "silu", max_seq_len=256, norm_eps=c.rms_norm_eps,
        norm_offset=1.0 if arch == "gemma3" else 0.0, rope_theta=_rope_theta(c.to_dict(), "full_attention", 10000.0),
        tie_embeddings=tied, qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "gemma3"),
        post_norms=arch == "gemma3", embed_scale=c.hidden_size ** 0.5 if arch == "gemma3" else 1.0,
        attn_scale=c.query_pre_attn_scalar ** -0.5 if arch == "gemma3" else 0.0,
        sliding_window=getattr(c, "sliding_window", 0) or 0 if arch == "gemma3" else 0, layer_types=layer_types,
        rope_local_theta=_rope_theta(c.to_dict(), "sliding_attention", 10000.0) if arch == "gemma3" else 0.0,
    )
    B = Builder(tile, interleave, pack)
    S = stripe_rows or tile[0] // 2
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    new = {}

    def put(key, name, type_=wtype):
        new[key] = B.add(name, sd[key], type_)

    put("model.embed_tokens.weight", "tok_embd", embtype or wtype)
    put("model.norm.weight", "output_norm")
    if not tied:
        put("lm_head.weight", "output", embtype or wtype)
    for l in range(cfg.n_layer):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        put(p + "input_layernorm.weight", b + "attn_norm")
        if split:
            for x in "qkv":
                put(p + f"self_attn.{x}_proj.weight", b + f"attn_{x}", split[f"attn_{x}"])
                if cfg.qkv_bias:
                    put(p + f"self_attn.{x}_proj.bias", b + f"attn_{x}.bias", "f32")
        else:
            qkv = [sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
            deq = B.add(b + "attn_qkv", np.concatenate(qkv), wtype)
            for x, part in zip("qkv", np.split(deq, np.cumsum([a.shape[0] for a in qkv])[:-1])):
                new[p + f"self_attn.{x}_proj.weight"] = part
            if cfg.qkv_bias:
                bias = np.concatenate([sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
                deq = B.add(b + "attn_qkv.bias", bias)
                for x, part in zip("qkv", np.split(deq, np.cumsum([a.shape[0] for a in qkv])[:-1])):
                    new[p + f"self_attn.{x}_proj.bias"] = part
        if cfg.qk_norm:
            put(p + "self_attn.q_norm.weight", b + "attn_q_norm")
            put(p + "self_attn.k_norm.weight", b + "attn_k_norm")
        put(p + "self_attn.o_proj.weight", b + "attn_output")
        if arch == "gemma3":
            put(p + "post_attention_layernorm.weight", b + "attn_post_norm")
            put(p + "pre_feedforward_layernorm.weight", b + "ffn_norm")
            put(p + "post_feedforward_layernorm.weight", b + "ffn_post_norm")
        else:
            put(p + "post_attention_layernorm.weight", b + "ffn_norm")
        if split:
            put(p + "mlp.gate_proj.weight", b + "ffn_gate", split["ffn_gate"])
            put(p + "mlp.up_proj.weight", b + "ffn_up", split["ffn_up"])
            put(p + "mlp.down_proj.weight", b + "ffn_down")
            continue
        g, u = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
        F = g.shape[0]
        order = np.concatenate([off + np.arange(j, min(F, j + S)) for j in range(0, F, S) for off in (0, F)])
        fused = np.concatenate([g, u])[order]
        deq = B.add(b + "ffn_gate_up", fused, wtype, stripe_rows=S)
        cat = np.empty_like(deq)
        cat[order] = deq
        new[p + "mlp.gate_proj.weight"], new[p + "mlp.up_proj.weight"] = cat[:F], cat[F:]
        put(p + "mlp.down_proj.weight", b + "ffn_down")
    with torch.no_grad():
        params = dict(model.state_dict())
        for k, v in new.items():
            params[k].copy_(torch.from_numpy(np.ascontiguousarray(v.reshape(params[k].shape))))
    return B.finish(cfg)


def hf_logits(model, ids) -> np.ndarray:
    """(len, vocab) float32 logits of HF's own forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()
