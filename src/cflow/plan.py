"""The step plan: the one description of a model's forward pass (docs/ENGINE.md).

A model's module (cflow.models) describes its forward pass as typed ops through a PlanBuilder:

    b = PlanBuilder(weights, precise=ROLES)          # weights: CflowFile or Checkpoint
    X = b.buffer("x", d_model)
    b.op(Embed, table="tok_embd", dst=X, scale=1.0)
    b.barrier()
    b.op(Matmul, weight="blk.0.attn_qkv", norm="blk.0.attn_norm", src=X, dst=QKV, role="qkv")
    ...
    plan = b.finish(logits=LOGITS, norm_eps=1e-6)

The op kinds and their fields are defined once, in csrc/include/cflow/plan.h, and bound as
classes of the native module (cflow._core.Matmul, ...): `Matmul._fields` lists them. The
native executor runs a plan, the numpy reference engine (engine_ref.py) interprets it, and
`bytes_per_token` walks it. Tensor fields (table, weight, bias, norm, q_norm, k_norm) take a
tensor name, which the builder turns into an index of plan.tensors.
"""

from __future__ import annotations

from cflow._native import core
from cflow.engine import ROLES
from cflow.errors import CflowError, CflowFormatError, UnsupportedError
from cflow.format.quant import TERNARY
from cflow.format.tiles import BLOCK_TYPES

Barrier, Embed, Matmul, GateUp, ActMul, Attention = (core.Barrier, core.Embed, core.Matmul, core.GateUp, core.ActMul,
                                                     core.Attention)
Add, Router, Experts = core.Add, core.Router, core.Experts
OP_KINDS = core.OP_KINDS
Plan, TensorRef, BufferSpec, ExpertRef = core.Plan, core.TensorRef, core.BufferSpec, core.ExpertRef

TENSOR_FIELDS = ("table", "weight", "bias", "norm", "q_norm", "k_norm", "gain")
# The weight streams (an op's `stream`, plan.h Stream): byte counters and the pipeline's lanes.
STREAMS = ("embed", "attention", "dense", "router", "experts", "head")
ROLE_STREAMS = {"qkv": "attention", "attn_output": "attention", "gate_up": "dense", "down": "dense", "head": "head",
                "experts": "experts"}
KIND_STREAMS = {"Embed": "embed", "Attention": "attention", "Router": "router", "Experts": "experts"}
ACTS = {"silu": 0, "gelu_tanh": 1, "relu2": 2}  # GateUp / ActMul `act` (relu2: max(x, 0)^2)
PACK_CODES = {"blocks": 0, "planes": 1}
TERNARY_CODES = tuple(BLOCK_TYPES[n].code for n in TERNARY)  # tq1_0, tq2_0


def tensor_ref(name: str, t) -> TensorRef:
    """A TensorRef from a tensor entry of a CflowFile (format.spec.Tensor), of a Checkpoint
    (convert.Tensor: in memory, offset -1: the reference engine only) or any object with the
    fields type, rows/cols or shape, tile, interleave, offset, nbytes, pack."""
    from cflow.format.tiles import block_type

    shape = tuple(getattr(t, "shape", None) or (t.rows, t.cols))
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    typ = t.type if hasattr(t.type, "code") else block_type(str(t.type))
    tile = getattr(t, "tile", (128, 256))
    offset = getattr(t, "offset", -1)
    nbytes = getattr(t, "nbytes", None)
    if nbytes is None:
        nbytes = int(t.data.nbytes)
    return TensorRef(name=name, offset=int(offset), nbytes=int(nbytes), type=int(typ.code), rows=int(rows),
                     cols=int(cols), tile_rows=int(tile[0]), tile_cols=int(tile[1]),
                     interleave=int(getattr(t, "interleave", 1)), pack=PACK_CODES[getattr(t, "pack", "blocks")])


class PlanBuilder:
    """Collects tensors, buffers and ops; `finish` returns the core.Plan.

    weights: an object with .tensors {name: entry} (CflowFile, Checkpoint).
    precise: the ROLES whose ops run two-level int8 activations (two_level=True).
    """

    def __init__(self, weights, precise=()):
        if unknown := set(precise) - set(ROLES):
            raise CflowError(f"precise: unknown roles {sorted(unknown)}; the roles are {', '.join(ROLES)}")
        self.weights = weights
        self.precise = frozenset(precise)
        self.tensors: list[TensorRef] = []
        self.buffers: list[BufferSpec] = []
        self.ops: list = []
        self.experts: list[ExpertRef] = []
        self._ids: dict[str, int] = {}
        self.stream = "attention"  # of ops that name none (ActMul, Add): the last one named
        self.ternary_layers = False  # an op so far multiplies by a ternary matrix

    # ---------------------------------------------------------------- tensors and buffers
    def has(self, name: str) -> bool:
        return name in self.weights.tensors

    def entry(self, name: str):
        """The file's entry of a tensor (stripe_rows, fuse, parts ...)."""
        t = self.weights.tensors.get(name)
        if t is None:
            raise CflowFormatError(f"the model has no tensor {name!r}")
        return t

    def tensor(self, name: str, *, optional: bool = False) -> int:
        """The plan's index of a tensor; -1 when optional and absent."""
        if name in self._ids:
            return self._ids[name]
        if optional and not self.has(name):
            return -1
        self.tensors.append(tensor_ref(name, self.entry(name)))
        self._ids[name] = len(self.tensors) - 1
        return self._ids[name]

    def rows(self, name: str) -> int:
        return self.tensors[self.tensor(name)].rows

    def buffer(self, name: str, width: int) -> int:
        self.buffers.append(BufferSpec(name=name, width=int(width)))
        return len(self.buffers) - 1

    # ---------------------------------------------------------------- ops
    def op(self, kind, *, role: str | None = None, stream: str | None = None, **fields):
        """Append kind(**fields); tensor fields may be names; role: one of ROLES (two-level; the
        experts' role is "experts", two-level with "gate_up"); stream: one of STREAMS, else the
        role's, the kind's (Embed, Attention, Router, Experts), or the last op's."""
        for f in TENSOR_FIELDS:
            if isinstance(fields.get(f), str):
                fields[f] = self.tensor(fields[f])
        if role is not None:
            if role not in ROLES and role != "experts":
                raise CflowError(f"unknown role {role!r}")
            # ternary weights take one int8 level: BitNet b1.58 trains with 8-bit activations, and
            # their kernels are compute-bound, so a second level would cost its full time; so does
            # the head of a model whose layers are ternary (at two levels, a tenth of its decode
            # step), as llama.cpp runs it (docs/KERNELS.md, "Ternary")
            ternary = fields.get("weight", -1) >= 0 and self.tensors[fields["weight"]].type in TERNARY_CODES
            self.ternary_layers |= ternary
            one_level = ternary or (role == "head" and self.ternary_layers)
            fields["two_level"] = (role if role != "experts" else "gate_up") in self.precise and not one_level
        stream = stream or ROLE_STREAMS.get(role) or KIND_STREAMS.get(kind.__name__) or self.stream
        if stream not in STREAMS:
            raise CflowError(f"unknown stream {stream!r}; the streams are {', '.join(STREAMS)}")
        self.stream = stream
        op = kind(stream=STREAMS.index(stream), **fields)
        self.ops.append(op)
        return op

    def expert_table(self, layer: int, n_expert: int, name: str = "blk.{l}.exp.{e}.") -> None:
        """Enter experts 0..n_expert-1 of `layer` (the file's expert offset table) in the plan's expert
        table: each one's range and its `{name}ffn_gate_up` (stripe-fused gate/up) and `{name}ffn_down`."""
        ranges = getattr(self.weights, "experts", {})
        for e in range(n_expert):
            p = name.format(l=layer, e=e)
            ent = ranges.get((layer, e))
            if not self.has(p + "ffn_gate_up") and self.has(p + "ffn_gate"):
                raise UnsupportedError(f"{p}ffn_gate and {p}ffn_up are stored apart (their block types differ); the "
                                       "engines run an expert's gate and up fused: convert with --quant q8_0 (or "
                                       "another single type)")
            gu = self.entry(p + "ffn_gate_up")
            if ent is None:  # a checkpoint in memory (reference engine): no file range
                off, length, crc = -1, 0, None
            else:
                off, length, crc = ent.offset, ent.length, getattr(ent, "crc32c", None)
            chunk = gu.stripe_rows if getattr(gu, "fuse", None) == "stripe" else gu.shape[0] // 2
            if not chunk:
                raise CflowFormatError(f"{p}ffn_gate_up: stripe fusion without stripe rows")
            self.experts.append(ExpertRef(layer=layer, expert=e, offset=int(off), length=int(length),
                                          gate_up=self.tensor(p + "ffn_gate_up"), down=self.tensor(p + "ffn_down"),
                                          chunk=int(chunk), crc32c=-1 if crc is None else int(crc)))

    def barrier(self) -> None:
        if self.ops and not isinstance(self.ops[-1], Barrier):
            self.ops.append(Barrier())

    def finish(self, *, logits: int, norm_eps: float, norm_offset: float = 0.0) -> Plan:
        p = Plan()
        p.tensors, p.buffers, p.ops, p.experts = self.tensors, self.buffers, self.ops, self.experts
        p.logits, p.norm_eps, p.norm_offset = int(logits), float(norm_eps), float(norm_offset)
        return p


def stream_bytes_per_token(plan: Plan) -> dict[str, int]:
    """Weight bytes one decode step of one sequence reads, per stream: every matrix an op multiplies
    by, once per op, one row of each embedding table, each router, and top_k experts of each
    Experts op (of the layer's first expert's size: a layer's experts share one shape)."""
    out = dict.fromkeys(STREAMS, 0)
    routes = {}
    experts = {}
    for e in plan.experts:
        experts.setdefault(e.layer, plan.tensors[e.gate_up].nbytes + plan.tensors[e.down].nbytes)
    for op in plan.ops:
        st = STREAMS[op.stream] if not isinstance(op, Barrier) else None
        if isinstance(op, (Matmul, GateUp, Router)):
            out[st] += plan.tensors[op.weight].nbytes
            if isinstance(op, Router):
                routes[op.dst] = op.top_k
        elif isinstance(op, Embed):
            t = plan.tensors[op.table]
            out[st] += t.nbytes // t.rows
        elif isinstance(op, Experts):
            out[st] += routes.get(op.route, 0) * experts.get(op.layer, 0)
    return out


def bytes_per_token(plan: Plan) -> int:
    """All the weight bytes one decode step of one sequence reads (stream_bytes_per_token summed)."""
    return sum(stream_bytes_per_token(plan).values())


def kv_slots(plan: Plan) -> list[tuple[int, int]]:
    """Per KV slot of a sequence state: (n_kv_head, head_dim), from the plan's Attention ops."""
    slots: dict[int, tuple[int, int]] = {}
    for op in plan.ops:
        if isinstance(op, Attention):
            shape = (op.n_kv_head, op.head_dim)
            if slots.setdefault(op.kv, shape) != shape:
                raise CflowError(f"plan: KV slot {op.kv} is used with two head shapes")
    if sorted(slots) != list(range(len(slots))):
        raise CflowError("plan: KV slots must be numbered 0..n-1")
    return [slots[i] for i in range(len(slots))]
