"""`cflow claims`: the paper's eight claims re-measured, written to docs/CLAIMS.md with plots."""

HELP = "rerun the paper's eight claims on this machine and write docs/CLAIMS.md (needs torch, matplotlib)"


def add_arguments(p):
    p.add_argument("-o", "--out", default="docs/CLAIMS.md", help="the page to write (plots go to img/ beside it)")
    p.add_argument("--work", default=None, help="folder for the models it makes (default: ~/.cache/cflow/claims)")
    p.add_argument("--only", default=None, help="comma-separated claim numbers (default: all eight)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--disk-model", default=None,
                   help="a mixture-of-experts .cflow larger than --memory-limit: claim 6 from disk as well")
    p.add_argument("--memory-limit", default="8G", help="the disk runs' memory limit (default 8G)")


def main(args) -> int:
    import os
    import sys
    from pathlib import Path

    from cflow.analysis.claims import CLAIMS, run_claims
    from cflow.engine import parse_size
    from cflow.errors import CflowError

    only = None
    if args.only:
        try:
            only = sorted({int(x) for x in args.only.split(",") if x.strip()})
        except ValueError:
            raise CflowError(f"--only takes claim numbers 1..8, got {args.only!r}") from None
        if not only or any(n not in CLAIMS for n in only):
            raise CflowError(f"--only takes claim numbers 1..8, got {args.only!r}")
    work = Path(args.work or os.path.join(os.path.expanduser("~"), ".cache", "cflow", "claims"))
    command = "cflow claims" + "".join(f" {a}" for a in sys.argv[2:])
    claims = run_claims(out=Path(args.out), work=work, threads=args.threads, only=only, disk_model=args.disk_model,
                        memory_limit=parse_size(args.memory_limit), command=command,
                        log=lambda *a: print(*a, file=sys.stderr, flush=True))
    for c in claims:
        print(f"claim {c.number}: {c.verdict}")
    print(f"wrote {args.out}")
    return 0
