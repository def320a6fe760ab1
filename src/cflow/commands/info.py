"""`cflow info`: version, native core, and which kernel path this CPU runs."""

HELP = "show the version, the native core's ISA path and CPU features"


def add_arguments(p):
    pass


def main(args) -> int:
    from cflow import __version__
    from cflow._native import core

    print(f"cflow {__version__}")
    print(f"kernel path: {core.best_isa()}")
    for isa in ("scalar", "avx2", "avx512"):
        print(f"  {isa:7s} {'yes' if core.isa_supported(isa) else 'no'}")
    print(f"  amx     {'yes' if core.amx_usable() else 'no'} (batched decode steps; CFLOW_AMX=0 turns it off)")
    return 0
