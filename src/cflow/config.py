"""ModelConfig: the single source of truth for a model's shape and dependency graph.

The same object configures the torch model (training, reference decode), the exporter, the
`.cflow` header (stored as `to_dict()`), the engine's step plan and the bandwidth analysis.

Every architecture of the registry (cflow.models) uses it; a family with fields of its own
subclasses it (the pipeline-native family: cflow.models.pipeline_native.PNTConfig), and both
`ModelConfig(arch=...)` and `from_dict` return that class for its `arch`. Fields a given
architecture does not use keep their defaults. Adding a field: give it a default so that older
files still load, and document it here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from cflow.errors import CflowError

ROPE_STYLES = ("neox", "interleaved")  # neox: rotate halves (HF llama); interleaved: pairs (2i, 2i+1)
ACTIVATIONS = ("silu", "gelu_tanh", "relu2")  # gated FFN: SwiGLU, GeGLU, squared-ReLU GLU (BitNet)
# Fields every config carried before they moved to the pipeline-native family's PNTConfig, with
# the values files of dense models hold: such headers still load (the fields are dropped).
MOVED_TO_FAMILY = {"delta_d": 0, "delta_e": 0, "routing_anchor": "post_dense", "combine": "delayed_sum", "n_iter": 1,
                   "variant": "", "residual": "single"}
RECONVERT = "re-convert the model with this version of cflow (cflow convert SRC -o OUT.cflow)"
MAX_SIZE = 1 << 24  # bound of every count and width: far above any model's, far below int32 overflow
SIZES = ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "max_seq_len")  # 1..MAX_SIZE
COUNTS = ("d_ff", "sliding_window", "n_expert", "top_k", "d_expert", "d_shared")  # 0..MAX_SIZE
SWITCHES = ("tie_embeddings", "qkv_bias", "qk_norm", "post_norms", "sub_norms", "expert_renorm")
# The float fields' ranges: (low (excluded), high, whether 0 stands for the default or "off").
# A value outside is no trained model's, and it turns every activation into inf, NaN or noise:
# norm_eps <= 0 divides a zero row by zero, a huge attention scale overflows the scores, and a
# NaN reaches the int8 activation quantizer, where converting NaN to an integer is undefined.
FLOAT_RANGES = {
    "norm_eps": (0.0, 1.0, False),
    "norm_offset": (-10.0, 10.0, True),  # llama 0, gemma 1
    "rope_theta": (1.0, 1e12, False),  # theta^(-2i/d) overflows for a tiny base
    "rope_local_theta": (1.0, 1e12, True),  # 0: rope_theta
    "embed_scale": (0.0, 1e4, False),  # gemma: sqrt(d_model) <= 2^12
    "attn_scale": (0.0, 1.0, True),  # 0: 1/sqrt(head_dim); scales are 1/sqrt of a factor >= 1
    "final_logit_softcap": (0.0, 1e4, True),  # 0: off; gemma 2: 30
}


def is_int(v: Any) -> bool:
    """A JSON integer: booleans are not integers (docs/FORMAT.md 3)."""
    return isinstance(v, int) and not isinstance(v, bool)


def float_error(name: str, v: Any) -> str | None:
    """Why `v` is not a valid value of the float field `name` (FLOAT_RANGES), or None."""
    lo, hi, zero_ok = FLOAT_RANGES[name]
    span = f"({lo:g}, {hi:g}]" + (" or 0" if zero_ok else "")
    if not (is_int(v) or isinstance(v, float) and math.isfinite(v)):  # a huge int has no float: compare it as it is
        return f"{name}={v!r} must be a finite number in {span}"
    if not (lo < v <= hi or (zero_ok and v == 0)):
        return f"{name}={v!r} is outside {span}"
    return None


def config_error(cond: bool, msg: str) -> None:
    if not cond:
        raise CflowError(f"invalid model config: {msg}")


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
    sub_norms: bool = False  # bitnet: RMSNorm of the attention output before Wo, of the GLU output before Wd
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
    expert_renorm: bool = True  # gates renormalised over the top_k (Mixtral; Qwen3-MoE, OLMoE: norm_topk_prob)
    d_shared: int = 0  # a shared expert beside the routed ones (Qwen2-MoE): its gated-FFN width; 0: none

    def __new__(cls, *args: Any, **kwargs: Any) -> "ModelConfig":
        """ModelConfig(arch=..., ...) builds the config class of that arch's family (cflow.models):
        ModelConfig(arch="pnt", delta_d=1, ...) is a PNTConfig."""
        if cls is ModelConfig:
            from cflow import models

            arch = kwargs.get("arch", args[0] if args else "llama")
            if isinstance(arch, str) and arch in models.architectures():
                cls = models.get(arch).config_class
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.head_dim == 0 and is_int(self.n_head) and is_int(self.d_model) and self.n_head > 0:
            self.head_dim = self.d_model // self.n_head
        self.validate()

    # ----------------------------------------------------------------- derived shapes
    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "global"

    # ----------------------------------------------------------------- checks and I/O
    def validate(self) -> None:
        from cflow import models

        need = config_error
        names = models.names()
        need(self.arch in names, f"arch {self.arch!r} is not one of {', '.join(names)}")
        cls = models.get(self.arch).config_class
        need(isinstance(self, cls), f"arch {self.arch!r} takes a {cls.__name__}, not a {type(self).__name__}")
        for name in SIZES:
            v = getattr(self, name)
            need(is_int(v) and 0 < v <= MAX_SIZE, f"{name}={v!r} must be a positive integer below 2^24")
        for name in COUNTS:
            v = getattr(self, name)
            need(is_int(v) and 0 <= v <= MAX_SIZE, f"{name}={v!r} must be an integer in 0..2^24")
        for name in SWITCHES:
            need(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be true or false")
        for name in FLOAT_RANGES:
            err = float_error(name, getattr(self, name))
            need(err is None, err)
        need(self.n_head % self.n_kv_head == 0, f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (rope turns pairs of values)")
        need(self.rope_style in ROPE_STYLES, f"rope_style {self.rope_style!r} not in {ROPE_STYLES}")
        need(self.act in ACTIVATIONS, f"act {self.act!r} not in {ACTIVATIONS}")
        need(isinstance(self.layer_types, list), "layer_types must be a list")
        need(not self.layer_types or len(self.layer_types) == self.n_layer, "layer_types must have one entry per layer")
        need(all(t in ("global", "sliding") for t in self.layer_types), "layer_types entries are 'global' or 'sliding'")
        need(self.n_expert == 0 or 0 < self.top_k <= self.n_expert, f"top_k={self.top_k} must be in 1..n_expert={self.n_expert}")
        need(self.n_expert == 0 or self.d_expert > 0, "d_expert must be > 0 when n_expert > 0")
        need(self.d_shared == 0 or self.n_expert > 0, "a shared expert (d_shared) needs routed experts")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """The config stored by to_dict, as the class of its arch's family (PNTConfig for "pnt").
        Headers of dense models written before the family fields moved still load."""
        from cflow import models
        from cflow.errors import UnsupportedError

        if not isinstance(d, dict):
            raise CflowError("model config must be a JSON object")
        arch = d.get("arch", "llama")
        try:
            target = models.get(arch)
        except (UnsupportedError, TypeError):
            raise CflowError(f"model config: unknown arch {arch!r} (this cflow knows {', '.join(models.names())}); "
                             f"{RECONVERT}") from None
        target = target.config_class
        if not issubclass(target, cls):
            raise CflowError(f"model config: arch {arch!r} takes a {target.__name__}, not a {cls.__name__}")
        known = {f.name for f in dataclasses.fields(target)}
        d = {k: v for k, v in d.items() if k in known or k not in MOVED_TO_FAMILY or v != MOVED_TO_FAMILY[k]}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CflowError(f"model config has fields arch {arch!r} does not know: {', '.join(unknown)}; {RECONVERT}")
        try:
            return target(**d)
        except TypeError as e:
            raise CflowError(f"invalid model config: {e}") from e
