"""Checkpoint -> .cflow through CflowWriter (atomic: an interrupted write leaves no file).

Fused groups: attn_qkv is written with fuse="stack" ([Wq; Wk; Wv] by rows), ffn_gate_up with
fuse="stripe" (gate and up rows interleaved by output stripe, so one kernel pass over a
stripe yields matching gate and up outputs). Quantized data is passed as GGUF-encoded rows,
so `keep` copies blocks unchanged.
"""

from __future__ import annotations

import os

import numpy as np

from cflow.convert import Checkpoint


def write_cflow(ckpt: Checkpoint, out: str | os.PathLike, *, progress: bool = True) -> None:
    from tqdm import tqdm

    from cflow.format import CflowWriter, decode_order

    names = decode_order(list(ckpt.tensors))
    total = sum(np.asarray(t.data).nbytes for t in ckpt.tensors.values())
    with CflowWriter(out, ckpt.config, tokenizer_json=ckpt.tokenizer_json, chat_template=ckpt.chat_template,
                     special_tokens=ckpt.special_tokens, metadata=ckpt.metadata) as w, \
            tqdm(total=total, desc=f"convert {os.path.basename(os.fspath(out))}"[:40], unit="B", unit_scale=True,
                 disable=not progress, leave=False) as bar:
        for name in names:
            t = ckpt.tensors[name]
            data = np.asarray(t.data)
            if data.dtype == np.uint16:  # bf16 bits -> its byte encoding
                data = data.view(np.uint8).reshape(data.shape[0], -1) if data.ndim == 2 else data.view(np.uint8)
            if t.parts:
                rows = [r for _, r in t.parts]
                pieces = np.split(data, np.cumsum(rows)[:-1])
                fuse = "stripe" if name.endswith("ffn_gate_up") else "stack"
                w.add_fused(name, t.type, [(n, p) for (n, _), p in zip(t.parts, pieces)], fuse, shape=t.shape)
            else:
                w.add_tensor(name, t.type, data, shape=t.shape)
            bar.update(data.nbytes)
