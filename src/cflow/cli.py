"""The `cflow` command: one dispatcher, one module per verb.

Each module in cflow/commands/ defines HELP (one line), add_arguments(parser) and
main(args) -> int. Verbs are discovered from that folder, and heavy imports stay inside each
verb's main(), so `cflow --help` is fast and the inference verbs never import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import pkgutil
import signal
import sys
import threading

from cflow import __version__
from cflow.errors import CflowError


def _verbs() -> dict[str, object]:
    import cflow.commands as pkg

    verbs = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        verbs[info.name.replace("_", "-")] = importlib.import_module(f"cflow.commands.{info.name}")
    return verbs


@functools.lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb (built once: `main` may run many times in one process, as the
    fuzz worker and the tests run it)."""
    parser = argparse.ArgumentParser(prog="cflow", description="CPU-first LLM inference and pipeline-native transformers.")
    parser.add_argument("--version", action="version", version=f"cflow {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, mod in _verbs().items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as SIGINT raises KeyboardInterrupt: `with` blocks and
    `finally` clauses run, so an atomic write (a temp file, then a rename) removes its temp file
    instead of leaving it behind. A BaseException, so that no `except Exception` swallows it."""


def _raise_terminated(signum, frame):
    raise Terminated


@contextlib.contextmanager
def _sigterm_unwinds():
    """While a verb runs, SIGTERM raises Terminated (where signals can be handled: the main
    thread, and unless the process was started with SIGTERM ignored); the previous handler comes
    back afterwards. The server replaces it with its own graceful shutdown while it serves."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def one_line(text: str) -> str:
    """text with control characters (newlines, form feeds; a hostile file's names may carry
    them) written as escapes, so an error stays one line on the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    try:
        with _sigterm_unwinds():
            return int(args._main(args) or 0)
    except CflowError as e:
        print(f"cflow {args.verb}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ncflow {args.verb}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"cflow {args.verb}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
