"""Hugging Face directory (config.json, *.safetensors, tokenizer files) -> Checkpoint.

safetensors files are mapped and parsed here (8-byte header length, JSON header, raw data), so
bf16 needs no torch: its bits are kept as uint16 and stored as block type bf16 under `keep`.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from cflow.config import ModelConfig
from cflow.convert import Checkpoint, Tensor, check_tensors, fuse_layers
from cflow.convert.names import GEMMA_HF_NAMES, HF_NAMES, rename
from cflow.errors import CflowFormatError, UnsupportedError

MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3", "gemma3": "gemma3"}
DTYPES = {"F32": ("f32", np.float32), "F16": ("f16", np.float16), "BF16": ("bf16", np.uint16)}


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CflowFormatError(f"{path}: {e}") from None


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Tensors of one .safetensors file, as views of a read-only mapping."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CflowFormatError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 1 << 28):
            raise CflowFormatError(f"{path}: header length {n} exceeds the file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CflowFormatError(f"{path}: bad safetensors header: {e}") from None
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info.get("dtype")
        if dt not in DTYPES:
            raise UnsupportedError(f"{path}: tensor {name} has dtype {dt}; supported: {', '.join(DTYPES)}")
        typ, np_dt = DTYPES[dt]
        a, b = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        if not 0 <= a <= b <= size - 8 - n or b - a != int(np.prod(shape)) * np.dtype(np_dt).itemsize:
            raise CflowFormatError(f"{path}: tensor {name} has bad data offsets {a}..{b}")
        out[name] = Tensor(typ, shape, mm[8 + n + a : 8 + n + b].view(np_dt).reshape(shape))
    return out


def _rope_theta(c: dict, kind: str, default: float) -> float:
    rp = c.get("rope_parameters") or {}
    if kind in rp and isinstance(rp[kind], dict):
        rp = rp[kind]
    scaling = c.get("rope_scaling") or {}
    rtype = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rtype != "default":
        raise UnsupportedError(f"rope type {rtype!r} is not supported yet (only the default rope)")
    return float(rp.get("rope_theta", c.get("rope_theta", default)))


def config_kwargs(c: dict) -> dict:
    mt = c.get("model_type")
    if mt == "gemma3" and "text_config" in c:
        c = dict(c["text_config"], model_type="gemma3_text")
    arch = MODEL_TYPES.get(mt)
    if arch is None:
        raise UnsupportedError(f"unsupported model_type {mt!r}; supported: {', '.join(MODEL_TYPES)}")
    d, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
    kw = dict(
        arch=arch, vocab_size=int(c["vocab_size"]), d_model=d, n_layer=int(c["num_hidden_layers"]), n_head=nh,
        n_kv_head=int(c.get("num_key_value_heads") or nh), head_dim=int(c.get("head_dim") or d // nh),
        d_ff=int(c["intermediate_size"]), max_seq_len=int(c.get("max_position_embeddings", 2048)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
    )
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedError(f"activation {act!r} is not supported; supported: silu, gelu_pytorch_tanh")
    kw["act"] = "silu" if act == "silu" else "gelu_tanh"
    if arch == "gemma3":
        types = c.get("layer_types") or []
        kw.update(
            qk_norm=True, post_norms=True, norm_offset=1.0, embed_scale=float(np.float32(d**0.5)),
            attn_scale=float(c.get("query_pre_attn_scalar", kw["head_dim"])) ** -0.5,
            sliding_window=int(c.get("sliding_window") or 0),
            layer_types=["sliding" if t == "sliding_attention" else "global" for t in types],
            rope_theta=_rope_theta(c, "full_attention", 1e6), rope_local_theta=_rope_theta(c, "sliding_attention", 1e4),
            final_logit_softcap=float(c.get("final_logit_softcapping") or 0.0),
        )
        if c.get("attn_logit_softcapping"):
            raise UnsupportedError("attention logit softcapping is not supported")
    else:
        kw["rope_theta"] = _rope_theta(c, "full_attention", 10000.0)
        if arch == "qwen3":
            kw["qk_norm"] = True
        if c.get("sliding_window") and c.get("use_sliding_window"):
            raise UnsupportedError("sliding-window attention is supported for gemma3 only")
    return kw


def _tokenizer(d: Path, kw: dict) -> tuple[str | None, str | None, dict]:
    tok_json = (d / "tokenizer.json").read_text() if (d / "tokenizer.json").is_file() else None
    tcfg = _json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    tmpl = tcfg.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        tmpl = (d / "chat_template.jinja").read_text()
    gen = _json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
    ids = {}
    if tok_json:
        from tokenizers import Tokenizer

        tk = Tokenizer.from_str(tok_json)
        for key in ("bos_token", "eos_token"):
            t = tcfg.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            if t is not None and tk.token_to_id(t) is not None:
                ids[key] = tk.token_to_id(t)
    eos = gen.get("eos_token_id", ids.get("eos_token"))
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    bos = gen.get("bos_token_id", ids.get("bos_token"))
    special = {"bos_token_id": bos, "eos_token_ids": sorted(set(int(e) for e in eos)),
               "add_bos": bool(tcfg.get("add_bos_token", kw["arch"] == "gemma3"))}
    return tok_json, tmpl, special


def load_hf(path) -> Checkpoint:
    d = Path(path)
    kw = config_kwargs(_json(d / "config.json"))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CflowFormatError(f"{d}: no *.safetensors files (only safetensors checkpoints are supported)")
    table = GEMMA_HF_NAMES if kw["arch"] == "gemma3" else HF_NAMES
    tensors: dict[str, Tensor] = {}
    for f in files:
        for name, t in read_safetensors(f).items():
            key = name[len("model.language_model."):] if name.startswith("model.language_model.") else name
            key = "model." + key if key.startswith(("layers.", "embed_tokens.", "norm.")) else key
            try:
                ours = rename(key, table)
            except KeyError:
                raise UnsupportedError(f"{f.name}: unexpected tensor {name} for arch {kw['arch']}") from None
            if ours is not None:
                tensors[ours] = t
    if kw["tie_embeddings"]:
        tensors.pop("output", None)
    elif "output" not in tensors:
        kw["tie_embeddings"] = True
    cfg = ModelConfig(**kw)
    tok_json, tmpl, special = _tokenizer(d, kw)
    ckpt = Checkpoint(cfg, fuse_layers(cfg, tensors), tok_json, tmpl, special,
                      {"source": os.path.basename(os.path.abspath(d)), "source_format": "hf"})
    check_tensors(ckpt)
    return ckpt
