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
from cflow.errors import CflowFormatError, UnsupportedError, library_failure
from cflow.models.base import hf_rope_theta as _rope_theta  # noqa: F401 - the name tests use

DTYPES = {"F32": ("f32", np.float32), "F16": ("f16", np.float16), "BF16": ("bf16", np.uint16)}


def _json(path: Path) -> dict:
    """A JSON object file; any other content is a CflowFormatError naming the file."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CflowFormatError(f"{path}: {e}") from None
    except RecursionError:
        raise CflowFormatError(f"{path}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise CflowFormatError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def _utf8(v) -> bool:
    """v is text that UTF-8 can encode (JSON allows lone surrogates; tokenizers does not)."""
    try:
        return isinstance(v, str) and bool(v.encode("utf-8"))
    except UnicodeEncodeError:
        return False


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
        except RecursionError:
            raise CflowFormatError(f"{path}: bad safetensors header: JSON nested too deeply") from None
    if not isinstance(header, dict):
        raise CflowFormatError(f"{path}: bad safetensors header: not a JSON object")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CflowFormatError(f"{path}: tensor {name}: expected an object with dtype, shape and data_offsets")
        dt = info.get("dtype")
        if not isinstance(dt, str) or dt not in DTYPES:
            raise UnsupportedError(f"{path}: tensor {name} has dtype {dt!r}; supported: {', '.join(DTYPES)}")
        typ, np_dt = DTYPES[dt]
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(s) and 0 <= s < 1 << 40 for s in shape):
            raise CflowFormatError(f"{path}: tensor {name} has bad shape {str(shape)[:80]}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
            raise CflowFormatError(f"{path}: tensor {name} has bad data_offsets {str(offsets)[:80]}")
        a, b = offsets
        shape = tuple(shape)
        if not 0 <= a <= b <= size - 8 - n or b - a != int(np.prod(shape, dtype=object)) * np.dtype(np_dt).itemsize:
            raise CflowFormatError(f"{path}: tensor {name} has bad data offsets {a}..{b}")
        out[name] = Tensor(typ, shape, mm[8 + n + a : 8 + n + b].view(np_dt).reshape(shape))
    return out


def _check_bpe(path: Path, text: str) -> None:
    """A BPE tokenizer.json's merges name tokens of its vocabulary, and so does each merge's
    result: tokenizers panics (a Rust panic, not an exception) on some merges that do not."""
    try:
        model = json.loads(text).get("model")
    except (ValueError, RecursionError, AttributeError):
        return  # tokenizers reports what is wrong with the JSON itself
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise CflowFormatError(f"{path}: a BPE model needs a vocab object and a merges list")
    for i, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p in vocab for p in pair)
                and pair[0] + pair[1] in vocab):
            raise CflowFormatError(f"{path}: merge {i} {str(m)[:40]!r} is not two tokens of the vocabulary "
                                   "whose join is one")


def _tokenizer(d: Path, add_bos: bool, gen: dict) -> tuple[str | None, str | None, dict]:
    tok_json = None
    if (d / "tokenizer.json").is_file():
        try:
            tok_json = (d / "tokenizer.json").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CflowFormatError(f"{d / 'tokenizer.json'}: {e}") from None
    tcfg = _json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    tmpl = tcfg.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        try:
            tmpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CflowFormatError(f"{d / 'chat_template.jinja'}: {e}") from None
    ids = {}
    if tok_json:
        from tokenizers import Tokenizer

        _check_bpe(d / "tokenizer.json", tok_json)
        try:
            tk = Tokenizer.from_str(tok_json)
        except BaseException as e:  # noqa: BLE001 - tokenizers raises bare Exceptions, and panics
            if not library_failure(e):
                raise
            raise CflowFormatError(f"{d / 'tokenizer.json'}: {str(e)[:200]}") from None
        for key in ("bos_token", "eos_token"):
            t = tcfg.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            if _utf8(t) and tk.token_to_id(t) is not None:
                ids[key] = tk.token_to_id(t)
    if isinstance(tmpl, list):  # named templates ([{"name", "template"}]): the default one
        tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if tmpl is not None and not _utf8(tmpl):
        raise CflowFormatError(f"{d / 'tokenizer_config.json'}: chat_template must be UTF-8 text")
    eos = gen.get("eos_token_id", ids.get("eos_token"))
    eos = [eos] if _is_int(eos) else eos or []
    bos = gen.get("bos_token_id", ids.get("bos_token"))
    if not isinstance(eos, list) or not all(_is_int(e) and 0 <= e < 1 << 31 for e in eos):
        raise CflowFormatError(f"{d}: eos_token_id={str(eos)[:60]} must be a token id or a list of them")
    if bos is not None and not (_is_int(bos) and 0 <= bos < 1 << 31):
        raise CflowFormatError(f"{d}: bos_token_id={str(bos)[:60]} must be a token id")
    add = tcfg.get("add_bos_token", add_bos)
    if not isinstance(add, bool):
        raise CflowFormatError(f"{d / 'tokenizer_config.json'}: add_bos_token={str(add)[:60]} must be true or false")
    special = {"bos_token_id": bos, "eos_token_ids": sorted(set(eos)), "add_bos": add}
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
