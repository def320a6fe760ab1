"""`cflow bench kernels|decode`: measured speed, side by side with the bandwidth probe."""

import importlib

HELP = "benchmarks: `kernels` (bandwidth probe + tile GEMVs), `decode` (end-to-end, optionally vs llama.cpp)"
BENCHMARKS = {
    "kernels": "bandwidth probe, then every tile GEMV on a matrix larger than L3",
    "decode": "decode and prefill tokens/s of a model, bytes/token, % of the probe",
    "load": "concurrent clients against `cflow serve`: errors, p50/p95 latency, tokens/s, server memory",
}


def add_arguments(p):
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, help_ in BENCHMARKS.items():
        # argparse %-formats help strings (not descriptions): a literal "%" must be doubled there
        sp = sub.add_parser(name, help=help_.replace("%", "%%"), description=help_)
        sp.set_defaults(_bench=name)
        try:
            mod = importlib.import_module(f"cflow.bench.{name}")
        except ModuleNotFoundError:
            continue
        mod.add_arguments(sp)


def main(args) -> int:
    from cflow.errors import CflowError

    try:
        mod = importlib.import_module(f"cflow.bench.{args._bench}")
    except ModuleNotFoundError as e:
        raise CflowError(f"benchmark {args._bench!r} is not available in this build") from e
    return mod.main(args)
