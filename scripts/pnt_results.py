"""Table and loss curves of the PNT experiment: python scripts/pnt_results.py runs/exp [docs/img/pnt_loss.png]
Ternary QAT against full precision: python scripts/pnt_results.py --ternary runs/exp runs/exp-ternary
(the llama-shaped baselines the same way: --ternary runs/dense runs/dense-ternary)

Prints a Markdown table (one row per preset; mean and spread when several seeds ran) built from
each run's final.json and `cflow analyze`'s arithmetic at the trained and at the paper's size;
with --ternary, each preset's held-out perplexity and top-1 in both runs side by side.
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cflow.analysis.bandwidth import analyze  # noqa: E402
from cflow.config import ModelConfig  # noqa: E402
from cflow.models.presets import DENSE_PRESETS, PRESETS, preset  # noqa: E402


def finished(root: Path) -> dict:
    """{preset: [run folders with a final.json]}"""
    runs = {}
    for d in sorted(root.glob("*-s*")):
        if (d / "final.json").exists():
            runs.setdefault(d.name.rsplit("-s", 1)[0], []).append(d)
    return runs


def fmt(v: list[float], p: int) -> str:
    """mean (± sample standard deviation when several runs)"""
    return f"{statistics.mean(v):.{p}f} ± {statistics.stdev(v):.{p}f}" if len(v) > 1 else f"{v[0]:.{p}f}"


def ternary_table(fp_root: Path, t_root: Path) -> None:
    fp, tq = finished(fp_root), finished(t_root)
    print("| arch | seeds | full precision: test ppl | top-1 | ternary QAT: test ppl | top-1 | ppl ratio | top-1 change |")
    print("|---|---|---|---|---|---|---|---|")
    for name in [*PRESETS, *DENSE_PRESETS]:  # the family's presets, then the llama-shaped baselines
        seeds = sorted({d.name for d in fp.get(name, [])} & {d.name for d in tq.get(name, [])})
        if not seeds:
            continue
        a, b = ([json.loads((root / s / "final.json").read_text()) for s in seeds] for root in (fp_root, t_root))
        pa, pb = [r["test_ppl"] for r in a], [r["test_ppl"] for r in b]
        ca, cb = [100 * r["test_acc"] for r in a], [100 * r["test_acc"] for r in b]
        print(f"| {name} | {len(seeds)} | {fmt(pa, 2)} | {fmt(ca, 2)}% | {fmt(pb, 2)} | {fmt(cb, 2)}% | "
              f"{statistics.mean(pb) / statistics.mean(pa):.3f}x | {statistics.mean(cb) - statistics.mean(ca):+.2f} points |")


def main() -> None:
    if sys.argv[1] == "--ternary":
        return ternary_table(Path(sys.argv[2]), Path(sys.argv[3]))
    root = Path(sys.argv[1])
    png = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    runs = finished(root)
    print("| arch | seeds | params | active/token | test ppl | top-1 acc | MB/token total / crit. (trained, Q4) "
          "| MB/token total / crit. (paper size, Q4) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in PRESETS:
        if name not in runs:
            continue
        fin = [json.loads((d / "final.json").read_text()) for d in runs[name]]
        head = json.loads(open(runs[name][0] / "metrics.jsonl").readline())
        cfg = ModelConfig.from_dict(head["config"])
        ppl = [r["test_ppl"] for r in fin]
        acc = [100 * r["test_acc"] for r in fin]
        a_t, a_p = analyze(cfg), analyze(preset(name))
        cell = lambda a: f"{a['total_mb_per_token']:.3f} / {a['critical_path_mb_per_token']['vertical_pipeline']:.3f}"  # noqa: E731
        print(f"| {name} | {len(fin)} | {fin[0]['params'] / 1e6:.2f}M | {fin[0]['active_params'] / 1e6:.2f}M | "
              f"{fmt(ppl, 2)} | {fmt(acc, 2)}% | {cell(a_t)} | {cell(a_p)} |")
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for name in PRESETS:
            for i, d in enumerate(runs.get(name, [])):
                rows = [json.loads(x) for x in open(d / "metrics.jsonl")]
                tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
                va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
                kw = dict(label=name if i == 0 else None, color=f"C{list(PRESETS).index(name)}", lw=1, alpha=0.8)
                ax1.plot(*zip(*tr), **kw)
                ax2.plot(*zip(*va), marker="o", **kw)
        for ax, t in ((ax1, "training loss"), (ax2, "held-out loss")):
            ax.set_xlabel("step")
            ax.set_ylabel("nats/token")
            ax.set_title(t)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
