"""The pipeline-native family ("pnt", docs/ARCHITECTURES.md): its configuration, registry entry
and step plan.

PNTConfig adds the family's dependency graph to ModelConfig: the delays of the dense FFN and of
the experts, the routing anchor, the combine style, the residual streams and weight sharing.
It is stored in the .cflow header like any config (ModelConfig.from_dict reads it back). The
torch model is cflow.models.pnt; no torch here, so `cflow analyze` and the registry stay light.

The plan (build) follows cflow.models.pnt.PNT.forward op for op. Per applied layer j (weights of
unique layer j mod n_layer, KV slot j), three weight streams:
    attention: qkv = Wqkv rms(h[j] (+ m[j])); att = Attn(qkv); a = Wo att
    dense    : f[j] = Wd GeGLU(rms(h[j - delta_d]))                 (reads an older residual)
    experts  : route = top_k(softmax(R rms(x[j]))); e[j] = Experts(rms(x[j]), route)
    combine  : h[j+1] = h[j] + a + c_d f[j] + c_e g e[j - delta_e]  (m[j+1] = m[j] + c_e e[j]: arch1)
Residuals live in a ring of max(delta_d, delta_e) + 2 buffers (h[j] is H[j mod depth]), expert
outputs in a ring of delta_e + 2, dense outputs in a ring of 2: every delay is between layers of
one token, so the plan's buffers are the ring and the pending queue (rows of the step), and the
sequence state keeps only the KV caches. The rings' extra slot lets the pipeline schedule run a
lane one layer ahead without overwriting what another lane still reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

from cflow.config import ModelConfig, config_error
from cflow.models.base import Architecture

COMBINE_STYLES = ("parallel_sqrt2", "delayed_sum", "async_experts")
ROUTING_ANCHORS = ("pre_dense", "post_dense")
RESIDUALS = ("single", "decoupled")  # decoupled: experts keep their own residual stream (arch1)


MAX_APPLICATIONS = 1 << 14  # 16384 layer applications per token: far above any model's


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
        # the plan holds an op list per layer application: bound it before anything loops over it
        need(self.n_layer * self.n_iter <= MAX_APPLICATIONS,
             f"n_layer x n_iter = {self.n_layer * self.n_iter} layer applications exceed {MAX_APPLICATIONS}")
        need(self.combine in COMBINE_STYLES, f"combine {self.combine!r} not in {COMBINE_STYLES}")
        need(self.routing_anchor in ROUTING_ANCHORS, f"routing_anchor {self.routing_anchor!r} not in {ROUTING_ANCHORS}")
        need(self.residual in RESIDUALS, f"residual {self.residual!r} not in {RESIDUALS}")
        need(0 <= self.delta_d < self.n_layer and 0 <= self.delta_e < self.n_layer, "delays must be in 0..n_layer-1")


def expected_tensors(cfg: PNTConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a PNT model as `cflow export` writes it (docs/ARCHITECTURES.md, "Export")."""
    c = cfg
    d = c.d_model
    need = {"tok_embd": (c.vocab_size, d), "output_norm": (d,), "output": (c.vocab_size, d)}
    for l in range(c.n_layer):
        b = f"blk.{l}."
        need.update({b + "attn_norm": (d,), b + "attn_qkv": (c.q_dim + 2 * c.kv_dim, d), b + "attn_output": (d, c.q_dim),
                     b + "ffn_norm": (d,), b + "ffn_gate_up": (2 * c.d_ff, d), b + "ffn_down": (d, c.d_ff),
                     b + "exp_norm": (d,), b + "ffn_gate_inp": (c.n_expert, d)})
        if c.post_norms:
            need.update({b + "attn_post_norm": (d,), b + "ffn_post_norm": (d,), b + "exp_post_norm": (d,)})
        if c.combine == "async_experts":
            need[b + "exp_gain"] = (d,)
        for e in range(c.n_expert):
            x = f"{b}exp.{e}."
            need.update({x + "ffn_gate_up": (2 * c.d_expert, d), x + "ffn_down": (d, c.d_expert)})
    return need


def build_pnt(b, cfg: PNTConfig):
    """The step plan of a PNT model (see the module doc); b: a cflow.plan.PlanBuilder."""
    from cflow.plan import ACTS, Add, Attention, Embed, Experts, GateUp, Matmul, Router

    c = cfg
    L, n, d = c.n_layer_eff, c.n_layer, c.d_model
    decoupled, post_dense = c.residual == "decoupled", c.routing_anchor == "post_dense"
    c_d = c_e = 1 / math.sqrt(2) if c.combine == "parallel_sqrt2" else 1.0
    act = ACTS["gelu_tanh"]
    depth = max(c.delta_d, c.delta_e) + 2
    H = [b.buffer(f"h{i}", d) for i in range(depth)]  # h[j] = H[j % depth]
    M = [b.buffer(f"m{i}", d) for i in range(2)] if decoupled else None  # m[j] = M[j % 2]
    XA = b.buffer("x_attn", d) if decoupled else -1  # h[j] + m[j]
    XE = b.buffer("x_exp", d) if post_dense else -1  # x[j] + f[j]
    QKV, ATT, AO = b.buffer("qkv", c.q_dim + 2 * c.kv_dim), b.buffer("att", c.q_dim), b.buffer("attn_out", d)
    HID, FO = b.buffer("ffn_h", c.d_ff), [b.buffer(f"ffn_out{i}", d) for i in range(2)]
    ROUTE = b.buffer("route", 2 * c.top_k)
    EO = [b.buffer(f"exp_out{i}", d) for i in range(c.delta_e + 2)]  # e[j] = EO[j % (delta_e + 2)]
    LOGITS = b.buffer("logits", c.vocab_size)
    h = lambda j: H[j % depth]  # noqa: E731
    for u in range(n):
        b.expert_table(u, c.n_expert)

    def land(i: int, dst: int) -> None:
        """e[i] joins the stream dst (h or m of the layer it lands at)."""
        p = f"blk.{i % n}."
        b.op(Add, src=EO[i % len(EO)], dst=dst, scale=c_e, norm=p + "exp_post_norm" if c.post_norms else -1,
             gain=p + "exp_gain" if c.combine == "async_experts" else -1, stream="experts" if decoupled else "attention")

    b.op(Embed, table="tok_embd", dst=h(0))
    if decoupled:
        b.op(Add, src=h(0), dst=M[0], accumulate=False, stream="experts")
    b.barrier()
    for j in range(L):
        p = f"blk.{j % n}."
        # attention
        xa = h(j)
        if decoupled:
            b.op(Add, src=h(j), dst=XA, accumulate=False, stream="attention")
            b.op(Add, src=M[j % 2], dst=XA)
            b.barrier()
            xa = XA
        b.op(Matmul, weight=p + "attn_qkv", norm=p + "attn_norm", src=xa, dst=QKV, role="qkv")
        b.barrier()
        b.op(Attention, kv=j, src=QKV, dst=ATT, n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.head_dim,
             rope_theta=c.rope_theta)
        b.barrier()
        b.op(Matmul, weight=p + "attn_output", src=ATT, dst=AO, role="attn_output")
        b.barrier()
        # dense FFN, on the residual of delta_d layers back
        gu = b.entry(p + "ffn_gate_up")
        chunk = gu.stripe_rows if getattr(gu, "fuse", None) == "stripe" else c.d_ff
        b.op(GateUp, weight=p + "ffn_gate_up", norm=p + "ffn_norm", src=h(max(0, j - c.delta_d)), dst=HID, chunk=chunk,
             act=act, role="gate_up")
        b.barrier()
        b.op(Matmul, weight=p + "ffn_down", src=HID, dst=FO[j % 2], role="down")
        b.barrier()
        # experts, routed on the anchor
        xe = M[j % 2] if decoupled else h(j)
        if post_dense:
            b.op(Add, src=xe, dst=XE, accumulate=False, stream="experts")
            b.op(Add, src=FO[j % 2], dst=XE)
            b.barrier()
            xe = XE
        b.op(Router, weight=p + "ffn_gate_inp", norm=p + "exp_norm", src=xe, dst=ROUTE, top_k=c.top_k, renorm=True)
        b.barrier()
        b.op(Experts, layer=j % n, n_expert=c.n_expert, src=xe, norm=p + "exp_norm", route=ROUTE, dst=EO[j % len(EO)],
             act=act, role="experts")
        b.barrier()
        # combine: h[j+1] = h[j] + a + c_d f (+ c_e e[j - delta_e]); m[j+1] = m[j] + c_e e[j] (decoupled)
        post = c.post_norms
        b.op(Add, src=h(j), dst=h(j + 1), accumulate=False, stream="attention")
        b.op(Add, src=AO, dst=h(j + 1), norm=p + "attn_post_norm" if post else -1)
        b.op(Add, src=FO[j % 2], dst=h(j + 1), scale=c_d, norm=p + "ffn_post_norm" if post else -1)
        if decoupled:
            b.op(Add, src=M[j % 2], dst=M[(j + 1) % 2], accumulate=False, stream="experts")
        if j - c.delta_e >= 0:
            land(j - c.delta_e, M[(j + 1) % 2] if decoupled else h(j + 1))
        b.barrier()
    for i in range(max(0, L - c.delta_e), L):  # experts due past the last layer join h[L]
        if c.delta_e:
            land(i, M[L % 2] if decoupled else h(L))
    b.barrier()
    out = h(L)
    if decoupled:
        b.op(Add, src=M[L % 2], dst=h(L), stream="attention")
        b.barrier()
    b.op(Matmul, weight="output", norm="output_norm", src=out, dst=LOGITS, last_token=True, role="head")
    return b.finish(logits=LOGITS, norm_eps=c.norm_eps, norm_offset=c.norm_offset)


class PipelineNative(Architecture):
    name = "pnt"
    summary = "pipeline-native research family (`cflow train`, `cflow export`): delays, experts, weight sharing"
    config_class = PNTConfig

    def expected_tensors(self, cfg, present):
        return expected_tensors(cfg)

    def build(self, b, cfg):
        return build_pnt(b, cfg)


ARCH = PipelineNative()
