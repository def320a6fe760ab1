"""CflowWriter: streams tensors into a `.cflow` file, atomically (temp file + fsync + rename).

    with CflowWriter("model.cflow", config, tokenizer_json=tok, chat_template=tpl,
                     generation={"temperature": 0.7, "top_p": 0.9}) as w:
        w.add_tensor("tok_embd", "q8_0", emb)                      # float (R, C): quantized here
        w.add_tensor("blk.0.attn_norm", "f32", norm)                # 1-D: stored as one row
        w.add_fused("blk.0.attn_qkv", "q4_0", [("blk.0.attn_q", wq), ("blk.0.attn_k", wk),
                    ("blk.0.attn_v", wv)], "stack")
        w.add_tensor("blk.0.ffn_down", "q4_k", encoded_rows)       # uint8: GGUF-encoded rows
        w.add_expert(0, 3, {"blk.0.exp.3.ffn_down": ("q4_0", w_down), ...})

Tensors are written in the order they are added: add them in the order the decode step
consumes them (`decode_order` sorts GGUF-style names that way). Sections are written one after
another; a section, once left, cannot be reopened. An exception inside the `with` block (or
`abort()`) removes the temp file and leaves no file at `path`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
from typing import Any

import numpy as np

from cflow.config import ModelConfig
from cflow.errors import CflowError, CflowFormatError
from cflow.format import quant
from cflow.format.spec import (ALIGN, FUSE_MODES, MAX_DIM, MAX_TILE, TENSOR_ALIGN, VERSION, Expert, Part, Preamble,
                               Section, Tensor, check_generation, check_special_tokens, align_up, crc32, fuse_rows)
from cflow.format.tiles import DEFAULT_TILE, BlockType, block_type, check_pack, pack_tiles

CHUNK_BYTES = 32 << 20  # encode and write at most about this much at once (bounded RAM)

_LAYER_ORDER = ("attn_norm", "attn_qkv", "attn_q_norm", "attn_k_norm", "attn_output", "post_attention_norm",
                "ffn_norm", "ffn_gate_inp", "ffn_gate_up", "ffn_down", "post_ffw_norm")


def decode_order(names: list[str]) -> list[str]:
    """Sort GGUF-style tensor names in decode order: tok_embd, blk.0 .. blk.N-1 (attention, then
    FFN, then experts), output_norm, output. Unknown names keep their relative order."""

    def key(item):
        i, n = item
        if n == "tok_embd":
            return (0, 0, 0, 0, i)
        m = re.match(r"blk\.(\d+)\.(?:exp\.(\d+)\.)?(.+)$", n)
        if m:
            layer, exp, rest = int(m[1]), m[2], m[3]
            rank = _LAYER_ORDER.index(rest) if rest in _LAYER_ORDER else len(_LAYER_ORDER)
            return (1, layer, 1 + int(exp) if exp is not None else 0, rank, i)
        return (2 if n in ("output_norm", "output") else 1, 1 << 30, 0, n == "output", i)

    return [n for _, n in sorted(enumerate(names), key=key)]


class CflowWriter:
    """Write a `.cflow` file. Use as a context manager; `close()` commits, `abort()` discards."""

    def __init__(self, path: str | os.PathLike, config: ModelConfig | dict, *, tokenizer_json: str | None = None,
                 chat_template: str | None = None, special_tokens: dict | None = None,
                 metadata: dict | None = None, generation: dict | None = None,
                 tile: tuple[int, int] = DEFAULT_TILE, interleave: int = 1, layout: str | None = None):
        """layout: None (layer by layer), or "stage-major" for a .vflow (stage() records its stages)."""
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config)
        if not isinstance(config, ModelConfig):
            raise CflowError(f"config must be a ModelConfig or a dict, got {type(config).__name__}")
        if tokenizer_json is not None and not isinstance(tokenizer_json, str):
            raise CflowError("tokenizer_json must be the tokenizer's JSON text (str) or None")
        self.path = os.fspath(path)
        self.config = config
        self._head = {"format": "cflow", "version": VERSION, "config": config.to_dict(), "tokenizer": tokenizer_json,
                      "chat_template": chat_template, "special_tokens": dict(special_tokens or {}),
                      "metadata": dict(metadata or {}), "generation": dict(generation or {})}
        if layout is not None:
            from cflow.format.vflow import LAYOUT

            if layout != LAYOUT:
                raise CflowError(f"layout must be None or {LAYOUT!r}, got {layout!r}")
            self._head.update(layout=layout, stages=[])
        json.dumps(self._head)  # fail now, not after the payload, on values JSON cannot hold
        check_special_tokens(self._head["special_tokens"])
        check_generation(self._head["generation"])
        self.tile, self.interleave = tuple(tile), interleave
        if os.path.isdir(self.path):  # the rename at the end would fail, after the whole payload
            raise CflowError(f"cannot write {self.path}: it is a directory")
        d = os.path.dirname(os.path.abspath(self.path))
        try:
            fd, self._tmp = tempfile.mkstemp(prefix=os.path.basename(self.path) + ".tmp-", dir=d)
        except OSError as e:  # a missing or read-only directory
            raise _cannot_write(self.path, e) from None
        self._f = os.fdopen(fd, "wb")
        self._pos = 0
        self._sections: dict[str, Section] = {}
        self._cur: list | None = None  # [name, offset, crc] of the open section
        self._tensors: dict[str, Tensor] = {}
        self._experts: dict[tuple[int, int], Expert] = {}
        self._ecrc: int | None = None  # CRC-32C of the open expert's bytes so far
        self._done = False
        self._f.write(bytes(ALIGN))  # the preamble page, filled in last
        self._pos = ALIGN

    # ------------------------------------------------------------------ raw output
    @contextlib.contextmanager
    def _output(self):
        """An OSError of the output file (a full disk, a file size limit, a vanished directory)
        becomes one CflowError naming `path`; the temp file goes."""
        try:
            yield
        except OSError as e:
            self.abort()
            raise _cannot_write(self.path, e) from None

    def _write(self, b) -> None:
        b = memoryview(b).cast("B")
        with self._output():
            self._f.write(b)
        self._cur[2] = crc32(b, self._cur[2])
        if self._ecrc is not None:
            self._ecrc = self._crc32c(b, self._ecrc)
        self._pos += len(b)

    def _pad(self, a: int) -> None:
        if self._pos % a:
            self._write(bytes(align_up(self._pos, a) - self._pos))

    def _enter_section(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise CflowError(f"section name must be a non-empty string, got {name!r}")
        if self._cur is not None and self._cur[0] == name:
            return
        if name in self._sections:
            raise CflowError(f"section {name!r} was already written; add its tensors together (sections are contiguous)")
        self._leave_section()
        self._cur = [name, self._pos, 0]

    def _leave_section(self) -> None:
        if self._cur is None:
            return
        self._pad(ALIGN)
        name, off, crc = self._cur
        if self._pos > off:  # a section left without bytes is not recorded
            self._sections[name] = Section(name, off, self._pos - off, crc)
        self._cur = None

    # ------------------------------------------------------------------ tensors
    def add_tensor(self, name: str, type: str, data, *, shape: tuple[int, ...] | None = None,
                   tile: tuple[int, int] | None = None, interleave: int | None = None, section: str = "weights",
                   parts: list | None = None, fuse: str | None = None, stripe_rows: int | None = None,
                   pack: str = "blocks") -> Tensor:
        """Tile and write one tensor; returns its index entry.

        data: float array (R, C) or (n,), encoded here into block type `type` (see
        quant.can_encode); or uint8 (R, C/QK*block_bytes) of GGUF-encoded rows (then `shape`
        gives the logical shape where it cannot be inferred, e.g. a 1-D tensor).
        parts/fuse/stripe_rows describe a fused tensor whose rows are already in fused order
        (add_fused builds one from its parts). pack: "blocks", or "planes" for q4_0/q4_1/q5_0/q5_1/q8_0/
        q4_k/q5_k/q6_k with interleave <= 16 (docs/FORMAT.md 5.1).
        """
        self._check_open()
        if not isinstance(name, str) or not name or len(name) > 512:
            raise CflowError(f"tensor name must be a string of 1..512 characters, got {name!r}")
        if name in self._tensors:
            raise CflowError(f"tensor {name!r} was already added")
        bt = block_type(type)
        tile = tuple(tile or self.tile)
        g = interleave or self.interleave
        rows_data, shape, encoded = _normalize(name, bt, data, shape)
        rows, cols = rows_data.shape[0], shape[-1]
        if not all(1 <= n <= MAX_DIM for n in shape):
            raise CflowError(f"tensor {name!r}: shape {shape} has a dimension outside 1..{MAX_DIM}")
        if len(tile) != 2 or not all(isinstance(n, int) and 1 <= n <= MAX_TILE for n in tile) \
                or tile[1] % bt.block_elems or not isinstance(g, int) or g < 1 or tile[0] % g:
            raise CflowError(f"tensor {name!r}: tile {tile} / interleave {g} do not fit {bt.name} "
                             f"(TC a multiple of {bt.block_elems}, G dividing TR)")
        if err := check_pack(bt, g, pack):
            raise CflowError(f"tensor {name!r}: {err}")
        part_list, stripe = _parts(name, rows, tile, parts, fuse, stripe_rows)
        if not encoded and not quant.can_encode(bt):
            quant.encode(rows_data[:0], bt)  # raises the UnsupportedError before anything is written

        self._enter_section(section)
        self._pad(TENSOR_ALIGN)
        offset = self._pos
        rb = quant.row_bytes(bt, cols)
        in_row = rb if encoded else 4 * cols  # input bytes per row
        step = max(tile[0], CHUNK_BYTES // in_row // tile[0] * tile[0])
        for r0 in range(0, rows, step):  # chunks of whole stripes: each packs independently
            chunk = rows_data[r0:r0 + step]
            try:
                enc = np.ascontiguousarray(chunk) if encoded else quant.encode(chunk, bt)
            except CflowFormatError as e:  # values it cannot encode; the writer's exit removes the file
                raise CflowFormatError(f"tensor {name!r}: {e}") from None
            self._write(pack_tiles(enc, bt, cols, tile, g, pack))
        t = Tensor(name, bt, tuple(shape), tile, g, section, offset, self._pos - offset, part_list,
                   fuse if part_list else None, stripe, pack)
        self._tensors[name] = t
        return t

    def add_fused(self, name: str, type: str, parts: list[tuple[str, Any]], fuse: str, *,
                  stripe_rows: int | None = None, **kw) -> Tensor:
        """Fuse parts [(name, array), ...] (all float, or all GGUF-encoded uint8 rows) into one tensor:
        fuse="stack" (Q/K/V: rows one after another) or "stripe" (gate/up: interleaved by output
        stripe of `stripe_rows` rows, default TR // len(parts)). See spec.fused_row_order."""
        if fuse not in FUSE_MODES:
            raise CflowError(f"fuse must be one of {FUSE_MODES}, got {fuse!r}")
        tile = tuple(kw.get("tile") or self.tile)
        if fuse == "stripe" and not stripe_rows:
            stripe_rows = max(1, tile[0] // len(parts))
        mats = [np.asarray(a) for _, a in parts]
        if any(m.ndim != 2 for m in mats) or len({(m.dtype, m.shape[1]) for m in mats}) != 1:
            raise CflowError(f"tensor {name!r}: fused parts must be 2-D arrays of one dtype and column count")
        fused = fuse_rows(mats, fuse, stripe_rows or 0)
        return self.add_tensor(name, type, fused, parts=[(n, m.shape[0]) for (n, _), m in zip(parts, mats)],
                               fuse=fuse, stripe_rows=stripe_rows, **kw)

    def add_expert(self, layer: int, expert: int, tensors: dict[str, Any], *, section: str = "experts") -> Expert:
        """Write one expert's tensors contiguously, starting on a 4096-byte boundary, and record
        (layer, expert) -> (offset, length) in the expert table. tensors: {name: (type, data)} or
        {name: dict(type=..., data=..., **add_tensor options)}; a "parts" entry means add_fused."""
        if not tensors:
            raise CflowError(f"expert (layer {layer}, expert {expert}) has no tensors")
        with self.expert(layer, expert, section=section):
            for n, spec in tensors.items():
                if isinstance(spec, dict):
                    kw = dict(spec)
                    typ, data = kw.pop("type"), kw.pop("data")
                    if "fuse" in kw and isinstance(data, (list, tuple)):
                        self.add_fused(n, typ, data, kw.pop("fuse"), section=section, **kw)
                        continue
                    self.add_tensor(n, typ, data, section=section, **kw)
                else:
                    typ, data = spec
                    self.add_tensor(n, typ, data, section=section)
        return self._experts[(layer, expert)]

    @contextlib.contextmanager
    def expert(self, layer: int, expert: int, *, section: str = "experts"):
        """The tensors added inside form expert (layer, expert): one 4096-aligned range, recorded
        in the expert table when the block ends."""
        self._check_open()
        for v, what in ((layer, "layer"), (expert, "expert")):
            if not isinstance(v, int) or not 0 <= v <= 1 << 24:
                raise CflowError(f"expert {what} must be an integer in 0..2^24, got {v!r}")
        if (layer, expert) in self._experts:
            raise CflowError(f"expert (layer {layer}, expert {expert}) was already added")
        self._enter_section(section)
        self._pad(ALIGN)
        off, before = self._pos, set(self._tensors)
        self._ecrc = 0
        try:
            yield
        finally:
            crc, self._ecrc = self._ecrc, None
        names = tuple(n for n in self._tensors if n not in before)
        if not names:
            raise CflowError(f"expert (layer {layer}, expert {expert}) has no tensors")
        self._experts[(layer, expert)] = Expert(layer, expert, section, off, self._pos - off, names, crc)
        self._pad(ALIGN)

    @staticmethod
    def _crc32c(b, value: int) -> int:
        """CRC-32C (the native core's) of bytes b, continuing from value: what the expert tier
        checks each expert read from disk against."""
        from cflow._native import core

        return core.crc32c(np.frombuffer(b, dtype=np.uint8), value)

    def copy_tensor(self, t: Tensor, payload, *, section: str = "weights") -> Tensor:
        """Write a tensor already tiled (another file's entry `t` and its bytes), unchanged."""
        self._check_open()
        if t.name in self._tensors:
            raise CflowError(f"tensor {t.name!r} was already added")
        payload = memoryview(np.ascontiguousarray(payload)).cast("B")
        if len(payload) != t.nbytes:
            raise CflowError(f"tensor {t.name!r}: {len(payload)} bytes given, its entry has {t.nbytes}")
        self._enter_section(section)
        self._pad(TENSOR_ALIGN)
        new = dataclasses.replace(t, section=section, offset=self._pos)
        self._write(payload)
        self._tensors[t.name] = new
        return new

    def stage(self, k: int, section: str, names: list[str]) -> None:
        """Record stage k of a stage-major file: its section and tensors (written before)."""
        if "stages" not in self._head:
            raise CflowError("stage(): the writer was not opened with layout='stage-major'")
        self._head["stages"].append({"stage": int(k), "section": section, "tensors": list(names)})

    # ------------------------------------------------------------------ commit / abort
    def _check_open(self) -> None:
        if self._done:
            raise CflowError("the writer is closed")

    def close(self) -> None:
        """Write the header and the preamble, fsync, and rename the temp file onto `path`."""
        if self._done:
            return
        try:
            with self._output():
                self._commit()
        except BaseException:
            self.abort()
            raise

    def _commit(self) -> None:
        """close() without its error handling."""
        self._leave_section()
        head = dict(self._head)
        head["alignment"] = {"section": ALIGN, "tensor": TENSOR_ALIGN}
        head["sections"] = [{"name": s.name, "offset": s.offset, "length": s.length, "crc32": s.crc32}
                            for s in self._sections.values()]
        head["tensors"] = [t.to_dict() for t in self._tensors.values()]
        head["experts"] = [{"layer": e.layer, "expert": e.expert, "section": e.section, "offset": e.offset,
                            "length": e.length, "tensors": list(e.tensors), "crc32c": e.crc32c}
                           for e in self._experts.values()]
        raw = json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        hoff = self._pos
        self._f.write(raw)
        pre = Preamble(VERSION, 0, hoff + len(raw), hoff, len(raw), crc32(raw), ALIGN)
        self._f.seek(0)
        self._f.write(pre.pack())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o666 & ~umask)
        os.replace(self._tmp, self.path)
        self._done = True
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Discard everything written: the temp file is removed, `path` is left as it was."""
        if self._done:
            return
        self._done = True
        try:
            with contextlib.suppress(OSError):  # flushing what is discarded may fail again (a full disk)
                self._f.close()
        finally:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "CflowWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self):
        if getattr(self, "_done", True) is False:
            self.abort()


def _normalize(name: str, bt: BlockType, data, shape) -> tuple[np.ndarray, tuple[int, ...], bool]:
    """-> (2-D rows (float or encoded uint8), logical shape, encoded?)."""
    a = np.asarray(data)
    if a.dtype == np.uint8:
        if shape is None:
            if a.ndim != 2:
                raise CflowError(f"tensor {name!r}: encoded uint8 data must be 2-D (R, row bytes), or give shape=")
            if a.shape[1] % bt.block_bytes:
                raise CflowError(f"tensor {name!r}: {a.shape[1]} bytes per row is not a whole number of {bt.name} blocks")
            shape = (a.shape[0], a.shape[1] // bt.block_bytes * bt.block_elems)
        shape = tuple(int(n) for n in shape)
        if len(shape) not in (1, 2):
            raise CflowError(f"tensor {name!r}: shape {shape} must have 1 or 2 dimensions")
        rows = shape[0] if len(shape) == 2 else 1
        try:
            a = a.reshape(rows, quant.row_bytes(bt, shape[-1]))
        except (ValueError, CflowFormatError) as e:
            raise CflowError(f"tensor {name!r}: encoded data {np.asarray(data).shape} does not hold {bt.name} {shape}: {e}") from None
        return a, shape, True
    if not np.issubdtype(a.dtype, np.floating):
        raise CflowError(f"tensor {name!r}: expected a float array or GGUF-encoded uint8 rows, got {a.dtype}")
    if a.ndim not in (1, 2):
        raise CflowError(f"tensor {name!r}: float data must be 1-D or 2-D, got shape {a.shape}")
    if shape is not None and tuple(shape) != a.shape:
        raise CflowError(f"tensor {name!r}: shape {tuple(shape)} does not match the data's {a.shape}")
    if a.shape[-1] % bt.block_elems:
        raise CflowError(f"tensor {name!r}: {a.shape[-1]} columns is not a multiple of {bt.name}'s block size {bt.block_elems}")
    return a.reshape(-1, a.shape[-1]), tuple(a.shape), False


def _parts(name: str, rows: int, tile, parts, fuse, stripe_rows) -> tuple[tuple[Part, ...], int]:
    if not parts:
        if fuse is not None:
            raise CflowError(f"tensor {name!r}: fuse={fuse!r} needs parts")
        return (), 0
    out = tuple(p if isinstance(p, Part) else Part(str(p[0]), int(p[1])) for p in parts)
    if sum(p.rows for p in out) != rows:
        raise CflowError(f"tensor {name!r}: parts have {sum(p.rows for p in out)} rows, the tensor has {rows}")
    if fuse not in FUSE_MODES:
        raise CflowError(f"tensor {name!r}: fuse must be one of {FUSE_MODES}, got {fuse!r}")
    if fuse == "stack":
        return out, 0
    if len({p.rows for p in out}) != 1:
        raise CflowError(f"tensor {name!r}: stripe fusion needs parts with equal rows")
    s = stripe_rows or max(1, tile[0] // len(out))
    return out, int(s)


def _cannot_write(path: str, e: OSError) -> CflowError:
    return CflowError(f"cannot write {path}: {e.strerror or e}")


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
