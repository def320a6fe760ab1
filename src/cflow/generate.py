"""The one generator: prefill, decode, sample, stop, detokenize (CLI, API and server share it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from cflow.errors import CflowError
from cflow.sampling import make_sampler
from cflow.tokenizer import StreamDecoder, Tokenizer


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class Timings:
    prompt_s: float
    decode_s: float
    prompt_tok_s: float
    decode_tok_s: float


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None | "stop" | "length"
    usage: Usage | None = None
    timings: Timings | None = None


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


def check_budget(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    if n_prompt == 0:
        raise CflowError("the prompt is empty (no tokens)")
    if max_tokens < 1:
        raise CflowError(f"max_tokens must be >= 1, got {max_tokens}")
    if n_prompt + max_tokens > n_ctx:
        raise CflowError(f"prompt of {n_prompt} tokens + max_tokens {max_tokens} = {n_prompt + max_tokens} "
                         f"exceeds the context of {n_ctx} tokens")


def generate_step(engine, state, tok: Tokenizer, prompt_ids: list[int], *, max_tokens: int = 256,
                  stop: list[str] | None = None, cached: int = 0, ignore_eos: bool = False,
                  **sampling) -> Iterator[Chunk]:
    """Yield one Chunk per generated token; the last one has finish_reason, usage and timings.

    cached: tokens of prompt_ids already in `state` (prompt-cache reuse); the rest is prefilled.
    Text that could be the start of a stop string is held back; stop strings are never emitted.
    ignore_eos: the end-of-sequence token does not end the generation (it is sampled like any
    other: fixed-length runs and benchmarks).
    """
    sample = make_sampler(**sampling)
    stops = [s for s in (stop or []) if s]
    t0 = time.perf_counter()
    state.truncate(min(cached, len(prompt_ids) - 1))
    logits = engine.forward(state, prompt_ids[state.pos :])
    t1 = time.perf_counter()
    history = list(prompt_ids)
    dec = StreamDecoder(tok)
    held, out_ids, pending, finish, n_fwd, stopped = "", [], [], "length", 0, False
    for i in range(max_tokens):
        t = sample(logits, history)
        if t in tok.eos_token_ids and not ignore_eos:
            finish = "stop"
            break
        out_ids.append(t)
        history.append(t)
        pending.append(t)
        held += dec.push(t)
        hit = min((held.find(s) for s in stops if s in held), default=-1)
        if hit >= 0:
            held, finish, stopped = held[:hit], "stop", True
            break
        if i + 1 == max_tokens:
            break
        keep = _held_back(held, stops)
        emit, held = held[: len(held) - keep], held[len(held) - keep :]
        yield Chunk(emit, pending)
        pending = []
        logits = engine.forward(state, [t])
        n_fwd += 1
    if not stopped:  # the end: release held-back text and any incomplete character
        held += dec.flush()
        hit = min((held.find(s) for s in stops if s in held), default=-1)
        if hit >= 0:
            held, finish = held[:hit], "stop"
    t2 = time.perf_counter()
    usage = Usage(len(prompt_ids), len(out_ids), len(prompt_ids) + len(out_ids))
    n_new = len(prompt_ids) - min(cached, len(prompt_ids) - 1)
    timings = Timings(t1 - t0, t2 - t1, _rate(n_new, t1 - t0), _rate(n_fwd, t2 - t1))
    yield Chunk(held, pending, finish, usage, timings)
