"""The tokenizer stored in a model file (Hugging Face `tokenizers`) and streaming detokenization."""

from __future__ import annotations

from cflow.errors import CflowError, library_failure


class Tokenizer:
    """encode / decode over a tokenizers JSON, with the model's special tokens.

    special: {"bos_token_id", "eos_token_ids", "add_bos"} as the converter stores them.
    """

    def __init__(self, tokenizer_json: str, special: dict | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        if not tokenizer_json:
            raise CflowError("the model file holds no tokenizer")
        try:
            self.backend = HFTokenizer.from_str(tokenizer_json)
        except BaseException as e:  # noqa: BLE001 - tokenizers raises bare Exceptions, and panics
            if not library_failure(e):
                raise
            raise CflowError(f"cannot load the model's tokenizer: {e}") from None
        special = special or {}
        self.bos_token_id: int | None = special.get("bos_token_id")
        self.eos_token_ids: set[int] = set(special.get("eos_token_ids") or [])
        self.add_bos: bool = bool(special.get("add_bos", False))
        self.vocab_size = self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; with add_special_tokens, BOS is prepended when the model wants it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, i: int) -> str | None:
        return self.backend.id_to_token(i)


class StreamDecoder:
    """Incremental detokenization that never emits half a UTF-8 character.

    Decodes a window of recent tokens and emits the text beyond what the window's prefix decoded
    to; while the new text ends in U+FFFD (an incomplete byte sequence) it waits for more tokens.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        old = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        new = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(new) > len(old) and not new.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(old) :]
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete character at the end decodes as U+FFFD)."""
        old = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        new = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return new[len(old) :]
