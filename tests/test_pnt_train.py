"""Data, tokenizer, trainer, resume, DDP and eval of the pipeline-native models (tiny configs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cflow.cli import main
from cflow.errors import CflowError
from cflow.train import data

HERE = Path(__file__).parent
SAMPLE = str(HERE / "data" / "stories_sample.jsonl")
TINY = ["--d-model", "32", "--n-layer", "3", "--n-head", "4", "--n-kv-head", "2", "--d-ff", "64",
        "--n-expert", "4", "--top-k", "2", "--d-expert", "16", "--seq-len", "32", "--batch", "4",
        "--vocab-size", "320", "--warmup", "2", "--log-every", "1", "--quiet", "--lr", "1e-2"]
ENV = {**os.environ, "PYTHONPATH": str(HERE.parent / "src"), "OMP_NUM_THREADS": "1"}


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A tokenizer trained once on the sample, shared by the runs below."""
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    from cflow.train import tokenizer

    train, _ = data.split(data.read_texts(SAMPLE))
    tokenizer.load_or_train(str(path), train, 320)
    return str(path)


def test_formats_and_split(tmp_path):
    js = data.read_texts(SAMPLE)
    assert len(js) == 160 and all(t and "{" not in t[:1] for t in js)
    txt = data.read_texts(str(HERE / "data" / "tinystories_format.txt"))
    assert txt == js[:12]  # the same stories through TinyStories' own separator format
    train, test = data.split(js)
    assert len(test) == 8 and test[0] == js[0] and js[1] in train and len(train) + len(test) == len(js)
    import lzma

    xz = tmp_path / "s.jsonl.xz"
    xz.write_bytes(lzma.compress(Path(SAMPLE).read_bytes()))
    assert data.read_texts(str(xz)) == js


def test_bad_data_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("<|endoftext|>\n  \n<|endoftext|>")
    with pytest.raises(CflowError, match="holds no text"):
        data.read_texts(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "x"}\n')
    with pytest.raises(CflowError, match='"text" string'):
        data.read_texts(str(bad))
    assert main(["train", "--arch", "arch1", "--data", str(empty), "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    assert "holds no text" in capsys.readouterr().err
    assert main(["train", "--arch", "arch9", "--data", SAMPLE, "--steps", "1", "--out", str(tmp_path / "r")] + TINY) == 2
    assert "unknown arch 'arch9'" in capsys.readouterr().err


def test_resume_reproduces_the_uninterrupted_run(tmp_path, tok):
    common = ["train", "--arch", "arch2_4_combined", "--data", SAMPLE, "--tokenizer", tok, "--steps", "8"] + TINY
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--stop-after", "4"]) == 0
    assert len(losses(tmp_path / "b")) == 4 and not (tmp_path / "b" / "final.json").exists()
    assert main(common + ["--out", str(tmp_path / "b"), "--resume"]) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 8 and a == b  # bit-identical: same batches, same optimizer state
    assert a[-1] < a[0]
    fa = json.loads((tmp_path / "a" / "final.json").read_text())
    fb = json.loads((tmp_path / "b" / "final.json").read_text())
    assert fa["test_ppl"] == fb["test_ppl"] and fa["params"] > fa["active_params"]
    assert (tmp_path / "a" / "loss.png").stat().st_size > 1000


def test_eval_and_vocab_mismatch(tmp_path, tok, capsys):
    run = tmp_path / "r"
    assert main(["train", "--arch", "arch4_async_experts", "--data", SAMPLE, "--tokenizer", tok, "--steps", "3",
                 "--out", str(run)] + TINY) == 0
    capsys.readouterr()
    assert main(["eval", str(run / "ckpt.pt"), "--data", SAMPLE, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    final = json.loads((run / "final.json").read_text())
    assert rec["ppl"] == pytest.approx(final["test_ppl"], rel=1e-6) and 0 <= rec["acc"] <= 1
    from cflow.train import tokenizer

    other = tmp_path / "other.json"
    tokenizer.load_or_train(str(other), data.read_texts(SAMPLE), 400)
    assert main(["eval", str(run), "--data", SAMPLE, "--tokenizer", str(other)]) == 2
    assert "400 tokens but checkpoint" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nothing.pt"), "--data", SAMPLE]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_ddp_two_processes_match_one(tmp_path, tok):
    """torchrun, 2 gloo processes, each half of the global batch: same losses as one process."""
    common = ["-m", "cflow", "train", "--arch", "arch2_4_sync", "--data", SAMPLE, "--tokenizer", tok,
              "--steps", "4", "--ckpt-every", "0", "--final-eval-batches", "1"] + TINY
    one = subprocess.run([sys.executable] + common + ["--out", str(tmp_path / "one")], env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    # --standalone: a rendezvous on a free port of localhost (a fixed one collides with any other
    # run on the host: EADDRINUSE)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                         + common + ["--out", str(tmp_path / "two")],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    head = json.loads(open(tmp_path / "two" / "metrics.jsonl").readline())
    assert head["world"] == 2
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 4
    # same data and weights; only float summation order and the per-process balance loss differ
    assert a == pytest.approx(b, abs=2e-3)


def train_ternary_and_eval(run: Path, capsys, args: list[str]) -> None:
    """6 steps of --ternary training into `run`: the loss falls, and `cflow eval` of the checkpoint
    gives the run's own final perplexity (eval runs the quantized model)."""
    assert main(["train", "--data", SAMPLE, "--steps", "6", "--out", str(run), "--ternary"] + args) == 0
    a = losses(run)
    assert a[-1] < a[0]
    capsys.readouterr()
    assert main(["eval", str(run), "--data", SAMPLE, "--json"]) == 0
    final = json.loads((run / "final.json").read_text())
    assert json.loads(capsys.readouterr().out)["ppl"] == pytest.approx(final["test_ppl"], rel=1e-6)


def test_ternary_qat_trains_evaluates_and_exports_ternary_weights(tmp_path, tok, capsys):
    # --ternary: the loss falls, eval runs the quantized model (the same perplexity as the run's
    # final one), and the exported matrices hold three values each (-s, 0, s), s = their mean |w|
    import numpy as np
    import torch

    from cflow.format.reader import CflowFile
    from cflow.models.pnt import int8_per_token, ternary_weight
    from cflow.train import checkpoint

    run = tmp_path / "t"
    train_ternary_and_eval(run, capsys, ["--arch", "arch2_4_combined", "--tokenizer", tok] + TINY)
    out = tmp_path / "t.cflow"
    assert main(["export", str(run), "-o", str(out), "--type", "f32"]) == 0
    sd = checkpoint.load(run)["model"]
    with CflowFile(out, verify=True) as f:
        assert f.metadata["ternary_qat"] is True
        down = f.dequantize("blk.1.ffn_down")
        s = sd["layers.1.ffn_down"].abs().mean().item()
        np.testing.assert_allclose(np.unique(np.abs(down)), [0.0, s], rtol=1e-6)
        e = f.dequantize("blk.0.exp.3.ffn_down")  # per expert: its own scale
        np.testing.assert_allclose(np.unique(np.abs(e)), [0.0, sd["layers.0.moe.w_down"][3].abs().mean().item()],
                                   rtol=1e-6)
        router = f.dequantize("blk.0.ffn_gate_inp")  # the router stays full precision
        assert len(np.unique(router)) > 3
    # the straight-through roundings: values rounded, gradients of the identity
    w = torch.randn(8, 16, requires_grad=True)
    ternary_weight(w).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    x = torch.randn(3, 16)
    q = int8_per_token(x)
    steps = q / (x.abs().amax(-1, keepdim=True) / 127)
    assert torch.allclose(steps, steps.round(), atol=1e-4) and (q - x).abs().max() <= x.abs().max() / 254 + 1e-6
    # resuming needs the same choice
    assert main(["train", "--arch", "arch2_4_combined", "--data", SAMPLE, "--tokenizer", tok, "--steps", "6",
                 "--out", str(run), "--resume"] + TINY) == 2
    assert "--ternary must match" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["bitnet", "llama"])
def test_llama_shaped_ternary_qat_exports_tq2_0_the_engine_runs(tmp_path, tok, capsys, arch):
    # the dense baselines: --ternary trains, eval agrees with the run, and `export --type tq2_0`
    # stores the ternary values exactly (d_model and d_ff whole blocks of 256): the engine with fp32
    # activations gives the torch model's logits (computed with those weights, fp32 activations)
    import numpy as np
    import torch

    from cflow.engine import Engine
    from cflow.format.reader import CflowFile
    from cflow.models.dense import Dense
    from cflow.models.pnt import ternary_values
    from cflow.train import checkpoint

    run = tmp_path / arch
    dims = ["--d-model", "256", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--d-ff", "512",
            "--seq-len", "32", "--batch", "4", "--vocab-size", "320", "--warmup", "2", "--log-every", "1", "--quiet",
            "--lr", "3e-3"]
    train_ternary_and_eval(run, capsys, ["--arch", arch, "--tokenizer", tok] + dims)
    out = tmp_path / f"{arch}.cflow"
    assert main(["export", str(run), "-o", str(out), "--type", "tq2_0", "--embd-type", "f32"]) == 0
    ck = checkpoint.load(run)
    plain = Dense(ck["config"]).eval()  # the ternarized weights, fp32 activations
    plain.load_state_dict({k: ternary_values(v) if k.startswith("layers.") and v.dim() == 2 else v
                           for k, v in ck["model"].items()})
    with CflowFile(out, verify=True) as f:
        assert f.metadata["ternary_qat"] is True and f.config.arch == arch
        assert {f.tensors[n].type.name for n in f.tensors if n.startswith("blk.") and n.endswith(("qkv", "down"))} \
            == {"tq2_0"}
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 300, 32)]  # the trained length
    with torch.no_grad():
        ref = plain(torch.tensor([ids]))[0][0].numpy()
    e = Engine(str(out), threads=2, fast=False)
    got = e.forward(e.new_state(), ids, all_logits=True)
    assert (np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).max() <= 1e-3
