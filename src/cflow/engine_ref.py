"""The numpy reference engine: the same step plan as the native engine, interpreted in fp32.

Slow and readable: each op kind of cflow.plan is a few lines of numpy below, on the weights
dequantized once. It is the second opinion the native engine is checked against (Hugging Face
transformers stays the independent one). It also runs GGUF files and HF directories in memory,
without converting them (their tensors have no file offsets, so the native engine cannot).

Rows: a step's new tokens of every sequence, one after another; a buffer is (rows, width).
"""

from __future__ import annotations

import numpy as np

from cflow import plan as P
from cflow.engine import EngineBase
from cflow.errors import CflowError


class RefState:
    """One sequence: its tokens and, per KV slot, k and v (n_ctx, n_kv_head, head_dim) fp32."""

    def __init__(self, slots: list[tuple[int, int]], n_ctx: int):
        self.n_ctx = n_ctx
        self.k = [np.zeros((n_ctx, h, d), np.float32) for h, d in slots]  # pages are committed as they fill
        self.v = [np.zeros((n_ctx, h, d), np.float32) for h, d in slots]
        self.tokens: list[int] = []

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.pos:
            raise CflowError(f"truncate({n}): the state holds {self.pos} tokens")
        del self.tokens[n:]

    def copy_prefix(self, src: "RefState", n: int) -> None:
        """Become the first n tokens of src and their KV cache."""
        if not 0 <= n <= src.pos:
            raise CflowError(f"copy_prefix({n}): the source holds {src.pos} tokens")
        if src is self:
            return self.truncate(n)
        if [k.shape for k in src.k] != [k.shape for k in self.k]:
            raise CflowError("copy_prefix: the states belong to different models")
        for dst, s in zip(self.k + self.v, src.k + src.v):
            dst[:n] = s[:n]
        self.tokens = list(src.tokens[:n])


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, offset: float) -> np.ndarray:
    """x (..., n) normalized over the last axis, times (offset + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w)


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """neox RoPE: x (T, H, hd) at positions pos (T,); rotates the halves (x1, x2)."""
    hd = x.shape[-1]
    inv = (theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)).astype(np.float32)  # (hd/2,), fp32 as HF
    ang = (pos[:, None].astype(np.float32) * inv[None, :]).astype(np.float64)  # (T, hd/2)
    cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


ACT_FNS = {P.ACTS["silu"]: silu, P.ACTS["gelu_tanh"]: gelu_tanh, P.ACTS["relu2"]: lambda x: np.square(np.maximum(x, 0))}


def kv_round(x: np.ndarray, dtype: str, keys: bool = False) -> np.ndarray:
    """x (..., head_dim) as a KV cache of dtype holds it: itself (f32), rounded to halves (f16), or
    quantized to q8_0 blocks of 32 along head_dim and back (gguf.quants, ggml's reference); keys
    in rotary pairs (i, i + head_dim / 2) side by side, as the native cache stores them."""
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "q8_0":
        from gguf import GGMLQuantizationType, quants

        shape, h = x.shape, x.shape[-1] // 2
        if keys:  # (..., h, 2): pair i is (x[i], x[i + h])
            x = np.stack([x[..., :h], x[..., h:]], -1)
        flat = np.ascontiguousarray(x, np.float32).reshape(-1, 2 * h)
        y = quants.dequantize(quants.quantize(flat, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        y = y.reshape(x.shape).astype(np.float32)
        return np.concatenate([y[..., 0], y[..., 1]], -1) if keys else y.reshape(shape)
    return x


class RefEngine(EngineBase):
    """The plan interpreter; `fast` and `precise` are accepted and ignored (always fp32). Its cache
    holds floats; cache_type_k / cache_type_v round what it stores as the native cache of that
    type would (kv_round)."""

    def __init__(self, weights, *, threads: int | None = None, n_ctx: int | None = None, fast: bool = True,
                 precise=True, cache_type_k: str | None = None, cache_type_v: str | None = None):
        from cflow.engine import check_kv_types

        check_kv_types(cache_type_k, cache_type_v)
        # the cache holds floats, rounded as the native engine's cache of each type would hold them
        # (halves; q8_0 blocks through gguf's reference quantizer, which is ggml's bit for bit)
        self.kv_types = (cache_type_k or "f32", cache_type_v or "f32")
        super().__init__(weights, threads=threads, n_ctx=n_ctx, fast=False, precise=())
        check_kv_types(cache_type_k, cache_type_v, self.plan)
        self.slots = P.kv_slots(self.plan)
        self.ops, self.tensors, self.buffers = self.plan.ops, self.plan.tensors, self.plan.buffers  # copies, once
        self._w: dict[int, np.ndarray] = {}

    def weight(self, i: int) -> np.ndarray:
        """Tensor i of the plan, dequantized (rows in the file's order); vectors flattened.
        From the bytes the plan points at when the weights are a mapped file; from the
        checkpoint's arrays otherwise."""
        if i not in self._w:
            t = self.tensors[i]
            buf = getattr(self.file, "buffer", None)
            if t.offset >= 0 and buf is not None:
                from cflow.format import quant
                from cflow.format.tiles import block_type, unpack_tiles

                bt, pack = block_type(t.type), ("blocks", "planes")[t.pack]
                rows = unpack_tiles(buf[t.offset:t.offset + t.nbytes], bt, t.rows, t.cols, (t.tile_rows, t.tile_cols),
                                    t.interleave, pack)
                w = quant.decode(rows, bt, t.cols)
            else:
                w = self.file.dequantize(t.name)
            w = np.asarray(w, np.float32)
            self._w[i] = w.reshape(-1) if t.rows == 1 else w.reshape(t.rows, t.cols)
        return self._w[i]

    def new_state(self) -> RefState:
        return RefState(self.slots, self.n_ctx)

    def norm(self, x: np.ndarray, i: int) -> np.ndarray:
        return x if i < 0 else rms_norm(x, self.weight(i), self.plan.norm_eps, self.plan.norm_offset)

    def _forward(self, states, ids, all_logits):
        tokens = np.concatenate(ids)
        first = np.concatenate([[0], np.cumsum([a.size for a in ids])[:-1]])
        last = first + np.array([a.size for a in ids]) - 1
        bufs = {i: np.zeros((tokens.size, b.width), np.float32) for i, b in enumerate(self.buffers)}
        for op in self.ops:
            if isinstance(op, P.Embed):
                bufs[op.dst] = self.weight(op.table)[tokens] * np.float32(op.scale)
            elif isinstance(op, P.Matmul):
                x = bufs[op.src]
                if op.last_token and not all_logits:
                    x = x[last]
                    if bufs[op.dst].shape[0] != x.shape[0]:
                        bufs[op.dst] = np.zeros((x.shape[0], bufs[op.dst].shape[1]), np.float32)
                w = self.weight(op.weight).reshape(-1, x.shape[1])  # a one-row weight is stored as a vector
                y = self.norm(x, op.norm) @ w.T
                if op.bias >= 0:
                    y = y + self.weight(op.bias)
                y = y * np.float32(op.scale)
                if op.softcap > 0:
                    y = np.tanh(y / op.softcap) * op.softcap
                cols = slice(op.dst_col, op.dst_col + w.shape[0])
                bufs[op.dst][:, cols] = bufs[op.dst][:, cols] + y if op.accumulate else y
            elif isinstance(op, P.GateUp):
                bufs[op.dst] = self.gated(op.weight, op.chunk, op.act, self.norm(bufs[op.src], op.norm))
            elif isinstance(op, P.ActMul):
                g, u = np.split(bufs[op.src], 2, axis=-1)
                bufs[op.dst] = ACT_FNS[op.act](g) * u
            elif isinstance(op, P.Attention):
                bufs[op.dst] = np.concatenate([self.attention(op, bufs[op.src][first[s]:last[s] + 1], st)
                                               for s, st in enumerate(states)])
            elif isinstance(op, P.Add):
                y = self.norm(bufs[op.src], op.norm)
                if op.gain >= 0:
                    y = y * self.weight(op.gain)
                y = y * np.float32(op.scale)
                if op.gate >= 0:
                    y = y / (1 + np.exp(-bufs[op.gate]))
                bufs[op.dst] = bufs[op.dst] + y if op.accumulate else y
            elif isinstance(op, P.Router):
                bufs[op.dst] = self.route(op, bufs[op.src])
            elif isinstance(op, P.Experts):
                y = self.experts(op, bufs[op.src], bufs[op.route]) * np.float32(op.scale)
                bufs[op.dst] = bufs[op.dst] + y if op.accumulate else y
        for st, a in zip(states, ids):
            st.tokens.extend(int(t) for t in a)
        return bufs[self.plan.logits].astype(np.float32, copy=False), None

    def gated(self, weight: int, c: int, act: int, x: np.ndarray) -> np.ndarray:
        """act(gate x) * (up x) of a gate/up tensor whose rows come in pieces: piece p holds gate
        rows [p c, p c + cp), then the same up rows (GateUp's chunk)."""
        w = self.weight(weight)
        F = w.shape[0] // 2
        gate = np.concatenate([np.arange(2 * s, 2 * s + min(c, F - s)) for s in range(0, F, c)])
        up = np.concatenate([np.arange(2 * s + min(c, F - s), 2 * s + 2 * min(c, F - s)) for s in range(0, F, c)])
        return ACT_FNS[act](x @ w[gate].T) * (x @ w[up].T)

    def route(self, op, x: np.ndarray) -> np.ndarray:
        """(T, C) -> (T, 2 top_k): the top_k expert ids (as floats; ties: the lower id) and gates."""
        logits = self.norm(x, op.norm) @ self.weight(op.weight).T  # (T, E)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        ids = np.argsort(-p, axis=-1, kind="stable")[:, :op.top_k]
        gates = np.take_along_axis(p, ids, axis=-1)
        if op.renorm:
            gates = gates / gates.sum(axis=-1, keepdims=True)
        return np.concatenate([ids.astype(np.float32), gates.astype(np.float32)], axis=-1)

    def experts(self, op, x: np.ndarray, route: np.ndarray) -> np.ndarray:
        """sum over each row's experts (ascending id) of gate * down(act(gate x) * up x)."""
        x = self.norm(x, op.norm)
        K = route.shape[1] // 2
        table = {(e.layer, e.expert): e for e in self.plan.experts}
        y = np.zeros_like(x)
        ids = route[:, :K].astype(np.int64)
        for e in range(op.n_expert):
            rows, slot = np.nonzero(ids == e)
            if rows.size == 0:
                continue
            ent = table.get((op.layer, e))
            if ent is None:
                raise CflowError(f"the expert table has no entry for layer {op.layer}, expert {e}")
            h = self.gated(ent.gate_up, ent.chunk, op.act, x[rows])
            y[rows] += (h @ self.weight(ent.down).T) * route[rows, K + slot][:, None]
        return y

    def attention(self, op, qkv: np.ndarray, st: RefState) -> np.ndarray:
        """One sequence's rows (T, q + 2 kv) -> (T, q): causal (and windowed) softmax attention."""
        T, hd, nh, nkv = qkv.shape[0], op.head_dim, op.n_head, op.n_kv_head
        p0 = st.pos
        pos = np.arange(p0, p0 + T)
        q, k, v = np.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
        per_head = lambda i: i < 0 or self.weight(i).size == hd  # noqa: E731 (else a norm over all of q or k)
        if not per_head(op.q_norm):
            q = self.norm(q, op.q_norm)
        if not per_head(op.k_norm):
            k = self.norm(k, op.k_norm)
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        q = self.norm(q, op.q_norm) if per_head(op.q_norm) else q
        k = self.norm(k, op.k_norm) if per_head(op.k_norm) else k
        q, k = rope(q, pos, op.rope_theta), rope(k, pos, op.rope_theta)
        st.k[op.kv][p0:p0 + T], st.v[op.kv][p0:p0 + T] = kv_round(k, self.kv_types[0], keys=True), kv_round(v, self.kv_types[1])
        K, V = st.k[op.kv][:p0 + T], st.v[op.kv][:p0 + T]  # (S, nkv, hd)
        qg = q.reshape(T, nkv, nh // nkv, hd)  # query heads grouped by their KV head
        s = np.einsum("tgqd,sgd->gqts", qg, K) * np.float32(op.scale or hd**-0.5)  # (nkv, group, T, S)
        kpos = np.arange(p0 + T)
        mask = kpos[None, :] > pos[:, None]  # (T, S) future keys
        if op.window:
            mask |= pos[:, None] - kpos[None, :] >= op.window
        s = np.exp(np.where(mask, -np.inf, s) - np.where(mask, -np.inf, s).max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        return np.einsum("gqts,sgd->tgqd", s, V).reshape(T, nh * hd)
