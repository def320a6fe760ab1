"""`cflow export`: write a training checkpoint as a `.cflow` file for the native engine."""

import sys

HELP = "export a pipeline-native training checkpoint to the .cflow tile format"

FLOAT_TYPES = ("f32", "f16", "bf16")


def add_arguments(p):
    p.add_argument("checkpoint", help="ckpt.pt (or its run folder)")
    p.add_argument("-o", "--output", required=True, help="the .cflow file to write")
    p.add_argument("--type", default="q8_0", help="block type of the weight matrices (q4_0, q8_0, f16, f32, ...)")
    p.add_argument("--embd-type", default=None,
                   help="block type of tok_embd and output (default: --type for f32/f16/bf16, else q8_0: "
                        "the head kept finer than 4-bit matrices, as llama.cpp's quantize does)")
    p.add_argument("--calibrate", metavar="DATA", default=None,
                   help="text to run the model on first (a corpus file as `cflow train --data` takes): q4_0 "
                        "and q4_1 matrices are then written by GPTQ against the activations it measured, which "
                        "keeps the error of their products, not of their weights, small (docs/ARCHITECTURES.md)")
    p.add_argument("--calibrate-tokens", type=int, default=8192,
                   help="tokens of --calibrate to run (default %(default)s)")


def main(args) -> int:
    from cflow.errors import CflowError
    from cflow.format.quant import FITTED
    from cflow.models.export import export_checkpoint

    from cflow.train import checkpoint

    etype = args.embd_type or (args.type if args.type in FLOAT_TYPES else "q8_0")
    ck = checkpoint.load(args.checkpoint)
    windows = None
    if args.calibrate is not None and not {args.type, etype} & set(FITTED):
        print(f"note: --calibrate not used: only q4_0 and q4_1 are written against it, not {args.type}"
              + (f" or {etype}" if etype != args.type else ""), file=sys.stderr)
    elif args.calibrate is not None:
        from cflow.models.calibrate import windows_of
        from cflow.train import data

        if args.calibrate_tokens < 1:
            raise CflowError(f"--calibrate-tokens must be positive, got {args.calibrate_tokens}")
        windows = windows_of(ck["tokenizer"], data.read_texts(args.calibrate), args.calibrate_tokens,
                             ck["config"].max_seq_len)
    n = export_checkpoint(ck, args.output, args.type, etype, calibration=windows)
    cal = f", calibrated on {sum(map(len, windows))} tokens" if windows else ""
    print(f"wrote {args.output}: {n} tensors ({args.type} matrices, {etype} embedding and head{cal})")
    return 0
