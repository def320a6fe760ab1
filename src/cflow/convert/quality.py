"""What a lossy conversion cost, measured: the converted model against its source, teacher-forced
on one fixed text (SAMPLE), both in the native engine with fp32 activations.

    compare(src, out) -> {"tokens": n, "top1": fraction of positions whose greedy next token
                          agrees, "ppl_source": perplexity of the text under the source,
                          "ppl_converted": the same under the converted model}

`cflow convert --quant tq1_0|tq2_0` prints it (a model that was not trained ternary loses most of
what it knew; a ternary-trained one next to nothing), together with the weights' relative RMS
change (the checkpoint metadata's ternarize_weight_error).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

SAMPLE = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. From the top he could see "
          "the whole bay: the fishing boats coming home, the gulls circling over the harbour, and the long line of "
          "hills turning blue as the sun went down. One night a storm rolled in from the sea. The wind howled around "
          "the tower and the waves crashed against the rocks below, but the light kept burning, and every ship that "
          "night found its way safely to the shore.")


def _logits(path, ids: list[int], cache) -> np.ndarray:
    from cflow.llm import LLM

    eng = LLM(str(path), fast=False, quiet=True, cache=cache).engine
    return eng.forward(eng.new_state(), ids, all_logits=True)


def _ppl(logits: np.ndarray, ids: list[int]) -> float:
    from cflow.sampling import log_softmax

    logp = log_softmax(logits[:-1])
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def compare(src, out, max_tokens: int = 256) -> dict:
    """The converted model `out` (.cflow) against its source `src` (anything `cflow convert` reads)."""
    from cflow.llm import LLM

    with tempfile.TemporaryDirectory(prefix="cflow-quality-", dir=os.path.dirname(os.path.abspath(out))) as cache:
        tok = LLM(str(out), quiet=True, cache=cache).tokenizer
        ids = tok.encode(SAMPLE, add_special_tokens=True)[:max_tokens]
        a, b = _logits(src, ids, cache), _logits(out, ids, cache)
    return {"tokens": len(ids), "top1": float(np.mean(a.argmax(1) == b.argmax(1))),
            "ppl_source": _ppl(a, ids), "ppl_converted": _ppl(b, ids)}
