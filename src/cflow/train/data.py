"""Text corpora for training: TinyStories' own formats and JSON lines, with a fixed held-out split.

Sources (read_texts):
- `*.txt`: stories separated by `<|endoftext|>` (TinyStoriesV2-GPT4-train.txt);
- `*.jsonl` / `*.json`: one JSON object per line with a "text" field;
- either compressed (`.xz`, `.gz`);
- `hf:NAME[:SPLIT]`: a Hugging Face hub dataset with a "text" column (roneneldan/TinyStories),
  through the `datasets` package when it is installed and the hub is reachable.
The held-out split is fixed by story index: story i is held out when i % HOLDOUT_EVERY == 0.
"""

from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

import numpy as np

from cflow.errors import CflowError

EOT = "<|endoftext|>"
HOLDOUT_EVERY = 20


def _open_text(path: Path):
    name = path.name
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _stem(name: str) -> str:
    for ext in (".xz", ".gz"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def read_texts(source: str) -> list[str]:
    """All documents of `source`, in file order (see module doc for the formats)."""
    if source.startswith("hf:"):
        return _read_hub(source[3:])
    path = Path(source)
    if not path.is_file():
        raise CflowError(f"data file not found: {source}")
    stem = _stem(path.name)
    try:
        with _open_text(path) as f:
            if stem.endswith((".jsonl", ".json")):
                texts = []
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise CflowError(f"{source}:{n}: not a JSON line ({e.msg})") from None
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        raise CflowError(f'{source}:{n}: expected an object with a "text" string')
                    texts.append(obj["text"])
            else:
                texts = f.read().split(EOT)
    except (UnicodeDecodeError, EOFError, lzma.LZMAError, OSError) as e:
        raise CflowError(f"cannot read {source}: {e}") from None
    texts = [t.strip() for t in texts if t.strip()]
    if not texts:
        raise CflowError(f"{source} holds no text")
    return texts


def _read_hub(spec: str) -> list[str]:
    name, _, split = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise CflowError("hub datasets need the `datasets` package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # network, unknown name: the library raises many kinds
        raise CflowError(f"cannot load hub dataset {name!r}: {e}") from None
    if "text" not in ds.column_names:
        raise CflowError(f"hub dataset {name!r} has no 'text' column")
    texts = [t.strip() for t in ds["text"] if t and t.strip()]
    if not texts:
        raise CflowError(f"hub dataset {name!r} holds no text")
    return texts


def split(texts: list[str]) -> tuple[list[str], list[str]]:
    """(train, test): story i is held out when i % HOLDOUT_EVERY == 0."""
    test = texts[::HOLDOUT_EVERY]
    train = [t for i, t in enumerate(texts) if i % HOLDOUT_EVERY]
    if not train:
        raise CflowError("corpus too small: no training stories after the held-out split")
    return train, test


def encode(tok, texts: list[str]) -> np.ndarray:
    """One token stream: each story followed by the end-of-text token. (N,) int32."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def batch_starts(n_tokens: int, seq_len: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Window starts of the global batch of `step`: a pure function of (seed, step), so a
    resumed or distributed run draws exactly the batches an uninterrupted run draws."""
    if n_tokens <= seq_len + 1:
        raise CflowError(f"training split has {n_tokens} tokens, fewer than seq_len+1={seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=batch)


def windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, each (len(starts), seq_len)."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = stream[idx]
    return w[:, :-1], w[:, 1:]
