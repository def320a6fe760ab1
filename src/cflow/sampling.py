"""Samplers: small composable functions over a logits vector (as mlx-lm's make_sampler).

make_sampler(...) returns sample(logits, history) -> token id. Order: repetition penalty,
then temperature; greedy when temperature == 0; otherwise top-k, top-p, min-p filters on the
probabilities and a draw from the seeded generator.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from cflow.errors import CflowError

Sampler = Callable[[np.ndarray, list[int]], int]

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
    out[ids] = np.where(v > 0, v / penalty, v * penalty)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


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


def draw(rng: np.random.Generator, p: np.ndarray) -> int:
    """A token drawn from the (unnormalised) probabilities p: the draw of rng.choice(p.size, p=p/sum),
    the same for the same generator state, without choice's checks of p (they cost as much as the
    draw, and the server samples every sequence of a step in turn)."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, seed: int | None = None) -> Sampler:
    """A sampler with these settings (checked here, so bad values fail before generation)."""
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
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray, history: list[int]) -> int:
        if temperature == 0.0 and repetition_penalty == 1.0:
            return int(np.argmax(logits))  # the argmax of the float64 copy, without the copy
        x = apply_repetition_penalty(np.asarray(logits, dtype=np.float64), history, repetition_penalty)
        if temperature == 0.0:
            return int(np.argmax(x))
        # softmax(x / temperature) computed in place: the same numbers, one array instead of four
        # (a vocabulary-sized temporary costs page faults on every token)
        p = np.divide(x, temperature)
        p -= p.max()
        np.exp(p, out=p)
        p /= p.sum()
        p = min_p_filter(top_p_filter(top_k_filter(p, top_k), top_p), min_p)
        return draw(rng, p)

    return sample
