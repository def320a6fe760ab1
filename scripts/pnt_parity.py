"""Native engine against the torch model, for the trained presets of the PNT experiment.

    python scripts/pnt_parity.py runs/exp [--data DATA] [--positions 2048] [--threads 2]

For each run folder runs/exp/<preset>-s<seed> with a ckpt.pt: exports the checkpoint with fp32
weights and with 4-bit matrices (--q4 q4_0 and/or q4_1; Q8_0 embedding and head, as `cflow
export --type q4_0` writes them; by GPTQ against the activations measured on the first
--calibrate tokens of the training split, as `cflow export --calibrate` does, or each block
fitted on its own with --calibrate 0), then feeds the same held-out tokens (the start of the held-out
split, `--positions` of them in windows of the model's max_seq_len; in each window the first half
is one prefill, the rest one decode step at a time) to
- the torch model (cflow.models.pnt, fp32): the reference;
- the native engine on the fp32 file, fp32 activations, both schedules: relative error of the
  logits and the share of positions with the same argmax;
- the native engine on the 4-bit files, default (two-level int8) activations: top-1 agreement
  with the fp32 reference and relative error.
Prints a Markdown table (docs/RESULTS.md, "Native engine").
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from cflow.engine import Engine  # noqa: E402
from cflow.models.calibrate import windows_of  # noqa: E402
from cflow.models.export import export_checkpoint  # noqa: E402
from cflow.models.pnt import PNT  # noqa: E402
from cflow.train import checkpoint, data, tokenizer  # noqa: E402


def logits_of(eng: Engine, ids: list[int], split: int) -> np.ndarray:
    st = eng.new_state()
    pre = eng.forward(st, ids[:split], all_logits=True)
    return np.concatenate([pre, np.stack([eng.forward(st, [t]) for t in ids[split:]])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--data", default="/work/shared/data/stories.jsonl.xz")
    # 2048 by default: a top-1 share near 98% over 256 positions has a standard error of about
    # 0.9 points (5 misses against 7 is chance), over 2048 about 0.3
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--q4", nargs="+", default=["q4_0", "q4_1"], help="4-bit block types of the matrices")
    ap.add_argument("--calibrate", type=int, default=8192, help="calibration tokens from the training split (0: none)")
    a = ap.parse_args()
    root = Path(a.root)
    train, test = data.split(data.read_texts(a.data))
    tok = tokenizer.load(str(root / "tokenizer.json"))
    print("| arch | positions | fp32 file: rel. error, sequential / pipeline | same argmax | "
          + " | ".join(f"{q}: top-1 vs fp32 | {q}: rel. error" for q in a.q4) + " |")
    print("|---|---|---|---|" + "---|---|" * len(a.q4))
    for run in sorted(root.glob("*-s*")):
        if not (run / "ckpt.pt").exists():
            continue
        ck = checkpoint.load(run / "ckpt.pt")
        cfg = ck["config"]
        ids = []
        for t in test:
            ids += tok.encode(t).ids
            if len(ids) >= a.positions:
                break
        w = cfg.max_seq_len
        windows = [ids[i:i + w] for i in range(0, min(a.positions, len(ids)), w)]
        m = PNT(cfg, ternary=bool(ck["train_args"].get("ternary"))).eval()
        m.load_state_dict(ck["model"])
        with torch.no_grad():
            ref = np.concatenate([m(torch.tensor([x]))[0][0].float().numpy() for x in windows])
        cells = []
        with tempfile.TemporaryDirectory() as d:
            f32 = f"{d}/f32.cflow"
            export_checkpoint(ck, f32, wtype="f32", etype="f32")
            rel, same = [], []
            for sched in ("sequential", "pipeline"):
                eng = Engine(f32, threads=a.threads, fast=False, schedule=sched)
                got = np.concatenate([logits_of(eng, x, len(x) // 2) for x in windows])
                rel.append(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                same.append((got.argmax(-1) == ref.argmax(-1)).mean())
            for q in a.q4:
                path = f"{d}/{q}.cflow"
                cal = windows_of(ck["tokenizer"], train, a.calibrate, w) if a.calibrate else None
                export_checkpoint(ck, path, wtype=q, etype="q8_0", calibration=cal)
                eng = Engine(path, threads=a.threads)
                got = np.concatenate([logits_of(eng, x, len(x) // 2) for x in windows])
                cells.append(f"{100 * (got.argmax(-1) == ref.argmax(-1)).mean():.1f}% | "
                             f"{np.linalg.norm(got - ref) / np.linalg.norm(ref):.1e}")
        print(f"| {run.name} | {len(ref)} | {rel[0]:.1e} / {rel[1]:.1e} | {100 * min(same):.1f}% | "
              + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
