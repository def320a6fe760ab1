"""The pipeline-native torch model: every preset trains, and decode equals the full forward."""

import pytest
import torch

from cflow.config import ModelConfig
from cflow.errors import CflowError
from cflow.models.pnt import PNT, DecodeState
from cflow.models.presets import PRESETS, preset

TINY = dict(vocab_size=97, d_model=32, n_layer=6, n_head=4, n_kv_head=2, d_ff=48,
            d_expert=16, n_expert=4, top_k=2, max_seq_len=64)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(PRESETS))
def test_forward_backward_reaches_every_weight(name):
    torch.manual_seed(0)
    m = PNT(preset(name, **TINY))
    idx = torch.randint(0, 97, (2, 16))
    logits, lb = m(idx)
    assert logits.shape == (2, 16, 97)
    assert torch.isfinite(lb) and 0.5 < lb.item() < 4.0  # 1.0 at perfect balance, n_expert at worst
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()) + 0.01 * lb
    loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, f"no gradient reaches {n}"
    router = m.layers[0].moe.router.weight.grad
    assert router.abs().sum() > 0


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("anchor", ["pre_dense", "post_dense"])
def test_decode_equals_full_forward(name, anchor):
    torch.manual_seed(1)
    m = PNT(preset(name, routing_anchor=anchor, **TINY)).double().eval()
    idx = torch.randint(0, 97, (2, 14))
    with torch.no_grad():
        full, _ = m(idx)
        st = DecodeState()
        first, _ = m(idx[:, :3], st)  # a prefill chunk, then single tokens
        steps = [first] + [m(idx[:, t:t + 1], st)[0] for t in range(3, 14)]
    assert st.pos == 14 and len(st.kv) == m.cfg.n_layer_eff
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-5


def test_delays_change_the_function():
    """The delays are wired in: the same weights give different logits under other delays."""
    torch.manual_seed(2)
    base = PNT(preset("arch2_4_combined", **TINY)).double()
    idx = torch.randint(0, 97, (1, 8))
    ref = base(idx)[0]
    for dd, de in [(0, 2), (1, 0), (2, 2)]:
        other = PNT(preset("arch2_4_combined", delta_d=dd, delta_e=de, **TINY)).double()
        other.load_state_dict(base.state_dict())
        assert (other(idx)[0] - ref).abs().max() > 1e-6


def test_weight_sharing_and_active_params():
    m = PNT(preset("arch5", **TINY))
    assert m.cfg.n_layer == 2 and m.cfg.n_iter == 3 and len(m.layers) == 2
    full = PNT(preset("arch3", **TINY))
    per_exp = 3 * 32 * 16
    assert full.n_params() - full.n_params(active=True) == 6 * 2 * per_exp


def test_bad_configs_are_clear_errors():
    with pytest.raises(CflowError, match="unknown arch 'arch9'"):
        preset("arch9")
    with pytest.raises(CflowError, match="residual"):
        preset("arch1", residual="triple")
    with pytest.raises(CflowError, match="experts"):
        PNT(ModelConfig(arch="pnt", act="gelu_tanh", d_model=32, n_head=4, n_kv_head=4))
    m = PNT(preset("arch1", **TINY))
    with pytest.raises(CflowError, match="max_seq_len"):
        m(torch.zeros(1, 65, dtype=torch.long))
