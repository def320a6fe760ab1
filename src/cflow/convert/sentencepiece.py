"""SentencePiece vocabularies of GGUF files (tokenizer.ggml.model "llama") as a `tokenizers` BPE.

A GGUF keeps a SentencePiece vocabulary as tokens, scores and token types, without merges and
without the tokenizer.json that says how text is split. This rebuilds the tokenizer that
transformers' GGUF loader builds for the same file (its LlamaTokenizer / GemmaTokenizer
backends), with `tokenizers` alone, so the base install converts Gemma or Llama 2 GGUF files
without torch or transformers and the token ids stay those of that reference
(tests/test_tokenizer_sentencepiece.py compares them):

  model     BPE with byte fallback (<0xNN> tokens); merges recovered from the vocabulary: every
            split of a token into two tokens, ranked by the token's score, or for Gemma by its
            position in the file (Gemma's scores do not follow its merge order);
  text      Gemma: spaces become "▁", no prefix; Llama: Metaspace, "▁" before the first piece;
            Phi-3: "▁" prepended and spaces replaced by a normalizer;
  decoder   "▁" -> " ", byte tokens -> bytes, fused; Llama and Phi-3 drop the prefix "▁";
  added     control tokens (and the backend's named specials) special, user-defined tokens as
            plain added tokens: both matched whole in the text, never split.
"""

from __future__ import annotations

from dataclasses import dataclass

SPACE = "\u2581"  # SentencePiece's visible space
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


@dataclass(frozen=True)
class Flavour:
    """How one family's reference tokenizer treats text around the same kind of vocabulary."""

    specials: tuple[str, ...]  # special tokens its backend class adds by name
    unk_token: str | None  # the BPE model's unknown token (Llama's backend sets none)
    rank_by_position: bool  # merges ranked by file position instead of score
    spaces_spelled: bool  # the file spells a token of spaces with " ", not "▁"
    text: str  # "gemma" (spaces -> ▁), "metaspace" (▁ prefix on the first piece), "prepend" (Phi-3)


GEMMA = Flavour(("<unk>", "<bos>", "<eos>", "<pad>", "<mask>"), "<unk>", True, True, "gemma")
LLAMA = Flavour(("<unk>", "<s>", "</s>"), None, False, False, "metaspace")
PHI3 = Flavour(LLAMA.specials, None, False, False, "prepend")
FLAVOURS = {"gemma": GEMMA, "gemma2": GEMMA, "gemma3": GEMMA, "phi3": PHI3}  # others: LLAMA


def recover_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: (left, right) for every token that splits into two tokens.

    Best first: by the token's priority (higher first), then longer left and right pieces; the
    splits of one token in vocabulary order of (left, right). Ties keep that order (a stable
    sort), which is what transformers' generate_merges does, so the merge ranks agree with it.
    """
    found = []
    for token, p in priority.items():
        splits = [(token[:k], token[k:], p) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda s: (vocab[s[0]], vocab[s[1]]))
        found.extend(splits)
    found.sort(key=lambda s: (s[2], len(s[0]), len(s[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def sentencepiece_tokenizer(tokens: list[str], scores: list[float], types: list[int], arch: str):
    """A tokenizers.Tokenizer for a GGUF SentencePiece vocabulary of architecture `arch`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    flavour = FLAVOURS.get(arch, LLAMA)
    pieces = list(tokens)
    if flavour.spaces_spelled:
        # the normalizer turns text spaces into ▁, so these tokens are respelled with ▁ to be
        # reachable (and to take part in the merges)
        pieces = [SPACE * len(t) if " " in t and not t.strip() else t for t in pieces]
    if flavour.rank_by_position:
        priority = {t: -i for i, t in enumerate(pieces)}
    else:
        priority = dict(zip(pieces, scores))
    vocab = {t: i for i, t in enumerate(pieces)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=recover_merges(vocab, priority), unk_token=flavour.unk_token,
                              fuse_unk=True, byte_fallback=True))
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if flavour.text == "gemma":
        tk.normalizer = normalizers.Replace(" ", SPACE)
        tk.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    else:
        decode.append(decoders.Strip(" ", 1, 0))  # the ▁ put before the text
        if flavour.text == "prepend":
            tk.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        else:
            tk.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence(decode)

    # Added tokens are matched in the raw text before the model sees it. A named special the
    # vocabulary lacks is left out (the reference would append it past the model's vocabulary).
    # User-defined tokens count under their file spelling only (the respelled space runs do not).
    special = [t for t in flavour.specials if t in vocab]
    special += [t for t, ty in zip(tokens, types) if ty == CONTROL]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(special)])
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tk
