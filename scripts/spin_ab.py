"""The thread pool's barrier spin budgets side by side (docs/KERNELS.md, "Thread pool").

    python scripts/spin_ab.py MODEL [--budgets 50,2000,adapt] [--pairs 4] [--threads 2]

Each round starts one fresh process per budget, in turn (CFLOW_SPIN_US=N fixes the budget;
"adapt" leaves the pool's own choice); each process decodes a 64-token prompt, then times 48
one-token decode steps and prints the median of the last 40. Fresh processes because the budget
is read when the pool starts, and rounds because a shared host drifts: compare within a row.
MODEL: a name in the cache (cflow list) or a .cflow path.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def one(model: str, threads: int) -> float:
    from cflow.engine import Engine
    from cflow.llm import load_model

    eng = Engine(load_model(model, quiet=True), threads=threads)
    st = eng.new_state()
    eng.forward(st, list(range(100, 164)))
    times, tok = [], 5
    for k in range(48):
        t0 = time.perf_counter()
        eng.forward(st, [tok])
        times.append(time.perf_counter() - t0)
        tok = 100 + (k * 37) % 1000
    return statistics.median(times[8:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--budgets", default="50,2000,adapt")
    ap.add_argument("--pairs", type=int, default=4, help="rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(f"{one(a.model, a.threads):.2f}")
        return
    budgets = a.budgets.split(",")
    rows = {b: [] for b in budgets}
    for r in range(a.pairs):
        line = []
        for b in budgets:
            env = dict(os.environ)
            env.pop("CFLOW_SPIN_US", None)
            if b != "adapt":
                env["CFLOW_SPIN_US"] = b
            out = subprocess.run([sys.executable, __file__, a.model, "--threads", str(a.threads), "--child"],
                                 env=env, capture_output=True, text=True, check=True)
            ms = float(out.stdout.strip())
            rows[b].append(ms)
            line.append(f"{b}: {ms:6.2f} ms")
        print(f"round {r + 1}: " + "  ".join(line), flush=True)
    print("median: " + "  ".join(f"{b}: {statistics.median(v):.2f} ms" for b, v in rows.items()))


if __name__ == "__main__":
    main()
