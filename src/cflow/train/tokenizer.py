"""Tokenizers for training: a byte-level BPE trained with `tokenizers`, or GPT-2's."""

from __future__ import annotations

import os
from pathlib import Path

from cflow.errors import CflowError
from cflow.train.data import EOT


def train_bpe(texts: list[str], vocab_size: int):
    """Byte-level BPE of `vocab_size` entries (EOT included) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise CflowError(f"vocab size {vocab_size} is too small for byte-level BPE (>= 300)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load(spec: str):
    """A tokenizer from a tokenizer.json path, or "gpt2" (needs the hub or its cache)."""
    from tokenizers import Tokenizer

    if spec == "gpt2":
        try:
            return Tokenizer.from_pretrained("gpt2")
        except Exception as e:  # offline, no cache
            raise CflowError(f"cannot load the GPT-2 tokenizer from the hub: {e}") from None
    try:
        tok = Tokenizer.from_file(spec)
    except Exception as e:
        raise CflowError(f"cannot read tokenizer {spec}: {e}") from None
    if tok.token_to_id(EOT) is None:
        raise CflowError(f"tokenizer {spec} has no {EOT} token")
    return tok


def from_json(text: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(text)


def load_or_train(spec: str, texts: list[str], vocab_size: int):
    """Load `spec` if it exists (or is "gpt2"), else train a BPE of vocab_size and save it there."""
    if spec == "gpt2" or Path(spec).is_file():
        return load(spec)
    tok = train_bpe(texts, vocab_size)
    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{spec}.tmp{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, spec)
    return tok


def check_vocab(tok, vocab_size: int, what: str) -> None:
    if tok.get_vocab_size() != vocab_size:
        raise CflowError(f"tokenizer has {tok.get_vocab_size()} tokens but {what} has vocab_size={vocab_size}")
