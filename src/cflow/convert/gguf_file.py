"""GGUF files (versions 2 and 3) read with every count checked against the bytes the file has.

gguf-py's GGUFReader believes the counts it reads: an array that claims 2^62 elements keeps it
looping, and growing memory, long after the file has ended, and a tensor offset near 2^64 wraps
around into the header. So cflow reads the header itself, in one pass that checks before it
reads or allocates anything:

- every count and string length against the bytes left in the file, so the work and the memory
  a file can ask for are bounded by its size;
- value types against the ones GGUF defines; arrays of arrays are refused, as llama.cpp does;
- keys and strings are strict UTF-8, and a key appears once;
- each tensor has 1..4 dimensions, a GGML type of known block size, whole blocks per row, and
  its data inside the data section, at an offset that is a multiple of general.alignment (the
  sum is a Python int: it cannot wrap), overlapping no other tensor's.

Every failure is a CflowFormatError naming the file and the key or tensor. Tensor data are views
of one read-only mapping, shaped as gguf-py shapes them.

    g = read_gguf("model.gguf")
    g.metadata["llama.block_count"]      # int, float, bool, str, or a list of one of those
    t = g.tensors[0]                     # GGUFTensor: name, dims, type_code, offset, nbytes
    g.data(t)                            # numpy view of the tensor's bytes
    t.shape                              # numpy order: (n,), (rows, cols), (n_expert, rows, cols)
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from cflow.errors import CflowError, CflowFormatError, UnsupportedError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
STRING, ARRAY = 8, 9
# the scalar value types: code -> (name, little-endian numpy dtype)
SCALARS = {0: ("uint8", "u1"), 1: ("int8", "i1"), 2: ("uint16", "<u2"), 3: ("int16", "<i2"), 4: ("uint32", "<u4"),
           5: ("int32", "<i4"), 6: ("float32", "<f4"), 7: ("bool", "u1"), 10: ("uint64", "<u8"), 11: ("int64", "<i8"),
           12: ("float64", "<f8")}
BOOL = 7
# the fewest bytes one entry can take: a metadata key/value (empty key, one byte value) and a
# tensor index entry (empty name, one dimension): counts above left // these cannot be true
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8
F32, F16 = 0, 1  # the GGML types gguf-py returns as float arrays (others: uint8 bytes per row)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGML order: dims[0] is the row length (columns)
    type_code: int
    offset: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's order, as gguf-py gives it: (n,), (rows, cols), or (n_expert, rows, cols) for
        the packed experts of a mixture-of-experts layer (dims reversed)."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int  # where the data section starts
    buffer: mmap.mmap

    def data(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes, no copy: float32 / float16 values for F32 / F16 tensors, else uint8,
        bytes per row (block types, BF16), in the tensor's shape (the last axis in bytes). Whole
        blocks per row and the byte count were checked when the index was read."""
        if t.type_code in (F32, F16):
            dtype = np.dtype("<f4" if t.type_code == F32 else "<f2")
            return np.frombuffer(self.buffer, dtype, t.nbytes // dtype.itemsize, t.offset).reshape(t.shape)
        a = np.frombuffer(self.buffer, np.uint8, t.nbytes, t.offset)
        return a.reshape(t.shape[:-1] + (-1,)) if len(t.shape) >= 2 else a


class _Cursor:
    """Reads the mapped file front to back; every read checks its length against the end first."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.end = buf, path, 0, len(buf)

    def fail(self, what: str, msg: str):
        raise CflowFormatError(f"{self.path}: truncated or malformed GGUF file: {what}: {msg}")

    def need(self, n: int, what: str, thing: str = "") -> None:
        """Fail unless n more bytes (`thing` says what they hold) are left after the cursor."""
        if n > self.end - self.pos:
            self.fail(what, f"{thing or f'{n} bytes'} at offset {self.pos} would run past the end of the file "
                            f"({self.end - self.pos} bytes left)")

    def take(self, n: int, what: str, thing: str = "") -> int:
        """Claim n bytes at the cursor; returns their offset."""
        self.need(n, what, thing)
        at, self.pos = self.pos, self.pos + n
        return at

    def scalar(self, code: int, what: str):
        dtype = np.dtype(SCALARS[code][1])
        v = np.frombuffer(self.buf, dtype, 1, self.take(dtype.itemsize, what))[0].item()
        return bool(v) if code == BOOL else v

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        at = self.take(n, what, f"a string of {n} bytes")
        try:
            return self.buf[at:at + n].decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(what, f"not valid UTF-8 ({e.reason} at byte {e.start})")

    def value(self, code: int, what: str) -> Any:
        if code == STRING:
            return self.string(what)
        if code in SCALARS:
            return self.scalar(code, what)
        if code != ARRAY:
            self.fail(what, f"unknown value type {code}")
        item, count = self.u32(what), self.u64(what)
        if item == ARRAY:
            self.fail(what, "arrays of arrays are not supported (llama.cpp refuses them too)")
        if item == STRING:
            # each string takes at least its 8-byte length: a count the file cannot hold fails before the loop
            self.need(8 * count, what, f"an array of {count} strings")
            return [self.string(f"{what}[{i}]") for i in range(count)]
        if item not in SCALARS:
            self.fail(what, f"array of unknown value type {item}")
        dtype = np.dtype(SCALARS[item][1])
        at = self.take(count * dtype.itemsize, what, f"an array of {count} values of {dtype.itemsize} bytes")
        values = np.frombuffer(self.buf, dtype, count, at)
        return (values != 0).tolist() if item == BOOL else values.tolist()


def _block_sizes() -> dict[int, tuple[int, int]]:
    """GGML type code -> (elements, bytes) of one block, for every type gguf-py knows."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(k): v for k, v in GGML_QUANT_SIZES.items()}


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Map a GGUF file and read its header, metadata and tensor index, all checked (see above)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise CflowFormatError(f"{path}: truncated or malformed GGUF file: {size} bytes are too few for "
                                       "a GGUF header")
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CflowError(f"cannot read {path}: {e.strerror or e}") from None
    c = _Cursor(buf, path)
    if buf[:4] != MAGIC:
        c.fail("header", f"bad magic {bytes(buf[:4])!r}: not a GGUF file")
    c.take(4, "magic")
    version = c.u32("header")
    if version not in VERSIONS:
        what = "a big-endian file, which cflow does not read" if version & 0xFFFF == 0 else "not a version cflow reads"
        c.fail("header", f"GGUF version {version}: {what} (cflow reads versions {', '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = c.u64("header"), c.u64("header")
    if n_kv > (size - c.pos) // MIN_KV_BYTES:
        c.fail("header", f"{n_kv} metadata keys cannot fit in the {size} bytes of the file")
    if n_tensors > (size - c.pos) // MIN_TENSOR_BYTES:
        c.fail("header", f"{n_tensors} tensors cannot fit in the {size} bytes of the file")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string(f"metadata key at offset {c.pos}")
        if key in metadata:
            c.fail(f"metadata {key!r}", "the key appears twice")
        what = f"metadata {key!r}"
        metadata[key] = c.value(c.u32(what), what)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or not 0 < alignment <= 1 << 30 \
            or alignment & (alignment - 1):
        c.fail("metadata 'general.alignment'", f"{alignment!r} is not a power of two up to 2^30")
    sizes = _block_sizes()
    index = []
    for _ in range(n_tensors):
        name = c.string(f"tensor name at offset {c.pos}")
        what = f"tensor {name!r}"
        n_dims = c.u32(what)
        if not 1 <= n_dims <= MAX_DIMS:
            c.fail(what, f"{n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
        dims = tuple(c.u64(what) for _ in range(n_dims))
        index.append((name, dims, c.u32(what), c.u64(what)))
    data_offset = -(-c.pos // alignment) * alignment
    tensors = [_tensor(c, sizes, alignment, data_offset, *entry) for entry in index]
    _no_overlaps(c, tensors)
    if len({t.name for t in tensors}) != len(tensors):
        c.fail("tensor index", "a tensor name appears twice")
    return GGUFFile(path, version, metadata, tensors, alignment, data_offset, buf)


def _tensor(c: _Cursor, sizes, alignment: int, data_offset: int, name: str, dims, code: int, offset: int) -> GGUFTensor:
    what = f"tensor {name!r}"
    if code not in sizes:
        raise UnsupportedError(f"{c.path}: {what} has GGML type code {code}, which is not a known GGML type")
    block_elems, block_bytes = sizes[code]
    if not all(d >= 1 for d in dims) or dims[0] % block_elems:
        c.fail(what, f"dimensions {list(dims)}: each must be positive, the first a multiple of the block size {block_elems}")
    elements = int(np.prod(dims, dtype=object))
    nbytes = elements // block_elems * block_bytes
    if offset % alignment:
        c.fail(what, f"data offset {offset} is not a multiple of the alignment {alignment}")
    start = data_offset + offset
    if start + nbytes > c.end:
        c.fail(what, f"data offset {offset} ({nbytes} bytes) lies outside the file's data section "
                     f"[{data_offset}, {c.end})")
    return GGUFTensor(name, dims, code, start, nbytes)


def _no_overlaps(c: _Cursor, tensors: list[GGUFTensor]) -> None:
    prev = None
    for t in sorted(tensors, key=lambda t: t.offset):
        if prev is not None and t.offset < prev.offset + prev.nbytes:
            c.fail(f"tensor {t.name!r}", f"data overlaps tensor {prev.name!r}")
        prev = t
