"""The native engine: runs a converted `.cflow` model through the C++ plan executor.

The step plan is built here ONCE per model: a flat op list (fused steps: norm+GEMV, GEMV+GLU,
rope+KV write+attention, ...) with byte offsets of every weight inside the mapped file and ids
of scratch buffers; barriers only where data dependence needs them. The C++ core checks every
offset and shape against the mapped size before it runs anything, then one native call runs a
whole forward (all layers, all threads, GIL released). Python never loops over layers.

    eng = Engine("smollm2.cflow", threads=2)
    st = eng.new_state()
    logits = eng.forward(st, prompt_ids)          # prefill as a batch: (vocab,)
    logits = eng.forward(st, [next_id])           # one decode step
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from cflow.config import ModelConfig
from cflow.errors import CflowError, CflowFormatError, UnsupportedError
from cflow.format.tiles import PACK_CODES

# Op kinds and flags: csrc/include/cflow/engine.h
OP_BARRIER, OP_EMBED, OP_MATVEC, OP_GLU, OP_ATTN, OP_NORM_ADD, OP_ACT_MUL = 0, 1, 2, 3, 4, 5, 6
F_ACCUM, F_LAST, F_PRECISE = 1, 2, 4
# Weight roles whose int8 activations may be two-level (F_PRECISE; see Engine's `precise`).
ROLES = ("qkv", "attn_output", "gate_up", "down", "head")
MAX_BATCH = 512  # tokens per native call when prefilling (bounds the scratch)


def default_threads() -> int:
    """CFLOW_THREADS when set, else the cores this process may run on."""
    env = os.environ.get("CFLOW_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise CflowError(f"CFLOW_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise CflowError(f"CFLOW_THREADS must be a positive integer, got {env!r}")
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class Plan:
    """The step plan in the flat form the C++ executor takes."""

    tensors: list[tuple] = field(default_factory=list)  # (off, nbytes, type, rows, cols, tr, tc, g)
    names: list[str] = field(default_factory=list)
    ops: list[tuple] = field(default_factory=list)  # (kind, w, bias, norm, src, dst, flags, layer, aux0, aux1, f0, f1)
    buffers: list[int] = field(default_factory=list)  # per-token widths
    buffer_names: list[str] = field(default_factory=list)
    logits: int = -1
    bytes_per_token: int = 0

    def op(self, kind, *, w=-1, bias=-1, norm=-1, src=-1, dst=-1, flags=0, layer=0, aux0=0, aux1=0, f0=0.0, f1=0.0):
        self.ops.append((kind, w, bias, norm, src, dst, flags, layer, aux0, aux1, f0, f1))

    def barrier(self):
        self.ops.append((OP_BARRIER, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0.0, 0.0))

    def buffer(self, name: str, width: int) -> int:
        self.buffer_names.append(name)
        self.buffers.append(int(width))
        return len(self.buffers) - 1

    def arrays(self):
        ti = np.array(self.tensors, dtype=np.int64).reshape(-1, 9)
        oi = np.array([o[:10] for o in self.ops], dtype=np.int32).reshape(-1, 10)
        of = np.array([o[10:] for o in self.ops], dtype=np.float32).reshape(-1, 2)
        return ti, oi, of, np.array(self.buffers, dtype=np.int32)


def build_plan(f, cfg: ModelConfig, precise=()) -> Plan:
    """The op list of one forward for a dense model (llama, qwen2, qwen3, gemma3).

    f: an object with .tensors {name: entry with type (BlockType), rows, cols, tile, interleave,
    offset, nbytes, stripe_rows}: a CflowFile. precise: the ROLES whose ops get F_PRECISE.
    """
    from cflow import models

    if cfg.arch not in (runs := models.supported("native")):
        raise UnsupportedError(f"the native engine runs {', '.join(runs)}; not arch {cfg.arch!r} yet")
    if cfg.n_expert:
        raise UnsupportedError("mixture-of-experts layers are not in the native engine yet")
    if unknown := set(precise) - set(ROLES):
        raise CflowError(f"precise: unknown roles {sorted(unknown)}; the roles are {', '.join(ROLES)}")
    flag = {role: F_PRECISE if role in precise else 0 for role in ROLES}
    P = Plan()
    ids: dict[str, int] = {}

    def tensor(name: str, *, optional: bool = False) -> int:
        if name in ids:
            return ids[name]
        t = f.tensors.get(name)
        if t is None:
            if optional:
                return -1
            raise CflowFormatError(f"the model has no tensor {name!r} (arch {cfg.arch})")
        P.tensors.append((t.offset, t.nbytes, t.type.code, t.rows, t.cols, t.tile[0], t.tile[1], t.interleave,
                          PACK_CODES[t.pack]))
        P.names.append(name)
        ids[name] = len(P.tensors) - 1
        return ids[name]

    def weight_bytes(i: int) -> int:
        return P.tensors[i][1]

    d, q, kv = cfg.d_model, cfg.q_dim, cfg.kv_dim
    X = P.buffer("x", d)
    QKV = P.buffer("qkv", q + 2 * kv)
    ATT = P.buffer("att", q)
    H = P.buffer("h", cfg.d_ff)
    GU = -1  # (gate | up) of layers that store them apart
    TMP = P.buffer("tmp", d) if cfg.post_norms else -1
    LOGITS = P.buffer("logits", cfg.vocab_size)
    P.logits = LOGITS

    emb = tensor("tok_embd")
    P.op(OP_EMBED, w=emb, dst=X)
    P.barrier()
    et = P.tensors[emb]
    P.bytes_per_token += et[1] // et[3]  # one row
    layer_w: list[int] = []  # the current layer's weights (each read once per token)

    def residual_out(weight: str, src: int, post_norm: str, role: str) -> None:
        """x += W @ src, or (gemma) x += post_norm(W @ src)."""
        wi = tensor(weight)
        layer_w.append(wi)
        if cfg.post_norms:
            P.op(OP_MATVEC, w=wi, src=src, dst=TMP, flags=flag[role])
            P.barrier()
            P.op(OP_NORM_ADD, norm=tensor(post_norm), src=TMP, dst=X)
        else:
            P.op(OP_MATVEC, w=wi, src=src, dst=X, flags=F_ACCUM | flag[role])
        P.barrier()

    for l in range(cfg.n_layer):
        b = f"blk.{l}."
        # Q/K/V: one fused weight, or three (when their block types differ) writing their columns
        # of the same (q | k | v) buffer; no barrier between them, they read the same input.
        fused = b + "attn_qkv" in f.tensors or b + "attn_q" not in f.tensors
        parts = ["attn_qkv"] if fused else ["attn_q", "attn_k", "attn_v"]
        layer_w = []
        col = 0
        for part in parts:
            wi = tensor(b + part)
            P.op(OP_MATVEC, w=wi, bias=tensor(b + part + ".bias", optional=not cfg.qkv_bias),
                 norm=tensor(b + "attn_norm"), src=X, dst=QKV, aux1=col, flags=flag["qkv"])
            col += P.tensors[wi][3]
            layer_w.append(wi)
        P.barrier()
        sliding = cfg.layer_type(l) == "sliding"
        theta = (cfg.rope_local_theta or cfg.rope_theta) if sliding else cfg.rope_theta
        qn = tensor(b + "attn_q_norm") if cfg.qk_norm else -1
        kn = tensor(b + "attn_k_norm") if cfg.qk_norm else -1
        P.op(OP_ATTN, w=qn, bias=kn, src=QKV, dst=ATT, layer=l, aux0=cfg.sliding_window if sliding else 0, f0=theta)
        P.barrier()
        residual_out(b + "attn_output", ATT, b + "attn_post_norm", "attn_output")
        gu = f.tensors.get(b + "ffn_gate_up")
        if gu is not None or b + "ffn_gate" not in f.tensors:
            if gu is None:
                raise CflowFormatError(f"the model has no tensor {b + 'ffn_gate_up'!r}")
            if getattr(gu, "fuse", "stripe") not in (None, "stripe") or not getattr(gu, "stripe_rows", 0):
                raise CflowFormatError(f"{b}ffn_gate_up must be stripe-fused (gate/up interleaved by stripes)")
            layer_w.append(tensor(b + "ffn_gate_up"))
            P.op(OP_GLU, w=layer_w[-1], norm=tensor(b + "ffn_norm"), src=X, dst=H, aux0=gu.stripe_rows,
                 flags=flag["gate_up"])
        else:  # gate and up apart: two matvecs into (gate | up), then act(gate) * up
            if GU < 0:
                GU = P.buffer("gate_up", 2 * cfg.d_ff)
            for col, part in ((0, "ffn_gate"), (cfg.d_ff, "ffn_up")):
                layer_w.append(tensor(b + part))
                P.op(OP_MATVEC, w=layer_w[-1], norm=tensor(b + "ffn_norm"), src=X, dst=GU, aux1=col,
                     flags=flag["gate_up"])
            P.barrier()
            P.op(OP_ACT_MUL, src=GU, dst=H)
        P.barrier()
        residual_out(b + "ffn_down", H, b + "ffn_post_norm", "down")
        P.bytes_per_token += sum(weight_bytes(i) for i in layer_w)
    out = tensor("output", optional=cfg.tie_embeddings)
    if out < 0:
        out = emb
    P.op(OP_MATVEC, w=out, norm=tensor("output_norm"), src=X, dst=LOGITS, flags=F_LAST | flag["head"],
         f1=cfg.final_logit_softcap)
    P.bytes_per_token += weight_bytes(out)
    return P


class State:
    """One sequence's KV cache. pos: tokens in the cache."""

    def __init__(self, core_state, n_ctx: int):
        self._st = core_state
        self.n_ctx = n_ctx

    @property
    def pos(self) -> int:
        return self._st.pos

    def reset(self) -> None:
        self._st.pos = 0

    def truncate(self, n: int) -> None:
        """Drop the tokens after the first n (prompt-cache reuse)."""
        if not 0 <= n <= self._st.pos:
            raise CflowError(f"truncate({n}): the cache holds {self._st.pos} tokens")
        self._st.pos = n


ACTIVATIONS = {"int8x2": dict(fast=True, precise=True), "int8": dict(fast=True, precise=False),
               "fp32": dict(fast=False, precise=False)}
"""The activation settings by name (CLI --activations): two-level int8 (the default), one-level
int8, fp32."""


def activations_name(fast: bool, precise_roles) -> str:
    if not fast:
        return "fp32"
    if not precise_roles:
        return "int8"
    return "int8x2" if set(precise_roles) == set(ROLES) else "int8x2:" + "+".join(precise_roles)


class Engine:
    """A converted model on the native executor; one per model, any number of States.

    fast=True: activations quantized to int8 once per op (integer dot products);
    fast=False: fp32 activations, the parity path.
    precise=True (with fast; the default): two-level int8 activations for every weight (ROLES;
    F_PRECISE, kernels.h AType::Q8x2): about 14 bits of activation precision. Planes-packed
    weights take both levels in one pass over the weights (decode and prefill); other
    types run two passes. A collection of ROLES names limits it to those weights; False: one
    level, as llama.cpp's q8 activations. ACTIVATIONS names the three settings.
    """

    def __init__(self, path_or_cflowfile, *, threads: int | None = None, n_ctx: int | None = None,
                 fast: bool = True, precise: bool | Iterable[str] = True):
        from cflow._native import core

        if isinstance(path_or_cflowfile, (str, os.PathLike)):
            from cflow.format.reader import CflowFile

            self.file = CflowFile(path_or_cflowfile)
        else:
            self.file = path_or_cflowfile
        cfg: ModelConfig = self.file.config
        self.config = cfg
        self.n_ctx = int(n_ctx or cfg.max_seq_len)
        if self.n_ctx <= 0:
            raise CflowError(f"n_ctx must be positive, got {self.n_ctx}")
        self.threads = int(threads or default_threads())
        if self.threads < 1:
            raise CflowError(f"threads must be >= 1, got {self.threads}")
        self.fast = bool(fast)
        roles = ROLES if precise is True else tuple(precise or ())
        self.precise_roles = roles if self.fast else ()
        self.precise = bool(self.precise_roles)
        self.activations = activations_name(self.fast, self.precise_roles)
        self.plan = build_plan(self.file, cfg, self.precise_roles)
        self.bytes_per_token = self.plan.bytes_per_token
        idims = np.array([cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.vocab_size,
                          self.n_ctx, 0 if cfg.rope_style == "neox" else 1, 0 if cfg.act == "silu" else 1], np.int32)
        fdims = np.array([cfg.norm_eps, cfg.norm_offset, cfg.attn_scale, cfg.embed_scale], np.float32)
        ti, oi, of, bw = self.plan.arrays()
        buf = self.file.buffer
        try:
            self._core = core.EngineCore(buf, buf, idims, fdims, ti, oi, of, bw, self.plan.logits, self.threads,
                                         self.fast)
        except (RuntimeError, ValueError) as e:
            raise CflowFormatError(f"cannot run this model: {e}") from None

    def new_state(self) -> State:
        """A fresh, empty KV cache."""
        return State(self._core.new_state(), self.n_ctx)

    def forward(self, state: State, token_ids, *, all_logits: bool = False) -> np.ndarray:
        """Append token_ids at state.pos; logits float32 (vocab,) of the last token, or (len, vocab)."""
        ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64).reshape(-1))
        n = ids.size
        if n == 0:
            raise CflowError("forward: no tokens")
        if state.pos + n > self.n_ctx:
            raise CflowError(f"context full: {state.pos} tokens in the cache + {n} new exceed n_ctx={self.n_ctx}")
        V = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= V:
            raise CflowError(f"token ids must be in 0..{V - 1}")
        ids = ids.astype(np.int32)
        out = np.empty((n, V) if all_logits else (V,), dtype=np.float32)
        for s in range(0, n, MAX_BATCH):
            chunk = ids[s:s + MAX_BATCH]
            dst = out[s:s + chunk.size] if all_logits else out
            try:
                self._core.forward(state._st, chunk, all_logits, dst)
            except RuntimeError as e:
                raise CflowError(str(e)) from None
        return out

    def profile(self) -> dict[str, float]:
        """Seconds spent per op kind since creation (needs CFLOW_PROFILE=1)."""
        names = ["barrier", "embed", "matvec", "glu", "attn", "norm_add", "act_mul"]
        return dict(zip(names, self._core.profile()))
