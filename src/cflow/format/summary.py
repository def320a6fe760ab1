"""Text summaries of a .cflow file for `cflow verify` and `cflow inspect`."""

from __future__ import annotations

import dataclasses
from collections import Counter

from cflow.config import ModelConfig
from cflow.format.reader import CflowFile


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def summary_lines(f: CflowFile) -> list[str]:
    c = f.config
    base = {fl.name for fl in dataclasses.fields(ModelConfig)}
    family = "".join(f" {fl.name}={getattr(c, fl.name)}" for fl in dataclasses.fields(c) if fl.name not in base)
    lines = [
        f"file      {f.path}  ({f.size} bytes, .cflow version {f.preamble.version})",
        f"config    arch={c.arch} n_layer={c.n_layer} d_model={c.d_model} n_head={c.n_head}/{c.n_kv_head} "
        f"d_ff={c.d_ff} vocab={c.vocab_size} n_expert={c.n_expert}{family}",
        f"tokenizer {'yes (%d bytes)' % len(f.tokenizer_json) if f.tokenizer_json else 'none'}; "
        f"chat template {'yes' if f.chat_template else 'none'}",
    ]
    if f.generation:
        lines.append("generation " + ", ".join(f"{k}={v}" for k, v in f.generation.items()))
    for s in f.sections.values():
        n = sum(1 for t in f.tensors.values() if t.section == s.name)
        lines.append(f"section   {s.name}: offset {s.offset}, {_mb(s.length)}, {n} tensors, crc32 {s.crc32:08x}")
    by_type: Counter = Counter()
    nbytes: Counter = Counter()
    for t in f.tensors.values():
        by_type[t.type.name] += 1
        nbytes[t.type.name] += t.nbytes
    lines.append("tensors   " + ", ".join(f"{k}: {by_type[k]} ({_mb(nbytes[k])})" for k in sorted(by_type))
                 + f"; {len(f.tensors)} in all")
    if f.experts:
        layers = sorted({k[0] for k in f.experts})
        lines.append(f"experts   {len(f.experts)} over {len(layers)} layers, {_mb(sum(e.length for e in f.experts.values()))}")
    if f.stages:
        lines.append(f"layout    stage-major: {len(f.stages)} stages (delta_d {getattr(f.config, 'delta_d', 0)}), "
                     "one section each (docs/FORMAT.md 3.5)")
    return lines


def tensor_table(f: CflowFile) -> list[str]:
    out = [f"{'name':32s} {'type':5s} {'shape':>14s} {'tile':>9s} {'G':>3s} {'pack':6s} {'section':10s} {'offset':>12s} {'nbytes':>11s}"]
    for t in f.tensors.values():
        shape = "x".join(map(str, t.shape))
        line = (f"{t.name:32s} {t.type.name:5s} {shape:>14s} {t.tile[0]:>4d}x{t.tile[1]:<4d} {t.interleave:>3d} {t.pack:6s} "
                f"{t.section:10s} {t.offset:>12d} {t.nbytes:>11d}")
        if t.parts:
            line += f"  {t.fuse}" + (f"/{t.stripe_rows}" if t.fuse == "stripe" else "") + ": " + \
                ", ".join(f"{p.name}({p.rows})" for p in t.parts)
        out.append(line)
    return out
