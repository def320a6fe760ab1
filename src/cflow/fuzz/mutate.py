"""Structure-aware mutations of GGUF, .cflow and safetensors files.

Each format is first walked into its fields (offset, width, what it is), so that most mutations
hit the places a loader trusts: counts, lengths, value types, tensor dimensions and offsets,
header JSON values. A mutation is one of:
  - an integer field set to an edge value (0, 1, -1, 2^31, 2^63, 2^64-1, off by one, random),
  - a float field set to NaN, +-inf, 0, a negative, a huge or a denormal value,
  - a string's bytes made invalid UTF-8, or its length prefix changed,
  - a JSON value (any depth of the header / config / tokenizer) replaced by a value of another
    type or an edge value, a key deleted or renamed, deep nesting; the file's own checksums and
    lengths are then fixed up, as a deliberate forger would,
  - a truncation (at a field boundary, or anywhere), bytes inserted or deleted at a field,
  - random byte flips (in the header region, or anywhere).
`mutate(kind, base, rng)` returns (member, bytes, description): member is None for a single-file
base, else the file of the directory (safetensors) that was changed.
"""

from __future__ import annotations

import json
import math
import random
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF value types: id -> (struct format or None, size)
GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9

EDGE_INTS = [0, 1, 2, 3, 7, 31, 32, 33, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
             2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 5e-324, 1e-30, 1e30, 3.4e38, 1e308, 1.0, 2.0]


@dataclass
class Field:
    offset: int
    fmt: str  # struct format ("<I", "<Q", "<f", ...) or "str" (bytes of a string)
    size: int
    what: str


def _edge_int(rng: random.Random, old: int, bits: int) -> int:
    choice = rng.random()
    if choice < 0.6:
        v = rng.choice(EDGE_INTS)
    elif choice < 0.8:
        v = old + rng.choice([-2, -1, 1, 2, 16, -16])
    else:
        v = rng.getrandbits(bits)
    return v % (1 << bits)


def _set_field(data: bytearray, f: Field, rng: random.Random) -> str:
    if f.fmt == "str":
        if f.size == 0:
            return "empty string kept"
        i = f.offset + rng.randrange(f.size)
        new = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"[: max(1, min(3, f.offset + f.size - i))], b"\x00", b" ",
                          bytes([rng.randrange(256)])])
        data[i:i + len(new)] = new
        return f"{f.what}: bytes {new!r} at {i}"
    if f.fmt in ("<f", "<d"):
        v = rng.choice(EDGE_FLOATS)
        if f.fmt == "<f" and math.isfinite(v) and abs(v) > 3.4e38:
            v = math.copysign(math.inf, v)  # what a float32 field holds for it
        data[f.offset:f.offset + f.size] = struct.pack(f.fmt, v)
        return f"{f.what} = {v!r}"
    (old,) = struct.unpack_from(f.fmt, data, f.offset)
    bits = 8 * f.size
    v = _edge_int(rng, int(old), bits)
    raw = v.to_bytes(f.size, "little")
    data[f.offset:f.offset + f.size] = raw
    return f"{f.what} = {v} (was {old})"


# ----------------------------------------------------------------------------------------- GGUF


def gguf_fields(data: bytes) -> tuple[list[Field], int]:
    """The fields of a GGUF file's header and tensor index; and where the index ends."""
    out = [Field(4, "<I", 4, "version"), Field(8, "<Q", 8, "tensor_count"), Field(16, "<Q", 8, "kv_count")]
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(what):
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        out.append(Field(pos, "<Q", 8, f"{what} length"))
        out.append(Field(pos + 8, "str", n, what))
        s = bytes(data[pos + 8:pos + 8 + n])
        pos += 8 + n
        return s.decode("utf-8", "replace")

    def value(t, what, many=True):
        nonlocal pos
        if t in GGUF_SCALARS:
            size = struct.calcsize(GGUF_SCALARS[t])
            if many:
                out.append(Field(pos, GGUF_SCALARS[t], size, what))
            pos += size
        elif t == STRING:
            string(what)
        elif t == ARRAY:
            et, n = struct.unpack_from("<IQ", data, pos)
            out.append(Field(pos, "<I", 4, f"{what} element type"))
            out.append(Field(pos + 4, "<Q", 8, f"{what} count"))
            pos += 12
            for i in range(n):
                value(et, f"{what}[{i}]", many=i < 4 or i == n - 1)
        else:
            raise ValueError(f"value type {t}")

    for _ in range(n_kv):
        key = string("key")
        out.append(Field(pos, "<I", 4, f"{key} value type"))
        (t,) = struct.unpack_from("<I", data, pos)
        pos += 4
        value(t, key)
    for _ in range(n_tensors):
        name = string("tensor name")
        (nd,) = struct.unpack_from("<I", data, pos)
        out.append(Field(pos, "<I", 4, f"{name} n_dims"))
        pos += 4
        for d in range(nd):
            out.append(Field(pos, "<Q", 8, f"{name} dim {d}"))
            pos += 8
        out.append(Field(pos, "<I", 4, f"{name} type"))
        out.append(Field(pos + 4, "<Q", 8, f"{name} offset"))
        pos += 12
    return out, pos


# ------------------------------------------------------------------------------- JSON values


def _paths(obj, prefix=(), limit=4000):
    """Every (path, value) in a JSON tree, breadth first, at most `limit`."""
    todo, out = [(prefix, obj)], []
    while todo and len(out) < limit:
        path, v = todo.pop(0)
        out.append((path, v))
        if isinstance(v, dict):
            todo.extend((path + (k,), x) for k, x in v.items())
        elif isinstance(v, list):
            todo.extend((path + (i,), x) for i, x in enumerate(v[:64]))
    return out


def _json_value(rng: random.Random, old):
    r = rng.random()
    if isinstance(old, bool) or r < 0.15:
        return rng.choice([True, False, None, "x", "", [], {}, [1, 2], {"a": 1}, "\udcff"])
    if isinstance(old, (int, float)) and r < 0.85:
        if isinstance(old, int) and rng.random() < 0.7:
            return rng.choice([0, 1, -1, 2, old + 1, old - 1, old * 2, 2**31, 2**53, 2**63, 2**64, -(2**63), 10**30])
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-45, 1e30, 1e308, float(old) + 0.5, 2.0])
    if isinstance(old, str) and r < 0.85:
        return rng.choice(["", "x", old[:-1], old + "x", old.upper(), "\u0000", "\udcff", "a" * 10000, "f32", "q4_0",
                           "bf16", "F64", "I8"])
    if isinstance(old, list) and r < 0.85:
        return rng.choice([[], old[:-1], old + old[-1:], list(reversed(old)), [old], old[:1] * 3])
    if isinstance(old, dict) and r < 0.85:
        if old:
            k = rng.choice(list(old))
            new = dict(old)
            del new[k]
            return new
        return {"x": 1}
    return rng.choice([0, -1, 2**64, 1.5, "", None, [], {}])


def mutate_json(obj, rng: random.Random) -> str:
    """Mutate a JSON tree in place (below its root); returns what changed."""
    paths = [(p, v) for p, v in _paths(obj) if p]
    if not paths:
        return "empty tree"
    path, old = rng.choice(paths)
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    r = rng.random()
    if r < 0.08 and isinstance(parent, dict):
        del parent[key]
        return f"deleted {'/'.join(map(str, path))}"
    if r < 0.12 and isinstance(parent, dict):
        parent[str(key) + "_"] = parent.pop(key)
        return f"renamed {'/'.join(map(str, path))}"
    if r < 0.14:
        parent[key] = f"{DEEP}{rng.choice([100, 1000, 5000])}"  # _dumps writes it as that many nested lists
        return f"{'/'.join(map(str, path))} nested deep"
    new = _json_value(rng, old)
    parent[key] = new
    return f"{'/'.join(map(str, path))} = {str(new)[:60]!r}"


DEEP = "\x00deep:"


def _dumps(obj) -> bytes:
    """JSON text (NaN and infinities as Python writes them, lone surrogates kept as escapes),
    with the DEEP placeholder expanded into that many nested lists."""
    text = json.dumps(obj, allow_nan=True)
    marker = json.dumps(DEEP)[:-1]
    while marker in text:
        at = text.index(marker)
        end = text.index('"', at + 1)
        n = int(text[at + len(marker):end])
        text = text[:at] + "[" * n + "0" + "]" * n + text[end + 1:]
    return text.encode()


# ------------------------------------------------------------------------------ raw mutations


def _raw(data: bytearray, rng: random.Random, boundaries: list[int], header_end: int) -> str:
    r = rng.random()
    if r < 0.35:
        at = rng.choice(boundaries) + rng.choice([0, 0, 1, -1, 3]) if boundaries and rng.random() < 0.6 \
            else rng.randrange(len(data))
        at = max(0, min(len(data) - 1, at))
        del data[at:]
        return f"truncated to {at} bytes"
    if r < 0.5 and boundaries:
        at = min(rng.choice(boundaries), len(data))
        if rng.random() < 0.5:
            n = rng.choice([1, 4, 8, 16])
            data[at:at] = bytes(rng.randrange(256) for _ in range(n))
            return f"{n} bytes inserted at {at}"
        n = rng.choice([1, 4, 8])
        del data[at:at + n]
        return f"{n} bytes deleted at {at}"
    region = header_end if rng.random() < 0.7 else len(data)
    flips = []
    for _ in range(rng.choice([1, 1, 2, 4, 16])):
        i = rng.randrange(max(1, min(region, len(data))))
        data[i] ^= 1 << rng.randrange(8)
        flips.append(i)
    return f"bits flipped at {flips[:4]}"


# -------------------------------------------------------------------------------- per format


def mutate_gguf(base: bytes, rng: random.Random) -> tuple[bytes, str]:
    data = bytearray(base)
    fields, end = gguf_fields(base)
    if rng.random() < 0.7:
        what = _set_field(data, rng.choice(fields), rng)
    else:
        what = _raw(data, rng, [f.offset for f in fields] + [end], end)
    return bytes(data), what


def mutate_cflow(base: bytes, rng: random.Random) -> tuple[bytes, str]:
    from cflow.format.spec import PREAMBLE, Preamble, crc32

    _magic, version, flags, size, hoff, hlen, hcrc, align, _res, _pcrc = PREAMBLE.unpack(base[:64])
    r = rng.random()
    if r < 0.6:  # a header JSON value, the checksums fixed up
        header = json.loads(base[hoff:hoff + hlen])
        what = mutate_json(header, rng)
        raw = _dumps(header)
        out = bytearray(base[:hoff]) + raw
        pre = Preamble(version, flags, len(out), hoff, len(raw), crc32(raw), align)
        out[:64] = pre.pack()
        return bytes(out), f"header {what}"
    data = bytearray(base)
    if r < 0.75:  # a preamble field, its checksum fixed up or not
        names = ["version", "flags", "file_size", "header_offset", "header_length", "header_crc32", "alignment"]
        offs = [8, 12, 16, 24, 32, 40, 44]
        fmts = ["<I", "<I", "<Q", "<Q", "<Q", "<I", "<I"]
        i = rng.randrange(len(names))
        what = _set_field(data, Field(offs[i], fmts[i], struct.calcsize(fmts[i]), names[i]), rng)
        if rng.random() < 0.7:
            data[60:64] = struct.pack("<I", crc32(bytes(data[:60])))
            what += " (preamble checksum fixed)"
        return bytes(data), what
    what = _raw(data, rng, [0, 64, 4096, hoff, len(base)], 64)
    return bytes(data), what


def mutate_safetensors(base: bytes, rng: random.Random) -> tuple[bytes, str]:
    (n,) = struct.unpack_from("<Q", base, 0)
    if rng.random() < 0.65:
        header = json.loads(base[8:8 + n])
        what = mutate_json(header, rng)
        raw = _dumps(header)
        return struct.pack("<Q", len(raw)) + raw + base[8 + n:], f"header {what}"
    data = bytearray(base)
    if rng.random() < 0.3:
        what = _set_field(data, Field(0, "<Q", 8, "header length"), rng)
    else:
        what = _raw(data, rng, [0, 8, 8 + n, len(base)], 8 + n)
    return bytes(data), what


def mutate(kind: str, base: Path, rng: random.Random) -> tuple[str | None, bytes, str]:
    """One mutant of the base of `kind`: (member or None, its bytes, a description)."""
    if kind == "gguf":
        data, what = mutate_gguf(base.read_bytes(), rng)
        return None, data, what
    if kind == "cflow":
        data, what = mutate_cflow(base.read_bytes(), rng)
        return None, data, what
    if kind == "safetensors":
        member = rng.choices(["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                              "generation_config.json"], weights=[6, 4, 2, 1, 1])[0]
        raw = (base / member).read_bytes()
        if member == "model.safetensors":
            data, what = mutate_safetensors(raw, rng)
        elif rng.random() < 0.85:
            obj = json.loads(raw)
            what = mutate_json(obj, rng)
            data = _dumps(obj)
        else:
            buf = bytearray(raw)
            what = _raw(buf, rng, [], len(buf))
            data = bytes(buf)
        return member, data, f"{member}: {what}"
    raise ValueError(kind)
