"""`cflow list`: the models in the cache, and the known names that can be pulled."""

HELP = "show the cached models (and the known ones that `cflow pull` can fetch)"


def add_arguments(p):
    p.add_argument("--cache", help="cache directory (default: $CFLOW_CACHE or $XDG_CACHE_HOME/cflow)")


def main(args) -> int:
    from cflow import hub

    rows = hub.list_cached(args.cache)
    print(f"cache: {hub.cache_dir(args.cache)}")
    have = {r["name"] for r in rows}
    for r in rows:
        conv = "  converted" if r["cflow"] and r["cflow"] != r["path"] else ""
        print(f"  {r['name']:20s} {r['bytes'] / 1e6:8.1f} MB  {r['path']}{conv}")
    if not rows:
        print("  (empty)")
    missing = [m for m in hub.KNOWN_MODELS.values() if m.name not in have]
    if missing:
        print("available with `cflow pull NAME`:")
        for m in missing:
            print(f"  {m.name:20s} {m.description}")
    return 0
