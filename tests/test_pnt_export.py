"""`cflow export`: a PNT checkpoint round-trips through the .cflow writer and reader."""

import numpy as np
import pytest
import torch

from cflow.cli import main
from cflow.format.reader import CflowFile
from cflow.models.pnt import PNT
from cflow.models.presets import preset
from cflow.train import checkpoint, tokenizer

TINY = dict(vocab_size=320, d_model=64, n_layer=3, n_head=4, n_kv_head=2, d_ff=128, d_expert=64,
            n_expert=4, top_k=2, max_seq_len=64)


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    cfg = preset("arch4_async_experts", **TINY)
    m = PNT(cfg)
    tok = tokenizer.train_bpe(["once upon a time there was a cat"] * 5, 320)
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model_state=m.state_dict(), optim_state=None, step=7, cfg=cfg,
                    tokenizer_json=tok.to_str(), train_args={})
    return path, m


@pytest.mark.parametrize("wtype,tol", [("f32", 0.0), ("q8_0", 5e-3)])
def test_export_round_trip(tmp_path, ckpt, wtype, tol):
    path, m = ckpt
    out = tmp_path / "m.cflow"
    assert main(["export", str(path), "-o", str(out), "--type", wtype]) == 0
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    with CflowFile(out, verify=True) as f:
        cfg = f.config
        assert (cfg.delta_d, cfg.delta_e, cfg.routing_anchor, cfg.combine) == (0, 2, "pre_dense", "async_experts")
        assert f.tokenizer_json and f.metadata["step"] == 7
        parts = f.unfuse("blk.1.attn_qkv")
        wqkv = sd["layers.1.attn.wqkv.weight"]
        got = np.concatenate([parts["blk.1.attn_q"], parts["blk.1.attn_k"], parts["blk.1.attn_v"]])
        assert np.abs(got - wqkv).max() <= tol * np.abs(wqkv).max() + 1e-7
        gu = f.unfuse("blk.2.ffn_gate_up")
        assert np.abs(np.concatenate([gu["blk.2.ffn_gate"], gu["blk.2.ffn_up"]]) - sd["layers.2.ffn_gate_up"]).max() \
            <= tol * np.abs(sd["layers.2.ffn_gate_up"]).max() + 1e-7
        np.testing.assert_array_equal(f.dequantize("blk.0.ffn_gate_inp"), sd["layers.0.moe.router.weight"])
        np.testing.assert_array_equal(f.dequantize("blk.0.exp_gain").ravel(), sd["layers.0.exp_gain"])
        assert len(f.experts) == 3 * 4
        for (l, e) in [(0, 0), (2, 3)]:
            down = f.dequantize(f"blk.{l}.exp.{e}.ffn_down")
            ref = sd[f"layers.{l}.moe.w_down"][e]
            assert np.abs(down - ref).max() <= tol * np.abs(ref).max() + 1e-7
            ex = f.experts[(l, e)]
            t = f.tensor(f"blk.{l}.exp.{e}.ffn_down")
            assert ex.offset <= t.offset and t.end <= ex.offset + ex.length  # behind the expert table
        out_w = f.dequantize("output")
        assert np.abs(out_w - sd["output.weight"]).max() <= tol * np.abs(sd["output.weight"]).max() + 1e-7


def test_export_missing_checkpoint(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.pt"), "-o", str(tmp_path / "x.cflow")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    assert not (tmp_path / "x.cflow").exists()
