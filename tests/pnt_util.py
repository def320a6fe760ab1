"""A tiny random pipeline-native model of any preset, exported to .cflow (shared by the tests)."""

import pytest
import torch

from cflow.models.export import export_checkpoint
from cflow.models.pnt import PNT
from cflow.models.presets import preset
from cflow.train import checkpoint, tokenizer

TINY = dict(vocab_size=320, d_model=64, n_layer=6, n_head=4, n_kv_head=2, d_ff=128, d_expert=64, n_expert=4, top_k=2,
            max_seq_len=300)
N_POS, N_PROMPT = 256, 200  # positions compared: a 200-token prefill, then 56 decode steps


@pytest.fixture(scope="module")
def tok():
    """A tiny BPE tokenizer (the exported files need one)."""
    return tokenizer.train_bpe(["once upon a time there was a cat"] * 5, 320)


def make(tmp_path, tok, name, wtype="f32", **over):
    """A random PNT of preset `name` (weights of std 0.3: routing and logits far from ties) and its
    export; returns (torch model, path)."""
    torch.manual_seed(0)
    cfg = preset(name, **{**TINY, **over})
    m = PNT(cfg).eval()
    m.reset_parameters(std=0.3)
    ck = tmp_path / f"{name}.pt"
    checkpoint.save(ck, model_state=m.state_dict(), optim_state=None, step=1, cfg=cfg, tokenizer_json=tok.to_str(),
                    train_args={})
    out = tmp_path / f"{name}-{wtype}.cflow"
    export_checkpoint(str(ck), str(out), wtype=wtype, etype=wtype)
    return m, str(out)


