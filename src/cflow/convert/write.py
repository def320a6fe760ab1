"""Checkpoint -> .cflow through CflowWriter (atomic: an interrupted write leaves no file).

Experts (blk.{l}.exp.{e}.*) go to the expert section, one contiguous, 4096-aligned range per
(layer, expert) recorded in the expert offset table (docs/FORMAT.md 3.3), with the same layouts as
dense matrices. Fused groups: attn_qkv is written with fuse="stack" ([Wq; Wk; Wv] by rows), ffn_gate_up with
fuse="stripe" (gate and up rows interleaved by output stripe, so one kernel pass over a
stripe yields matching gate and up outputs). Quantized data is passed as GGUF-encoded rows,
so `keep` copies blocks unchanged.

Layout: the matrices of the types with a planes pack (tiles.PLANES_HEADER: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) get interleave 16 and the planes pack (pack="planes", the default), which the fast int8
GEMV streams without shuffles (docs/KERNELS.md); pack="blocks" keeps whole blocks at interleave
1 for every tensor. Other types always take the latter.
"""

from __future__ import annotations

import os
import re

import numpy as np

from cflow.convert import Checkpoint


PACKS = ("planes", "blocks")


def tensor_layout(type_name: str, ndim: int, pack: str = "planes", cols: int | None = None) -> dict:
    """add_tensor's layout options for a tensor of block type `type_name` (of `cols` columns, where
    the layout depends on them: a ternary matrix takes whole rows as its one column tile, which
    saves its GEMV the per-tile work of a 256-weight block per 256-column tile: 1.1x on 1 thread,
    1.2x on 2 over a BitNet-2B layer's GEMVs, docs/KERNELS.md)."""
    from cflow.format.quant import TERNARY
    from cflow.format.tiles import DEFAULT_TILE, PLANES_HEADER, PLANES_MAX_G

    if pack not in PACKS:
        raise ValueError(f"pack must be one of {PACKS}, got {pack!r}")
    if pack == "planes" and ndim == 2 and type_name in PLANES_HEADER:
        return {"interleave": PLANES_MAX_G, "pack": "planes"}
    if type_name in TERNARY and ndim == 2 and cols:
        return {"interleave": 1, "pack": "blocks", "tile": (DEFAULT_TILE[0], int(cols))}
    return {"interleave": 1, "pack": "blocks"}


EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.exp\.(\d+)\.")


def tensor_spec(name: str, t, pack: str = "planes") -> dict:
    """What CflowWriter takes for one Checkpoint tensor: dict(type=, data=, shape=, layout options),
    with fuse= and data [(part, rows)] for a fused one (add_fused; add_expert takes it as it is)."""
    data = np.asarray(t.data)
    if data.dtype == np.uint16:  # bf16 bits -> its byte encoding
        data = data.view(np.uint8).reshape(data.shape[0], -1) if data.ndim == 2 else data.view(np.uint8)
    cols = t.shape[1] if len(t.shape) == 2 else None
    spec = dict(type=t.type, data=data, shape=t.shape, **tensor_layout(str(t.type), len(t.shape), pack, cols))
    if t.parts:
        pieces = np.split(data, np.cumsum([r for _, r in t.parts])[:-1])
        spec.update(data=[(n, p) for (n, _), p in zip(t.parts, pieces)],
                    fuse="stripe" if name.endswith("ffn_gate_up") else "stack")
    return spec


def write_cflow(ckpt: Checkpoint, out: str | os.PathLike, *, progress: bool = True, pack: str = "planes") -> None:
    """Dense tensors in decode order (section "weights"), then the experts, each (layer, expert)'s
    tensors in one range of the expert offset table (section "experts", CflowWriter.add_expert)."""
    from tqdm import tqdm

    from cflow.format import CflowWriter, decode_order

    names = decode_order(list(ckpt.tensors))
    experts: dict[tuple[int, int], list[str]] = {}
    for name in names:
        if m := EXPERT_TENSOR.match(name):
            experts.setdefault((int(m[1]), int(m[2])), []).append(name)
    total = sum(np.asarray(t.data).nbytes for t in ckpt.tensors.values())
    with CflowWriter(out, ckpt.config, tokenizer_json=ckpt.tokenizer_json, chat_template=ckpt.chat_template,
                     special_tokens=ckpt.special_tokens, metadata=ckpt.metadata, generation=ckpt.generation) as w, \
            tqdm(total=total, desc=f"convert {os.path.basename(os.fspath(out))}"[:40], unit="B", unit_scale=True,
                 disable=not progress, leave=False) as bar:
        for name in names:
            if EXPERT_TENSOR.match(name):
                continue
            s = tensor_spec(name, ckpt.tensors[name], pack)
            typ, data = s.pop("type"), s.pop("data")
            if "fuse" in s:
                w.add_fused(name, typ, data, s.pop("fuse"), **s)
            else:
                w.add_tensor(name, typ, data, **s)
            bar.update(np.asarray(ckpt.tensors[name].data).nbytes)
        for (layer, e), group in sorted(experts.items()):
            w.add_expert(layer, e, {n: tensor_spec(n, ckpt.tensors[n], pack) for n in group})
            bar.update(sum(np.asarray(ckpt.tensors[n].data).nbytes for n in group))
