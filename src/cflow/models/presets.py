"""The pipeline-native candidates as named presets (docs/ARCHITECTURES.md gives the equations).

No torch here: `cflow analyze` builds configs from presets without it.
"""

from __future__ import annotations

from typing import Any

from cflow.errors import CflowError
from cflow.config import ModelConfig
from cflow.models.pipeline_native import PNTConfig

# The paper's geometry as inferred in PAPER.md: d=512, 6 layers, vocab 50,257 untied, MHA
# attention (4 d^2), dense GeGLU hidden 2048, 8 GeGLU experts of hidden 512, top-2.
PAPER_GEOMETRY: dict[str, Any] = dict(
    vocab_size=50257, d_model=512, n_layer=6, n_head=8, n_kv_head=8,
    d_ff=2048, n_expert=8, top_k=2, d_expert=512, max_seq_len=512,
)

# name -> (description, fields that define the candidate)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "arch1": ("decoupled residual streams", dict(
        residual="decoupled", delta_d=0, delta_e=0, routing_anchor="pre_dense", combine="parallel_sqrt2")),
    "arch2_4_combined": ("dense-and-expert delay", dict(
        delta_d=1, delta_e=2, routing_anchor="pre_dense", combine="delayed_sum")),
    "arch2_4_sync": ("dense delay only (ablation)", dict(
        delta_d=1, delta_e=0, routing_anchor="pre_dense", combine="parallel_sqrt2")),
    "arch3": ("pipeline registers", dict(
        post_norms=True, delta_d=0, delta_e=0, routing_anchor="pre_dense", combine="parallel_sqrt2")),
    "arch4_async_experts": ("expert delay, pre-dense routing", dict(
        delta_d=0, delta_e=2, routing_anchor="pre_dense", combine="async_experts")),
    "arch5": ("fixed-point iteration with weight sharing (n_layer/3 unique x 3)", dict(
        delta_d=0, delta_e=0, routing_anchor="pre_dense", combine="parallel_sqrt2", n_iter=3)),
}


# Llama-shaped baselines outside the family (models/dense.py), for the ternary QAT comparison on a
# plain dense decoder: name -> (description, ModelConfig fields)
DENSE_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama-shaped dense decoder (SwiGLU)", dict(arch="llama", act="silu")),
    "bitnet": ("BitNet b1.58's shape: llama with sub-norms and a squared-ReLU GLU", dict(arch="bitnet", act="relu2",
                                                                                        sub_norms=True)),
}
DENSE_FIELDS = ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "max_seq_len")


def preset(name: str, **overrides: Any) -> PNTConfig | ModelConfig:
    """PNTConfig of preset `name` at the paper's geometry, with `overrides` (geometry or any
    field) applied on top. For arch5, n_layer is the applied depth: n_layer/3 unique layers
    run 3 times. A dense preset (DENSE_PRESETS) gives a ModelConfig of the same geometry, its
    experts' fields ignored."""
    if name in DENSE_PRESETS:
        kw = {k: v for k, v in PAPER_GEOMETRY.items() if k in DENSE_FIELDS}
        kw.update({k: v for k, v in overrides.items() if v is not None and k in DENSE_FIELDS})
        kw.update(DENSE_PRESETS[name][1])
        kw["head_dim"] = kw["d_model"] // kw["n_head"]
        return ModelConfig(norm_eps=1e-5, **kw)
    if name not in PRESETS:
        raise CflowError(f"unknown arch {name!r}; choose one of: {', '.join([*PRESETS, *DENSE_PRESETS])}")
    kw: dict[str, Any] = dict(arch="pnt", act="gelu_tanh", variant=name)
    kw.update(PAPER_GEOMETRY)
    kw.update(PRESETS[name][1])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    if name == "arch5":
        n_iter = kw["n_iter"]
        if kw["n_layer"] % n_iter:
            raise CflowError(f"arch5 needs n_layer divisible by n_iter={n_iter}, got {kw['n_layer']}")
        kw["n_layer"] //= n_iter
    return PNTConfig(**kw)
