"""Structured outputs: answers constrained to one JSON object (OpenAI's `response_format:
{"type": "json_object"}`) or to a JSON schema (`{"type": "json_schema", "json_schema": {...}}`),
as llama-server's grammars and vLLM's guided decoding constrain them.

The grammar and the sets of allowed tokens come from llguidance (the constrained-decoding
library that vLLM, SGLang and llama.cpp use): `grammar(...)` compiles a schema to its grammar
and checks it (an unsupported keyword or a broken reference is an error, never a schema silently
ignored), a `Constraint` follows one sequence's tokens with a matcher. What cflow adds is the
draw. The sampler runs as usual; when the matcher refuses its token (a check of 2-5 us, about 50
between engine steps, which evict its tables from the caches), the refused tokens of the whole
vocabulary are masked (the matcher's bitmask: tens to a few hundred microseconds for a 150k
vocabulary; where the next bytes are forced it holds the tokenizer's own spelling of them, "ll"
after "nu" but not "l") and the sampler draws once more from the same logits. Masking the refused tokens and
drawing again is a draw from the sampler's distribution over the allowed ones, so greedy takes
the most likely allowed token, a seeded draw repeats, and a batched sequence gets its alone
tokens (nothing depends on the rest of its step).

Ends: when nothing but the end may follow (the object closed), the answer ends there
(finish_reason "stop", no end-of-sequence token drawn); where the text may end or go on (a
schema whose value is a number), the end-of-sequence token is one of the allowed tokens. It may
end earlier at max_tokens ("length", unfinished, as OpenAI's) or at a stop string. Between
JSON tokens whitespace is one space, or a newline and at most MAX_INDENT spaces or tabs, as
llama.cpp's JSON grammar has it (a model can otherwise loop on newlines, and a random one fills
its answer with whitespace); nothing comes before the first token or after the last. Control
tokens (the tokenizer's added tokens) never match text, so they are never drawn. Strings take
every JSON escape but `\\/`, and DEL (0x7F) only escaped (llguidance's JSON; a solidus is
written as itself).
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass

import numpy as np

from cflow.errors import CflowError

MAX_INDENT = 20
# JSON text as RFC 8259 has it, but whitespace between tokens is one space, or a newline and an
# indent of at most MAX_INDENT spaces or tabs (llama.cpp's JSON grammar's rule); any \\uXXXX
# escape in strings
JSON_OPTIONS = {"whitespace_pattern": r"( |\n[ \t]{0," + str(MAX_INDENT) + "})?",
            "json_allow_general_unicode_escapes": True}
_MASKED = np.float32(np.finfo(np.float32).min)  # a logit no sampler setting gives mass to
_ANY_OBJECT = {"type": "object"}


def grammar(json_object: bool = False, json_schema=None) -> str | None:
    """The llguidance grammar of a response format: one JSON object, or text that the JSON schema
    `json_schema` (a dict, or a JSON string of one) accepts; None for free text. CflowError for
    a schema that cannot be followed (not JSON, unknown types or formats, broken references)."""
    if json_schema is None:
        return _compiled(json.dumps(_ANY_OBJECT)) if json_object else None
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise CflowError(f"the JSON schema is not JSON: {e}") from None
    if not isinstance(json_schema, (dict, bool)):
        raise CflowError(f"a JSON schema is an object (or true/false), got {type(json_schema).__name__}")
    return _compiled(json.dumps(json_schema))  # in its order: properties come out in it


@functools.lru_cache(maxsize=64)
def _compiled(schema: str) -> str:
    """The checked grammar of a schema (its JSON text): a client that sends the same schema with
    every request compiles and checks it once."""
    llg = _llguidance()
    try:
        g = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise CflowError(f"the JSON schema cannot be followed: {e}") from None
    err = llg.LLMatcher.validate_grammar(g)
    if err:
        raise CflowError(f"the JSON schema cannot be followed: {err}")
    return g


def lark_json(schema: dict) -> str:
    """A Lark rule's body of JSON text that `schema` accepts, written as grammar() writes JSON
    (JSON_OPTIONS, the schema's "x-guidance"), for lark_grammar."""
    return "%json " + json.dumps(dict(schema, **{"x-guidance": JSON_OPTIONS}))


@functools.lru_cache(maxsize=64)
def lark_grammar(lark: str) -> str:
    """The checked grammar of a Lark grammar in llguidance's dialect (JSON inside as lark_json's
    `%json {...}`, special tokens as `<name>`): tool calls' (cflow.tools)."""
    llg = _llguidance()
    g = llg.LLMatcher.grammar_from_lark(lark)
    err = llg.LLMatcher.validate_grammar(g)
    if err:
        raise CflowError(f"the grammar cannot be followed: {err}")
    return g


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of cflow
        raise CflowError("structured outputs need the llguidance package (pip install llguidance)") from None
    return llguidance


_TOKENIZERS_LOCK = threading.Lock()


def matcher_tokenizer(tok):
    """llguidance's view of a Tokenizer (its vocabulary's bytes, special tokens and ends), built
    once a tokenizer (SmolLM2's 49,152 tokens: 0.24 s; Qwen2.5's 151,936: 1.0 s; Gemma 3's
    262,144: 2.6 s) and kept on it. The server builds it off its event loop."""
    with _TOKENIZERS_LOCK:  # two first requests at once build it once
        lt = tok._llguidance
        if lt is None:
            llg = _llguidance()
            eos = sorted(tok.eos_token_ids) or None
            try:
                lt = llg.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
            except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read: the error says so
                raise CflowError(f"structured outputs: llguidance cannot read this model's tokenizer: {e}") from None
            tok._llguidance = lt
        return lt


class Constraint:
    """One sequence's structured output: `draw` samples a token the grammar allows next and takes
    it, `complete` says whether nothing but the end may follow; `allows` and `advance` check and
    take a given token."""

    def __init__(self, tok, grammar: str):
        llg = _llguidance()
        self._lt = matcher_tokenizer(tok)
        self.matcher = llg.LLMatcher(self._lt, grammar, log_level=0)
        if self.matcher.is_error():
            raise CflowError(f"structured outputs: {self.matcher.get_error()}")
        self._bits = np.full((self._lt.vocab_size + 31) // 32, -1, dtype=np.int32)

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        """Back to the grammar's start."""
        self.matcher.reset()

    def allows(self, t: int) -> bool:
        return 0 <= t < self._lt.vocab_size and self.matcher.validate_tokens([t]) == 1

    def advance(self, t: int) -> None:
        if not self.matcher.consume_token(t):
            raise ValueError(f"token {t} does not continue the structured text: {self.matcher.get_error()}")

    def allowed(self, size: int) -> np.ndarray:
        """A bool per id of `size` logits: whether the grammar allows that token next (ids past
        the tokenizer's vocabulary, the padding of some models' logits, never)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        ok = np.unpackbits(self._bits.view(np.uint8), bitorder="little").view(bool)
        out = np.zeros(size, dtype=bool)
        m = min(size, self._lt.vocab_size)
        out[:m] = ok[:m]
        return out

    def draw(self, sample, logits: np.ndarray, history: list[int]) -> int | None:
        """A token drawn by sample(logits, history) among those allowed, and taken (advance); None
        when the grammar allows none (the matcher failed: an error state)."""
        t = sample(logits, history)
        if 0 <= t < self._lt.vocab_size and self.matcher.try_consume_tokens([t]) == 1:
            return t  # the check and the advance in one call: most draws end here
        ok = self.allowed(np.asarray(logits).size)
        if not ok.any():
            return None
        y = np.where(ok, np.asarray(logits, dtype=np.float32), _MASKED)
        t = sample(y, history)
        if not ok[t]:
            t = int(np.argmax(y))  # a filter left only masked tokens: the most likely allowed
        self.advance(t)
        return t


@dataclass(frozen=True)
class BlockGrammar:
    """A grammar that constrains parts of an otherwise free answer (llama.cpp's lazy grammars): each
    time the answer's token is `trigger`, what follows keeps to `grammar` until the grammar ends;
    then the text is free again, or (once) the answer ends. A native tool call's block: after the
    <tool_call> token, a call of a given tool and </tool_call> (cflow.tools)."""

    trigger: int
    grammar: str
    once: bool = False


def follow(tok, grammar: str, text: str) -> Constraint | None:
    """The Constraint after `text` (its tokens as the tokenizer splits it), or None where the
    grammar refuses it: whether an answer is the grammar's text or the start of one (`complete`)."""
    c = Constraint(tok, grammar)
    for t in tok.encode(text):
        if not c.allows(t):
            return None
        c.advance(t)
    return c
