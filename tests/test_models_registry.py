"""The registry of architectures (cflow.models): discovered from the family modules, the only
list of architectures (docs table included), configs dispatched to the family's class."""

import subprocess
import sys
from pathlib import Path

import pytest

from cflow import models
from cflow.config import ModelConfig
from cflow.errors import CflowError, UnsupportedError
from cflow.models.base import Architecture
from cflow.models.pipeline_native import PNTConfig

DOCS = Path(__file__).parent.parent / "docs" / "MODELS.md"


def test_docs_table_is_the_registry():
    text = DOCS.read_text()
    start, end = "<!-- architectures: python -m cflow.models -->\n", "<!-- end architectures -->"
    table = text[text.index(start) + len(start):text.index(end)]
    assert table == models.docs_table(), "docs/MODELS.md: paste the output of `python -m cflow.models`"


def test_registry_lookups():
    assert {"llama", "qwen2", "qwen3", "gemma3", "pnt"} <= set(models.names())
    assert models.for_hf("mistral").name == "llama" and models.for_gguf("gemma3").name == "gemma3"
    assert {"pnt", "llama"} <= set(models.supported("native")) and "llama" in models.supported("ref")
    with pytest.raises(UnsupportedError, match="unsupported architecture 'mamba'; supported: bitnet, gemma3, llama"):
        models.get("mamba")


def test_registry_imports_no_torch():
    code = "import sys; from cflow import models; models.names(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_module_is_all_it_takes(tmp_path, monkeypatch):
    (tmp_path / "toy.py").write_text(
        "from cflow.models.base import Architecture\n\n\n"
        "class Toy(Architecture):\n    name = 'toy'\n    hf_model_types = ('toy',)\n"
        "    fixed = dict(qkv_bias=True)\n\n\nARCH = Toy()\n")
    (tmp_path / "helper.py").write_text("raise AssertionError('modules without ARCH are not imported')\n")
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    monkeypatch.setattr(models, "_registry", None)
    assert "toy" in models.names()
    cfg = models.for_hf("toy").config_from_hf(dict(model_type="toy", hidden_size=64, num_attention_heads=4,
                                                   num_hidden_layers=2, intermediate_size=128, vocab_size=100))
    assert (cfg.arch, cfg.qkv_bias, cfg.head_dim) == ("toy", True, 16)
    assert "| `toy` | toy |" in models.docs_table()
    monkeypatch.delitem(sys.modules, "cflow.models.toy")


def test_dense_families_build_a_plan():
    import numpy as np

    from cflow.convert import Checkpoint, Tensor
    from cflow.plan import PlanBuilder, kv_slots

    for name in models.supported("native"):
        arch = models.get(name)
        cfg = arch.config(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48)
        ts = {n: Tensor("f32", s, np.zeros(s, np.float32)) for n, s in arch.expected_tensors(cfg, {}).items()}
        plan = arch.build(PlanBuilder(Checkpoint(cfg, ts)), cfg)
        assert kv_slots(plan) == [(2, 8), (2, 8)] and plan.tensors[plan.ops[-1].weight].name == "output"


def test_configs_take_the_family_class():
    cfg = ModelConfig(arch="pnt", n_expert=2, top_k=1, d_expert=8, delta_e=1)
    assert type(cfg) is PNTConfig and cfg.n_layer_eff == cfg.n_layer
    assert type(ModelConfig.from_dict(cfg.to_dict())) is PNTConfig
    assert type(ModelConfig()) is ModelConfig and not hasattr(ModelConfig(), "delta_d")
    with pytest.raises(TypeError):
        ModelConfig(arch="llama", delta_d=1)
    with pytest.raises(CflowError, match="cflow convert"):
        ModelConfig.from_dict(dict(arch="llama", delta_d=1))
    assert isinstance(models.get("llama"), Architecture)
