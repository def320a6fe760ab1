"""A pipeline-native model with random weights, exported for speed measurements.

    python scripts/pnt_random_model.py arch2_4_combined runs/bench/arch2_4_combined.cflow \
        [--type q4_0] [--d-model 512 --n-layer 6 ...]   (default: the paper's geometry)

Decode speed does not depend on the weights' values, so a random model of a preset at a real
geometry measures the schedules (`cflow bench decode -m FILE --schedule sequential|pipeline`)
on weights far beyond the cache. The tokenizer is a small BPE (bench decode feeds token ids).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from cflow.commands.analyze import GEOMETRY  # noqa: E402
from cflow.models.export import random_pnt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--type", default="q4_0", help="matrices' block type (embedding and head: q8_0)")
    for name in GEOMETRY:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    print(random_pnt(a.preset, a.out, a.type, a.seed, **{k: getattr(a, k) for k in GEOMETRY}))


if __name__ == "__main__":
    main()
