"""`cflow pull NAME`: fetch a model into the cache; the last line printed is its local path."""

HELP = "download a model into the cache (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, hf://owner/repo/file)"


def add_arguments(p):
    p.add_argument("name", help="a known model name or hf://owner/repo[/file][@revision]")
    p.add_argument("--cache", help="cache directory (default: $CFLOW_CACHE or $XDG_CACHE_HOME/cflow)")
    p.add_argument("--force", action="store_true", help="download again even when cached")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def main(args) -> int:
    from cflow import hub

    path = hub.pull(args.name, cache=args.cache, quiet=args.quiet, force=args.force)
    print(path)
    return 0
