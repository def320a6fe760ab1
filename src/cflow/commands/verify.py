"""`cflow verify FILE`: check a .cflow file completely and print a summary, then OK."""

HELP = "check a .cflow file (structure, every offset, every section checksum, config against tensors); prints a summary and OK"


def add_arguments(p):
    p.add_argument("file", help="the .cflow file")


def main(args) -> int:
    from cflow import models
    from cflow.errors import CflowFormatError
    from cflow.format import CflowFile
    from cflow.format.summary import summary_lines

    try:
        f = CflowFile(args.file, verify=True)
        models.check_model(f.config, f.tensors)  # as the engines check it on load
    except CflowFormatError as e:
        raise CflowFormatError(f"{args.file}: {e}") from None
    with f:
        for line in summary_lines(f):
            print(line)
    print("OK")
    return 0
