"""ModelConfig: the single source of truth for a model's shape and dependency graph.

The same object configures the torch model (training, reference decode), the exporter, the
`.cflow` header (stored as `to_dict()`), the engine's step plan and the bandwidth analysis.

Existing architectures (llama, qwen2, qwen3, gemma3) and the pipeline-native family ("pnt")
share it. Fields a given architecture does not use keep their defaults. Adding a field: give it
a default so that older files still load, and document it here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cflow.errors import CflowError

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "pnt")
ROPE_STYLES = ("neox", "interleaved")  # neox: rotate halves (HF llama); interleaved: pairs (2i, 2i+1)
ACTIVATIONS = ("silu", "gelu_tanh")  # gated FFN: silu -> SwiGLU, gelu_tanh -> GeGLU
COMBINE_STYLES = ("parallel_sqrt2", "delayed_sum", "async_experts")
ROUTING_ANCHORS = ("pre_dense", "post_dense")
RESIDUALS = ("single", "decoupled")  # decoupled: experts keep their own residual stream (arch1)


@dataclass
class ModelConfig:
    arch: str = "llama"
    vocab_size: int = 32000
    d_model: int = 512
    n_layer: int = 6
    n_head: int = 8
    n_kv_head: int = 8
    head_dim: int = 0  # 0 -> d_model // n_head
    d_ff: int = 2048  # dense gated-FFN hidden size (0: no dense FFN)
    act: str = "silu"
    max_seq_len: int = 2048  # context length the engine allocates for
    norm_eps: float = 1e-5
    norm_offset: float = 0.0  # RMSNorm weight is (norm_offset + w); gemma uses 1.0
    rope_theta: float = 10000.0
    rope_style: str = "neox"
    tie_embeddings: bool = False
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over each head of q and k
    post_norms: bool = False  # gemma3: extra RMSNorm after attention and after the FFN
    embed_scale: float = 1.0  # gemma: sqrt(d_model)
    attn_scale: float = 0.0  # 0 -> 1/sqrt(head_dim); gemma3: query_pre_attn_scalar**-0.5
    sliding_window: int = 0  # 0: all layers global
    layer_types: list[str] = field(default_factory=list)  # per layer "global"|"sliding"; [] -> all global
    rope_local_theta: float = 0.0  # rope base of sliding layers (gemma3: 10000); 0 -> rope_theta
    final_logit_softcap: float = 0.0
    # --- mixture of experts (all archs may have one; pnt layers always do when n_expert > 0)
    n_expert: int = 0
    top_k: int = 0
    d_expert: int = 0  # expert gated-FFN hidden size
    # --- pipeline-native family (arch == "pnt"); see docs/ARCHITECTURES.md
    delta_d: int = 0  # dense FFN of layer l reads the residual of layer l - delta_d
    delta_e: int = 0  # experts routed at layer l are added at layer l + delta_e
    routing_anchor: str = "post_dense"
    combine: str = "delayed_sum"
    n_iter: int = 1  # weight sharing: the n_layer unique layers are applied n_iter times
    variant: str = ""  # named preset this config came from (arch1, arch2_4_combined, ...)
    residual: str = "single"  # "decoupled": attention+dense and experts write separate streams

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.n_head:
            self.head_dim = self.d_model // self.n_head
        self.validate()

    # ----------------------------------------------------------------- derived shapes
    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def n_layer_eff(self) -> int:
        """Layer applications per token: n_layer unique layers applied n_iter times."""
        return self.n_layer * self.n_iter

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "global"

    # ----------------------------------------------------------------- checks and I/O
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise CflowError(f"invalid model config: {msg}")

        need(self.arch in ARCHS, f"arch {self.arch!r} is not one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "max_seq_len", "n_iter"):
            v = getattr(self, name)
            need(isinstance(v, int) and 0 < v <= 1 << 24, f"{name}={v!r} must be a positive integer below 2^24")
        need(self.n_head % self.n_kv_head == 0, f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        need(self.rope_style in ROPE_STYLES, f"rope_style {self.rope_style!r} not in {ROPE_STYLES}")
        need(self.act in ACTIVATIONS, f"act {self.act!r} not in {ACTIVATIONS}")
        need(self.combine in COMBINE_STYLES, f"combine {self.combine!r} not in {COMBINE_STYLES}")
        need(self.routing_anchor in ROUTING_ANCHORS, f"routing_anchor {self.routing_anchor!r} not in {ROUTING_ANCHORS}")
        need(not self.layer_types or len(self.layer_types) == self.n_layer, "layer_types must have one entry per layer")
        need(all(t in ("global", "sliding") for t in self.layer_types), "layer_types entries are 'global' or 'sliding'")
        need(self.n_expert == 0 or 0 < self.top_k <= self.n_expert, f"top_k={self.top_k} must be in 1..n_expert={self.n_expert}")
        need(self.n_expert == 0 or self.d_expert > 0, "d_expert must be > 0 when n_expert > 0")
        need(self.residual in RESIDUALS, f"residual {self.residual!r} not in {RESIDUALS}")
        need(0 <= self.delta_d < self.n_layer and 0 <= self.delta_e < self.n_layer, "delays must be in 0..n_layer-1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise CflowError("model config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CflowError(f"model config has unknown fields: {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise CflowError(f"invalid model config: {e}") from e
