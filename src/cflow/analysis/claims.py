"""`cflow claims`: the paper's eight claims (../docs/CLAIMS.md), re-measured on this machine.

Each claim is one function that measures, decides and describes: it returns a Claim with the
verdict (proven, refuted or inconclusive, or "not measured" with the reason), the numbers as a
table, a paragraph that reads them, and the command that reruns it. `run_claims` makes the models
it needs in a work folder (random weights at the paper's geometry: decode speed does not depend on
the values), runs the claims asked for and writes docs/CLAIMS.md with its plots; every number in
the page comes from that run.

The models: arch2_4_combined (dense delay 1, expert delay 2) and arch1 (no delays) at the paper's
geometry (d 512, 6 layers, dense 2048, 8 experts of 512, top-2, vocabulary 50,257 untied), Q4_0
matrices and a Q8_0 head: 46.9 MB a token (CLAIMS.md gives the ratio to this machine's L3). Claims 6 and 7 also run on the
disk tier when --disk-model gives a mixture-of-experts .cflow larger than --memory-limit (the
48-layer Qwen3-30B-A3B-geometry model of `cflow bench moe-model`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cflow.errors import CflowError

PROVEN, REFUTED, INCONCLUSIVE, NOT_MEASURED = "proven", "refuted", "inconclusive", "not measured"
TITLES = {
    1: "Conditional expert loading",
    2: "Tile-streaming cache locality",
    3: "Native kernels against the reference",
    4: "Fused projections",
    5: "Compute-order file layout",
    6: "Explicit software prefetch",
    7: "Delay-aware schedule: the critical path",
    8: "Stage-major (.vflow) readahead",
}
PAPER = {
    1: "proven by construction: after the router fires only the top-k experts' tiles are read; 16x fewer bytes "
       "than loading all experts at 128 experts / top-8",
    2: "7.29x fewer L1-d read misses than a row-major baseline (dense-down projection, d = 8192, PMU counters)",
    3: "AVX2 Q4 kernels validated against the scalar reference; parity with PyTorch within 0.006%",
    4: "Q, K, V (and gate, up) interleaved by output stripe: one pass over the activation serves all of them",
    5: "by construction: tiles stored in the order the decode step consumes them",
    6: "refuted: explicit PREFETCHT0 about 4% slower at 4.7 GB with direct I/O (the hardware prefetcher already "
       "saturates linear reads)",
    7: "2.00x less critical-path bandwidth (9.00 -> 4.50 MB/token), realised in wall clock only through the disk "
       "tier (up to 1.68x)",
    8: "inconclusive: needs asynchronous streaming of stage l while l - 1 computes",
}


@dataclasses.dataclass
class Claim:
    number: int
    verdict: str
    rows: list  # [(quantity, value), ...]
    text: str
    command: str
    plot: str | None = None


@dataclasses.dataclass
class Context:
    work: Path
    img: Path  # where plots go (docs/img)
    threads: int
    models: dict  # name -> .cflow path
    disk_model: str | None
    memory_limit: int
    log: object


# ------------------------------------------------------------------ helpers
def make_models(work: Path, log) -> dict:
    """The two pipeline-native models at the paper's geometry (made once, kept in `work`), the
    stage-major copy of the delayed one and a copy of it in reversed file order."""
    from cflow.format import CflowFile

    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in ("arch2_4_combined", "arch1"):
        path = work / f"{name}-q4_0.cflow"
        if not path.exists():
            log(f"  making {path.name} (random weights, the paper's geometry)")
            from cflow.models.export import random_pnt

            random_pnt(name, str(path), "q4_0")
        out[name] = str(path)
    vflow = work / "arch2_4_combined-q4_0.vflow"
    if not vflow.exists():
        from cflow.format.vflow import write_vflow

        with CflowFile(out["arch2_4_combined"]) as f:
            write_vflow(f, vflow)
    out["vflow"] = str(vflow)
    rev = work / "arch2_4_combined-q4_0-reversed.cflow"
    if not rev.exists():
        write_reordered(out["arch2_4_combined"], rev)
    out["reversed"] = str(rev)
    return out


def write_reordered(src_path, out) -> None:
    """A copy of a .cflow with its tensors in reverse decode order (the last layer first): the
    same bytes, the file order unlike the compute order."""
    from cflow.format import CflowFile, CflowWriter
    from cflow.format.vflow import copy_tensors

    with CflowFile(src_path) as src, CflowWriter(out, src.config, tokenizer_json=src.tokenizer_json,
                                                 chat_template=src.chat_template, special_tokens=src.special_tokens,
                                                 metadata=src.metadata, generation=src.generation) as w:
        copy_tensors(src, w, list(reversed(list(src.tensors))), "weights")


def drop_caches() -> bool:
    from cflow.bench.disk_tier import drop_caches as drop

    return drop()


def prompt(vocab: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(5).integers(100, min(vocab, 30000), size=n)]


def decode_tok_s(eng, tokens: int = 128) -> float:
    st = eng.new_state()
    out = eng.forward(st, prompt(eng.vocab, 16))
    t = time.perf_counter()
    for _ in range(tokens):
        out = eng.forward(st, [int(out.argmax())])
    return tokens / (time.perf_counter() - t)


def alternate(fns: dict, rounds: int) -> dict:
    """{name: [result per round]}: the functions run in turn, round after round (a drift of the
    host spreads over all of them)."""
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            res[k].append(f())
    return res


def med(xs) -> float:
    return float(statistics.median(xs))


def span(xs, fmt="{:.1f}") -> str:
    return f"{fmt.format(med(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def bar_plot(path: Path, groups: dict, ylabel: str, title: str) -> str:
    """A grouped bar chart: {group: {series: value}}; returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    w = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs = [j + i * w for j in range(len(groups))]
        ax.bar(xs, [g.get(s, 0) for g in groups.values()], w, label=s)
    ax.set_xticks([j + w * (len(series) - 1) / 2 for j in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path.name


def engine(path, ctx: Context, **kw):
    from cflow.engine import ACTIVATIONS, Engine

    return Engine(path, threads=ctx.threads, n_ctx=512, **{**ACTIVATIONS["int8"], **kw})


CMD = "cflow claims --only {n}"


# ------------------------------------------------------------------ the claims
def claim1(ctx: Context) -> Claim:
    """Bytes per token by the engine's counters, top-k against every expert; logits the same."""
    path = ctx.models["arch2_4_combined"]
    top, every = engine(path, ctx), engine(path, ctx, all_experts=True)
    cfg = top.config

    def per_token(eng):
        st = eng.new_state()
        eng.forward(st, prompt(eng.vocab, 16))
        b0, outs = eng.byte_counts()["bytes"], []
        for t in prompt(eng.vocab, 16):
            outs.append(eng.forward(st, [t]))
        b1 = eng.byte_counts()["bytes"]
        return {k: (b1[k] - b0[k]) / 16 for k in b1}, np.stack(outs)

    (bt, lt), (ba, la) = per_token(top), per_token(every)
    speed = alternate({"top": lambda: decode_tok_s(top), "all": lambda: decode_tok_s(every)}, 5)
    ratio = ba["experts"] / bt["experts"]
    want = cfg.n_expert / cfg.top_k
    same = bool(np.array_equal(lt, la))
    rows = [("experts", f"{cfg.n_expert}, top-{cfg.top_k}"),
            ("expert bytes / token, top-k", f"{bt['experts'] / 1e6:.2f} MB"),
            ("expert bytes / token, all experts", f"{ba['experts'] / 1e6:.2f} MB"),
            ("ratio (n_expert / top_k expected)", f"{ratio:.3f} ({want:.3f})"),
            ("all weight bytes / token, top-k / all", f"{sum(bt.values()) / 1e6:.1f} / {sum(ba.values()) / 1e6:.1f} MB"),
            ("decode tok/s, top-k", span(speed["top"])), ("decode tok/s, all experts", span(speed["all"])),
            ("logits identical", str(same))]
    ok = abs(ratio - want) / want < 0.01 and same
    plot = bar_plot(ctx.img / "claims-1.png", {
        k: {"top-k": bt[k] / 1e6, "all experts": ba[k] / 1e6} for k in ("attention", "dense", "experts", "head")},
        "MB per token", "Claim 1: weight bytes per token by stream (arch2_4_combined)")
    return Claim(1, PROVEN if ok else REFUTED, rows,
                 f"Reading only the routed experts moves {ratio:.2f}x fewer expert bytes (exactly n_expert / top_k) "
                 f"with identical logits, and decodes {med(speed['top']) / med(speed['all']):.2f}x faster here. At the "
                 "paper's 128 experts / top-8 the same counters give 16.0x (docs/MOE.md, `--all-experts`).",
                 CMD.format(n=1), plot)


CACHEGRIND_SNIPPET = """
import sys, numpy as np
from cflow import kernels as K
w = np.load(sys.argv[1], mmap_mode="r"); x = np.load(sys.argv[2])
rows, cols, tc, reps = (int(a) for a in sys.argv[3:7])
for _ in range(reps):
    K.gemv("q4_0", w, x, rows, cols, tile=(128, tc), act="q8", threads=1)
"""


def _cachegrind(w_path, x_path, rows, cols, tc, reps, work) -> dict:
    out = work / f"cg.{tc}.{reps}.out"
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--cachegrind-out-file={out}", sys.executable, "-c",
           CACHEGRIND_SNIPPET, str(w_path), str(x_path), str(rows), str(cols), str(tc), str(reps)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise CflowError(f"cachegrind failed: {p.stderr.strip().splitlines()[-1:]}")
    events = summary = None
    for line in out.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        if line.startswith("summary:"):
            summary = [int(v) for v in line.split()[1:]]
    out.unlink()
    return dict(zip(events, summary))


def claim2(ctx: Context) -> Claim:
    """D1 read misses of one Q4_0 GEMV, 128 x 256 tiles against whole rows, by cachegrind."""
    import shutil

    rows, cols = 8192, 32768  # dense-down at d = 8192: 8192 outputs of a 4 d = 32768 hidden
    if not shutil.which("valgrind"):
        return Claim(2, NOT_MEASURED, [], "valgrind is not installed (the machine has no hardware counters).",
                     CMD.format(n=2))
    w_path, x_path = ctx.work / "claim2-w.npy", ctx.work / "claim2-x.npy"
    nbytes = rows * cols // 32 * 18
    if not w_path.exists():
        rng = np.random.default_rng(2)
        w = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        w.reshape(-1, 18)[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        np.save(w_path, w)
        np.save(x_path, rng.standard_normal(cols).astype(np.float32))
    res = {}
    for name, tc in (("tiled 128 x 256", 256), ("row-major (whole rows)", cols)):
        one, two = (_cachegrind(w_path, x_path, rows, cols, tc, r, ctx.work) for r in (1, 2))
        res[name] = {k: two[k] - one[k] for k in ("Dr", "D1mr", "DLmr")}  # one GEMV: the second call's counts
    t, r = res["tiled 128 x 256"], res["row-major (whole rows)"]
    factor = r["D1mr"] / max(1, t["D1mr"])
    rows_ = [("matrix", f"Q4_0 {rows} x {cols} ({nbytes / 1e6:.0f} MB), one thread, int8 (q8_0) activations")]
    for name, v in res.items():
        rows_.append((f"{name}: D1 read misses", f"{v['D1mr']:,} of {v['Dr']:,} reads"))
        rows_.append((f"{name}: last-level read misses", f"{v['DLmr']:,}"))
    rows_.append(("row-major / tiled D1 read misses", f"{factor:.2f}x"))
    plot = bar_plot(ctx.img / "claims-2.png", {k: {"D1 read misses (M)": v["D1mr"] / 1e6} for k, v in res.items()},
                    "millions", "Claim 2: D1 read misses of one GEMV (cachegrind)")
    verdict = PROVEN if factor >= 1.5 else INCONCLUSIVE if factor > 1.05 else REFUTED
    return Claim(2, verdict, rows_,
                 f"Cachegrind (valgrind's cache simulator: this machine exposes no hardware counters; it models the "
                 f"L1 and last level of the host, and no hardware prefetcher) counts {factor:.2f}x more D1 read misses "
                 "for whole rows than for 128 x 256 tiles, over the same bytes and the same kernel. With whole rows "
                 f"the int8 activation row ({cols // 32 * 34:,} bytes of q8_0 blocks) cannot stay in a 32 KiB L1 "
                 "while the 128 rows of a stripe stream past; a tile's slice of it (272 bytes) does. The weights miss "
                 "once per line either way. The paper's 7.29x was measured with PMU counters on a Xeon E5-2650 and a "
                 "kernel of its own; the ratio depends on the kernel's activation reuse.",
                 CMD.format(n=2), plot)


def claim3(ctx: Context) -> Claim:
    from cflow.engine_ref import RefEngine

    path = ctx.models["arch2_4_combined"]
    nat = engine(path, ctx, fast=False, precise=False)
    ref = RefEngine(path, n_ctx=512)
    ids = prompt(nat.vocab, 48)
    a = nat.forward(nat.new_state(), ids, all_logits=True)
    b = ref.forward(ref.new_state(), ids, all_logits=True)
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    same = float((a.argmax(-1) == b.argmax(-1)).mean())
    fast = engine(path, ctx)
    t_nat, t_fast = decode_tok_s(nat, 32), decode_tok_s(fast, 32)
    t_ref = decode_tok_s(ref, 4)
    from cflow.kernels import best_isa

    rows = [("kernel path", best_isa()), ("relative error, native fp32 against the reference (48 positions)", f"{rel:.2e}"),
            ("same argmax", f"{100 * same:.1f}% of positions"),
            ("decode tok/s: reference (numpy), native fp32, native int8", f"{t_ref:.2f}, {t_nat:.1f}, {t_fast:.1f}")]
    ok = rel <= 1e-4 and same == 1.0
    return Claim(3, PROVEN if ok else REFUTED, rows,
                 f"The native engine ({best_isa()} kernels) runs the same plan as the numpy reference engine to a "
                 f"relative error of {rel:.1e} with the same greedy token everywhere, {t_nat / t_ref:.0f}x faster with "
                 f"fp32 activations and {t_fast / t_ref:.0f}x with int8. The kernels are also checked block by block "
                 "against the scalar reference in the test suite (tests/test_kernels.py), and the pipeline-native "
                 "presets against PyTorch to 1e-4 (tests/test_pnt_engine.py).", CMD.format(n=3))


def claim4(ctx: Context) -> Claim:
    """One pass over stacked Q|K|V (and gate|up) against one GEMV per part, same bytes."""
    from cflow import kernels as K

    d, q, kv, ff = 4096, 4096, 1024, 14336  # an 8B-class layer (Llama 3 8B): 14 and 66 MB in Q4_0
    rng = np.random.default_rng(4)

    def mat(rows):
        w = rng.integers(0, 256, size=rows * d // 32 * 18, dtype=np.uint8)
        w.reshape(-1, 18)[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        return w

    x = rng.standard_normal(d).astype(np.float32)
    parts = [mat(q), mat(kv), mat(kv)]
    stacked = np.concatenate(parts)
    gate, up = mat(ff), mat(ff)
    glu = np.concatenate([gate, up])  # random bytes: the fused layout's order is the same traffic
    kw = dict(act="q8", threads=ctx.threads)

    def timed(f, n=200):
        f()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return 1e6 * med(ts)

    def silu_mul(g, u):
        return g / (1 + np.exp(-g)) * u

    res = alternate({
        "qkv fused": lambda: timed(lambda: K.gemv_qkv("q4_0", stacked, x, (q, kv, kv), d, **kw)),
        "qkv apart": lambda: timed(lambda: [K.gemv("q4_0", p, x, r, d, **kw) for p, r in zip(parts, (q, kv, kv))]),
        "gate_up fused": lambda: timed(lambda: K.gemv_glu("q4_0", glu, x, ff, d, **kw)),
        "gate_up apart": lambda: timed(lambda: silu_mul(K.gemv("q4_0", gate, x, ff, d, **kw),
                                                         K.gemv("q4_0", up, x, ff, d, **kw))),
    }, 3)
    q_gain = med(res["qkv apart"]) / med(res["qkv fused"])
    g_gain = med(res["gate_up apart"]) / med(res["gate_up fused"])
    rows = [("shapes", f"d {d}: Q {q}, K and V {kv} rows; gate and up {ff} rows; Q4_0, {ctx.threads} threads, int8")]
    rows += [(f"{k} (µs per call)", span(v)) for k, v in res.items()]
    rows += [("QKV apart / fused", f"{q_gain:.2f}x"), ("gate+up apart / fused", f"{g_gain:.2f}x")]
    verdict = PROVEN if min(q_gain, g_gain) > 1.03 else INCONCLUSIVE if max(q_gain, g_gain) > 1.03 else REFUTED

    def said(gain, what):
        if gain > 1.03:
            return f"{what} is {gain:.2f}x faster fused"
        if gain < 0.97:
            return f"{what} is {1 / gain:.2f}x faster apart"
        return f"{what} runs as fast fused as apart ({gain:.2f}x)"

    return Claim(4, verdict, rows,
                 "At the kernel level (cflow.kernels, one call per GEMV, the same bytes either way): "
                 f"{said(q_gain, 'Q|K|V')}, and {said(g_gain, 'gate/up with its GLU')}. Fused, the activation is "
                 "quantized once and the threads meet once per group instead of once per part; apart, each GEMV is "
                 "a separate pass over the same activation, which stays in cache. The engine runs the parts fused "
                 "wherever they share a block type (docs/ENGINE.md).", CMD.format(n=4))


def _cold_start(path, ctx: Context, tokens: int = 8) -> float:
    """Seconds from a dropped page cache to `tokens` decoded: the engine made, a 16-token prompt."""
    drop_caches()
    t = time.perf_counter()
    eng = engine(path, ctx)
    st = eng.new_state()
    out = eng.forward(st, prompt(eng.vocab, 16))
    for _ in range(tokens):
        out = eng.forward(st, [int(out.argmax())])
    return time.perf_counter() - t


def _cold_claim(n: int, ctx: Context, better: str, worse: str, lb: str, lw: str, what: str) -> Claim:
    """The claim: model `better` (label lb) starts faster from a cold page cache than `worse` (lw)."""
    if not drop_caches():
        return Claim(n, NOT_MEASURED, [], "the page cache cannot be dropped here (root only): no cold start to measure.",
                     CMD.format(n=n))
    res = alternate({lb: lambda: _cold_start(ctx.models[better], ctx), lw: lambda: _cold_start(ctx.models[worse], ctx)},
                    7)
    engines = {lb: engine(ctx.models[better], ctx), lw: engine(ctx.models[worse], ctx)}
    warm = alternate({k: (lambda k=k: decode_tok_s(engines[k], 256)) for k in engines}, 5)
    gain = med(res[lw]) / med(res[lb])
    rows = [(f"cold start to 8 tokens, {k} (s)", span(v, "{:.3f}")) for k, v in res.items()]
    rows += [(f"warm decode tok/s, {k}", span(v)) for k, v in warm.items()]
    rows.append((f"{lw} / {lb} cold time", f"{gain:.3f}x"))
    verdict = PROVEN if gain > 1.05 else REFUTED if gain < 0.95 else INCONCLUSIVE
    warm_ratio = med(warm[lb]) / med(warm[lw])
    text = what.format(gain=gain, size=os.path.getsize(ctx.models[better]) / 1e6) + (
        f" Warm, with the same bytes in RAM, the {lb} file decodes at {warm_ratio:.3f}x the {lw} file's speed.")
    return Claim(n, verdict, rows, text, CMD.format(n=n))


def claim5(ctx: Context) -> Claim:
    return _cold_claim(5, ctx, "arch2_4_combined", "reversed", "compute order", "reversed order",
                       "The same model ({size:.0f} MB) written in compute order and in reversed order (the last layer "
                       "first), each started from a dropped page cache: the reversed file takes {gain:.3f}x the time "
                       "to its 8th token. The kernel's readahead follows faults forward through the file, which "
                       "compute order lines up with.")


def claim8(ctx: Context) -> Claim:
    return _cold_claim(8, ctx, "vflow", "arch2_4_combined", ".vflow", ".cflow",
                       "The delayed model as .vflow (stage-major: each stage's attention, delayed dense FFN and experts "
                       "contiguous) and as .cflow (layer by layer), each from a dropped page cache: the .cflow takes "
                       "{gain:.3f}x the .vflow's time to its 8th token. The engine reads mapped weights when a kernel "
                       "first touches them, so a file's order helps only as far as the kernel's readahead follows the "
                       "faults; stage-major order would pay off with stages streamed ahead of compute, which the engine "
                       "does for experts (the disk tier), not for mapped weights.")


def claim6(ctx: Context) -> Claim:
    from cflow._native import core

    path = ctx.models["arch2_4_combined"]
    eng = engine(path, ctx)

    def speed(on):
        core.set_prefetch(on)
        try:
            return decode_tok_s(eng, 256)
        finally:
            core.set_prefetch(True)

    ram = alternate({"prefetch on": lambda: speed(True), "prefetch off": lambda: speed(False)}, 7)
    gain = med(ram["prefetch on"]) / med(ram["prefetch off"])
    rows = [(f"in RAM, {k} (decode tok/s)", span(v)) for k, v in ram.items()]
    rows.append(("in RAM, on / off", f"{gain:.3f}x"))
    disk = None
    if ctx.disk_model:  # two rounds, on and off in turn: the disk's rate drifts from run to run
        disk = {"prefetch on": [], "prefetch off": []}
        for _ in range(2):
            r = _disk_runs(ctx, {"prefetch on": {}, "prefetch off": {"CFLOW_PREFETCH": "0"}})
            for k in disk:
                disk[k].append(r[k]["tok_s"])
    text = (f"In RAM (the paper-geometry model, {eng.bytes_per_token / 1e6:.1f} MB a token), decode with the "
            f"kernels' software prefetches is {gain:.3f}x the speed without them (Q4_0 planes GEMV: one hint per "
            "cache line, 2 KiB ahead).")
    if disk:
        d_gain = med(disk["prefetch on"]) / med(disk["prefetch off"])
        rows += [(f"disk tier (staged), {k} (warm tok/s, two runs)", ", ".join(f"{v:.2f}" for v in vs))
                 for k, vs in disk.items()]
        rows.append(("disk tier, on / off", f"{d_gain:.3f}x"))
        text += (f" From disk (the staged tier on {os.path.basename(ctx.disk_model)} under a "
                 f"{ctx.memory_limit / 2**30:.0f} GiB limit, two runs each, in turn): {d_gain:.3f}x; there the disk's "
                 "rate sets the speed, and it drifts between runs by more than the prefetches could change.")
    else:
        text += " The disk half was not run (give --disk-model)."
        d_gain = 1.0
    worst = min(gain, d_gain)
    verdict = REFUTED if max(gain, d_gain) < 1.02 else PROVEN if worst > 1.02 else INCONCLUSIVE
    plot = bar_plot(ctx.img / "claims-6.png", {"in RAM": {k: med(v) for k, v in ram.items()}},
                    "decode tok/s", "Claim 6: software prefetch on and off")
    return Claim(6, verdict, rows, text, CMD.format(n=6) + " [--disk-model FILE]", plot)


def _disk_runs(ctx: Context, variants: dict) -> dict:
    """Warm-phase records of staged runs of the disk model under the memory limit, one per variant
    (environment overrides)."""
    from cflow.bench.disk_tier import _run_limited

    spec = dict(model=ctx.disk_model, threads=ctx.threads, activations="int8", ram_budget=ctx.memory_limit - (3 << 29),
                io_threads=4, tokens=4, warm_tokens=12, engine="cflow", policy="staged")
    out = {}
    for name, env in variants.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            rec = _run_limited(spec, ctx.memory_limit, ctx.log)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if "error" in rec:
            raise CflowError(f"disk run {name}: {rec['error']}")
        out[name] = rec["phases"]["warm"]
    return out


def claim7(ctx: Context) -> Claim:
    from cflow.analysis.bandwidth import critical_paths, layer_bytes

    rows, groups = [], {}
    for name in ("arch2_4_combined", "arch1"):
        e = engine(ctx.models[name], ctx)
        cp = e.critical_path_bytes / 2**20
        an = critical_paths(e.config, layer_bytes(e.config, "q4_0"))["longest_path"] / 2**20
        engines = {s: engine(ctx.models[name], ctx, schedule=s) for s in ("sequential", "pipeline")}
        sp = alternate({s: (lambda s=s: decode_tok_s(engines[s], 256)) for s in engines}, 5)
        rows += [(f"{name}: critical path, engine / `cflow analyze --model` (MiB/token)", f"{cp:.2f} / {an:.2f}"),
                 (f"{name}: decode tok/s, sequential / pipeline", f"{span(sp['sequential'])} / {span(sp['pipeline'])}")]
        groups[name] = {"critical path (MiB)": cp, "_pipe": med(sp["pipeline"]) / med(sp["sequential"])}
        # the tier: every expert read from disk (the smallest cache that works), no prediction
        tier = engine(ctx.models[name], ctx, expert_policy="staged", predict=False,
                      ram_budget=_small_budget(ctx.models[name]))
        t_ram, t_disk = med(sp["sequential"]), decode_tok_s(tier, 256)
        r = tier.tier_report()
        rows.append((f"{name}: disk tier (staged, no prediction), tok/s and wait per token",
                     f"{t_disk:.1f} ({100 * t_disk / t_ram:.0f}% of in RAM), {1e3 * r['wait_s'] / max(1, r['misses']):.2f} "
                     f"ms waited per read"))
        groups[name]["disk tier / RAM (%)"] = 100 * t_disk / t_ram
        ctx_rec = groups[name]
        ctx_rec["_ram"], ctx_rec["_disk"] = t_ram, t_disk
    a, b = groups["arch2_4_combined"], groups["arch1"]
    cp_gain = b["critical path (MiB)"] / a["critical path (MiB)"]
    keep_a, keep_b = a["disk tier / RAM (%)"], b["disk tier / RAM (%)"]
    rows.append(("critical path, arch1 / arch2_4_combined", f"{cp_gain:.2f}x"))
    pipe_a, pipe_b = a["_pipe"], b["_pipe"]
    in_ram = (f"In RAM the wall clock does not follow: the pipeline schedule runs at {pipe_a:.2f}x the sequential one on "
              f"the delayed model and {pipe_b:.2f}x on the undelayed one; on {ctx.threads} cores a step is bound by all "
              "the bytes it reads, whichever thread reads them (docs/MOE.md)." if pipe_a < 1.1 * pipe_b else
              f"In RAM the pipeline schedule runs at {pipe_a:.2f}x the sequential one on the delayed model against "
              f"{pipe_b:.2f}x on the undelayed one.")
    plot = bar_plot(ctx.img / "claims-7.png", {k: {"critical path (MiB)": v["critical path (MiB)"]} for k, v in groups.items()},
                    "MiB per token", "Claim 7: critical path of one token (Q4_0)")
    verdict = PROVEN if cp_gain > 1.3 and keep_a > keep_b * 1.05 else INCONCLUSIVE
    return Claim(7, verdict, rows,
                 f"The delays shorten the critical path {cp_gain:.2f}x (the engine's figure equals `cflow analyze`'s). "
                 f"{in_ram} On the disk tier with every expert read from disk, the delayed model "
                 f"keeps {keep_a:.0f}% of its in-RAM speed against {keep_b:.0f}% without delays: its reads, issued two "
                 "layers before their use, overlap that compute.", CMD.format(n=7), plot)


def _small_budget(path) -> int:
    """A RAM budget that leaves the staged tier about 3 slots per expert it can pin at once: most
    expert reads go to disk."""
    from cflow.format import CflowFile

    with CflowFile(path) as f:
        slot = max((e.length + 4095) // 4096 * 4096 for e in f.experts.values())
        experts = sum((e.length + 4095) // 4096 * 4096 for e in f.experts.values())
        return f.size - experts + 2 * (f.config.top_k * 4) * slot


CLAIMS = {1: claim1, 2: claim2, 3: claim3, 4: claim4, 5: claim5, 6: claim6, 7: claim7, 8: claim8}


# ------------------------------------------------------------------ the page
def machine() -> str:
    from cflow.kernels import best_isa

    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    l3 = ""
    try:
        l3 = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip() + " L3, "
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores, {l3}kernels {best_isa()}, {platform.system()} {platform.release()}"


def render(claims: list[Claim], command: str, when: str, ctx: Context) -> str:
    out = ["# The paper's eight claims, measured here", "",
           f"Generated by `{command}` on {when} ({machine()}, {ctx.threads} threads). Every number on this page comes "
           "from that run; rerun one claim with the command given under it. Models: random weights at the paper's "
           "geometry (src/cflow/analysis/claims.py says which and why).", "",
           "| # | claim | the paper | here |", "|---|---|---|---|"]
    for c in claims:
        out.append(f"| {c.number} | {TITLES[c.number]} | {PAPER[c.number].split(':')[0]} | **{c.verdict}** |")
    for c in claims:
        out += ["", f"## {c.number}. {TITLES[c.number]}: {c.verdict}", "", f"The paper: {PAPER[c.number]}.", ""]
        if c.rows:
            out += ["| quantity | measured |", "|---|---|"] + [f"| {k} | {v} |" for k, v in c.rows] + [""]
        out.append(c.text)
        if c.plot:
            out += ["", f"![claim {c.number}](img/{c.plot})"]
        out += ["", f"Command: `{c.command}`"]
    return "\n".join(out) + "\n"


def run_claims(*, out: Path, work: Path, threads: int, only=None, disk_model=None, memory_limit: int = 8 << 30,
               command: str = "cflow claims", log=print) -> list[Claim]:
    ctx = Context(work=work, img=out.parent / "img", threads=threads, models={}, disk_model=disk_model,
                  memory_limit=memory_limit, log=log)
    log("models ...")
    ctx.models = make_models(work, log)
    claims = []
    for n in sorted(only or CLAIMS):
        log(f"claim {n}: {TITLES[n]} ...")
        t = time.perf_counter()
        c = CLAIMS[n](ctx)
        log(f"  {c.verdict} ({time.perf_counter() - t:.0f} s): " + "; ".join(f"{k} = {v}" for k, v in c.rows[-2:]))
        claims.append(c)
    page = render(claims, command, time.strftime("%Y-%m-%d %H:%M"), ctx)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page)
    os.replace(tmp, out)
    (work / "claims.json").write_text(json.dumps([dataclasses.asdict(c) for c in claims], indent=1))
    return claims
