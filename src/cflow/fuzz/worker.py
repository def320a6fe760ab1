"""The fuzz worker: `python -m cflow.fuzz.worker WORKDIR` reads one JSON request per line
({"kind": ..., "path": ...}) and answers one JSON line per request with each target's outcome.

Targets, each run as the `cflow` command in this process (so a traceback is seen as one):
  .cflow:             verify, inspect, generate -n 4
  GGUF, safetensors:  convert -o OUT.cflow, then verify, inspect and generate -n 4 of OUT when it
                      converted, else generate -n 4 of the mutant (which must fail as clearly)
and, when generate accepted the file, the logits of a prompt, which must be finite.

Outcomes: "ok" (exit 0), "error" (exit 2 and one line `cflow VERB: error: ...`), and the
failures "traceback" (an exception escaped the command), "memory" (MemoryError: an allocation
past the worker's address-space limit), "badexit" (any other exit, or an error that is not one
line), "nonfinite" (an accepted file whose logits are not all finite), "leftover" (a failed
convert left a file behind). The watcher (`cflow.fuzz.run`) adds "crash" and "hang".
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import shutil
import sys
import traceback
from pathlib import Path

FAILURES = ("crash", "hang", "traceback", "memory", "badexit", "nonfinite", "leftover")
ADDRESS_SPACE = 6 << 30  # a hostile length field that makes a loader allocate without bound stops here
PROMPT = "Once upon a time"


def run_verb(argv: list[str]) -> tuple[str, str]:
    """(outcome, detail) of `cflow ARGV` in this process."""
    from cflow.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
    except MemoryError:
        return "memory", "MemoryError"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any exception escaping the command is the finding
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        return "traceback", f"{type(e).__name__} at {where}: {str(e)[:200]}"
    text = err.getvalue()
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("converting ")
             and "\r" not in ln and "it/s" not in ln and "B/s" not in ln]
    if rc == 0:
        return "ok", ""
    if rc == 2 and lines and "Traceback" not in text and len(lines) == 1 and \
            re.match(rf"cflow {argv[0]}: error: \S", lines[-1]):
        return "error", lines[-1][:300]
    return "badexit", f"exit {rc}: {text.strip()[-300:]}"


def logits_finite(path: str) -> tuple[str, str]:
    import numpy as np

    from cflow import LLM
    from cflow.errors import CflowError

    try:
        llm = LLM(path, threads=1)
        x = llm.logits(llm.encode_prompt(PROMPT))
    except CflowError as e:
        return "error", str(e)[:300]
    except MemoryError:
        return "memory", "MemoryError"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        return "traceback", f"{type(e).__name__}: {str(e)[:200]}"
    if not np.isfinite(x).all():
        return "nonfinite", f"{int((~np.isfinite(x)).sum())} of {x.size} logits are not finite"
    return "ok", ""


def check(kind: str, path: str, work: Path) -> dict:
    out_dir = work / "out"
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(work / "cache", ignore_errors=True)
    out_dir.mkdir(parents=True)
    results = {}
    if kind == "cflow":
        results["verify"] = run_verb(["verify", path])
        results["inspect"] = run_verb(["inspect", path])
    else:
        out = out_dir / "out.cflow"
        results["convert"] = run_verb(["convert", path, "-o", str(out), "--quiet"])
        if results["convert"][0] == "ok":
            results["verify"] = run_verb(["verify", str(out)])
            results["inspect"] = run_verb(["inspect", str(out)])
        elif any(out_dir.iterdir()):
            results["convert"] = ("leftover", f"{results['convert'][1]}; left {sorted(p.name for p in out_dir.iterdir())}")
    # a converted GGUF or safetensors mutant runs from its conversion (generate would convert it
    # again); one that failed to convert must fail as clearly in generate
    model = str(out_dir / "out.cflow") if results.get("convert", ("",))[0] == "ok" else path
    results["generate"] = run_verb(["generate", "-m", model, "-n", "4", "--temperature", "0", "--threads", "1", PROMPT])
    if results["generate"][0] == "ok":
        results["logits"] = logits_finite(model)
    return {k: list(v) for k, v in results.items()}


def main() -> None:
    work = Path(sys.argv[1])
    os.environ["CFLOW_CACHE"] = str(work / "cache")
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    # answers go to the original stdout; anything native code prints goes to /dev/null
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import cflow.cli  # noqa: F401 - imported once, before the first request
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        answers.write(json.dumps(check(req["kind"], req["path"], work)) + "\n")


if __name__ == "__main__":
    main()
