"""The pipeline-native family ("pnt", docs/ARCHITECTURES.md): its configuration and registry entry.

PNTConfig adds the family's dependency graph to ModelConfig: the delays of the dense FFN and of
the experts, the routing anchor, the combine style, the residual streams and weight sharing.
It is stored in the .cflow header like any config (ModelConfig.from_dict reads it back). The
torch model is cflow.models.pnt; no torch here, so `cflow analyze` and the registry stay light.
"""

from __future__ import annotations

from dataclasses import dataclass

from cflow.config import ModelConfig, config_error
from cflow.errors import UnsupportedError
from cflow.models.base import Architecture

COMBINE_STYLES = ("parallel_sqrt2", "delayed_sum", "async_experts")
ROUTING_ANCHORS = ("pre_dense", "post_dense")
RESIDUALS = ("single", "decoupled")  # decoupled: experts keep their own residual stream (arch1)


@dataclass
class PNTConfig(ModelConfig):
    arch: str = "pnt"
    delta_d: int = 0  # dense FFN of layer l reads the residual of layer l - delta_d
    delta_e: int = 0  # experts routed at layer l are added at layer l + delta_e
    routing_anchor: str = "post_dense"
    combine: str = "delayed_sum"
    n_iter: int = 1  # weight sharing: the n_layer unique layers are applied n_iter times
    variant: str = ""  # named preset this config came from (arch1, arch2_4_combined, ...)
    residual: str = "single"  # "decoupled": attention+dense and experts write separate streams

    @property
    def n_layer_eff(self) -> int:
        """Layer applications per token: n_layer unique layers applied n_iter times."""
        return self.n_layer * self.n_iter

    def validate(self) -> None:
        super().validate()
        need = config_error
        need(isinstance(self.n_iter, int) and 0 < self.n_iter <= 1 << 24,
             f"n_iter={self.n_iter!r} must be a positive integer below 2^24")
        need(self.combine in COMBINE_STYLES, f"combine {self.combine!r} not in {COMBINE_STYLES}")
        need(self.routing_anchor in ROUTING_ANCHORS, f"routing_anchor {self.routing_anchor!r} not in {ROUTING_ANCHORS}")
        need(self.residual in RESIDUALS, f"residual {self.residual!r} not in {RESIDUALS}")
        need(0 <= self.delta_d < self.n_layer and 0 <= self.delta_e < self.n_layer, "delays must be in 0..n_layer-1")


class PipelineNative(Architecture):
    name = "pnt"
    summary = "pipeline-native research family (`cflow train`, `cflow export`): delays, experts, weight sharing"
    engines = ()
    config_class = PNTConfig

    def check_tensors(self, cfg, tensors):
        """No engine runs the family: its files hold what cflow.models.pnt's exporter writes and its
        loader reads, and only the container checks (cflow.format) apply to them."""

    def build(self, b, cfg):
        raise UnsupportedError("the native engine does not run mixture-of-experts / pipeline-native models yet "
                               "(the torch model cflow.models.pnt does)")


ARCH = PipelineNative()
