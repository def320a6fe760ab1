"""Activation settings side by side, step by step, in one process (docs/SERVER.md, "Load").

    python scripts/settings_ab.py MODEL [--settings int8x2,int8x2:qkv+attn_output+gate_up+down,int8]
                                        [--batch 8] [--context 40] [--steps 300] [--threads 2]

One engine per setting (an --activations value, or int8x2:ROLE+ROLE as `cflow bench fidelity`
takes it), each with --batch sequences of a --context-token prompt; then --steps decode steps
of every engine in turn, the order reversed every step (ABBA), the sequences started again every
64 steps so that the context stays near --context. Prints each engine's median step and, against
the first setting, the median and quartiles of the step-by-step ratios: on a shared host whose
speed drifts over seconds and minutes, a ratio of steps taken a few milliseconds apart is the
figure that carries over. MODEL: a name in the cache (cflow list) or a .cflow path.
"""
import argparse
import statistics
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--settings", default="int8x2,int8x2:qkv+attn_output+gate_up+down,int8")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=40)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    from cflow.bench.fidelity import parse_setting
    from cflow.engine import Engine
    from cflow.llm import load_model

    names = [s for s in a.settings.split(",") if s]
    f = load_model(a.model, quiet=True)
    engines = [Engine(f, threads=a.threads, **parse_setting(s)) for s in names]
    prompt = [100 + (i * 7919) % 5000 for i in range(a.context)]  # distinct tokens of any vocabulary

    def start(e):
        states = [e.new_state() for _ in range(a.batch)]
        return states, e.forward(states, [prompt[i:] + prompt[:i] for i in range(a.batch)])

    runs = [start(e) for e in engines]
    times = [[] for _ in engines]
    for k in range(a.steps):
        if k and k % 64 == 0:
            runs = [start(e) for e in engines]
        order = range(len(engines)) if k % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            states, outs = runs[i]
            t0 = time.perf_counter()
            outs = engines[i].forward(states, [[int(np.argmax(o))] for o in outs])
            times[i].append(time.perf_counter() - t0)
            runs[i] = (states, outs)
    print(f"{a.model}: {a.batch} sequences at ~{a.context} positions, {a.threads} threads, {a.steps} steps each")
    for name, t in zip(names, times):
        print(f"  {name:45s} median step {1e3 * statistics.median(t):7.2f} ms")
    for name, t in zip(names[1:], times[1:]):
        r = [b / c for b, c in zip(t, times[0])]
        q1, q3 = np.percentile(r, [25, 75])
        print(f"  {name} / {names[0]}: median {statistics.median(r):.3f} (quartiles {q1:.3f}-{q3:.3f})")


if __name__ == "__main__":
    main()
