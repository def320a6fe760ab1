"""The `.cflow` container, versions 1 to 3: constants, the preamble, and the header's validation.

File layout (docs/FORMAT.md has every byte):
    [0, 64)          preamble (little-endian; struct PREAMBLE below)
    [64, 4096)       zeros
    sections         each starts on a 4096-byte boundary, length a multiple of 4096 (zero padded)
    header           UTF-8 JSON at a 4096-byte boundary, the last bytes of the file
The header sits at the end so a writer streams tensors to disk and fills the preamble last.

`parse_header` turns the header JSON into checked `Section` / `Tensor` / `Expert` records: every
offset and length inside the file and inside its section, no overlaps, sizes consistent with
shape, block type and tile. Every failure is a CflowFormatError naming the field.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cflow.errors import CflowFormatError
from cflow.format.tiles import BLOCK_TYPES, TERNARY_CODE, BlockType, check_pack, tiled_nbytes

MAGIC = b"\x89CFLOW\r\n"
VERSION = 3  # what the writer writes
# what the reader reads: version 2 added the tensor key "pack"; version 3 reordered q6_k's planes
# (docs/FORMAT.md 5.1), so a q6_k planes tensor of an earlier version is refused, never misread
READ_VERSIONS = (1, 2, 3)
ALIGN = 4096  # sections, expert ranges and the header start on this boundary (O_DIRECT)
TENSOR_ALIGN = 64  # tensors start on this boundary inside their section (cache line, SIMD loads)
# magic, version, flags, file_size, header_offset, header_length, header_crc32, alignment,
# reserved[12], preamble_crc32 (crc32 of bytes 0..59)
PREAMBLE = struct.Struct("<8sIIQQQII12sI")
assert PREAMBLE.size == 64
MAX_HEADER = 1 << 30  # a header (tokenizer included) above 1 GiB is hostile, not a model
MAX_DIM = (1 << 31) - 1  # rows / cols fit a C int
MAX_TILE = 1 << 20
MAX_NAME = 512
FUSE_MODES = ("stack", "stripe")
RESERVED_TYPES = {"ternary": TERNARY_CODE}


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def crc32(data, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


@dataclass(frozen=True)
class Preamble:
    version: int
    flags: int
    file_size: int
    header_offset: int
    header_length: int
    header_crc32: int
    alignment: int

    def pack(self) -> bytes:
        head = PREAMBLE.pack(MAGIC, self.version, self.flags, self.file_size, self.header_offset,
                             self.header_length, self.header_crc32, self.alignment, bytes(12), 0)
        return head[:60] + struct.pack("<I", crc32(head[:60]))

    @classmethod
    def unpack(cls, raw: bytes, file_size: int) -> "Preamble":
        """Check the 64 preamble bytes against the actual file size; raise CflowFormatError."""
        if len(raw) < PREAMBLE.size:
            raise CflowFormatError(f"file too small ({file_size} bytes) to be a .cflow file (preamble is 64 bytes)")
        magic, version, flags, size, hoff, hlen, hcrc, align, reserved, pcrc = PREAMBLE.unpack(raw[:64])
        if magic != MAGIC:
            raise CflowFormatError(f"bad magic {magic!r}: not a .cflow file (expected {MAGIC!r})")
        if version not in READ_VERSIONS:
            raise CflowFormatError(f"unsupported .cflow version {version} (this reader knows versions "
                                   f"{', '.join(map(str, READ_VERSIONS))})")
        if crc32(raw[:60]) != pcrc:
            raise CflowFormatError("preamble checksum mismatch: the first 64 bytes are corrupt")
        if flags != 0 or reserved != bytes(12):
            raise CflowFormatError(f"preamble: flags {flags:#x} / reserved bytes must be zero in version {version}")
        if align != ALIGN:
            raise CflowFormatError(f"preamble: alignment {align} is not {ALIGN}")
        if size != file_size:
            what = "truncated" if file_size < size else "longer than recorded"
            raise CflowFormatError(f"file is {what}: preamble says {size} bytes, file has {file_size}")
        if hoff % ALIGN or hoff < ALIGN or hlen < 2 or hlen > MAX_HEADER or hoff + hlen != file_size:
            raise CflowFormatError(
                f"preamble: header at offset {hoff} length {hlen} must start on a {ALIGN}-byte boundary "
                f"after the preamble page and end at the end of the file ({file_size} bytes), at most {MAX_HEADER} bytes"
            )
        return cls(version, flags, size, hoff, hlen, hcrc, align)


@dataclass(frozen=True)
class Section:
    name: str
    offset: int  # absolute file offset, multiple of ALIGN
    length: int  # multiple of ALIGN (zero padding included)
    crc32: int  # of the bytes [offset, offset + length)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Part:
    name: str
    rows: int


@dataclass(frozen=True)
class Tensor:
    name: str
    type: BlockType
    shape: tuple[int, ...]  # (rows, cols) or (n,) for 1-D (stored as one row)
    tile: tuple[int, int]  # (TR, TC)
    interleave: int  # G: rows interleaved per group inside a tile
    section: str
    offset: int  # absolute file offset, multiple of TENSOR_ALIGN
    nbytes: int
    parts: tuple[Part, ...] = ()
    fuse: str | None = None  # "stack" | "stripe" when parts are given
    stripe_rows: int = 0  # rows of each part per output stripe ("stripe" fusion)
    pack: str = "blocks"  # "blocks" | "planes": how a group's chunk holds its blocks (tiles.py)

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def tile_offset(self, s: int, t: int) -> int:
        """Absolute offset of tile (stripe s, column tile t): the tile index is implicit."""
        tr, tc = self.tile
        rb = self.cols // self.type.block_elems * self.type.block_bytes  # bytes per row
        nr = min(tr, self.rows - s * tr)
        tb = tc // self.type.block_elems * self.type.block_bytes  # bytes of one full tile row
        return self.offset + s * tr * rb + nr * t * tb

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "type": self.type.name, "shape": list(self.shape), "tile": list(self.tile),
             "interleave": self.interleave, "section": self.section, "offset": self.offset, "nbytes": self.nbytes}
        if self.pack != "blocks":
            d["pack"] = self.pack
        if self.parts:
            d["parts"] = [{"name": p.name, "rows": p.rows} for p in self.parts]
            d["fuse"] = self.fuse
            if self.fuse == "stripe":
                d["stripe_rows"] = self.stripe_rows
        return d


@dataclass(frozen=True)
class Expert:
    layer: int
    expert: int
    section: str
    offset: int  # absolute, multiple of ALIGN
    length: int  # bytes used; align_up(length) bytes may be read (zero padding follows)
    tensors: tuple[str, ...] = field(default=())
    crc32c: int | None = None  # CRC-32C of the `length` bytes (None: a file written before experts had one)


# --------------------------------------------------------------------------- fused groups
def fused_row_order(part_rows: list[int], fuse: str, stripe_rows: int = 0) -> np.ndarray:
    """idx (sum(part_rows),): fused row i is row idx[i] of the parts concatenated in order.

    "stack": parts one after another (Q, K, V).
    "stripe": all parts have n rows; for output stripe j = 0 .. ceil(n/S)-1, for each part p,
    rows [j*S, min(n, (j+1)*S)) of part p (gate/up: S gate rows then the same S up rows).
    """
    starts = np.cumsum([0] + list(part_rows))
    if fuse == "stack":
        return np.arange(starts[-1])
    if fuse != "stripe":
        raise CflowFormatError(f"fuse mode {fuse!r} is not one of {FUSE_MODES}")
    n = part_rows[0]
    if stripe_rows <= 0 or any(r != n for r in part_rows):
        raise CflowFormatError(f"stripe fusion needs parts of equal rows and stripe_rows > 0, got {part_rows}, {stripe_rows}")
    return np.concatenate([starts[p] + np.arange(j, min(n, j + stripe_rows))
                           for j in range(0, n, stripe_rows) for p in range(len(part_rows))])


def fuse_rows(mats: list[np.ndarray], fuse: str, stripe_rows: int = 0) -> np.ndarray:
    """Stack parts (R_p, ...) into one matrix in fused row order (works on floats or encoded rows)."""
    return np.concatenate(mats)[fused_row_order([m.shape[0] for m in mats], fuse, stripe_rows)]


def unfuse_rows(fused: np.ndarray, part_rows: list[int], fuse: str, stripe_rows: int = 0) -> list[np.ndarray]:
    """Inverse of fuse_rows: the parts, in order."""
    cat = np.empty_like(fused)
    cat[fused_row_order(part_rows, fuse, stripe_rows)] = fused
    return np.split(cat, np.cumsum(part_rows)[:-1])


# --------------------------------------------------------------------------- header checks
def _fail(where: str, msg: str):
    raise CflowFormatError(f"{where}: {msg}")


def _get(d: dict, key: str, where: str, types, optional: bool = False):
    if key not in d:
        if optional:
            return None
        _fail(where, f"missing field {key!r}")
    v = d[key]
    if v is None and optional:
        return None
    if not isinstance(v, types) or (isinstance(v, bool) and types is not bool):
        _fail(where, f"field {key!r} has type {type(v).__name__}, expected {getattr(types, '__name__', types)}")
    return v


def _int(d: dict, key: str, where: str, lo: int, hi: int) -> int:
    v = _get(d, key, where, int)
    if not lo <= v <= hi:
        _fail(where, f"{key}={v} is outside {lo}..{hi}")
    return v


def _block_type(name: str, where: str) -> BlockType:
    if name in RESERVED_TYPES:
        _fail(where, f"block type {name!r} (code {RESERVED_TYPES[name]}) is reserved and not defined in version {VERSION}")
    if name not in BLOCK_TYPES:
        _fail(where, f"unknown block type {name!r}; version {VERSION} has {', '.join(BLOCK_TYPES)}")
    return BLOCK_TYPES[name]


def parse_section(d: Any, i: int, pre: Preamble) -> Section:
    where = f"header.sections[{i}]"
    if not isinstance(d, dict):
        _fail(where, "must be an object")
    name = _get(d, "name", where, str)
    where = f"section {name!r}"
    off = _int(d, "offset", where, ALIGN, pre.header_offset)
    length = _int(d, "length", where, 0, pre.header_offset)
    if off % ALIGN or length % ALIGN:
        _fail(where, f"offset {off} and length {length} must be multiples of {ALIGN}")
    if off + length > pre.header_offset:
        _fail(where, f"ends at {off + length}, past the start of the header ({pre.header_offset}) / end of file")
    return Section(name, off, length, _int(d, "crc32", where, 0, 0xFFFFFFFF))


def _byte_range(d: dict, where: str, sections: dict[str, Section], length_key: str, align: int,
                padded: bool = False) -> tuple[str, int, int]:
    """(section, offset, length) of an entry; offset aligned, the range (rounded up to ALIGN
    when `padded`: what one aligned read fetches) inside the section."""
    name = _get(d, "section", where, str)
    if name not in sections:
        _fail(where, f"section {name!r} is not in header.sections")
    sec = sections[name]
    off = _int(d, "offset", where, 0, 1 << 62)
    n = _int(d, length_key, where, 1, 1 << 62)
    if off % align:
        _fail(where, f"offset {off} is not a multiple of {align}")
    end = off + (align_up(n) if padded else n)
    if off < sec.offset or end > sec.end:
        _fail(where, f"bytes [{off}, {end}) are outside section {name!r} [{sec.offset}, {sec.end})")
    return name, off, n


def parse_tensor(d: Any, i: int, sections: dict[str, Section]) -> Tensor:
    where = f"header.tensors[{i}]"
    if not isinstance(d, dict):
        _fail(where, "must be an object")
    name = _get(d, "name", where, str)
    if not 0 < len(name) <= MAX_NAME:
        _fail(where, f"tensor name must have 1..{MAX_NAME} characters")
    where = f"tensor {name!r}"
    bt = _block_type(_get(d, "type", where, str), where)
    shape = _get(d, "shape", where, list)
    if len(shape) not in (1, 2) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        _fail(where, f"shape {shape!r} must be a list of 1 or 2 integers")
    if not all(1 <= n <= MAX_DIM for n in shape):
        _fail(where, f"absurd shape {shape}: each dimension must be in 1..{MAX_DIM}")
    tile = _get(d, "tile", where, list)
    if len(tile) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_TILE for n in tile):
        _fail(where, f"tile {tile!r} must be two integers in 1..{MAX_TILE}")
    g = _int(d, "interleave", where, 1, MAX_TILE)
    cols, rows = shape[-1], (shape[0] if len(shape) == 2 else 1)
    if tile[1] % bt.block_elems or cols % bt.block_elems:
        _fail(where, f"tile columns {tile[1]} and columns {cols} must be multiples of {bt.name}'s block size {bt.block_elems}")
    if tile[0] % g:
        _fail(where, f"interleave {g} does not divide the tile rows {tile[0]}")
    pack = d.get("pack", "blocks")
    if err := check_pack(bt, g, pack if isinstance(pack, str) else repr(pack)):
        _fail(where, err)
    sec_name, off, nbytes = _byte_range(d, where, sections, "nbytes", TENSOR_ALIGN)
    want = tiled_nbytes(bt, rows, cols)
    if nbytes != want:
        _fail(where, f"nbytes {nbytes} does not match shape {shape} of {bt.name} ({want} bytes)")
    parts, fuse, stripe = (), None, 0
    if d.get("parts") is not None:
        plist = _get(d, "parts", where, list)
        if not plist:
            _fail(where, "parts must not be empty")
        parts = []
        for j, p in enumerate(plist):
            pw = f"{where} parts[{j}]"
            if not isinstance(p, dict):
                _fail(pw, "must be an object")
            parts.append(Part(_get(p, "name", pw, str), _int(p, "rows", pw, 1, MAX_DIM)))
        parts = tuple(parts)
        if sum(p.rows for p in parts) != rows:
            _fail(where, f"parts have {sum(p.rows for p in parts)} rows in all, the tensor has {rows}")
        fuse = _get(d, "fuse", where, str)
        if fuse not in FUSE_MODES:
            _fail(where, f"fuse {fuse!r} is not one of {FUSE_MODES}")
        if fuse == "stripe":
            stripe = _int(d, "stripe_rows", where, 1, MAX_DIM)
            if len({p.rows for p in parts}) != 1:
                _fail(where, "stripe fusion needs parts with equal rows")
    return Tensor(name, bt, tuple(shape), (tile[0], tile[1]), g, sec_name, off, nbytes, parts, fuse, stripe, pack)


def parse_expert(d: Any, i: int, sections: dict[str, Section], tensors: dict[str, Tensor]) -> Expert:
    where = f"header.experts[{i}]"
    if not isinstance(d, dict):
        _fail(where, "must be an object")
    layer = _int(d, "layer", where, 0, 1 << 24)
    expert = _int(d, "expert", where, 0, 1 << 24)
    where = f"expert (layer {layer}, expert {expert})"
    sec_name, off, length = _byte_range(d, where, sections, "length", ALIGN, padded=True)
    names = _get(d, "tensors", where, list)
    for n in names:
        if not isinstance(n, str) or n not in tensors:
            _fail(where, f"tensor {n!r} is not in header.tensors")
        t = tensors[n]
        if t.offset < off or t.end > off + length:
            _fail(where, f"tensor {n!r} [{t.offset}, {t.end}) lies outside the expert's range [{off}, {off + length})")
    crc = _int(d, "crc32c", where, 0, 0xFFFFFFFF) if "crc32c" in d else None
    return Expert(layer, expert, sec_name, off, length, tuple(names), crc)


def _table(entries: list, parse, key, label, span) -> dict:
    """Parse a header list into {key: record}: unique keys, byte ranges [span) not overlapping."""
    out = {}
    for i, d in enumerate(entries):
        x = parse(d, i)
        if key(x) in out:
            _fail(label(x), "appears twice")
        out[key(x)] = x
    prev = None
    for x in sorted(out.values(), key=lambda x: span(x)[0]):
        if prev is not None and span(x)[0] < span(prev)[1]:
            (a, b), (c, e) = span(prev), span(x)
            raise CflowFormatError(f"{label(prev)} [{a}, {b}) and {label(x)} [{c}, {e}) overlap")
        prev = x
    return out


def check_special_tokens(sp: dict) -> None:
    """The keys readers act on have fixed types; other keys are free."""
    where = "header.special_tokens"
    _get(sp, "bos_token_id", where, int, optional=True)
    _get(sp, "add_bos", where, bool, optional=True)
    eos = _get(sp, "eos_token_ids", where, list, optional=True) or []
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in eos):
        _fail(where, "eos_token_ids must be a list of token ids (integers in 0..2^31-1)")
    bos = sp.get("bos_token_id")
    if bos is not None and not 0 <= bos < 1 << 31:
        _fail(where, f"bos_token_id={bos} is outside 0..2^31-1")


# header.generation: the sampling defaults a source gives (docs/FORMAT.md 3.4); key -> (type, check, range)
GENERATION_FIELDS = {
    "do_sample": (bool, lambda v: True, "true or false"),
    "temperature": ((int, float), lambda v: 0.0 <= v <= 100.0, "0..100"),
    "top_k": (int, lambda v: 0 <= v < 1 << 31, "0..2^31-1"),
    "top_p": ((int, float), lambda v: 0.0 < v <= 1.0, "(0, 1]"),
    "min_p": ((int, float), lambda v: 0.0 <= v <= 1.0, "[0, 1]"),
    "repetition_penalty": ((int, float), lambda v: 0.0 < v <= 100.0, "(0, 100]"),
}


def generation_error(key: str, v: Any) -> str | None:
    """Why `v` is not a valid value of header.generation[key], or None (unknown keys are free)."""
    if key not in GENERATION_FIELDS:
        return None
    types, ok, span = GENERATION_FIELDS[key]
    if not isinstance(v, types) or (isinstance(v, bool) and types is not bool):
        kind = {bool: "a boolean", int: "an integer"}.get(types, "a number")
        return f"{key}={v!r} must be {kind} in {span}"
    return None if ok(v) else f"{key}={v!r} is outside {span}"


def check_generation(gen: dict) -> None:
    """The sampling keys readers act on have fixed types and ranges; other keys are free."""
    for key, v in gen.items():
        if err := generation_error(key, v):
            _fail("header.generation", err)


def parse_header(raw: bytes, pre: Preamble) -> dict[str, Any]:
    """Check and decode the header bytes. Returns the JSON dict with three added keys:
    "_sections" {name: Section}, "_tensors" {name: Tensor}, "_experts" {(layer, expert): Expert}."""
    if crc32(raw) != pre.header_crc32:
        raise CflowFormatError("header checksum mismatch: the header is corrupt")
    try:
        h = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CflowFormatError(f"header is not valid UTF-8 JSON: {str(e)[:200]}") from None
    if not isinstance(h, dict):
        _fail("header", f"must be a JSON object, got {type(h).__name__}")
    # `type(...) is int`: 2.0 and true compare equal to 2 and 1, and the format allows only integers
    if h.get("format") != "cflow" or type(h.get("version")) is not int or h.get("version") != pre.version:
        _fail("header", f"format/version fields are {h.get('format')!r}/{h.get('version')!r}, expected 'cflow'/{pre.version}")
    _get(h, "config", "header", dict)
    for key in ("tokenizer", "chat_template"):
        _get(h, key, "header", str, optional=True)
    for key in ("special_tokens", "metadata", "generation"):
        _get(h, key, "header", dict, optional=True)
    check_special_tokens(h.get("special_tokens") or {})
    check_generation(h.get("generation") or {})

    sections = _table(_get(h, "sections", "header", list), lambda d, i: parse_section(d, i, pre),
                      lambda s: s.name, lambda s: f"section {s.name!r}", lambda s: (s.offset, s.end))
    tensors = _table(_get(h, "tensors", "header", list), lambda d, i: parse_tensor(d, i, sections),
                     lambda t: t.name, lambda t: f"tensor {t.name!r}", lambda t: (t.offset, t.end))
    experts = _table(_get(h, "experts", "header", list, optional=True) or [],
                     lambda d, i: parse_expert(d, i, sections, tensors), lambda e: (e.layer, e.expert),
                     lambda e: f"expert (layer {e.layer}, expert {e.expert})", lambda e: (e.offset, e.offset + e.length))
    if pre.version < 2:
        for t in tensors.values():
            if t.pack != "blocks":
                _fail(f"tensor {t.name!r}", "the key 'pack' needs version 2 (a version-1 reader would misread it)")
    if pre.version < 3:
        for t in tensors.values():
            if t.pack == "planes" and t.type.name == "q6_k":
                _fail(f"tensor {t.name!r}", f"q6_k planes in a version-{pre.version} file are in the plane order before "
                      "version 3; convert the model again (cflow convert SOURCE -o OUT.cflow)")
    if "layout" in h or "stages" in h:  # a stage-major file (.vflow): its stages against the delays
        from cflow.format.vflow import check_stages

        check_stages(h, tensors)
    h["_sections"], h["_tensors"], h["_experts"] = sections, tensors, experts
    return h
