"""`cflow export`: write a training checkpoint as a `.cflow` file for the native engine."""

HELP = "export a pipeline-native training checkpoint to the .cflow tile format"


def add_arguments(p):
    p.add_argument("checkpoint", help="ckpt.pt (or its run folder)")
    p.add_argument("-o", "--output", required=True, help="the .cflow file to write")
    p.add_argument("--type", default="q8_0", help="block type of the weight matrices (q4_0, q8_0, f16, f32, ...)")
    p.add_argument("--embd-type", default=None, help="block type of tok_embd and output (default: --type)")


def main(args) -> int:
    from cflow.models.export import export_checkpoint

    n = export_checkpoint(args.checkpoint, args.output, args.type, args.embd_type or args.type)
    print(f"wrote {args.output}: {n} tensors")
    return 0
