"""Exceptions. Every error a user can cause ends in one of these, with a message naming the
problem; the CLI prints the message and exits with status 2 (no traceback)."""


class CflowError(Exception):
    """Base class of cflow's user-facing errors."""


class CflowFormatError(CflowError):
    """A weight file (.cflow, GGUF, safetensors) is malformed, truncated or hostile."""


class UnsupportedError(CflowError):
    """An architecture, tensor type or option that cflow does not support."""


class ModelFileChanged(CflowError):
    """The mapped model file was truncated or written in place while in use: the weights in
    memory are no longer the model's, so the engine refuses every step from then on."""


def library_failure(e: BaseException) -> bool:
    """Whether `e`, raised by a library reading a hostile file, is that library's failure: any
    Exception, or a Rust panic (pyo3's PanicException, e.g. from tokenizers, derives from
    BaseException so that `except Exception` misses it). Interrupts and exits are not."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"
