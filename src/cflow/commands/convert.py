"""`cflow convert SRC -o OUT.cflow`: a GGUF file or Hugging Face directory to .cflow."""

HELP = "convert a GGUF file or Hugging Face directory (or a known model name) to .cflow"


def add_arguments(p):
    from cflow import models

    p.epilog = "architectures: " + "; ".join(
        f"{a.name} (model_type {', '.join(a.hf_model_types) or '-'}; GGUF {', '.join(a.gguf_archs) or '-'})"
        for a in models.architectures().values() if a.hf_model_types or a.gguf_archs)
    p.add_argument("src", help="a .gguf file, an HF directory (config.json + *.safetensors), a known name or hf://...")
    p.add_argument("-o", "--output", required=True, help="output .cflow path (written atomically)")
    p.add_argument("--quant", "--quantize", default="keep",
                   choices=("keep", "q4_0", "q4_1", "q8_0", "f16", "f32", "tq1_0", "tq2_0"),
                   help="block type of the matrices (keep: GGUF blocks unchanged, HF dtypes kept). tq1_0 / tq2_0 "
                        "ternarize the layers' matrices (absmean rounding per block of 256; embeddings and head "
                        "q8_0) and then measure and print what that cost against the source")
    p.add_argument("--no-measure", action="store_true",
                   help="tq1_0 / tq2_0: skip the measurement against the source (a teacher-forced text in both models)")
    p.add_argument("--pack", default="planes", choices=("planes", "blocks"),
                   help="q4_0/q4_1/q5_0/q5_1/q8_0/q4_k/q5_k/q6_k matrices: planes (16-row planes, the fast GEMV "
                        "layout) or whole GGUF blocks (interleave 1); other types always keep whole blocks")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def main(args) -> int:
    import os

    from cflow import hub
    from cflow.convert import convert

    src = hub.resolve(args.src, quiet=args.quiet)
    out = convert(src, args.output, quant=args.quant, progress=not args.quiet, pack=args.pack)
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB)")
    if args.quant in ("tq1_0", "tq2_0"):
        from cflow.convert.quality import compare
        from cflow.format import CflowFile

        with CflowFile(out) as f:
            werr = f.metadata.get("ternarize_weight_error")
        if werr is not None:
            print(f"ternarized: the layers' weights moved by {100 * werr:.1f}% (relative RMS)")
        if not args.no_measure:
            q = compare(src, out)
            print(f"quality on a {q['tokens']}-token text against the source: perplexity {q['ppl_source']:.2f} -> "
                  f"{q['ppl_converted']:.2f}, greedy next token the same at {100 * q['top1']:.1f}% of positions")
    return 0
