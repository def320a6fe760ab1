"""`cflow inspect FILE`: a .cflow file's header summary and tensor table (reads no payload)."""

HELP = "show a .cflow file's header (config, sections, experts) and its tensor table"


def add_arguments(p):
    p.add_argument("file", help="the .cflow file")
    p.add_argument("--config", action="store_true", help="print the full model config as JSON")


def main(args) -> int:
    import json

    from cflow.errors import CflowFormatError
    from cflow.format import CflowFile
    from cflow.format.summary import summary_lines, tensor_table

    try:
        f = CflowFile(args.file)
    except CflowFormatError as e:
        raise CflowFormatError(f"{args.file}: {e}") from None
    with f:
        for line in summary_lines(f):
            print(line)
        if args.config:
            print(json.dumps(f.config.to_dict(), indent=2))
        for line in tensor_table(f):
            print(line)
    return 0
