"""GGUF -> Checkpoint (gguf-py's GGUFReader; tensor blocks are kept bit-identical).

Rope: llama.cpp's converter permutes the rows of llama's Q and K weights so that its
interleaved rope (pairs 2i, 2i+1) equals HF's rotate-half rope. We undo that row permutation
here, so every architecture uses one rope style, "neox" (rotate halves), as Hugging Face does.
Permuting whole rows moves blocks without re-encoding them: `keep` stays bit-identical per row.
qwen2, qwen3 and gemma3 GGUF files are not permuted (llama.cpp runs them with neox rope).

Gemma: llama.cpp stores gemma's RMSNorm weights with the +1 already added, so norm_offset = 0
for GGUF sources (1.0 for HF sources).
"""

from __future__ import annotations

import os

import numpy as np

from cflow.config import ModelConfig
from cflow.convert import Checkpoint, Tensor, check_tensors, fuse_layers
from cflow.convert.names import GGUF_NAMES, rename
from cflow.errors import CflowFormatError, UnsupportedError
from cflow.format.tiles import BLOCK_TYPES, BLOCK_TYPES_BY_CODE

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def _reader(path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError, struct.error, IndexError... on bad files
        size = os.path.getsize(path)
        raise CflowFormatError(f"{path}: truncated or malformed GGUF file ({size} bytes): {type(e).__name__}: {e}") from None


def _meta(r) -> dict:
    out = {}
    for k, f in r.fields.items():
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001 - unreadable metadata we do not need
            pass
    return out


def config_kwargs(m: dict) -> dict:
    """ModelConfig fields from GGUF metadata."""
    arch = m.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHS)}")

    def g(key, default=None):
        v = m.get(f"{arch}.{key}", default)
        if v is None:
            raise CflowFormatError(f"GGUF metadata lacks {arch}.{key}")
        return v

    d, n_head = int(g("embedding_length")), int(g("attention.head_count"))
    n_kv = g("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):
        raise UnsupportedError("per-layer KV head counts are not supported")
    head_dim = int(g("attention.key_length", d // n_head))
    vocab = m.get(f"{arch}.vocab_size")
    kw = dict(
        arch=arch, d_model=d, n_layer=int(g("block_count")), n_head=n_head, n_kv_head=int(n_kv), head_dim=head_dim,
        d_ff=int(g("feed_forward_length")), max_seq_len=int(g("context_length", 2048)),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=float(g("rope.freq_base", 10000.0)),
        vocab_size=int(vocab) if vocab else 0,
    )
    scaling = m.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and float(m.get(f"{arch}.rope.scaling.factor", 1.0)) != 1.0:
        raise UnsupportedError(f"rope scaling {scaling!r} is not supported yet")
    if arch == "qwen2":
        kw.update(qkv_bias=True)
    if arch == "qwen3":
        kw.update(qk_norm=True)
    if arch == "gemma3":
        window = int(g("attention.sliding_window", 512))
        pattern = int(m.get("gemma3.attention.sliding_window_pattern", 6))
        kw.update(
            act="gelu_tanh", qk_norm=True, post_norms=True, embed_scale=float(np.sqrt(d)),
            attn_scale=head_dim**-0.5, sliding_window=window, rope_local_theta=10000.0,
            layer_types=["sliding" if (i + 1) % pattern else "global" for i in range(kw["n_layer"])],
            final_logit_softcap=float(m.get("gemma3.final_logit_softcapping", 0.0) or 0.0),
        )
    return kw


def _tensor_type(t) -> str:
    code = int(t.tensor_type)
    bt = BLOCK_TYPES_BY_CODE.get(code)
    if bt is None:
        raise UnsupportedError(
            f"tensor {t.name} has GGML type {t.tensor_type.name} ({code}), which cflow does not support; "
            f"supported: {', '.join(n.upper() for n in BLOCK_TYPES)}"
        )
    return bt.name


def _unpermute(data: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of Q/K rows: (n_head, hd/2, 2) -> (n_head, 2, hd/2)."""
    rows = data.shape[0]
    hd = rows // n_head
    return data.reshape(n_head, hd // 2, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


# pre-tokenizer split regexes of byte-level BPE vocabularies, by tokenizer.ggml.pre
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _byte_level_bpe(r, m: dict) -> "tokenizers.Tokenizer":
    """Byte-level BPE (tokenizer.ggml.model == "gpt2") straight from the GGUF's tokens and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in r.fields else []
    merges = [tuple(x.split(" ", 1)) for x in r.fields["tokenizer.ggml.merges"].contents()]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = m.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":  # digits one by one, then GPT-2's split
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS.get(pre, _GPT2_SPLIT)), "isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tk


def _sentencepiece(path) -> "tokenizers.Tokenizer":
    """SentencePiece vocabularies (tokenizer.ggml.model == "llama": gemma, llama 2) through transformers."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as e:
        raise UnsupportedError(f"converting this GGUF's SentencePiece tokenizer needs transformers>=5 "
                               f"(pip install 'cflow[convert]'): {e}") from None
    arch, tok_dict, _ = get_gguf_tokenizer(str(path))
    return convert_gguf_tokenizer(arch, tok_dict)[0]


def gguf_tokenizer(path, r=None, m=None) -> tuple[str, dict]:
    """(tokenizers JSON, {bos_token_id, eos_token_ids, add_bos}) from the GGUF's tokenizer metadata."""
    r = r if r is not None else _reader(path)
    m = m if m is not None else _meta(r)
    kind = m.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tk = _byte_level_bpe(r, m)
    elif kind == "llama":
        tk = _sentencepiece(path)
    else:
        raise UnsupportedError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
                               "llama (SentencePiece)")
    eos = {int(m["tokenizer.ggml.eos_token_id"])} if "tokenizer.ggml.eos_token_id" in m else set()
    if "tokenizer.ggml.eot_token_id" in m:
        eos.add(int(m["tokenizer.ggml.eot_token_id"]))
    for t in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>"):  # end-of-turn markers of chat models
        i = tk.token_to_id(t)
        if i is not None:
            eos.add(int(i))
    bos = m.get("tokenizer.ggml.bos_token_id")
    special = {
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_ids": sorted(eos),
        "add_bos": bool(m.get("tokenizer.ggml.add_bos_token", kind == "llama")),
    }
    return tk.to_str(), special


def load_gguf(path) -> Checkpoint:
    path = os.fspath(path)
    r = _reader(path)
    m = _meta(r)
    kw = config_kwargs(m)
    tensors: dict[str, Tensor] = {}
    for t in r.tensors:
        try:
            ours = rename(t.name, GGUF_NAMES)
        except KeyError:
            raise UnsupportedError(f"{path}: unexpected tensor {t.name} for arch {kw['arch']}") from None
        if ours is None:  # e.g. rope_freqs
            continue
        typ = _tensor_type(t)
        data = t.data
        shape = (int(t.shape[0]),) if len(t.shape) == 1 else (int(data.shape[0]), int(t.shape[0]))
        if len(t.shape) > 2:
            raise UnsupportedError(f"tensor {t.name} has {len(t.shape)} dimensions; only matrices and vectors are supported")
        if kw["arch"] == "llama" and ours.endswith(("attn_q", "attn_k")):
            data = _unpermute(np.asarray(data), kw["n_head"] if ours.endswith("attn_q") else kw["n_kv_head"])
        tensors[ours] = Tensor(typ, shape, data)
    tok_json, special = gguf_tokenizer(path, r, m)
    if not kw["vocab_size"]:
        kw["vocab_size"] = tensors["tok_embd"].shape[0] if "tok_embd" in tensors else len(r.fields["tokenizer.ggml.tokens"].data)
    kw["tie_embeddings"] = "output" not in tensors
    cfg = ModelConfig(**kw)
    tmpl = m.get("tokenizer.chat_template")
    ckpt = Checkpoint(cfg, fuse_layers(cfg, tensors), tok_json, tmpl, special,
                      {"source": os.path.basename(path), "source_format": "gguf", "name": m.get("general.name", "")})
    check_tensors(ckpt)
    return ckpt

