"""Hugging Face directory (config.json, *.safetensors, tokenizer files) -> Checkpoint.

config.json's model_type picks the architecture (cflow.models.for_hf); it reads the config and
names and adapts the tensors; packed experts (transformers' 3-D experts.gate_up_proj / down_proj)
are split into one matrix per expert. generation_config.json gives the end-of-sequence ids and the
sampling defaults (do_sample, temperature, top_k, top_p, min_p, repetition_penalty).

safetensors files are mapped and parsed here (8-byte header length, JSON header, raw data), so
bf16 needs no torch: its bits are kept as uint16 and stored as block type bf16 under `keep`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import numpy as np

from cflow import models
from cflow.convert import Checkpoint, Tensor, fuse_layers, generation_fields, split_experts
from cflow.convert.names import rename
from cflow.errors import CflowFormatError, UnsupportedError
from cflow.models.base import hf_rope_theta as _rope_theta  # noqa: F401 - the name tests use

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


def _tokenizer(d: Path, add_bos: bool, gen: dict) -> tuple[str | None, str | None, dict]:
    tok_json = (d / "tokenizer.json").read_text() if (d / "tokenizer.json").is_file() else None
    tcfg = _json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    tmpl = tcfg.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        tmpl = (d / "chat_template.jinja").read_text()
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
               "add_bos": bool(tcfg.get("add_bos_token", add_bos))}
    return tok_json, tmpl, special


def load_hf(path) -> Checkpoint:
    d = Path(path)
    c = _json(d / "config.json")
    arch = models.for_hf(c.get("model_type"))
    cfg = arch.config_from_hf(c)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CflowFormatError(f"{d}: no *.safetensors files (only safetensors checkpoints are supported)")
    tensors: dict[str, Tensor] = {}
    for f in files:
        for name, t in read_safetensors(f).items():
            key = name[len("model.language_model."):] if name.startswith("model.language_model.") else name
            key = "model." + key if key.startswith(("layers.", "embed_tokens.", "norm.")) else key
            try:
                ours = rename(key, arch.hf_names)
            except KeyError:
                raise UnsupportedError(f"{f.name}: unexpected tensor {name} for arch {arch.name}") from None
            if ours is None:
                continue
            for part, pt in split_experts(ours, t, cfg.n_expert, name).items():
                tensors.update(arch.adapt(part, pt, cfg, "hf"))
    if cfg.tie_embeddings:
        tensors.pop("output", None)
    elif "output" not in tensors:
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    gen = _json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
    tok_json, tmpl, special = _tokenizer(d, arch.add_bos, gen)
    ckpt = Checkpoint(cfg, fuse_layers(cfg, tensors), tok_json, tmpl, special,
                      {"source": os.path.basename(os.path.abspath(d)), "source_format": "hf"},
                      generation_fields(gen))
    models.check_model(ckpt.config, ckpt.tensors)
    return ckpt
