"""`cflow export`: a PNT checkpoint round-trips through the .cflow writer and reader."""

import numpy as np
import pytest
import torch

from cflow.cli import main
from cflow.errors import CflowError
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


@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_gptq_beats_the_blockwise_fit_on_correlated_inputs(name):
    # GPTQ minimises the error of W x over the calibration's inputs, the blockwise fit that of W:
    # with correlated inputs (activations are) the product's error drops well below the fit's
    from cflow.format import quant
    from cflow.format.tiles import block_type
    from cflow.models.calibrate import Calib, gptq_encode

    rng = np.random.default_rng(0)
    W = rng.standard_normal((48, 128)).astype(np.float32)
    X = rng.standard_normal((4000, 16)) @ rng.standard_normal((16, 128)) + 0.1 * rng.standard_normal((4000, 128))
    H = X.T @ X / len(X)
    calib = Calib(np.diag(H).astype(np.float32), H, len(X))
    bt = block_type(name)
    got = gptq_encode(W, calib, name)
    assert got.shape == (48, 128 // 32 * bt.block_bytes) and got.dtype == np.uint8
    Q_gptq, Q_fit = quant.decode(got, bt, 128), quant.decode(quant.encode(W, bt), bt, 128)
    err = lambda Q: np.linalg.norm((W - Q) @ X.T)  # noqa: E731
    assert err(Q_gptq) < 0.6 * err(Q_fit)
    assert np.abs(Q_gptq - W).max() < 3 * np.abs(Q_fit - W).max()  # still a rounding of W, not another matrix
    with pytest.raises(CflowError, match="second moments"):
        gptq_encode(W, Calib(calib.diag, None, 1), name)
    with pytest.raises(CflowError, match="shape"):
        gptq_encode(W[:, :96], calib, name)


def llama_ckpt(tmp_path):
    from cflow.models.dense import Dense

    torch.manual_seed(0)
    cfg = preset("llama", vocab_size=320, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, max_seq_len=64)
    m = Dense(cfg).eval()
    tok = tokenizer.train_bpe(["once upon a time there was a cat"] * 5, 320)
    path = tmp_path / "llama.pt"
    checkpoint.save(path, model_state=m.state_dict(), optim_state=None, step=3, cfg=cfg,
                    tokenizer_json=tok.to_str(), train_args={})
    return path, m


@pytest.mark.parametrize("arch", ["pnt", "llama"])
def test_export_calibrated(tmp_path, ckpt, capsys, arch):
    # `cflow export --calibrate`: the 4-bit matrices written by GPTQ against the model's own
    # activations on the text; its logits on such text closer to the fp32 model's than without
    from cflow.engine import Engine
    from cflow.models.calibrate import windows_of
    from cflow.train.data import EOT

    path, m = ckpt if arch == "pnt" else llama_ckpt(tmp_path)
    words = "once upon a time there was a cat who sat on a mat and a dog who ran in the sun".split()
    rng = np.random.default_rng(1)
    text = tmp_path / "cal.txt"
    text.write_text(EOT.join(" ".join(rng.choice(words, 60)) for _ in range(40)))
    plain, cal = tmp_path / "plain.cflow", tmp_path / "cal.cflow"
    assert main(["export", str(path), "-o", str(plain), "--type", "q4_0"]) == 0
    assert main(["export", str(path), "-o", str(cal), "--type", "q4_0", "--calibrate", str(text),
                 "--calibrate-tokens", "1000"]) == 0
    assert "q4_0 matrices, q8_0 embedding and head, calibrated on 1000 tokens" in capsys.readouterr().out
    with CflowFile(cal) as f:
        assert f.tensor("blk.0.attn_qkv").type.name == "q4_0" and f.tensor("output").type.name == "q8_0"
        assert f.tensor("blk.1.ffn_down").type.name == "q4_0"
    ck = checkpoint.load(path)
    ids = windows_of(ck["tokenizer"], [text.read_text().split(EOT)[-1]], 64, 64)[0]  # text of the kind it met
    with torch.no_grad():
        ref = m(torch.tensor([ids]))[0][0].float().numpy()
    errs = []
    for p in (plain, cal):
        eng = Engine(str(p), threads=1, fast=False)
        got = eng.forward(eng.new_state(), ids, all_logits=True)
        errs.append(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert errs[1] < errs[0]
    assert main(["export", str(path), "-o", str(tmp_path / "q8.cflow"), "--type", "q8_0", "--calibrate", str(text)]) == 0
    assert "--calibrate not used: only q4_0 and q4_1" in capsys.readouterr().err
    for args, msg in [(["--calibrate", str(tmp_path / "none.txt")], "data file not found"),
                      (["--calibrate", str(text), "--calibrate-tokens", "0"], "must be positive")]:
        out = tmp_path / "bad.cflow"
        assert main(["export", str(path), "-o", str(out), "--type", "q4_0", *args]) == 2
        assert msg in capsys.readouterr().err
        assert not out.exists()
