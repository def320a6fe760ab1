"""`.vflow`, the stage-major layout: written from a .cflow with every tensor's bytes unchanged,
checked against the config's delays on open, run by the engine with the same logits."""

import json
import struct

import numpy as np
import pytest

from cflow.cli import main
from cflow.engine import Engine
from cflow.errors import CflowFormatError
from cflow.format import CflowFile
from cflow.format.spec import PREAMBLE, crc32
from cflow.format.vflow import placement
from pnt_util import make, tok  # noqa: F401 (tok: a fixture)


def to_vflow(tmp_path, tok, name, wtype="q8_0"):
    _, src = make(tmp_path, tok, name, wtype)
    out = str(tmp_path / f"{name}.vflow")
    assert main(["convert", src, "-o", out, "-q"]) == 0
    return src, out


@pytest.mark.parametrize("name", ["arch2_4_combined", "arch4_async_experts", "arch5"])
def test_stage_major_copy_runs_with_the_same_logits(tmp_path, tok, name):
    src, out = to_vflow(tmp_path, tok, name)
    a, b = CflowFile(src), CflowFile(out, verify=True)
    assert b.layout == "stage-major" and a.layout == "layer-major"
    cfg = b.config
    assert [s["stage"] for s in b.stages] == list(range(cfg.n_layer + 1))
    offsets = [min(b.tensor(n).offset for n in s["tensors"]) for s in b.stages]
    assert offsets == sorted(offsets)  # stage after stage in the file
    for s in b.stages:
        for n in s["tensors"]:  # each tensor where the delays put it, its bytes unchanged
            assert placement(n, cfg.delta_d, cfg.n_layer)[0] == s["stage"]
            assert b.tensor(n).section == s["section"]
            np.testing.assert_array_equal(a.tensor_bytes(n), b.tensor_bytes(n))
    if cfg.delta_d:  # the dense FFN of layer 1 streams with the attention of layer 0
        assert "blk.1.ffn_gate_up" in b.stages[0]["tensors"] and "blk.0.attn_qkv" in b.stages[0]["tensors"]
    assert set(a.experts) == set(b.experts)
    for key, e in b.experts.items():
        assert e.offset % 4096 == 0
        np.testing.assert_array_equal(a.expert_bytes(*key), b.expert_bytes(*key))
    ids = list(range(5, 70))
    for sched in ("sequential", "pipeline"):
        ea, eb = Engine(src, threads=2, schedule=sched), Engine(out, threads=2, schedule=sched)
        np.testing.assert_array_equal(ea.forward(ea.new_state(), ids, all_logits=True),
                                      eb.forward(eb.new_state(), ids, all_logits=True))


def rewrite_header(path, fn) -> None:
    """Apply fn to the header JSON of the file at path, with its checksums made consistent again."""
    data = bytearray(open(path, "rb").read())
    magic, ver, flags, size, hoff, hlen, hcrc, align, res, _ = PREAMBLE.unpack(data[:64])
    h = json.loads(data[hoff:hoff + hlen])
    fn(h)
    raw = json.dumps(h, separators=(",", ":")).encode()
    pre = PREAMBLE.pack(magic, ver, flags, hoff + len(raw), hoff, len(raw), crc32(raw), align, res, 0)
    pre = pre[:60] + struct.pack("<I", crc32(pre[:60]))
    open(path, "wb").write(pre + bytes(data[64:hoff]) + raw)


def test_stages_that_disagree_with_the_delays_do_not_load(tmp_path, tok):
    _, out = to_vflow(tmp_path, tok, "arch2_4_sync")  # delta_d = 1

    def expect(fn, match):
        bad = tmp_path / "bad.vflow"
        bad.write_bytes(open(out, "rb").read())
        rewrite_header(bad, fn)
        with pytest.raises(CflowFormatError, match=match):
            CflowFile(bad)
        assert main(["generate", "-m", str(bad), "-n", "2", "hi"]) == 2  # one line, exit 2

    def undelayed(h):
        h["config"]["delta_d"] = 0  # the dense FFN of layer 1 now belongs to stage 1

    expect(undelayed, r"tensor 'blk.1.ffn_norm' belongs to stage 1 with delta_d=0: the stages disagree")

    def moved(h):
        s0, s1 = h["stages"][0]["tensors"], h["stages"][1]["tensors"]
        s1.append(s0.pop(s0.index("blk.0.attn_qkv")))

    expect(moved, r"stages\[1\]: tensor 'blk.0.attn_qkv' belongs to stage 0")

    def dropped(h):
        h["stages"][2]["tensors"].remove("blk.2.attn_output")

    expect(dropped, "tensor 'blk.2.attn_output' is in no stage")

    def short(h):
        h["stages"].pop()

    expect(short, "6 stages, the config's 6 layers need 7")

    def no_layout(h):
        del h["layout"]

    expect(no_layout, 'a stage-major file has "layout": "stage-major"')


def test_vflow_from_a_checkpoint_source_and_bad_requests(tmp_path, tok, capsys):
    src, out = to_vflow(tmp_path, tok, "arch1")
    assert main(["convert", src, "-o", str(tmp_path / "x.vflow"), "--quant", "q4_0", "-q"]) == 2
    assert "--quant keep only" in capsys.readouterr().err
    assert not (tmp_path / "x.vflow").exists()
    assert main(["convert", out, "-o", out, "-q"]) == 2  # never onto its source
    assert CflowFile(out).layout == "stage-major"


def test_a_dense_model_converts_straight_to_vflow(tmp_path, tiny_hf, tiny_cflow):
    out = tmp_path / "tiny.vflow"
    assert main(["convert", str(tiny_hf), "-o", str(out), "-q"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.vflow"]  # the layer-major step is gone
    f = CflowFile(out, verify=True)
    assert f.layout == "stage-major" and len(f.stages) == f.config.n_layer + 1
    ids = list(range(3, 40))
    a, b = Engine(str(tiny_cflow), threads=1), Engine(str(out), threads=1)
    np.testing.assert_array_equal(a.forward(a.new_state(), ids, all_logits=True),
                                  b.forward(b.new_state(), ids, all_logits=True))
