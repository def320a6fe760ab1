"""The tokenizer stored in a model file (Hugging Face `tokenizers`) and streaming detokenization."""

from __future__ import annotations

import functools
import json
import re

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
        self._spelt: dict[int, bytes] = {}  # token_bytes, as tokens are asked for
        self._llguidance = None  # structured outputs' view of it (cflow.structured.matcher_tokenizer)

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

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for in decoded text, a part of a character included: how
        logprobs spell a token. Byte-level vocabularies (GPT-2's, Qwen's) map each byte to a
        printable character; SentencePiece ones write a space as U+2581 and a byte they have no
        piece for as <0xNN>; added (special) tokens stand for their own text."""
        b = self._spelt.get(i)
        if b is None:
            b = self._spelt[i] = self._spell(i)
        return b

    @functools.cached_property
    def _decoders(self) -> tuple[set[int], set[str], list[tuple[str, str]]]:
        """(added token ids, the decoder's step types, its Replace steps)."""
        spec = json.loads(self.backend.to_str())
        added = {t["id"] for t in spec.get("added_tokens") or []}
        steps = spec.get("decoder") or {}
        steps = (steps.get("decoders") or []) if steps.get("type") == "Sequence" else [steps]
        kinds = {d.get("type") for d in steps if isinstance(d, dict)}
        replace = [(d["pattern"]["String"], d["content"]) for d in steps if isinstance(d, dict)
                   and d.get("type") == "Replace" and isinstance(d.get("pattern"), dict) and "String" in d["pattern"]]
        return added, kinds, replace

    def _spell(self, i: int) -> bytes:
        piece = self.backend.id_to_token(i)
        if piece is None:
            return b""
        added, kinds, replace = self._decoders
        if i in added:
            return piece.encode()
        if "ByteLevel" in kinds and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if "ByteFallback" in kinds:
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        for a, b in replace:
            piece = piece.replace(a, b)
        return piece.encode()


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: printable bytes stand for themselves, the others
    (controls, space, 127-160, 173) for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF_CHAR = _byte_level_chars()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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
