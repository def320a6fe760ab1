"""JSON mode: generation constrained to one JSON object (OpenAI's `response_format: {"type":
"json_object"}`, llama-server's and vLLM's guided JSON).

Two parts:
- `feed` and `complete`: a recogniser of JSON text (RFC 8259) byte by byte. Its state is a small
  tuple, so trying a token is a few transitions from it: `feed(state, data)` gives the state after
  `data`, or None when no JSON object starts with the text so far plus `data`; `complete(state)`
  says whether the text is a whole object.
- `JsonConstraint`: one sequence's state, and the draw. The sampler runs as usual; if its token
  cannot continue the text, that token's logit is masked and the sampler draws again (llama.cpp's
  grammar sampler does the same before it filters every candidate). Masking one rejected token
  at a time and drawing again from the rest is a draw from the sampler's distribution over the
  allowed tokens, so greedy picks the most likely allowed token and a seeded draw repeats. After
  `QUICK_TRIES` rejections (the model wants prose where JSON must go on), the allowed tokens are
  looked for in order of their logits, at least the sampler's top-k of them (64 without one), and
  the sampler draws once among those.

The generation ends as soon as the object closes (finish_reason "stop"): nothing but whitespace
may follow it, so there is nothing left to sample. It may end earlier at max_tokens ("length",
the JSON unfinished, as OpenAI's) or at a stop string. Outside strings at most `MAX_WS` whitespace
bytes may follow one another (a model can otherwise loop on newlines: llama.cpp's JSON grammar
bounds them too). Tokens the tokenizer adds (control tokens such as end-of-turn) and tokens of no
text are never allowed: the end comes from the object itself.
"""

from __future__ import annotations

import functools

import numpy as np

MAX_WS = 20
QUICK_TRIES = 4
_MASKED = np.float32(np.finfo(np.float32).min)  # a logit no sampler setting gives mass to

# modes of the recogniser
_TOP, _VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _DONE = range(8)
_STR, _ESC, _HEX, _NUM, _LIT = range(8, 13)
_STRUCTURAL = frozenset((_TOP, _VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _DONE))  # whitespace keeps them
_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEXDIGITS = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
# number sub-states: what was read last, and whether the number may end there
_SIGN, _ZERO, _INT, _DOT, _FRAC, _E, _ESIGN, _EXP = range(8)
_NUM_ENDS = frozenset((_ZERO, _INT, _FRAC, _EXP))

State = tuple  # (stack: str of "o"/"a", mode, aux, whitespace run)
START: State = ("", _TOP, None, 0)


def _closed(stack: str) -> State:
    """The state after a value that ends inside `stack` (the whole object when it is empty)."""
    return (stack, _AFTER, None, 0) if stack else ("", _DONE, None, 0)


def _step(s: State, c: int) -> State | None:
    stack, mode, aux, ws = s
    if mode == _STR:
        if c == 0x22:  # "
            return (stack, _COLON, None, 0) if aux else _closed(stack)
        if c == 0x5C:  # backslash
            return (stack, _ESC, aux, 0)
        return s if c >= 0x20 else None  # control characters must be escaped
    if mode == _ESC:
        if c == 0x75:  # u: four hex digits
            return (stack, _HEX, (aux, 4), 0)
        return (stack, _STR, aux, 0) if c in _ESCAPES else None
    if mode == _HEX:
        key, left = aux
        if c not in _HEXDIGITS:
            return None
        return (stack, _STR, key, 0) if left == 1 else (stack, _HEX, (key, left - 1), 0)
    if mode == _LIT:
        if c != aux[0]:
            return None
        return (stack, _LIT, aux[1:], 0) if len(aux) > 1 else _closed(stack)
    if mode == _NUM:
        nxt = _number(aux, c)
        if nxt is not None:
            return (stack, _NUM, nxt, 0)
        if aux not in _NUM_ENDS:
            return None
        return _step(_closed(stack), c)  # the number ended; c comes after it
    if c in _WS:
        return (stack, mode, aux, ws + 1) if ws < MAX_WS else None
    if mode == _DONE:
        return None
    if mode == _TOP:
        return ("o", _KEY_OR_CLOSE, None, 0) if c == 0x7B else None
    if mode in (_KEY_OR_CLOSE, _KEY):
        if c == 0x22:
            return (stack, _STR, True, 0)
        if c == 0x7D and mode == _KEY_OR_CLOSE:  # {}
            return _closed(stack[:-1])
        return None
    if mode == _COLON:
        return (stack, _VALUE, None, 0) if c == 0x3A else None
    if mode == _AFTER:
        top = stack[-1]
        if c == 0x2C:  # ,
            return (stack, _KEY if top == "o" else _VALUE, None, 0)
        if (c == 0x7D and top == "o") or (c == 0x5D and top == "a"):
            return _closed(stack[:-1])
        return None
    # _VALUE, _VALUE_OR_CLOSE: a value starts
    if c == 0x5D and mode == _VALUE_OR_CLOSE:  # []
        return _closed(stack[:-1])
    if c == 0x7B:
        return (stack + "o", _KEY_OR_CLOSE, None, 0)
    if c == 0x5B:
        return (stack + "a", _VALUE_OR_CLOSE, None, 0)
    if c == 0x22:
        return (stack, _STR, False, 0)
    if c == 0x2D:
        return (stack, _NUM, _SIGN, 0)
    if c in _DIGITS:
        return (stack, _NUM, _ZERO if c == 0x30 else _INT, 0)
    lit = _LITERALS.get(c)
    return (stack, _LIT, lit, 0) if lit else None


def _number(sub: int, c: int) -> int | None:
    """The number's next sub-state after byte c, or None when c does not continue it."""
    digit = c in _DIGITS
    if sub == _SIGN:
        return (_ZERO if c == 0x30 else _INT) if digit else None
    if sub in (_ZERO, _INT):
        if digit:
            return _INT if sub == _INT else None  # no leading zeros
        return _DOT if c == 0x2E else _E if c in (0x65, 0x45) else None
    if sub in (_DOT, _FRAC):
        if digit:
            return _FRAC
        return _E if sub == _FRAC and c in (0x65, 0x45) else None
    if sub == _E:
        return _ESIGN if c in (0x2B, 0x2D) else _EXP if digit else None
    return _EXP if digit else None  # _ESIGN, _EXP


def feed(s: State, data: bytes) -> State | None:
    """The state after data, or None when no JSON object begins with the text so far + data."""
    for c in data:
        s = _step(s, c)
        if s is None:
            return None
    return s


def complete(s: State) -> bool:
    """Whether the text so far is one whole JSON object (trailing whitespace allowed)."""
    return s[1] == _DONE


class VocabTable:
    """What the fallback's first filter reads of every token of the tokenizer's vocabulary, as
    arrays: its first byte, its leading whitespace and the byte after it, and whether it is never
    allowed (added and end-of-sequence tokens, tokens of no text). Built once a tokenizer, when
    its first JSON-mode request arrives (SmolLM2's 49,152 tokens: 0.17 s, Qwen2.5's 151,936: 0.56)."""

    def __init__(self, tok):
        self.data = tok.all_token_bytes()
        n = len(self.data)
        self.first = np.full(n, 256, np.int16)  # 256: no byte
        self.lead = np.zeros(n, np.int16)
        self.after = np.full(n, 256, np.int16)  # the first byte that is not whitespace
        for i, b in enumerate(self.data):
            if b:
                rest = b.lstrip(b" \t\n\r")
                self.first[i], self.lead[i] = b[0], len(b) - len(rest)
                if rest:
                    self.after[i] = rest[0]
        self.banned = self.first == 256
        ids = [i for i in set(tok.added_ids) | set(tok.eos_token_ids) if 0 <= i < n]
        self.banned[ids] = True
        self.all_ws = ~self.banned & (self.after == 256)


@functools.lru_cache(maxsize=4)
def vocab_table(tok) -> VocabTable:
    return VocabTable(tok)


class JsonConstraint:
    """One sequence's JSON mode: `draw` samples a token that keeps the text a prefix of a JSON
    object, `advance` takes the token chosen, `complete` says whether the object has closed."""

    def __init__(self, tok):
        self.state: State = START
        self._vocab = vocab_table(tok)  # here, in the request's handler, rather than mid-step

    @property
    def complete(self) -> bool:
        return complete(self.state)

    def allows(self, t: int) -> bool:
        v = self._vocab
        return 0 <= t < v.banned.size and not v.banned[t] and feed(self.state, v.data[t]) is not None

    def advance(self, t: int) -> None:
        nxt = feed(self.state, self._vocab.data[t])
        if nxt is None:
            raise ValueError(f"token {t} does not continue the JSON text")
        self.state = nxt

    def draw(self, sample, logits: np.ndarray, history: list[int], top_k: int = 0) -> int | None:
        """A token drawn by sample(logits, history) among those allowed; None when no token of
        the vocabulary is (no byte-level or byte-fallback vocabulary meets that)."""
        x = logits
        for _ in range(QUICK_TRIES):
            t = sample(x, history)
            if self.allows(t):
                return t
            if x is logits:
                x = np.array(logits, dtype=np.float32)
            x[t] = _MASKED
        found = self._allowed_first(x, max(top_k, 64))
        if not found:
            return None
        y = np.full_like(x, _MASKED)
        y[found] = x[found]
        t = sample(y, history)
        return t if self.allows(t) else found[0]

    def _allowed_first(self, x: np.ndarray, want: int) -> list[int]:
        """Up to `want` allowed tokens, most likely first. A first filter over the whole vocabulary
        at once: outside strings, numbers and literals whitespace keeps the recogniser's mode, so a
        token passes when its leading whitespace fits the bound and its first other byte may come
        next (or it is all whitespace); elsewhere its first byte must. The tokens that pass are
        then checked whole, in the order of their logits."""
        v, s = self._vocab, self.state
        ok = np.array([_step(s, c) is not None for c in range(256)] + [False])  # [256]: no byte
        if s[1] in _STRUCTURAL:
            passed = ~v.banned & (v.lead + s[3] <= MAX_WS) & (ok[v.after] | v.all_ws)
        else:
            passed = ~v.banned & ok[v.first]
        m = min(x.size, passed.size)  # logits past the tokenizer's vocabulary (padding): never
        ids = np.flatnonzero(passed[:m] & (x[:m] != _MASKED))
        found: list[int] = []
        for t in ids[np.argsort(-x[ids], kind="stable")].tolist():
            if feed(s, v.data[t]) is not None:
                found.append(t)
                if len(found) == want:
                    break
        return found
