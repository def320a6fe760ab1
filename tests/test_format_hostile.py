"""Corrupt, truncated and hostile .cflow files: always a CflowFormatError naming the problem."""

import json
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cflow.config import ModelConfig
from cflow.errors import CflowFormatError
from cflow.format import CflowFile, CflowWriter
from cflow.format.spec import MAGIC, PREAMBLE, VERSION, crc32

CFG = ModelConfig(vocab_size=100, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, n_expert=2, top_k=1, d_expert=32)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _build() -> bytes:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.cflow")
        with CflowWriter(path, CFG, tokenizer_json='{"model": {}}', chat_template="{{ m }}",
                         special_tokens={"bos_token_id": 1, "eos_token_ids": [2], "add_bos": True}, metadata={"source": "test"}) as w:
            w.add_tensor("tok_embd", "q8_0", rng.standard_normal((100, 64)), interleave=16, pack="planes")
            w.add_tensor("blk.0.attn_norm", "f32", rng.standard_normal(64))
            w.add_fused("blk.0.attn_qkv", "q4_0", [("q", rng.standard_normal((64, 64))), ("k", rng.standard_normal((32, 64))),
                                                   ("v", rng.standard_normal((32, 64)))], "stack")
            w.add_fused("blk.0.ffn_gate_up", "q4_1", [("g", rng.standard_normal((64, 64))), ("u", rng.standard_normal((64, 64)))],
                        "stripe", interleave=4)
            w.add_tensor("blk.0.ffn_down", "bf16", rng.standard_normal((64, 64)))
            for e in range(2):
                w.add_expert(0, e, {f"blk.0.exp.{e}.ffn_down": ("q5_0", rng.standard_normal((64, 32)))})
        with open(path, "rb") as f:
            return f.read()


GOOD = _build()
_, _, _, SIZE, HOFF, HLEN, _, _, _, _ = PREAMBLE.unpack(GOOD[:64])
HEADER = json.loads(GOOD[HOFF:])


def assemble(header, *, payload: bytes = GOOD[:HOFF], **fields) -> bytes:
    """A file with this header (dict or raw bytes) and a consistent preamble, unless `fields`
    override preamble values (magic, version, flags, size, hoff, hlen, hcrc, align)."""
    raw = header if isinstance(header, bytes) else json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    v = dict(magic=MAGIC, version=VERSION, flags=0, size=len(payload) + len(raw), hoff=len(payload), hlen=len(raw),
             hcrc=crc32(raw), align=4096)
    v.update(fields)
    pre = PREAMBLE.pack(v["magic"], v["version"], v["flags"], v["size"], v["hoff"], v["hlen"], v["hcrc"], v["align"], bytes(12), 0)
    pre = pre[:60] + struct.pack("<I", crc32(pre[:60]))
    return pre + payload[64:] + raw


def open_bytes(data: bytes, verify: bool = True):
    """Write `data` to a file and open it (and, if it opens, read every tensor)."""
    fd, path = tempfile.mkstemp(suffix=".cflow")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        with CflowFile(path, verify=verify) as f:
            for n in f.tensors:
                f.dequantize(n)
            return f.header
    finally:
        os.unlink(path)


def expect_error(data: bytes, match: str, verify: bool = True) -> None:
    with pytest.raises(CflowFormatError, match=match):
        open_bytes(data, verify)


def edited(fn) -> dict:
    h = json.loads(json.dumps(HEADER))
    fn(h)
    return h


def tensor(h, name):
    return next(t for t in h["tensors"] if t["name"] == name)


def test_the_base_file_is_valid_and_reassembles_identically():
    assert assemble(HEADER) == GOOD
    assert open_bytes(GOOD)["config"]["d_model"] == 64


@settings(max_examples=40, **SETTINGS)
@given(pos=st.integers(0, len(GOOD) - 1), xor=st.integers(1, 255))
def test_any_byte_flip_is_detected(pos, xor):
    data = bytearray(GOOD)
    data[pos] ^= xor
    with pytest.raises(CflowFormatError):
        open_bytes(bytes(data))


@settings(max_examples=30, **SETTINGS)
@given(cut=st.integers(0, len(GOOD) - 1))
def test_any_truncation_is_detected(cut):
    with pytest.raises(CflowFormatError):
        open_bytes(GOOD[:cut], verify=False)


@pytest.mark.parametrize("cut", [0, 1, 63, 64, 4095, 4096, HOFF - 1, HOFF, HOFF + 1, len(GOOD) - 1])
def test_truncation_at_each_region_boundary(cut):
    expect_error(GOOD[:cut], "too small|truncated", verify=False)


def test_appended_bytes_are_detected():
    expect_error(GOOD + b"\0", "longer than recorded", verify=False)


@settings(max_examples=40, **SETTINGS)
@given(pos=st.integers(0, HLEN - 1), xor=st.integers(1, 255))
def test_header_flips_with_a_fixed_up_checksum_never_crash(pos, xor):
    raw = bytearray(GOOD[HOFF:])
    raw[pos] ^= xor
    try:
        open_bytes(assemble(bytes(raw)))
    except CflowFormatError as e:
        assert str(e)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)


@settings(max_examples=60, **SETTINGS)
@given(where=st.sampled_from(["top", "section", "tensor", "expert", "part"]), idx=st.integers(0, 50),
       key_pick=st.integers(0, 50), value=JSON_VALUES)
def test_wrong_json_values_anywhere_are_format_errors(where, idx, key_pick, value):
    h = json.loads(json.dumps(HEADER))
    obj = {"top": h, "section": h["sections"][idx % len(h["sections"])], "tensor": h["tensors"][idx % len(h["tensors"])],
           "expert": h["experts"][idx % len(h["experts"])], "part": tensor(h, "blk.0.attn_qkv")["parts"][idx % 3]}[where]
    keys = sorted(obj)
    obj[keys[key_pick % len(keys)]] = value
    try:
        open_bytes(assemble(h))
    except CflowFormatError as e:
        assert str(e)


CRAFTED = {
    "bad magic": (lambda: b"GGUF" + GOOD[4:], "bad magic"),
    "empty file": (lambda: b"", "too small"),
    "unknown version": (lambda: assemble(HEADER, version=4), "unsupported .cflow version 4"),
    "planes in a version-1 file": (lambda: assemble(edited(lambda h: h.update(version=1)), version=1), "needs version 2"),
    "nonzero flags": (lambda: assemble(HEADER, flags=1), "flags"),
    "huge header length": (lambda: assemble(HEADER, hlen=1 << 40), "header at offset"),
    "header past the end": (lambda: assemble(HEADER, hoff=1 << 50), "header at offset"),
    "size field lies": (lambda: assemble(HEADER, size=1 << 40), "truncated"),
    "header checksum": (lambda: assemble(HEADER, hcrc=12345), "header checksum mismatch"),
    "not utf-8": (lambda: assemble(b'{"a": "\xff\xfe"}'), "not valid UTF-8 JSON"),
    "not json": (lambda: assemble(b"{nope"), "not valid UTF-8 JSON"),
    "deep nesting": (lambda: assemble(b"[" * 200000 + b"]" * 200000), "not valid UTF-8 JSON"),
    "huge integer literal": (lambda: assemble(b'{"x": ' + b"9" * 5000 + b"}"), "not valid UTF-8 JSON"),
    "not an object": (lambda: assemble(b"[1, 2]"), "must be a JSON object"),
    "wrong format field": (lambda: assemble(edited(lambda h: h.update(version=1))), "format/version"),
    "tensors not a list": (lambda: assemble(edited(lambda h: h.update(tensors={}))), "'tensors' has type dict"),
    "config invalid": (lambda: assemble(edited(lambda h: h["config"].update(n_head=3))), "header.config"),
    "config wrong type": (lambda: assemble(edited(lambda h: h.update(config=[]))), "'config' has type list"),
    "tensor offset past the end": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(offset=(SIZE // 64 + 1) * 64))),
                                   "tensor 'tok_embd'.*outside section"),
    "negative offset": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(offset=-64))), "offset=-64 is outside"),
    "negative interleave": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(interleave=-1))), "interleave=-1"),
    "float offset": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(offset=4096.0))), "'offset' has type float"),
    "bool nbytes": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(nbytes=True))), "'nbytes' has type bool"),
    "unaligned tensor": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(offset=4097))), "not a multiple of 64"),
    "overlapping tiles": (lambda: assemble(edited(lambda h: tensor(h, "blk.0.attn_norm").update(
        offset=tensor(h, "tok_embd")["offset"] + 64))), "overlap"),
    "absurd dims": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(shape=[1 << 40, 1 << 40]))), "absurd shape"),
    "zero dim": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(shape=[0, 64]))), "absurd shape"),
    "3-d shape": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(shape=[2, 50, 64]))), "1 or 2 integers"),
    "nbytes mismatch": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(shape=[101, 64]))), "nbytes .* does not match"),
    "huge consistent tensor": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(
        shape=[(1 << 31) - 1, 1 << 20], nbytes=((1 << 31) - 1) * (1 << 15) * 34))), "outside section"),
    "ternary reserved": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(type="ternary"))), "reserved"),
    "unknown block type": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(type="q9_9"))), "unknown block type"),
    "tile vs block size": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(tile=[128, 100]))), "multiples of"),
    "absurd tile": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(tile=[1 << 40, 256]))), "tile"),
    "unknown pack": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(pack="soa"))), "pack 'soa' is not one of"),
    "pack not a string": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(pack=1))), "pack '1' is not one of"),
    "planes of a type without them": (lambda: assemble(edited(lambda h: tensor(h, "blk.0.ffn_down").update(pack="planes"))),
                                      "planes pack exists only for"),
    "planes with a wide interleave": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(interleave=32))),
                                      "at most 16"),
    "interleave vs tile": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(interleave=3))), "does not divide"),
    "unknown section": (lambda: assemble(edited(lambda h: tensor(h, "tok_embd").update(section="nope"))), "'nope' is not in"),
    "duplicate tensor": (lambda: assemble(edited(lambda h: h["tensors"].append(dict(h["tensors"][0])))), "appears twice"),
    "parts do not add up": (lambda: assemble(edited(lambda h: tensor(h, "blk.0.attn_qkv")["parts"][0].update(rows=1))), "parts have"),
    "bad fuse mode": (lambda: assemble(edited(lambda h: tensor(h, "blk.0.attn_qkv").update(fuse="zip"))), "fuse 'zip'"),
    "section past the end": (lambda: assemble(edited(lambda h: h["sections"][0].update(length=1 << 40))), "section 'weights'.*(outside|past the start of the header)"),
    "unaligned section": (lambda: assemble(edited(lambda h: h["sections"][0].update(offset=4100))), "multiples of 4096"),
    "overlapping sections": (lambda: assemble(edited(lambda h: h["sections"][1].update(offset=h["sections"][0]["offset"]))), "overlap"),
    "expert outside section": (lambda: assemble(edited(lambda h: h["experts"][0].update(section="weights"))), "outside section"),
    "expert overlap": (lambda: assemble(edited(lambda h: h["experts"][1].update(offset=h["experts"][0]["offset"]))), "outside the expert's range|overlap"),
    "expert unknown tensor": (lambda: assemble(edited(lambda h: h["experts"][0].update(tensors=["nope"]))), "'nope' is not in header.tensors"),
    "duplicate expert": (lambda: assemble(edited(lambda h: h["experts"].append(dict(h["experts"][0])))), "appears twice"),
    "bad eos ids": (lambda: assemble(edited(lambda h: h["special_tokens"].update(eos_token_ids=["2"]))), "eos_token_ids"),
    "bad bos id": (lambda: assemble(edited(lambda h: h["special_tokens"].update(bos_token_id=-1))), "bos_token_id=-1"),
    "bad add_bos": (lambda: assemble(edited(lambda h: h["special_tokens"].update(add_bos=1))), "'add_bos' has type int"),
    "bad generation type": (lambda: assemble(edited(lambda h: h.update(generation={"temperature": "0.7"}))),
                            "header.generation: temperature='0.7' must be a number"),
    "bad generation range": (lambda: assemble(edited(lambda h: h.update(generation={"min_p": 2.0}))), "min_p=2.0 is outside"),
    "generation not an object": (lambda: assemble(edited(lambda h: h.update(generation=[0.7]))), "'generation' has type list"),
    "section checksum": (lambda: assemble(edited(lambda h: h["sections"][0].update(crc32=h["sections"][0]["crc32"] ^ 1))),
                         "section 'weights': checksum mismatch"),
    "dirty preamble page": (lambda: assemble(HEADER, payload=GOOD[:100] + b"x" + GOOD[101:HOFF]), "must be zero"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_hostile_files(case):
    make, match = CRAFTED[case]
    expect_error(make(), match)


def test_payload_checksums_are_checked_only_when_asked():
    data = assemble(edited(lambda h: h["sections"][0].update(crc32=h["sections"][0]["crc32"] ^ 1)))
    assert open_bytes(data, verify=False)  # structure is fine; `cflow verify` / verify=True find it
    expect_error(data, "checksum mismatch", verify=True)


def test_missing_file_directory_and_fifo_are_clear_errors(tmp_path):
    with pytest.raises(CflowFormatError, match="cannot read"):
        CflowFile(tmp_path / "none.cflow")
    with pytest.raises(CflowFormatError, match="not a regular file"):
        CflowFile(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CflowFormatError, match="not a regular file"):  # opening a FIFO would block
        CflowFile(tmp_path / "fifo")


def test_version_1_files_still_open():
    """Files written before the planes pack existed (version 1, whole blocks) still read."""
    def v1(h):
        h["version"] = 1
        t = tensor(h, "tok_embd")
        del t["pack"]
        t["interleave"] = 1
    # the edit relabels planes-packed bytes as whole blocks: they decode to garbage (NaN scales
    # among them), which is not what this test is about
    with np.errstate(invalid="ignore", over="ignore"):
        h = open_bytes(assemble(edited(v1), version=1))
    assert h["version"] == 1


def test_configs_of_the_previous_version():
    """Dense headers written while every config carried the pipeline-native fields (at their
    defaults) still load; what cannot be read says to re-convert."""
    from cflow.config import MOVED_TO_FAMILY

    h = open_bytes(assemble(edited(lambda h: h["config"].update(MOVED_TO_FAMILY))))
    assert h["config"]["delta_d"] == 0
    for change in (dict(delta_d=1), dict(arch="mamba"), dict(rotary_dim=8)):
        expect_error(assemble(edited(lambda h: h["config"].update(change))), r"header.config: .*cflow convert")
