"""`cflow bench disk-tier`: a mixture-of-experts model larger than its memory, per expert policy
and against llama.cpp's mmap run, each in a child process under one memory limit.

Every run starts from a cold page cache (`echo 3 > /proc/sys/vm/drop_caches`, where allowed) in a
fresh process confined to --memory-limit by the kernel (cgroup v2 `memory.max`, cgroup v1
`memory.limit_in_bytes`, or `systemd-run --scope -p MemoryMax=`; the page cache the process fills
counts against it). A run prefills a short prompt, then decodes --tokens greedy tokens ("cold":
the expert cache fills) and --warm-tokens more ("warm"). Reported per phase: tok/s, MiB read from
disk per token (the process's storage reads, /proc/self/io read_bytes: mapped faults and O_DIRECT
reads alike), and for the tier the cache hit rate (experts already in a slot when routed, hinted
reads not counted), the prediction's accuracy and the milliseconds per token spent waiting on
reads.

The overlap model (the paper's): a token costs compute C and reads IO. Sync waits for every read,
so t_sync = C + IO_sync, with C and IO_sync taken from the sync run (its step time less its wait
per token). Staged overlaps the two: t_staged = max(C, IO_staged), IO_staged the wall time per
token during which the staged run had a read in flight (the tier's busy time: the device's time
for the bytes staged read, at the depth it kept). Predicted ratio t_sync / t_staged, against the
measured staged / sync tok/s. Both from the runs themselves: a cloud disk's rate drifts (burst
credits) between runs minutes apart, so a separate probe would model another disk.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from cflow.errors import CflowError

POLICIES = ("mmap", "sync", "staged")


def add_arguments(p):
    p.add_argument("-m", "--model", required=True, help="the .cflow of a mixture-of-experts model")
    p.add_argument("--gguf", default=None, help="the same model's GGUF: llama.cpp's mmap run under the same limit")
    p.add_argument("--memory-limit", default="8G", help="memory of each run's process, page cache included (default 8G)")
    p.add_argument("--ram-budget", default=None,
                   help="the tier's budget (default: the limit less 1.5 GiB for the process, KV and buffers)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of mmap,sync,staged (default all)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--io-threads", type=int, default=4, help="the staged policy's reads in flight (default 4)")
    p.add_argument("--io", choices=("pread", "uring"), default="pread",
                   help="how staged reads reach the disk (default pread threads)")
    p.add_argument("--tokens", type=int, default=16, help="cold decode steps (default 16)")
    p.add_argument("--warm-tokens", type=int, default=32, help="warm decode steps after them (default 32)")
    p.add_argument("--activations", default="int8x2", choices=("int8x2", "int8", "fp32"),
                   help="cflow's activations (default int8x2, the engine's own; int8 is llama.cpp's q8)")
    p.add_argument("--json", default=None, help="write the results to this file")


# ------------------------------------------------------------------ memory limits
class MemoryLimit:
    """A cgroup of its own for one child process, limited to `limit` bytes (v2, else v1); the
    command prefix for systemd-run where neither can be written; none where nothing works."""

    def __init__(self, limit: int):
        self.limit, self.dir, self.kind, self.prefix = limit, None, None, []
        name = f"cflow-bench-{os.getpid()}-{time.monotonic_ns()}"
        for kind, root, knob in (("v2", "/sys/fs/cgroup", "memory.max"),
                                 ("v1", "/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
            if kind == "v2" and not os.path.exists(os.path.join(root, "cgroup.controllers")):
                continue
            if not os.path.isdir(root):
                continue
            d = os.path.join(root, name)
            try:
                os.mkdir(d)
                with open(os.path.join(d, knob), "w") as fh:
                    fh.write(str(limit))
            except OSError:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
                continue
            self.dir, self.kind = d, kind
            return
        if subprocess.run(["systemd-run", "--version"], capture_output=True).returncode == 0:
            self.kind, self.prefix = "systemd-run", ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={limit}"]
            return
        raise CflowError("cannot limit a process's memory here (no writable cgroup, no systemd-run): run as root "
                         "or under a cgroup you may write")

    def enter(self):  # in the child, before exec
        if self.dir:
            with open(os.path.join(self.dir, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))

    def peak(self) -> int | None:
        for f in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                with open(os.path.join(self.dir or "", f)) as fh:
                    return int(fh.read())
            except (OSError, ValueError):
                continue
        return None

    def close(self):
        if self.dir:
            try:
                os.rmdir(self.dir)
            except OSError:
                pass


def drop_caches() -> bool:
    """Empty the page cache (root only); whether it was done."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def read_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------------ the child
def _child(spec: dict) -> dict:
    """One run in this (limited) process: prompt, cold and warm decode, counters per phase."""
    import numpy as np

    from cflow.bench.decode import _prompt

    prompt = None
    t0 = time.perf_counter()
    if spec["engine"] == "llama.cpp":
        from cflow.bench.decode import LlamaCppRunner

        r = LlamaCppRunner(spec["gguf"], spec["threads"], 256, extra_bufts=False)
        prompt = _prompt(r.llm.n_vocab(), 8, 1)

        def step(tok):
            r._eval([tok])
            return r._greedy()

        r.llm.reset()
        r._eval(prompt)
        tok = r._greedy()
        tier = None
    else:
        from cflow.engine import ACTIVATIONS, Engine

        eng = Engine(spec["model"], threads=spec["threads"], n_ctx=256, **ACTIVATIONS[spec["activations"]],
                     expert_policy=spec["policy"], ram_budget=spec["ram_budget"] if spec["policy"] != "mmap" else None,
                     io_threads=spec["io_threads"], io_backend=spec.get("io", "pread"))
        st = eng.new_state()
        prompt = _prompt(eng.vocab, 8, 1)
        tok = int(np.argmax(eng.forward(st, prompt)))

        def step(t):
            return int(np.argmax(eng.forward(st, [t])))

        tier = eng.tier_report if spec["policy"] != "mmap" else None
    load_prompt_s = time.perf_counter() - t0
    out = {"load_prompt_s": round(load_prompt_s, 2), "phases": {}}
    for phase, n in (("cold", spec["tokens"]), ("warm", spec["warm_tokens"])):
        b0, r0, steps = read_bytes(), tier() if tier else None, []
        for _ in range(n):
            t = time.perf_counter()
            tok = step(tok)
            steps.append(time.perf_counter() - t)
        rec = {"tok_s": round(n / sum(steps), 3), "step_ms_median": round(1e3 * statistics.median(steps), 1),
               "disk_mib_per_token": round((read_bytes() - b0) / n / 2**20, 1)}
        if tier:
            r1 = tier()
            d = {k: r1[k] - r0[k] for k in ("hits", "misses", "hinted_reads", "hinted_used", "reads", "bytes_read",
                                             "predicted", "predicted_right")}
            d.update(read_s=r1["read_s"] - r0["read_s"], wait_s=r1["wait_s"] - r0["wait_s"],
                     busy_s=r1["busy_s"] - r0["busy_s"])
            asked = d["hits"] + d["misses"]
            # hit_rate: found in the cache when routed; found_rate: also those a prediction had started
            rec.update(hit_rate=round((d["hits"] - d["hinted_used"]) / asked, 3) if asked else None,
                       found_rate=round(d["hits"] / asked, 3) if asked else None,
                       prediction_accuracy=round(d["predicted_right"] / d["predicted"], 3) if d["predicted"] else None,
                       tier_mib_per_token=round(d["bytes_read"] / n / 2**20, 1),
                       wait_ms_per_token=round(1e3 * d["wait_s"] / n, 1),
                       io_busy_ms_per_token=round(1e3 * d["busy_s"] / n, 1),
                       read_gbps=round(d["bytes_read"] / d["busy_s"] / 1e9, 3) if d["busy_s"] else None,
                       hinted_reads=d["hinted_reads"], hinted_used=d["hinted_used"])
            rec["slots"], rec["direct"], rec["io"] = r1["slots"], r1["direct"], r1["io"]
        out["phases"][phase] = rec
    return out


# ------------------------------------------------------------------ the parent
def _run_limited(spec: dict, limit: int, log) -> dict:
    cold = drop_caches()
    lim = MemoryLimit(limit)
    try:
        cmd = lim.prefix + [sys.executable, "-m", "cflow.bench.disk_tier", "--child", json.dumps(spec)]
        p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=lim.enter if lim.dir else None)
        peak = lim.peak()
    finally:
        lim.close()
    if p.returncode != 0:
        tail = (p.stderr or "").strip().splitlines()[-3:]
        why = "killed for memory (over the limit)" if p.returncode in (-9, 137) else f"exit {p.returncode}"
        return {"error": why + (": " + " | ".join(tail) if tail else "")}
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    rec["page_cache_dropped"] = cold
    rec["limit"] = lim.kind
    if peak:
        rec["peak_mib"] = round(peak / 2**20)
    return rec


def main(args) -> int:
    from cflow.engine import parse_size
    from cflow.format import CflowFile

    limit = parse_size(args.memory_limit)
    budget = parse_size(args.ram_budget) if args.ram_budget else limit - (3 << 29)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for x in policies:
        if x not in POLICIES:
            raise CflowError(f"--policies: {x!r} is not one of {', '.join(POLICIES)}")
    f = CflowFile(args.model)
    if not f.experts:
        raise CflowError(f"{args.model} has no experts: the disk tier is for mixture-of-experts models")
    size = os.path.getsize(args.model)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    log(f"{args.model}: {size / 2**30:.2f} GiB, limit {limit / 2**30:.2f} GiB, tier budget {budget / 2**30:.2f} GiB")
    spec = dict(model=args.model, threads=args.threads, activations=args.activations, ram_budget=budget,
                io_threads=args.io_threads, io=args.io, tokens=args.tokens, warm_tokens=args.warm_tokens)
    results = {"model": args.model, "model_bytes": size, "memory_limit": limit, "ram_budget": budget,
               "threads": args.threads, "io_threads": args.io_threads, "io": args.io, "activations": args.activations, "runs": {}}
    for pol in policies:
        log(f"  cflow {pol} ...")
        results["runs"][pol] = _run_limited(dict(spec, engine="cflow", policy=pol), limit, log)
        log("   ", json.dumps(results["runs"][pol]))
    if args.gguf:
        log("  llama.cpp mmap ...")
        results["runs"]["llama.cpp"] = _run_limited(dict(spec, engine="llama.cpp", gguf=args.gguf), limit, log)
        log("   ", json.dumps(results["runs"]["llama.cpp"]))
    runs = results["runs"]
    if "sync" in runs and "staged" in runs and "error" not in runs["sync"] and "error" not in runs["staged"]:
        results["overlap"] = overlap_model(runs)
    print(report(results))
    if args.json:
        with open(args.json + ".tmp", "w") as fh:
            json.dump(results, fh, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0


def overlap_model(runs: dict) -> dict:
    """The paper's (C + IO) / max(C, IO_eff) against the measured staged / sync ratio (warm phase)."""
    s, g = runs["sync"]["phases"]["warm"], runs["staged"]["phases"]["warm"]
    t_sync = 1 / s["tok_s"]
    io_sync = s["wait_ms_per_token"] / 1e3
    compute = max(t_sync - io_sync, 0.0)
    io_staged = g["io_busy_ms_per_token"] / 1e3
    predicted = (compute + io_sync) / max(compute, io_staged)
    measured = g["tok_s"] / s["tok_s"]
    return {"compute_ms": round(1e3 * compute, 1), "io_sync_ms": round(1e3 * io_sync, 1),
            "io_staged_ms": round(1e3 * io_staged, 1), "sync_read_gbps": s["read_gbps"],
            "staged_read_gbps": g["read_gbps"], "predicted_ratio": round(predicted, 3),
            "measured_ratio": round(measured, 3), "error_pct": round(100 * (predicted - measured) / measured, 1)}


def report(r: dict) -> str:
    lines = [f"{r['model']}: {r['model_bytes'] / 2**30:.2f} GiB under a {r['memory_limit'] / 2**30:.2f} GiB limit "
             f"(tier budget {r['ram_budget'] / 2**30:.2f} GiB), {r['threads']} threads, activations {r['activations']}"]
    lines.append(f"{'run':10} {'phase':5} {'tok/s':>7} {'disk MiB/tok':>12} {'hit rate':>8} {'pred. acc':>9} "
                 f"{'wait ms/tok':>11}")
    for name, run in r["runs"].items():
        if "error" in run:
            lines.append(f"{name:10} failed: {run['error']}")
            continue
        for phase, p in run["phases"].items():
            hr = "-" if p.get("hit_rate") is None else f"{100 * p['hit_rate']:.1f}%"
            pa = "-" if p.get("prediction_accuracy") is None else f"{100 * p['prediction_accuracy']:.1f}%"
            w = "-" if "wait_ms_per_token" not in p else f"{p['wait_ms_per_token']:.0f}"
            lines.append(f"{name:10} {phase:5} {p['tok_s']:7.2f} {p['disk_mib_per_token']:12.1f} {hr:>8} {pa:>9} {w:>11}")
        if run.get("peak_mib"):
            lines.append(f"{'':10} peak memory {run['peak_mib']} MiB, load + prompt {run['load_prompt_s']} s"
                         + ("" if run.get("page_cache_dropped") else " (page cache NOT dropped: not cold)"))
    if "overlap" in r:
        o = r["overlap"]
        lines.append(f"overlap model: C {o['compute_ms']} ms, IO sync {o['io_sync_ms']} ms ({o['sync_read_gbps']} GB/s), "
                     f"IO staged {o['io_staged_ms']} ms ({o['staged_read_gbps']} GB/s at up to {r['io_threads']} "
                     f"in flight): predicted staged/sync x{o['predicted_ratio']}, measured x{o['measured_ratio']} "
                     f"({o['error_pct']:+.1f}%)")
    return "\n".join(lines)


if __name__ == "__main__":  # the child: python -m cflow.bench.disk_tier --child SPEC
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit("usage: python -m cflow.bench.disk_tier --child SPEC (cflow bench disk-tier starts it)")
    print(json.dumps(_child(json.loads(sys.argv[2]))))
