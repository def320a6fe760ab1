"""GGUF -> Checkpoint (tensor blocks are kept bit-identical).

The file is read by gguf_file.read_gguf, which checks every count, length and offset against
the file before it reads anything. general.architecture picks the architecture
(cflow.models.for_gguf); it reads the metadata and names and adapts the tensors (llama's Q/K
rows are un-permuted there, so every architecture runs one rope style, "neox"; moving whole rows
keeps `keep` bit-identical per row). Packed experts (blk.{l}.ffn_gate_exps ..., 3-D, experts on
the outer axis) are split into one matrix per expert, whole rows of blocks each. The config is
checked against the tensors before they are adapted (cflow.models.check_model): the head counts
must split the rows the adaptation regroups. Sampling defaults come from general.sampling.*
where a file has them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from cflow import models
from cflow.config import is_int
from cflow.convert import Checkpoint, Tensor, fuse_layers, generation_fields, split_experts
from cflow.convert.gguf_file import GGUFFile, GGUFTensor, read_gguf
from cflow.convert.names import rename
from cflow.convert.sentencepiece import CONTROL, USER_DEFINED, sentencepiece_tokenizer
from cflow.errors import CflowFormatError, UnsupportedError, library_failure
from cflow.format.tiles import BLOCK_TYPES, BLOCK_TYPES_BY_CODE
from cflow.models.base import unpermute_rope_rows as _unpermute  # noqa: F401 - the name tests use

if TYPE_CHECKING:
    import tokenizers

TOKENS, SCORES, TOKEN_TYPES, MERGES = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                                       "tokenizer.ggml.merges")


def _tensor_type(t: GGUFTensor) -> str:
    bt = BLOCK_TYPES_BY_CODE.get(t.type_code)
    if bt is None:
        from gguf import GGMLQuantizationType

        raise UnsupportedError(
            f"tensor {t.name} has GGML type {GGMLQuantizationType(t.type_code).name} ({t.type_code}), which cflow "
            f"does not support; supported: {', '.join(n.upper() for n in BLOCK_TYPES)}"
        )
    return bt.name


# pre-tokenizer split regexes of byte-level BPE vocabularies, by tokenizer.ggml.pre
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _fail(path, msg: str):
    raise CflowFormatError(f"{path}: GGUF tokenizer: {msg}")


def _vocabulary(path, m: dict) -> tuple[list[str], list[int]]:
    """The tokens and their types (tokenizer.ggml.token_type; [] when absent), checked."""
    tokens = m.get(TOKENS)
    if tokens is None:
        _fail(path, f"the metadata lacks {TOKENS} (the vocabulary)")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        _fail(path, f"{TOKENS} must be a non-empty array of strings")
    types = m.get(TOKEN_TYPES, [])
    if not isinstance(types, list) or types and len(types) != len(tokens) \
            or not all(is_int(t) for t in types):
        _fail(path, f"{TOKEN_TYPES} must be an array of one integer per token ({len(tokens)})")
    return tokens, types


def _byte_level_bpe(path, m: dict) -> tokenizers.Tokenizer:
    """Byte-level BPE (tokenizer.ggml.model == "gpt2") straight from the GGUF's tokens and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens, types = _vocabulary(path, m)
    lines = m.get(MERGES)
    if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
        _fail(path, f"{MERGES} must be an array of strings")
    merges = [tuple(x.split(" ")) for x in lines]
    for i, pair in enumerate(merges):
        if len(pair) != 2 or not all(pair):  # byte-level tokens hold no spaces: one separates the pair
            _fail(path, f"{MERGES}[{i}] {lines[i]!r} is not two tokens separated by one space")
    try:  # tokenizers raises a bare Exception naming the token, e.g. a merge whose result is no token
        tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    except BaseException as e:  # noqa: BLE001 - tokenizers raises bare Exceptions, and panics
        if not library_failure(e):
            raise
        _fail(path, f"the vocabulary and {MERGES} do not make a BPE tokenizer: {e}")
    pre = m.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":  # digits one by one, then GPT-2's split
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        split = _SPLITS.get(pre, _GPT2_SPLIT) if isinstance(pre, str) else _GPT2_SPLIT
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tk


def _sentencepiece(path, m: dict) -> tokenizers.Tokenizer:
    """SentencePiece vocabularies (tokenizer.ggml.model == "llama": gemma, llama 2, phi-3)."""
    tokens, types = _vocabulary(path, m)
    scores = m.get(SCORES)
    if not types or not isinstance(scores, list) or len(scores) != len(tokens) \
            or not all(is_int(x) or isinstance(x, float) for x in scores):
        _fail(path, f"a SentencePiece vocabulary needs {SCORES} and {TOKEN_TYPES}, one number per token "
                    f"({len(tokens)})")
    try:  # tokenizers raises a bare Exception naming what it refuses
        return sentencepiece_tokenizer(tokens, scores, types, m.get("general.architecture", ""))
    except BaseException as e:  # noqa: BLE001 - tokenizers raises bare Exceptions, and panics
        if not library_failure(e):
            raise
        _fail(path, f"the SentencePiece vocabulary does not make a tokenizer: {e}")


def _token_id(path, m: dict, key: str) -> int | None:
    """A special token id of the metadata: absent, or one of the vocabulary's ids."""
    i = m.get(key)
    if i is not None and not (is_int(i) and 0 <= i < len(m[TOKENS])):
        _fail(path, f"{key}={i!r} is not a token id (0..{len(m[TOKENS]) - 1})")
    return i


def gguf_tokenizer(path, m: dict | None = None) -> tuple[str, dict]:
    """(tokenizers JSON, {bos_token_id, eos_token_ids, add_bos}) from the GGUF's tokenizer metadata
    (`m`, the file's metadata, when the caller has read it already)."""
    m = m if m is not None else read_gguf(path).metadata
    kind = m.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tk = _byte_level_bpe(path, m)
    elif kind == "llama":
        tk = _sentencepiece(path, m)
    else:
        raise UnsupportedError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
                               "llama (SentencePiece)")
    eos = {_token_id(path, m, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")} - {None}
    for t in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>"):  # end-of-turn markers of chat models
        i = tk.token_to_id(t)
        if i is not None:
            eos.add(int(i))
    special = {
        "bos_token_id": _token_id(path, m, "tokenizer.ggml.bos_token_id"),
        "eos_token_ids": sorted(eos),
        "add_bos": bool(m.get("tokenizer.ggml.add_bos_token", kind == "llama")),
    }
    return tk.to_str(), special


# general.sampling.* (what llama.cpp's converter copies from generation_config.json) -> our names
GGUF_SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}


def gguf_generation(m: dict) -> dict:
    """The sampling defaults a GGUF file carries (most carry none)."""
    got = {}
    for key, ours in GGUF_SAMPLING.items():
        v = m.get(f"general.sampling.{key}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            got[ours] = int(v) if ours == "top_k" else round(float(v), 6)  # float32 0.95 -> 0.95
    return generation_fields(got)


def _vocab_size(g: GGUFFile) -> int:
    """Rows of the token embedding, else the tokenizer's vocabulary size."""
    for t in g.tensors:
        if t.name == "token_embd.weight":
            return t.shape[0]
    tokens = g.metadata.get(TOKENS)
    return len(tokens) if isinstance(tokens, list) else 0


def load_gguf(path) -> Checkpoint:
    path = os.fspath(path)
    g = read_gguf(path)
    m = g.metadata
    arch = models.for_gguf(m.get("general.architecture"))
    types = {t.name: _tensor_type(t) for t in g.tensors}
    key = f"{m['general.architecture']}.vocab_size"
    if not m.get(key):
        m[key] = _vocab_size(g)
    cfg = arch.config_from_gguf(m)
    renamed: dict[str, Tensor] = {}
    for t in g.tensors:
        try:
            ours = rename(t.name, arch.gguf_names)
        except KeyError:
            raise UnsupportedError(f"{path}: unexpected tensor {t.name} for arch {arch.name}") from None
        if ours is None:  # e.g. rope_freqs
            continue
        renamed.update(split_experts(ours, Tensor(types[t.name], t.shape, g.data(t)), cfg.n_expert, t.name))
    cfg = dataclasses.replace(cfg, tie_embeddings="output" not in renamed)
    models.check_model(cfg, renamed)
    tensors: dict[str, Tensor] = {}
    for name, t in renamed.items():
        tensors.update(arch.adapt(name, t, cfg, "gguf"))
    tok_json, special = gguf_tokenizer(path, m)
    tmpl = m.get("tokenizer.chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        raise CflowFormatError(f"{path}: GGUF metadata tokenizer.chat_template must be a string")
    name = m.get("general.name", "")
    return Checkpoint(cfg, fuse_layers(cfg, tensors), tok_json, tmpl, special,
                      {"source": os.path.basename(path), "source_format": "gguf",
                       "name": name if isinstance(name, str) else ""},
                      gguf_generation(m))
