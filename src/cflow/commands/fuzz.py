"""`cflow fuzz`: structure-aware fuzzing of the model-file loaders (cflow/fuzz)."""

HELP = "mutate real .cflow, GGUF and safetensors files and check every loader's answer (a clear error or a good model)"


def add_arguments(p):
    p.add_argument("-n", "--mutants", type=int, default=1000, help="mutants to check (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: mutant i of a seed is always the same")
    p.add_argument("--start", type=int, default=0, help="first mutant index (to continue a run)")
    p.add_argument("--kinds", default="gguf,cflow,safetensors", help="bases to mutate (default all three, in turn)")
    p.add_argument("-j", "--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a worker may take for one mutant before it counts as a hang (default 60)")
    p.add_argument("--bases", default=None, help="where the base files are made (default CFLOW_CACHE/fuzz-bases)")
    p.add_argument("--failures", default="fuzz-failures",
                   help="where failing mutants are kept (DIR/corpus.jsonl; default ./fuzz-failures)")
    p.add_argument("--replay", default=None, metavar="CORPUS",
                   help="check the entries of a corpus file (or a directory of *.jsonl) instead of new mutants")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every outcome as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    import json
    import time
    from pathlib import Path

    from tqdm import tqdm

    from cflow import hub
    from cflow.errors import CflowError
    from cflow.fuzz import run as fuzz

    bases = Path(args.bases) if args.bases else hub.cache_dir() / "fuzz-bases"
    t = time.perf_counter()
    if args.replay:
        if not Path(args.replay).exists():
            raise CflowError(f"{args.replay}: no such corpus file or directory")
        entries = fuzz.read_corpus(Path(args.replay))
        if not entries:
            raise CflowError(f"{args.replay}: no corpus entries")
        outcomes = fuzz.replay(entries, bases_dir=bases, jobs=args.jobs, timeout=args.timeout)
    else:
        kinds = tuple(k for k in args.kinds.split(",") if k)
        unknown = set(kinds) - set(fuzz.fuzz_bases.KINDS)
        if unknown or not kinds:
            raise CflowError(f"--kinds {args.kinds!r}: choose from {', '.join(fuzz.fuzz_bases.KINDS)}")
        if args.mutants < 1 or args.jobs < 1:
            raise CflowError("--mutants and --jobs must be at least 1")
        with tqdm(total=args.mutants, unit="mutant", disable=args.quiet) as bar:
            outcomes = fuzz.run(args.mutants, seed=args.seed, start=args.start, jobs=args.jobs, timeout=args.timeout,
                                kinds=kinds, bases_dir=bases, failures=Path(args.failures), progress=bar)
    for line in fuzz.summary(outcomes, time.perf_counter() - t):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=0))
    return 1 if any(o.failed for o in outcomes) else 0
