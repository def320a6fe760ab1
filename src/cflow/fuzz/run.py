"""The fuzz run: mutants to worker processes, outcomes classified, failures kept.

Mutant i of a run with seed S is fixed by (S, i): its base is KINDS[i % 3] and its mutation
comes from random.Random(f"{S}:{i}"), so a run is repeatable. Each worker process takes one
mutant at a time; a worker that dies is a "crash" (and is restarted), one that does not answer
within `timeout` seconds is a "hang" (killed and restarted).

A failing mutant is appended to `failures/corpus.jsonl` as an edit of its base file (kind,
member: the file of a safetensors directory that was changed, and the bytes that differ: see
`diff`; the bases are made the same way each time). `replay(entries)`
runs such entries again: tests/data/fuzz-corpus.jsonl holds every mutant that ever failed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cflow.fuzz import bases as fuzz_bases
from cflow.fuzz.mutate import mutate
from cflow.fuzz.worker import FAILURES

SEVERITY = {"ok": 0, "error": 0, **{f: i + 1 for i, f in enumerate(reversed(FAILURES))}}


@dataclass
class Outcome:
    index: int
    kind: str
    member: str | None
    what: str
    result: str  # the worst target outcome: ok / error / a failure
    targets: dict = field(default_factory=dict)
    sha: str = ""

    @property
    def failed(self) -> bool:
        return self.result in FAILURES


class Worker:
    """One `python -m cflow.fuzz.worker` process and its private directory."""

    def __init__(self, root: Path, timeout: float):
        self.dir = Path(tempfile.mkdtemp(prefix="w", dir=root))
        self.timeout = timeout
        self.proc = None

    def _start(self):
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the cflow package's parent, for a source checkout
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "cflow.fuzz.worker", str(self.dir)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self._read(120)
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError("the fuzz worker did not start")

    def _read(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else None

    def check(self, kind: str, path: Path) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps({"kind": kind, "path": str(path)}) + "\n")
        self.proc.stdin.flush()
        line = self._read(self.timeout)
        if line:
            return json.loads(line)
        if line is None:  # no answer in time: a hang
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return {"worker": ["hang", f"no answer in {self.timeout:g} s"]}
        try:  # end of its output: the worker is exiting
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        return {"worker": ["crash", f"worker died with {'signal ' + str(-rc) if rc < 0 else 'exit ' + str(rc)}"]}

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


def materialize(kind: str, member: str | None, data: bytes, base: Path, at: Path) -> Path:
    """Write a mutant where a worker reads it: a file, or a copy of the base directory with
    `member` replaced."""
    if member is None:
        path = at / ("mutant.gguf" if kind == "gguf" else "mutant.cflow")
        path.write_bytes(data)
        return path
    path = at / "mutant"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base, path)
    (path / member).write_bytes(data)
    return path


def _worst(targets: dict) -> str:
    return max((v[0] for v in targets.values()), key=lambda r: SEVERITY.get(r, 99), default="ok")


def diff(base: bytes, data: bytes) -> dict:
    """data as an edit of base. Same length: `edits`, [offset, base64 bytes] runs that differ.
    Otherwise: the first `prefix` and last `suffix` bytes are base's and `middle` lies between.
    Every mutation here is local, so an entry stays small."""
    if len(base) == len(data):
        edits, i = [], 0
        while i < len(data):
            if base[i] != data[i]:
                j = i
                while j < len(data) and (base[j] != data[j] or base[j:j + 8] != data[j:j + 8]):
                    j += 1
                edits.append([i, base64.b64encode(data[i:j]).decode()])
                i = j
            else:
                i += 1
        return {"edits": edits}
    p = 0
    n = min(len(base), len(data))
    while p < n and base[p] == data[p]:
        p += 1
    q = 0
    while q < n - p and base[len(base) - 1 - q] == data[len(data) - 1 - q]:
        q += 1
    return {"prefix": p, "suffix": q, "middle": base64.b64encode(data[p:len(data) - q]).decode()}


def undiff(base: bytes, entry: dict) -> bytes:
    if "edits" in entry:
        out = bytearray(base)
        for at, raw in entry["edits"]:
            b = base64.b64decode(raw)
            out[at:at + len(b)] = b
        return bytes(out)
    return base[:entry["prefix"]] + base64.b64decode(entry["middle"]) + base[len(base) - entry["suffix"]:]


def base_bytes(kind: str, member: str | None, paths: dict[str, Path]) -> bytes:
    return (paths[kind] / member).read_bytes() if member else paths[kind].read_bytes()


def save_failure(o: Outcome, data: bytes, base: bytes, failures: Path) -> None:
    """Append the mutant to failures/corpus.jsonl (as an edit of its base)."""
    failures.mkdir(parents=True, exist_ok=True)
    entry = {"kind": o.kind, "member": o.member, "what": o.what, "result": o.result,
             "base_sha256": hashlib.sha256(base).hexdigest()[:16], **diff(base, data)}
    with open(failures / "corpus.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def read_corpus(path: Path) -> list[dict]:
    """The entries of a corpus file (or of every *.jsonl file in a directory)."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


def _pool(jobs: int, timeout: float, root: Path, items, handle, progress=None):
    """Run handle(worker, item) over items on `jobs` workers (one thread each)."""
    lock = threading.Lock()
    it = iter(items)

    def loop():
        w = Worker(root, timeout)
        try:
            while True:
                with lock:
                    item = next(it, None)
                if item is None:
                    return
                handle(w, item)
                if progress is not None:
                    progress.update(1)
        finally:
            w.close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(n: int, *, seed: int = 0, jobs: int = 2, timeout: float = 60.0, kinds=fuzz_bases.KINDS,
        bases_dir: Path, failures: Path | None = None, start: int = 0, progress=None) -> list[Outcome]:
    """Mutants start .. start+n-1 of `seed`, checked; failures saved to `failures`."""
    paths = fuzz_bases.make(bases_dir)
    root = Path(tempfile.mkdtemp(prefix="cflow-fuzz-"))
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def handle(w: Worker, i: int):
        kind = kinds[i % len(kinds)]
        member, data, what = mutate(kind, paths[kind], random.Random(f"{seed}:{i}"))
        targets = w.check(kind, materialize(kind, member, data, paths[kind], w.dir))
        o = Outcome(i, kind, member, what, _worst(targets), targets, hashlib.sha256(data).hexdigest()[:12])
        with lock:
            outcomes.append(o)
            if o.failed and failures is not None:
                save_failure(o, data, base_bytes(kind, member, paths), failures)

    try:
        _pool(jobs, timeout, root, range(start, start + n), handle, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return sorted(outcomes, key=lambda o: o.index)


def replay(entries: list[dict], *, bases_dir: Path, jobs: int = 1, timeout: float = 60.0) -> list[Outcome]:
    """Check corpus entries (see save_failure) again."""
    paths = fuzz_bases.make(bases_dir)
    root = Path(tempfile.mkdtemp(prefix="cflow-fuzz-"))
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def handle(w: Worker, item):
        i, e = item
        kind, member = e["kind"], e.get("member")
        data = undiff(base_bytes(kind, member, paths), e)
        targets = w.check(kind, materialize(kind, member, data, paths[kind], w.dir))
        with lock:
            outcomes.append(Outcome(i, kind, member, e.get("what", ""), _worst(targets), targets,
                                    hashlib.sha256(data).hexdigest()[:12]))

    try:
        _pool(jobs, timeout, root, list(enumerate(entries)), handle)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return sorted(outcomes, key=lambda o: o.index)


def summary(outcomes: list[Outcome], seconds: float) -> list[str]:
    """The run's table: outcome counts per base kind, then the failures."""
    classes = ["ok", "error", *FAILURES]
    lines = [f"{'base':12}" + "".join(f"{c:>10}" for c in classes) + f"{'total':>10}"]
    for kind in sorted({o.kind for o in outcomes}):
        c = Counter(o.result for o in outcomes if o.kind == kind)
        lines.append(f"{kind:12}" + "".join(f"{c[k]:>10}" for k in classes) + f"{sum(c.values()):>10}")
    c = Counter(o.result for o in outcomes)
    lines.append(f"{'all':12}" + "".join(f"{c[k]:>10}" for k in classes) + f"{sum(c.values()):>10}")
    lines.append(f"{len(outcomes)} mutants in {seconds:.0f} s ({len(outcomes) / max(seconds, 1e-9):.1f} per second)")
    for o in outcomes:
        if o.failed:
            bad = {k: v for k, v in o.targets.items() if v[0] in FAILURES}
            lines.append(f"FAIL #{o.index} {o.kind} {o.what[:80]}: {json.dumps(bad)[:300]}")
    return lines


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t
