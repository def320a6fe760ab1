"""`cflow bench kernels`: the read-bandwidth probe, then every tile GEMV in the same run.

For each block type: a matrix of --matrix-mb MB of weights (cols = --cols), timed with 1 and 2
threads in the layouts compared over the same bytes:
  "tiled"        what `cflow convert` writes: tile (128, 256); Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K in
                 the planes pack at interleave 16 (their fast kernels), other types whole blocks at
                 interleave 1;
  "tiled_blocks" (the planes types only) tile (128, 256), whole GGUF blocks, interleave 1;
  "row_major"    tile (128, cols), whole blocks, interleave 1: whole rows, the block kernel.
Repeats of the layouts alternate with one pass of the probe (same thread count), so all see the
same machine noise. Reported: the median GB/s of weight bytes (activation quantization included
in the time), its min..max, and % of the probe: the median over repeats of kernel / probe of the
same repeat (paired, because on a shared machine the bandwidth on offer moves by several times
within a run). The weights are random bytes with sane scales: a GEMV's speed does not
depend on the values.

--ternary: instead, one shape (--rows x --cols, default 16384 x 8192: Q4_0 75 MB, TQ2_0 35 MB, both
far beyond L3) in each of: Q4_0 as convert writes it (the 4-bit reference), TQ2_0 and TQ1_0 with
int8 activations (the default), TQ2_0 with fp32 activations (masked add and subtract, no multiply
per weight), and the dequantize-then-multiply baseline (the scalar reference kernel on TQ2_0: each
block decoded to 256 floats, then multiplied with x). Repeats alternate the kernels and a probe
pass; reported per kernel: ms per GEMV (median, min..max), weights/s, GB/s, % of the probe, and
TQ2_0's speed-up over Q4_0 and over the baseline, each the median of the per-repeat ratios.
"""

from __future__ import annotations

import json
import statistics
import sys

TYPES = ["q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "tq2_0", "tq1_0", "f16", "bf16", "f32"]


def add_arguments(p):
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated block types (default: all)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (median; >= 5)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--probe-mib", type=float, default=1024.0, help="probe buffer in MiB (>= 256)")
    p.add_argument("--matrix-mb", type=float, default=512.0,
                   help="weight bytes per matrix in MB (default 512: beyond a large L3; >= 64)")
    p.add_argument("--cols", type=int, default=8192, help="matrix columns (multiple of 256)")
    p.add_argument("--act", choices=["auto", "q8", "q8x2", "f32"], default="auto",
                   help="activation path: auto = what the engine's decode runs by default: q8x2 (two "
                        "int8 levels, --activations int8x2) for quantized types, f32 for f32/f16/bf16; q8: "
                        "one int8 level (--activations int8)")
    p.add_argument("--isa", choices=["scalar", "avx2", "avx512"], default=None, help="cap the ISA (default: best)")
    p.add_argument("--resident", action="store_true",
                   help="instead: each kernel on a 0.5 MB matrix that stays in L2 (200 timed runs, median), "
                        "its compute ceiling with memory out of the way; no probe")
    p.add_argument("--ternary", action="store_true",
                   help="instead: ternary kernels against Q4_0 and a dequantize-then-multiply baseline at one shape")
    p.add_argument("--rows", type=int, default=16384, help="--ternary: matrix rows (default 16384)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON line")


def _act(bt, choice: str) -> str:
    """The activation path a kernel run uses: under auto the engine's default, two int8 levels
    for quantized types (Engine's precise) and f32 for f32/f16/bf16."""
    from cflow import kernels as K

    if choice == "auto":
        return "q8x2" if K.default_act(bt.name) == "q8" else "f32"
    return "f32" if choice in ("q8", "q8x2") and bt.block_elems == 1 else choice


def _layouts(bt, cols: int) -> dict:
    """The layouts compared over the same bytes: {name: (tile, interleave, pack)}."""
    from cflow.convert.write import tensor_layout

    lay = tensor_layout(bt.name, 2, cols=cols)
    out = {"tiled": (lay.get("tile", (128, 256)), lay["interleave"], lay["pack"])}
    if lay["pack"] == "planes":
        out["tiled_blocks"] = ((128, 256), 1, "blocks")
    out["row_major"] = ((128, cols), 1, "blocks")
    return out


def _matrix(bt, cols: int, mb: float, rng):
    """Random weights of about `mb` MB, rows a multiple of 128, with valid scales in every
    layout of _layouts: (payload, rows). The blocks' header bytes are set in both places a
    header can be (whole blocks, and planes chunks of 16 blocks), so either reading is sane."""
    import numpy as np

    from cflow.format.tiles import PLANES_HEADER, PLANES_MAX_G

    row_bytes = cols // bt.block_elems * bt.block_bytes
    rows = max(128, int(mb * 1e6 / row_bytes) // 128 * 128)
    w = rng.integers(0, 256, size=rows * row_bytes, dtype=np.uint8)
    blocks = w.reshape(-1, bt.block_bytes)
    half = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if bt.name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k"):
        blocks[:, 0:2] = half  # d
    if bt.name in ("q4_1", "q5_1", "q4_k", "q5_k"):
        blocks[:, 2:4] = half  # m / dmin
    if bt.name in PLANES_HEADER:  # planes chunks: the 16 d (and 16 m) words lead each chunk
        chunks = w.reshape(-1, PLANES_MAX_G * bt.block_bytes)
        chunks[:, :PLANES_MAX_G * PLANES_HEADER[bt.name]] = np.tile(half, PLANES_MAX_G * PLANES_HEADER[bt.name] // 2)
    if bt.name in ("q6_k", "tq1_0", "tq2_0"):  # d: the last two bytes
        blocks[:, -2:] = half
    if bt.name == "f32":
        blocks[:] = np.frombuffer(np.float32(0.5).tobytes(), dtype=np.uint8)
    if bt.name in ("f16", "bf16"):
        blocks[:, 1] &= 0x3F  # finite, moderate values
    return w, rows


def main(args) -> int:
    import numpy as np

    from cflow import kernels as K
    from cflow.errors import CflowError
    from cflow.format.tiles import block_type

    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    if args.repeats < 1 or not threads or min(threads) < 1:
        raise CflowError("--repeats and --threads must be positive")
    if args.cols % 256:
        raise CflowError("--cols must be a multiple of 256")
    bts = [block_type(t) for t in types]
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))

    if args.resident:
        return _resident(args, bts, threads, log)
    if args.ternary:
        return _ternary(args, threads, log)
    probe = {}
    for t in threads:
        runs = K.probe_read(args.probe_mib, t, args.repeats, args.isa)
        probe[t] = runs
        log(f"probe  {t} thread(s), {args.probe_mib:.0f} MiB: median {statistics.median(runs):6.1f} GB/s "
            f"(min {min(runs):.1f}, max {max(runs):.1f})")

    rng = np.random.default_rng(0)
    x = rng.standard_normal(args.cols).astype(np.float32)
    results = []
    for bt in bts:
        act = _act(bt, args.act)
        w, rows = _matrix(bt, args.cols, args.matrix_mb, rng)
        layouts = _layouts(bt, args.cols)
        for t in threads:
            secs = {name: [] for name in layouts}
            paired = []  # the probe pass of each repeat
            for name, (tile, g, pack) in layouts.items():  # warm-up
                K._call(K.core.gemv_time, bt.name, w, x, rows, args.cols, tile, g, act, args.isa, t, 0, 1, pack)
            for _ in range(args.repeats):
                paired += K.probe_read(args.probe_mib, t, 1, args.isa)
                for name, (tile, g, pack) in layouts.items():
                    secs[name] += K._call(K.core.gemv_time, bt.name, w, x, rows, args.cols, tile, g, act, args.isa,
                                          t, 1, 0, pack)
            probe[t] += paired
            for name, (_, g, pack) in layouts.items():
                isa = K.gemv_isa(bt.name, act, args.isa, pack)
                gb = [w.size / s * 1e-9 for s in secs[name]]
                med = statistics.median(gb)
                pct = statistics.median(100.0 * k / p for k, p in zip(gb, paired))
                # unrounded: under heavy load a rate can be far below 0.01 GB/s
                r = {"type": bt.name, "layout": name, "threads": t, "gbps": med,
                     "pct_of_probe": pct, "min_gbps": min(gb),
                     "max_gbps": max(gb), "isa": isa, "act": act, "interleave": g, "pack": pack,
                     "mb": round(w.size / 1e6, 1)}
                results.append(r)
                log(f"{bt.name:5s} {act:3s} {isa:6s} {name:12s} {t} thr: {med:6.1f} GB/s "
                    f"({min(gb):.1f}..{max(gb):.1f}) {r['pct_of_probe']:5.1f}% of probe")
        del w
    out = {"probe_gbps": statistics.median(probe[max(threads)]),
           "probe": {str(t): statistics.median(v) for t, v in probe.items()},
           "probe_mib": args.probe_mib, "best_isa": K.best_isa(), "kernels": results}
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    return 0


def _resident(args, bts, threads, log) -> int:
    """Kernel compute ceilings: a 0.5 MB matrix (1024 columns) stays in L2 between runs."""
    import numpy as np

    from cflow import kernels as K

    rng = np.random.default_rng(0)
    cols = 1024
    x = rng.standard_normal(cols).astype(np.float32)
    results = []
    for bt in bts:
        act = _act(bt, args.act)
        w, rows = _matrix(bt, cols, 0.5, rng)
        layouts = _layouts(bt, cols)
        for t in threads:
            for name, (tile, g, pack) in layouts.items():
                isa = K.gemv_isa(bt.name, act, args.isa, pack)
                secs = K._call(K.core.gemv_time, bt.name, w, x, rows, cols, tile, g, act, args.isa, t, 200, 5, pack)
                gb = [w.size / s * 1e-9 for s in secs]
                r = {"type": bt.name, "layout": name, "threads": t, "gbps": statistics.median(gb),
                     "max_gbps": max(gb), "isa": isa, "act": act, "interleave": g, "pack": pack, "resident": True}
                results.append(r)
                log(f"{bt.name:5s} {act:3s} {isa:6s} {name:12s} {t} thr: {r['gbps']:6.1f} GB/s median, "
                    f"{max(gb):.1f} best (L2-resident)")
    if args.json:
        sys.stdout.write(json.dumps({"resident": True, "best_isa": K.best_isa(), "kernels": results}) + "\n")
    return 0


# (name, type, activations, isa cap, repeats per repeat round): the --ternary kernels, Q4_0 first
TERNARY_KERNELS = [("q4_0", "q4_0", "q8", None, 1), ("tq2_0", "tq2_0", "q8", None, 1), ("tq1_0", "tq1_0", "q8", None, 1),
                   ("tq2_0 fp32 masked", "tq2_0", "f32", None, 1), ("tq2_0 dequantize+multiply", "tq2_0", "f32", "scalar", 1)]


def _ternary(args, threads, log) -> int:
    import numpy as np

    from cflow import kernels as K
    from cflow.errors import CflowError
    from cflow.format.tiles import block_type

    if args.rows < 128 or args.rows % 128:
        raise CflowError("--rows must be a positive multiple of 128")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(args.cols).astype(np.float32)
    mats = {}
    for _, name, _, _, _ in TERNARY_KERNELS:
        if name not in mats:
            bt = block_type(name)
            w, _ = _matrix(bt, args.cols, args.rows * args.cols / bt.block_elems * bt.block_bytes / 1e6, rng)
            mats[name] = (bt, w, _layouts(bt, args.cols)["tiled"])
    results, summary = [], {}
    for t in threads:
        secs = {k[0]: [] for k in TERNARY_KERNELS}
        paired = []
        for label, name, act, isa, _ in TERNARY_KERNELS:  # warm-up
            bt, w, (tile, g, pack) = mats[name]
            K._call(K.core.gemv_time, name, w, x, args.rows, args.cols, tile, g, act, isa, t, 0, 1, pack)
        for _ in range(args.repeats):
            paired += K.probe_read(args.probe_mib, t, 1, args.isa)
            for label, name, act, isa, _ in TERNARY_KERNELS:
                bt, w, (tile, g, pack) = mats[name]
                secs[label] += K._call(K.core.gemv_time, name, w, x, args.rows, args.cols, tile, g, act,
                                       isa or args.isa, t, 1, 0, pack)
        for label, name, act, isa, _ in TERNARY_KERNELS:
            bt, w, (tile, g, pack) = mats[name]
            s = secs[label]
            gb = [w.size / v * 1e-9 for v in s]
            r = {"kernel": label, "type": name, "act": act, "isa": K.gemv_isa(name, act, isa or args.isa, pack),
                 "threads": t, "ms": 1e3 * statistics.median(s), "min_ms": 1e3 * min(s), "max_ms": 1e3 * max(s),
                 "gweights_per_s": args.rows * args.cols / statistics.median(s) * 1e-9, "gbps": statistics.median(gb),
                 "pct_of_probe": statistics.median(100.0 * k / p for k, p in zip(gb, paired)),
                 "mb": round(w.size / 1e6, 1), "interleave": g, "pack": pack}
            results.append(r)
            log(f"{label:26s} {r['isa']:6s} {t} thr: {r['ms']:8.2f} ms ({r['min_ms']:.2f}..{r['max_ms']:.2f}) "
                f"{r['gweights_per_s']:6.2f} Gweights/s {r['gbps']:5.1f} GB/s {r['pct_of_probe']:5.1f}% of probe")
        tq = secs["tq2_0"]
        ratio = lambda other: statistics.median(o / q for o, q in zip(secs[other], tq))  # noqa: E731
        summary[str(t)] = {"tq2_0_vs_q4_0": ratio("q4_0"), "tq2_0_vs_dequantize_multiply":
                           ratio("tq2_0 dequantize+multiply"), "tq2_0_vs_fp32_masked": ratio("tq2_0 fp32 masked")}
        log(f"  {t} thr: TQ2_0 is {summary[str(t)]['tq2_0_vs_q4_0']:.2f}x Q4_0, "
            f"{summary[str(t)]['tq2_0_vs_dequantize_multiply']:.1f}x dequantize+multiply, "
            f"{summary[str(t)]['tq2_0_vs_fp32_masked']:.1f}x its fp32 masked path "
            f"(medians of per-repeat ratios); probe {statistics.median(paired):.1f} GB/s")
    if args.json:
        sys.stdout.write(json.dumps({"ternary": True, "rows": args.rows, "cols": args.cols, "best_isa": K.best_isa(),
                                     "kernels": results, "speedups": summary}) + "\n")
    return 0
