"""`cflow bench kernels|decode|load|moe-model|disk-tier|ternary-model|fidelity`: measured speed,
side by side with the bandwidth probe, the files to measure it on, and the logits' fidelity. A
benchmark NAME is the module cflow.bench.NAME (a "-" in the name is a "_" in the module's)."""

import importlib

HELP = ("benchmarks: `kernels` (bandwidth probe + tile GEMVs), `decode` (end-to-end, optionally vs llama.cpp), "
        "`load` (clients vs a server), `moe-model` (a random-weight GGUF of a real MoE's size), `disk-tier` (that "
        "model beyond its memory limit), `ternary-model` "
        "(a random ternary GGUF of BitNet b1.58 2B's size), `fidelity` (logits against transformers, with llama.cpp's)")
BENCHMARKS = {
    "kernels": "bandwidth probe, then every tile GEMV on a matrix larger than L3",
    "decode": "decode and prefill tokens/s of a model, bytes/token, % of the probe",
    "load": "concurrent clients against `cflow serve`: errors, p50/p95 latency, tokens/s, server memory",
    "moe-model": "write a GGUF with Qwen3-30B-A3B's geometry (qwen3moe) and random Q4_0/Q4_K weights",
    "disk-tier": "a mixture-of-experts model beyond its memory limit: each expert policy and llama.cpp's mmap run",
    "ternary-model": "write a GGUF with BitNet b1.58 2B's geometry (bitnet) and random ternary TQ2_0/TQ1_0/Q4_0 weights",
    "fidelity": "teacher-forced logits of a GGUF against transformers (fp32): cflow per activation setting, llama.cpp",
}


def _module(name: str) -> str:
    return f"cflow.bench.{name.replace('-', '_')}"


def add_arguments(p):
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, help_ in BENCHMARKS.items():
        # argparse %-formats help strings (not descriptions): a literal "%" must be doubled there
        sp = sub.add_parser(name, help=help_.replace("%", "%%"), description=help_)
        sp.set_defaults(_bench=name)
        try:
            mod = importlib.import_module(_module(name))
        except ModuleNotFoundError:
            continue
        mod.add_arguments(sp)


def main(args) -> int:
    from cflow.errors import CflowError

    try:
        mod = importlib.import_module(_module(args._bench))
    except ModuleNotFoundError as e:
        raise CflowError(f"benchmark {args._bench!r} is not available in this build") from e
    return mod.main(args)
