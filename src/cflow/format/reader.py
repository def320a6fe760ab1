"""CflowFile: a `.cflow` file, mapped read-only, checked before anything is exposed.

    with CflowFile("model.cflow") as f:
        f.config                       # ModelConfig
        f.generation                   # the source's sampling defaults, e.g. {"temperature": 0.7}; may be {}
        f.tensors["blk.0.attn_qkv"]    # spec.Tensor: type, shape, tile, interleave, offset, nbytes, parts
        f.tensor_bytes("blk.0.ffn_down")   # uint8 view of the tiled payload (no copy)
        f.dequantize("blk.0.ffn_down")     # float32 (rows, cols), the GGUF dequantization
        f.experts[(0, 3)]              # spec.Expert: section, offset, length, tensors

Opening reads the preamble and the header (never the payload), checks the header checksum,
the JSON structure, every section / tensor / expert offset and length against the file size
and against each other, then maps the file. `verify=True` (or `verify()`) also checks every
section's crc32, reading the file in chunks.

The mapping is the native core's guarded MappedFile (numpy's memmap where the core is not
built): a file truncated while mapped reads zeros past its new end instead of killing the
process with SIGBUS, and `mapping_error()` / `check_mapping()` say when the file changed under
the mapping (docs/ENGINE.md, "Model file changed on disk").
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from typing import Any

import numpy as np

from cflow.config import ModelConfig
from cflow.errors import CflowError, CflowFormatError, ModelFileChanged
from cflow.format import quant
from cflow.format.spec import PREAMBLE, Expert, Preamble, Section, Tensor, align_up, crc32, parse_header, unfuse_rows
from cflow.format.tiles import unpack_tiles

VERIFY_CHUNK = 16 << 20


class CflowFile:
    """A mapped, validated `.cflow` file. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = False):
        self.path = os.fspath(path)
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):  # a FIFO or device would block or lie
                raise CflowFormatError(f"{self.path}: not a regular file")
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                size = st.st_size
                self.preamble = Preamble.unpack(fh.read(PREAMBLE.size), size)
                fh.seek(self.preamble.header_offset)
                raw = fh.read(self.preamble.header_length)
        except OSError as e:
            raise CflowFormatError(f"{self.path}: cannot read: {e.strerror or e}") from None
        if len(raw) != self.preamble.header_length:
            raise CflowFormatError(f"{self.path}: file shrank while reading the header")
        self.size = size
        h = parse_header(raw, self.preamble)
        self.sections: dict[str, Section] = h.pop("_sections")
        self.tensors: dict[str, Tensor] = h.pop("_tensors")
        self.experts: dict[tuple[int, int], Expert] = h.pop("_experts")
        self.header: dict[str, Any] = h
        try:
            self.config = ModelConfig.from_dict(h["config"])
        except Exception as e:  # ModelConfig raises CflowError; hostile values may raise others
            raise CflowFormatError(f"header.config: {e}") from None
        self.tokenizer_json: str | None = h.get("tokenizer")
        self.chat_template: str | None = h.get("chat_template")
        self.special_tokens: dict = h.get("special_tokens") or {}
        self.metadata: dict = h.get("metadata") or {}
        self.generation: dict = h.get("generation") or {}  # the source's sampling defaults; {} in older files
        self.layout: str = h.get("layout") or "layer-major"  # "stage-major": a .vflow (format/vflow.py)
        self.stages: list[dict] = h.get("stages") or []  # [{"stage", "section", "tensors"}] of a .vflow
        if verify:
            self.verify()
        self._mm = self._mapping = self._fh = None
        self._changed: str | None = None  # once the file changed under the mapping: why (sticky)
        self._map((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    def _map(self, checked: tuple) -> None:
        """Map the file whose header was checked (`checked`: its dev, inode, size, mtime_ns):
        with the core's guarded MappedFile where it is built, else with numpy (unguarded); a
        descriptor stays open either way, for mapping_error's fstat of the mapped inode."""
        try:
            from cflow._core import MappedFile
        except ImportError:  # the native core is not built: numpy's mapping
            MappedFile = None
        try:
            if MappedFile is not None:
                self._mapping = MappedFile(self.path)
                mm, opened = self._mapping.array(), tuple(self._mapping.opened)
            else:
                self._fh = open(self.path, "rb")
                s = os.fstat(self._fh.fileno())
                opened = (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)
                mm = np.memmap(self._fh, dtype=np.uint8, mode="r", shape=(s.st_size,))
        except RuntimeError as e:  # MappedFile's message names the path
            raise CflowFormatError(str(e)) from None
        except (OSError, ValueError) as e:
            raise CflowFormatError(f"{self.path}: cannot map: {getattr(e, 'strerror', None) or e}") from None
        if opened != checked:
            raise CflowFormatError(f"{self.path}: the file changed while it was being opened")
        self._opened, self._mm = opened, mm

    def mapping_error(self) -> str | None:
        """Why the mapped bytes are no longer this model's, or None while they are: a read of the
        mapping faulted (the file shrank under it: those pages now read as zeros; or an I/O
        error), or the mapped file's size or modification time changed (truncated, or written in
        place: a rewrite of the same size shows through a shared mapping at once). One fstat and
        a flag; once it has said so it always does. A file replaced by a rename (or deleted) is
        not a change: the mapping holds the old inode, which stays whole while mapped."""
        if self._changed is None:
            self._changed = self._check_changed()
        return self._changed

    def check_mapping(self) -> None:
        """Raise ModelFileChanged with mapping_error()'s reason, if there is one."""
        err = self.mapping_error()
        if err is not None:
            raise ModelFileChanged(err)

    def _check_changed(self) -> str | None:
        if self._mapping is not None:
            lost, now = self._mapping.lost, tuple(self._mapping.stat())
        elif self._fh is not None and not self._fh.closed:
            s = os.fstat(self._fh.fileno())
            lost, now = False, (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)
        else:  # closed
            return None
        was = self._opened
        if now[2] != was[2]:
            return f"model file {self.path} changed on disk while in use (now {now[2]} bytes, was {was[2]}): " \
                   "restart with a good file"
        if now[3] != was[3]:
            return f"model file {self.path} was written in place while in use (same size, modified since it was " \
                   "loaded): restart with a good file"
        if lost:
            return f"model file {self.path}: a read of its mapping failed (an I/O error, or the file shrank and " \
                   "grew back): restart with a good file"
        return None

    # ------------------------------------------------------------------ checks
    def verify(self) -> None:
        """Check every section's crc32 and that bytes outside sections (the rest of the preamble
        page, gaps) are zero: every byte of the file is then covered by a check."""
        with open(self.path, "rb") as fh:
            pos = PREAMBLE.size
            for s in sorted(self.sections.values(), key=lambda s: s.offset) + [None]:
                end = s.offset if s else self.preamble.header_offset
                fh.seek(pos)
                while pos < end:
                    b = fh.read(min(VERIFY_CHUNK, end - pos))
                    if not b or b.count(0) != len(b):
                        raise CflowFormatError(f"bytes [{pos}, {end}) outside every section must be zero")
                    pos += len(b)
                if s is None:
                    break
                pos = s.end
            for s in self.sections.values():
                crc = _checksum(fh, s.offset, s.length, crc32, f"section {s.name!r}")
                if crc != s.crc32:
                    raise CflowFormatError(f"section {s.name!r}: checksum mismatch (crc32 {crc:08x}, header says {s.crc32:08x})")
            self._verify_experts(fh)

    def _verify_experts(self, fh) -> None:
        """Each expert's CRC-32C (the expert tier checks the same on every read from disk)."""
        if not any(e.crc32c is not None for e in self.experts.values()):
            return
        from cflow._native import core

        def crc32c(b, value):
            return core.crc32c(np.frombuffer(b, dtype=np.uint8), value)

        for (layer, expert), e in sorted(self.experts.items()):
            if e.crc32c is None:
                continue
            crc = _checksum(fh, e.offset, e.length, crc32c, f"expert (layer {layer}, expert {expert})")
            if crc != e.crc32c:
                raise CflowFormatError(f"expert (layer {layer}, expert {expert}): checksum mismatch (crc32c "
                                       f"{crc:08x}, the expert table says {e.crc32c:08x})")

    # ------------------------------------------------------------------ data
    @property
    def buffer(self) -> np.ndarray:
        """The whole file as a read-only uint8 array (mapped, not read)."""
        if self._mm is None:
            raise CflowError(f"{self.path} is closed")
        return self._mm

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise CflowError(f"no tensor {name!r} in {self.path}") from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """uint8 (nbytes,): the tensor's tiled payload, a view into the mapping (no copy)."""
        t = self.tensor(name)
        return self.buffer[t.offset:t.end]

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """uint8 (length,): one expert's contiguous range, a view into the mapping."""
        try:
            e = self.experts[(layer, expert)]
        except KeyError:
            raise CflowError(f"no expert (layer {layer}, expert {expert}) in {self.path}") from None
        return self.buffer[e.offset:e.offset + e.length]

    def read_expert(self, layer: int, expert: int, *, direct: bool = True) -> np.ndarray:
        """uint8 (length,): one expert's bytes read from disk, not from the mapping: one
        4096-aligned pread of align_up(length) bytes, with O_DIRECT where the file system allows
        it (the page cache is bypassed; falls back to a buffered read where O_DIRECT is refused)."""
        try:
            e = self.experts[(layer, expert)]
        except KeyError:
            raise CflowError(f"no expert (layer {layer}, expert {expert}) in {self.path}") from None
        n = align_up(e.length)
        buf = mmap.mmap(-1, n)  # anonymous mappings are page-aligned, as O_DIRECT needs
        for flags in ((os.O_RDONLY | os.O_DIRECT,) if direct and hasattr(os, "O_DIRECT") else ()) + (os.O_RDONLY,):
            try:
                fd = os.open(self.path, flags)
                try:
                    got = os.preadv(fd, [buf], e.offset)
                finally:
                    os.close(fd)
                break
            except OSError as err:
                if err.errno != errno.EINVAL or flags == os.O_RDONLY:
                    raise CflowFormatError(f"{self.path}: cannot read expert ({layer}, {expert}): {err}") from None
        if got != n:
            raise CflowFormatError(f"{self.path}: short read of expert ({layer}, {expert}): {got} of {n} bytes")
        return np.frombuffer(buf, dtype=np.uint8, count=e.length)

    def row_blocks(self, name: str) -> np.ndarray:
        """uint8 (rows, row bytes): the tensor untiled into GGUF's row-major encoding (a copy)."""
        t = self.tensor(name)
        return unpack_tiles(self.tensor_bytes(name), t.type, t.rows, t.cols, t.tile, t.interleave, t.pack)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 array of the tensor's shape (fused tensors: rows in fused order)."""
        t = self.tensor(name)
        return quant.decode(self.row_blocks(name), t.type, t.cols).reshape(t.shape)

    def unfuse(self, name: str) -> dict[str, np.ndarray]:
        """A fused tensor's parts, dequantized: {part name: float32 (rows_p, cols)}."""
        t = self.tensor(name)
        if not t.parts:
            raise CflowError(f"tensor {name!r} is not fused")
        mats = unfuse_rows(self.dequantize(name), [p.rows for p in t.parts], t.fuse, t.stripe_rows)
        return {p.name: m for p, m in zip(t.parts, mats)}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Drop the mapping (views already handed out keep it alive until they go)."""
        self._mm = self._mapping = None
        if self._fh is not None:
            self._fh.close()

    def __enter__(self) -> "CflowFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CflowFile({self.path!r}, {len(self.tensors)} tensors, {len(self.experts)} experts, {self.size} bytes)"


def _checksum(fh, offset: int, length: int, fn, what: str) -> int:
    """fn(bytes, value) chained over [offset, offset + length) of the open file, in chunks."""
    fh.seek(offset)
    crc, left = 0, length
    while left:
        b = fh.read(min(VERIFY_CHUNK, left))
        if not b:
            raise CflowFormatError(f"{what}: the file ends inside it")
        crc, left = fn(b, crc), left - len(b)
    return crc
