"""Training checkpoints: model and optimizer state, step, config and tokenizer in one file.

Written atomically (temp file + rename) by rank 0; everything needed to resume exactly (the
data order is a function of (seed, step), see data.batch_starts) or to evaluate and export.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cflow.config import ModelConfig
from cflow.errors import CflowError


def save(path: str | Path, *, model_state: dict, optim_state: dict | None, step: int, cfg: ModelConfig,
         tokenizer_json: str, train_args: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    torch.save({"format": "cflow-train-ckpt", "version": 1, "step": step, "config": cfg.to_dict(),
                "model": model_state, "optim": optim_state, "tokenizer": tokenizer_json,
                "train_args": train_args}, tmp)
    os.replace(tmp, path)


def load(path: str | Path) -> dict:
    """The checkpoint dict; a clear CflowError for a missing or foreign file."""
    path = Path(path)
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise CflowError(f"checkpoint not found: {path}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors of many kinds
        raise CflowError(f"cannot read checkpoint {path}: {e}") from None
    if not isinstance(ck, dict) or ck.get("format") != "cflow-train-ckpt":
        raise CflowError(f"{path} is not a cflow training checkpoint")
    ck["config"] = ModelConfig.from_dict(ck["config"])
    return ck
