"""The one generator: prefill, decode, sample, stop, detokenize (CLI, API and server share it:
LLM.complete drives one Decoder with its own forwards, the server's batcher many in one step)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from cflow.errors import CflowError
from cflow.structured import BlockGrammar, Constraint
from cflow.sampling import TokenLogprob, check_logprobs, make_sampler, token_logprob
from cflow.tokenizer import StreamDecoder, Tokenizer


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was already in the state (prompt reuse)


@dataclass
class Timings:
    prompt_s: float
    decode_s: float
    prompt_tok_s: float
    decode_tok_s: float
    prompt_n: int = 0  # prompt tokens prefilled (the prompt less its cached prefix)


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None | "stop" | "length"
    usage: Usage | None = None
    timings: Timings | None = None
    # when the Decoder was asked for them: token_ids' own, and last the end-of-sequence token's
    # when it ended the generation (it has no text, but it was generated)
    logprobs: list[TokenLogprob] | None = None
    # the first Chunk, when the Decoder was asked for them: the prompt's tokens' (None for the
    # first, which nothing predicts)
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _rate(n: int, s: float) -> float:
    return n / s if s > 0 else 0.0


def check_budget(n_prompt: int, max_tokens: int, n_ctx: int, scoring: bool = False) -> None:
    """scoring: the prompt's logprobs are asked for, so max_tokens may be 0 (no generation)."""
    if n_prompt == 0:
        raise CflowError("the prompt is empty (no tokens)")
    if max_tokens < (0 if scoring else 1):
        raise CflowError(f"max_tokens must be >= {0 if scoring else 1}, got {max_tokens}")
    if n_prompt + max_tokens > n_ctx:
        raise CflowError(f"prompt of {n_prompt} tokens + max_tokens {max_tokens} = {n_prompt + max_tokens} "
                         f"exceeds the context of {n_ctx} tokens")


PREFILL_CHUNK = 64
"""Prompt tokens per prefill step. A sequence's rows are exact whatever else shares its step as
long as its own steps keep their sizes (1 row: the decode kernel, >= 2: the prefill GEMM), so
every prompt is cut the same way whether it runs alone (LLM.complete) or joins a batch (the
server): pieces of this size, a last piece of 1 token folded into the one before."""


def prefill_chunks(ids: list[int], size: int = PREFILL_CHUNK) -> list[list[int]]:
    """ids in pieces of `size` tokens; never a last piece of 1 token after a longer one."""
    pieces = [ids[i:i + size] for i in range(0, len(ids), size)]
    if len(pieces) > 1 and len(pieces[-1]) == 1:
        pieces[-2:] = [pieces[-2] + pieces[-1]]
    return pieces


class Decoder:
    """One sequence's generation, step by step, without the engine: it says what to feed next
    (`next_input`: a prefill piece, then the sampled token) and turns the logits of each step
    into a Chunk (`feed`). LLM.complete drives one with its own forwards; the server's batcher
    drives many, all advanced by one forward per step.

    Text that could be the start of a stop string is held back; stop strings are never emitted.
    ignore_eos: the end-of-sequence token does not end the generation (it is sampled like any
    other: fixed-length runs and benchmarks).
    logprobs: None, or n: each Chunk carries its tokens' logprobs (sampling.token_logprob) with
    the n most likely tokens of their steps; the last one also the end-of-sequence token's when
    that ended the generation (an evaluation harness reads one entry per generated token).
    logit_bias: {token id: added to its logit} before every draw (-100 bans a token in practice,
    +100 all but forces it); logprobs stay the model's own.
    prompt_logprobs: None, or n: the first Chunk carries the prompt's tokens' logprobs. Their
    pieces then need the logits of every row (`all_rows`), and no cached prefix is reused (it
    holds no logits). With max_tokens=0 the generation ends after the prompt (scoring a text).
    grammar: None, or a structured output's grammar (cflow.structured.grammar: one JSON object, or
    a JSON schema's): each draw is among the tokens it allows next, and the generation ends when
    nothing but the end may follow.
    block_grammar: None, or a cflow.structured.BlockGrammar: the text is free but for the blocks
    its trigger token opens, each kept to its grammar (tool calls under "auto"); its matcher is
    built here, so that a block's start costs the step nothing.
    """

    def __init__(self, tok: Tokenizer, prompt_ids: list[int], *, max_tokens: int = 256,
                 stop: list[str] | None = None, ignore_eos: bool = False, recompute: int = 2,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 logit_bias: dict[int, float] | None = None, grammar: str | None = None,
                 block_grammar: BlockGrammar | None = None, **sampling):
        self.sample = make_sampler(**sampling)  # bad settings fail here, before any step
        self.constraint = None if grammar is None else Constraint(tok, grammar)
        self.block = block_grammar
        self._block_constraint = None if block_grammar is None else Constraint(tok, block_grammar.grammar)
        self.bias = bias_arrays(logit_bias)
        for n in (logprobs, prompt_logprobs):
            if n is not None:
                check_logprobs(n)  # a bad n fails here too
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs
        self.prompt_lps: list[TokenLogprob | None] | None = None if prompt_logprobs is None else [None]
        self.recompute = recompute  # prompt tokens computed again at least (begin)
        self.tok, self.prompt, self.max_tokens, self.ignore_eos = tok, list(prompt_ids), max_tokens, ignore_eos
        self.stops = [s for s in (stop or []) if s]
        self.history = list(prompt_ids)
        self.dec = StreamDecoder(tok)
        self.held, self.out_ids, self.pending = "", [], []
        self.pending_lp: list[TokenLogprob] | None = None if logprobs is None else []
        self.finish: str | None = None
        self.cached, self.n_fwd = 0, 0
        self._todo: list[list[int]] = []
        self.t0 = self.t1 = 0.0

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def prefilling(self) -> bool:
        return bool(self._todo)

    @property
    def all_rows(self) -> bool:
        """Whether the next step must give the logits of every row of next_input(), not only
        its last: a prompt piece whose tokens' logprobs were asked for."""
        return self.prompt_lps is not None and bool(self._todo)

    def begin(self, state, cached: int = 0) -> None:
        """Start on `state`, whose first `cached` tokens are the prompt's. At least the last
        `recompute` prompt tokens are computed again (all of a shorter prompt): the last one's
        logits start the generation. With recompute=2 (the default) the piece has two or more
        rows and takes the same prefill path as a fresh prompt; 1 is for engines whose prompt
        rows compute what decode rows do (`recompute_for`). Either way a cached prefix gives the
        tokens of an uncached run."""
        self.cached = self.reusable(cached)
        state.truncate(self.cached)
        self._todo = prefill_chunks(self.prompt[self.cached:])
        self.t0 = time.perf_counter()

    def reusable(self, cached: int) -> int:
        """How much of a cached prefix of `cached` prompt tokens begin() keeps (it computes the
        last `recompute` prompt tokens again; none when the prompt's logprobs are asked for)."""
        if self.prompt_logprobs is not None:
            return 0
        return max(0, min(cached, len(self.prompt) - min(self.recompute, len(self.prompt))))

    def next_input(self) -> list[int]:
        """The tokens the next step appends to this sequence's state."""
        return self._todo[0] if self._todo else [self.history[-1]]

    def feed(self, logits) -> Chunk | None:
        """The logits of the step that appended next_input(): None while the prompt is still
        being prefilled, else the Chunk of the sampled token (the last one, with finish_reason,
        usage and timings, when the generation ends)."""
        if self._todo:
            piece = self._todo.pop(0)
            if self.prompt_lps is not None:
                logits = self._score(piece, logits)
            if self._todo:
                return None
            self.t1 = time.perf_counter()
            if self.max_tokens == 0:
                return self._end("length")
        else:
            self.n_fwd += 1
        t = self._draw(self._biased(logits))
        if t is None:  # a structured output whose grammar allows no token
            return self._end("stop")
        if self.pending_lp is not None:
            self.pending_lp.append(token_logprob(logits, t, self.logprobs))
        if t in self.tok.eos_token_ids and not self.ignore_eos:
            return self._end("stop")
        self.out_ids.append(t)
        self.history.append(t)
        self.pending.append(t)
        self.held += self.dec.push(t)
        hit = self._stop_hit()
        if hit >= 0:
            self.held = self.held[:hit]
            return self._end("stop", flush=False)
        if self.constraint is not None and self.constraint.complete:
            if self.constraint is not self._block_constraint or self.block.once:
                return self._end("stop")
            self.constraint = None  # the block ended: free text again
        elif self._block_constraint is not None and self.constraint is None and t == self.block.trigger:
            self._block_constraint.reset()
            self.constraint = self._block_constraint
        if len(self.out_ids) == self.max_tokens:
            return self._end("length")
        keep = _held_back(self.held, self.stops)
        emit, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        chunk = Chunk(emit, self.pending, logprobs=self.pending_lp, prompt_logprobs=self._prompt_once())
        self.pending, self.pending_lp = [], None if self.pending_lp is None else []
        return chunk

    def _prompt_once(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs for the first Chunk; None after it."""
        out, self.prompt_lps = self.prompt_lps, None
        return out

    def _draw(self, logits) -> int | None:
        if self.constraint is None:
            return self.sample(logits, self.history, self.out_ids)
        return self.constraint.draw(lambda x, history: self.sample(x, history, self.out_ids), logits, self.history)

    def _biased(self, logits):
        if self.bias is None:
            return logits
        x = np.array(logits, dtype=np.float32)
        x[self.bias[0]] += self.bias[1]
        return x

    def _score(self, piece: list[int], rows):
        """The logprobs of the prompt tokens that the rows of `piece` predict (row r, at prompt
        position a + r, predicts the token at a + r + 1); returns the last row."""
        a = len(self.prompt_lps) - 1  # the piece's first position: pieces come in order from 0
        for r in range(len(piece)):
            if a + r + 1 < len(self.prompt):
                self.prompt_lps.append(token_logprob(rows[r], self.prompt[a + r + 1], self.prompt_logprobs))
        return rows[-1]

    def _stop_hit(self) -> int:
        return min((self.held.find(s) for s in self.stops if s in self.held), default=-1)

    def _end(self, finish: str, flush: bool = True) -> Chunk:
        self.finish = finish
        if flush:  # release held-back text and any incomplete character
            self.held += self.dec.flush()
            hit = self._stop_hit()
            if hit >= 0:
                self.held, self.finish = self.held[:hit], "stop"
        t2 = time.perf_counter()
        n_prompt, n_out = len(self.prompt), len(self.out_ids)
        n_new = n_prompt - self.cached
        usage = Usage(n_prompt, n_out, n_prompt + n_out, self.cached)
        timings = Timings(self.t1 - self.t0, t2 - self.t1, _rate(n_new, self.t1 - self.t0), _rate(self.n_fwd, t2 - self.t1),
                          n_new)
        return Chunk(self.held, self.pending, self.finish, usage, timings, self.pending_lp, self._prompt_once())


def bias_arrays(logit_bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """A logit bias {token id: value} as (ids, values) arrays; None for none. Ids must be >= 0 and
    values finite within +-100 (OpenAI's range); a token id past the vocabulary fails at the first
    draw's indexing, so callers that know the vocabulary check it first."""
    if not logit_bias:
        return None
    ids = np.fromiter((int(k) for k in logit_bias), dtype=np.int64, count=len(logit_bias))
    vals = np.fromiter((float(v) for v in logit_bias.values()), dtype=np.float32, count=len(logit_bias))
    if (ids < 0).any() or not np.isfinite(vals).all() or (np.abs(vals) > 100).any():
        raise CflowError("logit_bias: token ids >= 0, biases finite within -100..100")
    return ids, vals


def recompute_for(engine) -> int:
    """The prompt tokens a Decoder on `engine` computes again after a cached prefix: 1 where its
    prompt rows compute bit for bit what its decode rows do, else 2."""
    return 1 if getattr(engine, "prompt_rows_as_decode", False) else 2


def generate_step(engine, state, tok: Tokenizer, prompt_ids: list[int], *, max_tokens: int = 256,
                  stop: list[str] | None = None, cached: int = 0, ignore_eos: bool = False,
                  logprobs: int | None = None, prompt_logprobs: int | None = None, **sampling) -> Iterator[Chunk]:
    """Yield one Chunk per generated token; the last one has finish_reason, usage and timings.

    cached: tokens of prompt_ids already in `state` (prompt-cache reuse); the rest is prefilled.
    logprobs, prompt_logprobs: None, or n: each Chunk's tokens' logprobs, the first's the prompt's,
    with the n most likely tokens of each step (Decoder).
    """
    d = Decoder(tok, prompt_ids, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos,
                recompute=recompute_for(engine), logprobs=logprobs, prompt_logprobs=prompt_logprobs, **sampling)
    d.begin(state, cached)
    while not d.done:
        chunk = d.feed(engine.forward(state, d.next_input(), all_logits=d.all_rows))
        if chunk is not None:
            yield chunk
