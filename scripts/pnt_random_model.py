"""A pipeline-native model with random weights, exported for speed measurements.

    python scripts/pnt_random_model.py arch2_4_combined runs/bench/arch2_4_combined.cflow \
        [--type q4_0] [--d-model 512 --n-layer 6 ...]   (default: the paper's geometry)

Decode speed does not depend on the weights' values, so a random model of a preset at a real
geometry measures the schedules (`cflow bench decode -m FILE --schedule sequential|pipeline`)
on weights far beyond the cache. The tokenizer is a small BPE (bench decode feeds token ids).
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from cflow.commands.analyze import GEOMETRY  # noqa: E402
from cflow.models.export import export_checkpoint  # noqa: E402
from cflow.models.pnt import PNT  # noqa: E402
from cflow.models.presets import preset  # noqa: E402
from cflow.train import checkpoint, tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--type", default="q4_0", help="matrices' block type (embedding and head: q8_0)")
    for name in GEOMETRY:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    cfg = preset(a.preset, **{k: getattr(a, k) for k in GEOMETRY}, max_seq_len=2048)
    tok = tokenizer.train_bpe(["once upon a time there was a little cat who lived in a big house"] * 20, 512)
    m = PNT(cfg)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        ck = f"{d}/ckpt.pt"
        checkpoint.save(ck, model_state=m.state_dict(), optim_state=None, step=0, cfg=cfg, tokenizer_json=tok.to_str(),
                        train_args={})
        n = export_checkpoint(ck, a.out, wtype=a.type, etype="q8_0")
    print(f"wrote {a.out}: {n} tensors, {m.n_params() / 1e6:.1f}M parameters ({m.n_params(active=True) / 1e6:.1f}M active)")


if __name__ == "__main__":
    main()
