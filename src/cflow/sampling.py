"""Samplers: small composable functions over a logits vector (as mlx-lm's make_sampler).

make_sampler(...) returns sample(logits, history, answer=()) -> token id (history: the prompt
and the answer so far; answer: the answer's tokens alone). Order: repetition penalty (on the
history's tokens), frequency and presence penalties (on the answer's), then temperature; greedy
when temperature == 0; otherwise top-k, top-p, min-p filters on the probabilities and a draw
from the seeded generator. With top-k on and float32 logits (the engine's), the filters and the
draw run in one native call (`cflow._core.ops.sample_top_k`, the same float64 arithmetic for the
generator's same uniform number; `sample_top_k_penalised` with a repetition penalty,
`sample_top_k_moved` with the others: they move only the logits of the tokens seen); other
inputs take numpy.

No setting gives NaN probabilities: the logits are shifted by their maximum before they are
divided by the temperature, so a temperature as small as 5e-324 gives the limit of the
distribution (all the mass on the most likely token: greedy, a draw among exact ties), and a
repetition penalty as small as 1e-320 gives a huge but finite logit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cflow.errors import CflowError

Sampler = Callable[..., int]  # sample(logits, history, answer=())

# llama.cpp's sampling defaults (common/common.h), for models that give none of their own
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
# a setting a model's defaults leave out is off (temperature 1, as in transformers)
NOT_GIVEN = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
SAMPLING_KEYS = tuple(NOT_GIVEN)


def generation_defaults(source: dict | None) -> tuple[dict, str]:
    """(defaults, where they come from) for a model whose source gave `source` (a .cflow header's
    `generation`: generation_config.json's do_sample, temperature, top_k, top_p, min_p,
    repetition_penalty). Any of those given: "model", the ones left out off, and do_sample false
    means greedy (temperature 0). None given: llama.cpp's defaults, "llama.cpp"."""
    given = {k: v for k, v in (source or {}).items() if k in SAMPLING_KEYS + ("do_sample",)}
    if not given:
        return dict(LLAMA_CPP_DEFAULTS), "llama.cpp"
    out = {k: (int if k == "top_k" else float)(given.get(k, NOT_GIVEN[k])) for k in SAMPLING_KEYS}
    if given.get("do_sample") is False:
        out["temperature"] = 0.0
    return out, "model"


def apply_repetition_penalty(logits: np.ndarray, history: list[int], penalty: float) -> np.ndarray:
    """CTRL-style: logits of seen tokens are divided by penalty when > 0, multiplied when < 0."""
    if penalty == 1.0 or not history:
        return logits
    ids = np.unique(np.asarray(history, dtype=np.int64))
    out = logits.copy()
    v = out[ids]
    with np.errstate(over="ignore"):
        v = np.where(v > 0, v / penalty, v * penalty)
    # finite, and far enough from overflow that the difference of two logits stays finite
    out[ids] = np.clip(v, -_BIG, _BIG)
    return out


_BIG = np.finfo(np.float64).max / 4
_BIG32 = 1e30  # float32 logits moved by penalties stay this far from overflow


def penalty_moves(logits: np.ndarray, history: list[int], answer: list[int], repetition: float,
                  frequency: float, presence: float) -> tuple[np.ndarray, np.ndarray]:
    """(ids, values): the tokens the penalties move and their logits after them (float32 values,
    as float64): the repetition penalty on the history's tokens (apply_repetition_penalty's
    rule), then OpenAI's additive penalties on the answer's: each token the answer holds c times
    loses frequency x c + presence, as vLLM and llama.cpp apply them after the multiplicative one.
    Computed in float64 and rounded once, clipped to +-1e30."""
    if repetition == 1.0:  # the additive ones alone (the usual case): three numpy calls a draw
        ids, counts = np.unique(np.asarray(answer, dtype=np.int32), return_counts=True)
        v = np.asarray(logits)[ids].astype(np.float64) - (frequency * counts + presence)
        return ids, np.clip(v, -_BIG32, _BIG32).astype(np.float32).astype(np.float64)
    seen = np.unique(np.asarray(history, dtype=np.int64))
    held, counts = np.unique(np.asarray(answer, dtype=np.int64), return_counts=True)
    ids = np.union1d(seen, held)
    v = np.asarray(logits)[ids].astype(np.float64)
    if seen.size:
        m = np.isin(ids, seen)
        with np.errstate(over="ignore"):
            v[m] = np.where(v[m] > 0, v[m] / repetition, v[m] * repetition)
    v[np.searchsorted(ids, held)] -= frequency * counts + presence
    return ids.astype(np.int32), np.clip(v, -_BIG32, _BIG32).astype(np.float32).astype(np.float64)


def apply_penalties(logits: np.ndarray, history: list[int], answer: list[int], repetition: float,
                    frequency: float, presence: float) -> np.ndarray:
    """A float32 copy of logits with the penalties of penalty_moves applied."""
    x = np.array(logits, dtype=np.float32)
    ids, values = penalty_moves(logits, history, answer, repetition, frequency, presence)
    x[ids] = values
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of (n, vocab) logits, in float64."""
    z = z.astype(np.float64) - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (the softmax of its raw logits:
    before any penalty, temperature or filter, as OpenAI's and vLLM's logprobs are), and the `n`
    most likely tokens of that step with theirs, most likely first (ties: the lower id)."""

    id: int
    logprob: float
    top: list[tuple[int, float]]


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def check_logprobs(n) -> None:
    """The number of most likely tokens asked for with each token's logprob: 0..MAX_TOP_LOGPROBS."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise CflowError(f"top logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {n!r}")


def token_logprob(logits: np.ndarray, chosen: int, n: int = 0) -> TokenLogprob:
    """The TokenLogprob of `chosen` at a step of 1-D logits, with the n (check_logprobs) most
    likely tokens. The log of the normaliser is summed in float64 (a 152k vocabulary)."""
    check_logprobs(n)
    x = np.asarray(logits)
    m = float(x.max())
    if not math.isfinite(m) or not np.isfinite(x[chosen]):
        raise CflowError("logprobs of logits that are not finite")
    lse = m + math.log(float(np.exp(x - np.float32(m), dtype=np.float32).sum(dtype=np.float64)))
    top: list[tuple[int, float]] = []
    n = min(n, x.size)
    if n:
        ids = _top_k_ids(x, n) if x.dtype == np.float32 else np.argpartition(x, x.size - n)[x.size - n:]
        ids = sorted((int(i) for i in ids), key=lambda i: (-float(x[i]), i))[:n]
        top = [(i, float(x[i]) - lse) for i in ids]
    return TokenLogprob(int(chosen), float(x[chosen]) - lse, top)


def top_k_filter(p: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= p.size:
        return p
    kth = np.partition(p, -k)[-k]
    return np.where(p >= kth, p, 0.0)


def top_p_filter(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    if top_p >= 1.0:
        return p
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    keep = order[: int(np.searchsorted(cum, top_p * cum[-1])) + 1]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out


def min_p_filter(p: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens less likely than min_p times the most likely one."""
    if min_p <= 0.0:
        return p
    return np.where(p >= min_p * p.max(), p, 0.0)


def pick(p: np.ndarray, u: float) -> int:
    """The index drawn from the (unnormalised) probabilities p by the uniform number u in [0, 1)
    (the generator's random()): the draw of rng.choice(p.size, p=p/sum) for the same generator
    state, without choice's checks of p (they cost as much as the draw, and the server samples
    every sequence of a step in turn)."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return int(cdf.searchsorted(u, side="right"))


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, seed: int | None = None, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0) -> Sampler:
    """A sampler with these settings (checked here, so bad values fail before generation)."""
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                    ("repetition_penalty", repetition_penalty), ("frequency_penalty", frequency_penalty),
                    ("presence_penalty", presence_penalty)):
        if not math.isfinite(v):
            raise CflowError(f"{name} must be a finite number, got {v}")
    if temperature < 0:
        raise CflowError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise CflowError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise CflowError(f"min_p must be in [0, 1], got {min_p}")
    if top_k < 0:
        raise CflowError(f"top_k must be >= 0, got {top_k}")
    if repetition_penalty <= 0:
        raise CflowError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 1 << 64):
        raise CflowError(f"seed must be an integer in 0..2^64-1, got {seed}")
    rng = np.random.default_rng(seed)
    counted = frequency_penalty != 0.0 or presence_penalty != 0.0

    def sample(logits: np.ndarray, history: list[int], answer=()) -> int:
        moves = counted and len(answer) > 0
        if temperature == 0.0 and repetition_penalty == 1.0 and not moves:
            return int(np.argmax(logits))  # the argmax of the float64 copy, without the copy
        x = np.asarray(logits)
        u = rng.random() if temperature > 0.0 else 0.0  # one draw a token, none when greedy
        rp = repetition_penalty
        if moves:  # all the penalties: the moved tokens' values, in the native draw or on a copy
            ids, values = penalty_moves(x, history, answer, rp, frequency_penalty, presence_penalty)
            k = 1 if temperature == 0.0 else top_k
            if 0 < k < x.size and _native_vector(x):
                t = _native().sample_top_k_moved(x, k, ids, values, temperature, top_p, min_p, u)
                if t is not None:
                    return t
            x = np.array(x, dtype=np.float32)
            x[ids] = values
            rp = 1.0
        if rp != 1.0:
            t = _penalised_draw(x, history, rp, 1 if temperature == 0.0 else top_k, temperature, top_p, min_p, u)
            if t is not None:
                return t
            x = apply_repetition_penalty(x.astype(np.float64), history, rp)
        if temperature == 0.0:
            return int(np.argmax(x))
        if 0 < top_k < x.size and _native_vector(x):
            # the steps below in one native call (ops.h sample_top_k): the same arithmetic in
            # float64, 4x faster than the dozen numpy calls over a few dozen candidates
            t = _native().sample_top_k(x, top_k, temperature, top_p, min_p, u)
            if t is not None:  # None: values that are not finite
                return t
        ids, p = _top_k_top_p(x, temperature, top_k, top_p)
        return int(ids[pick(min_p_filter(p, min_p), u)])

    return sample


@functools.cache
def _native():
    """cflow._core.ops, imported at the first draw (not with this module: `cflow convert` and the
    other paths that never sample run without the native core), then kept: the server draws
    every sequence of every step."""
    from cflow._native import core

    return core.ops


# A top-p set is searched among this many most likely tokens first (the whole vocabulary only
# when they hold less than top_p of the mass).
TOP_P_SHORTLIST = 256


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids top_k_filter keeps (the k largest of x and any ties of the k-th), in id order,
    without a selection over the whole vocabulary (argpartition of Qwen's 152k logits: 0.9 ms, a
    tenth of a server step). Cut x into k runs: each run's maximum is some value of x, so at least
    k values reach the smallest of those maxima, and the k largest are among them; one comparison
    over the vocabulary finds them, a selection among them the k-th. (A fixed margin below the
    maximum found a handful of Qwen's logits at 8 and nearly all of them at 32.)"""
    if x.dtype == np.float32 and x.ndim == 1 and x.flags.c_contiguous:
        ids = _native().top_k_ids(x, k)  # the same set, the same order, 5x faster
        if ids is not None:  # None: values that are not finite (penalised logits can be), below
            return ids
    n = x.size // k * k
    bound = x[:n].reshape(k, -1).max(axis=1).min()
    near = np.flatnonzero(x >= bound)
    if near.size < k:  # NaN logits: no bound holds
        near = np.arange(x.size)
    kth = np.partition(x[near], near.size - k)[near.size - k]
    return near[x[near] >= kth]


def _native_vector(x: np.ndarray) -> bool:
    """Whether x is what the native sampler reads: a contiguous float32 vector (the engine's logits)."""
    return x.dtype == np.float32 and x.ndim == 1 and x.flags.c_contiguous


def _penalised_draw(x: np.ndarray, history: list[int], penalty: float, k: int, temperature: float, top_p: float,
                    min_p: float, u: float) -> int | None:
    """The token of a draw (greedy at temperature 0, then k = 1) from x with the repetition penalty
    on the history's tokens, as penalising the whole vocabulary and filtering give, in one native
    call (ops.h penalised_top_k: only the history's tokens move, so the answer lies among them and
    the k largest of the other tokens): 27 us a draw on Qwen2.5's 151936 logits with 60 history
    tokens, where penalising a float64 copy of the vocabulary and selecting in numpy took 1.2 ms,
    and a server step samples every sequence in turn. None where the native call does not apply
    (top-k off, logits that are not a float32 vector or not finite, history ids out of range, or
    k plus the history's distinct tokens reaching the vocabulary); the caller then penalises the
    whole vocabulary."""
    if not (0 < k < x.size and _native_vector(x)):
        return None
    ids = np.asarray(history, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= x.size):  # as the whole path would: IndexError there
        return None
    return _native().sample_top_k_penalised(x, k, ids.astype(np.int32), penalty, temperature, top_p, min_p, u)


def _top_k_top_p(x: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(ids, p): the tokens softmax(x / temperature) keeps through top_k_filter then top_p_filter,
    in id order, and their (unnormalised) probabilities: what those filters give over the whole
    vocabulary, found without sorting it. A step of the server samples every sequence in turn,
    and sorting a 50k-token vocabulary per token cost more than the engine's batched step."""
    v = x.size
    if 0 < top_k < v:  # the k largest, then top-p among them (relative to their mass, as the filters)
        ids = _top_k_ids(x, top_k)
        z = x[ids].astype(np.float64)
        z -= z.max()  # before the division: x / a tiny temperature would overflow, and inf - inf is NaN
        with np.errstate(over="ignore"):
            z /= temperature
        np.exp(z, out=z)
        p = top_p_filter(z / z.sum(), top_p)
        keep = np.flatnonzero(p)
        return ids[keep], p[keep]
    z = np.subtract(x, x.max(), dtype=np.float64)  # softmax in place: one vocabulary-sized array
    with np.errstate(over="ignore"):
        z /= temperature  # after the shift, as above: the maximum stays 0, the rest <= 0 or -inf
    np.exp(z, out=z)
    z /= z.sum()
    if top_p < 1.0 and v > TOP_P_SHORTLIST:
        ids = _top_k_ids(z, TOP_P_SHORTLIST)  # the shortlist, ties of its last value too, in id order
        order = np.argsort(-z[ids], kind="stable")
        cum = np.cumsum(z[ids][order])
        if cum[-1] >= top_p:  # the top-p set ends inside: the same cut as top_p_filter's
            keep = np.sort(ids[order[: int(np.searchsorted(cum, top_p)) + 1]])
            return keep, z[keep]
    p = top_p_filter(z, top_p)
    keep = np.flatnonzero(p)
    return keep, p[keep]
