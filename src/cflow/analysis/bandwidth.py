"""Per-token weight bandwidth of a pipeline-native model: pure arithmetic on PNTConfig.

The per-token dependency graph (docs/ARCHITECTURES.md, "Bandwidth model"):
- nodes: the weight streams one token reads in each applied layer j: A[j] (attention: fused QKV
  and output projection), D[j] (dense GeGLU FFN), E[j] (the top_k experts the router chose);
- values: the residual streams h[j] (and m[j] for decoupled streams), h[0] the embedding;
- edges: A[j] reads h[j] (+ m[j]); D[j] reads h[max(0, j - delta_d)]; E[j] reads h[j] (m[j]
  when decoupled) and, with post_dense routing, the output of D[j]; h[j+1] needs h[j], A[j],
  D[j] and every E[i] with min(i + delta_e, L) == j (L: experts past the end join at h[L]).
A node takes as long as its bytes; independent nodes stream at the same time.
- sequential schedule: layer by layer with a barrier after each layer (the blocks of one layer
  run side by side): sum over layers of max(A, D, E) (D + E with post-dense routing).
- vertical-pipeline schedule: any node starts as soon as its inputs exist and layers stay in
  flight. Its cost per layer is the steady-state period of the layer-periodic graph, the
  largest bytes-per-layer-advanced of any chain: max(A, D / (delta_d + 1), E / (delta_e + 1)),
  with (D + E) / (delta_d + delta_e + 1) for post-dense routing. Times L this is the law
  B_crit = sum_l max(...) behind the paper's table. The plain longest path through one
  token's finite graph, which adds the pipeline's fill and drain at the first and last
  layers, is reported beside it as `longest_path`.
Fully serial execution reads the total. Embedding row, output head, norms and the router
(d x n_expert: 2 KiB per layer at the paper's size) are not counted, as in the paper's table.
"""

from __future__ import annotations

from dataclasses import dataclass

from cflow.models.pipeline_native import PNTConfig
from cflow.errors import CflowError

MIB = 1 << 20
# bytes per parameter; "q4" is the paper's count, q4_0 as stored (18 B per 32 weights)
BYTES_PER_PARAM = {"q4": 0.5, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "q8_0": 34 / 32,
                   "q4_k": 144 / 256, "q5_k": 176 / 256, "q6_k": 210 / 256, "f16": 2.0, "bf16": 2.0, "f32": 4.0}


@dataclass
class LayerBytes:
    attn: float
    dense: float
    experts: float  # the top_k experts chosen
    router: float  # not on the counted path (see module doc)


def layer_bytes(cfg: PNTConfig, quant: str = "q4") -> LayerBytes:
    if quant not in BYTES_PER_PARAM:
        raise CflowError(f"unknown quant {quant!r}; choose one of: {', '.join(BYTES_PER_PARAM)}")
    b = BYTES_PER_PARAM[quant]
    d = cfg.d_model
    attn = d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d
    dense = 3 * d * cfg.d_ff
    experts = cfg.top_k * 3 * d * cfg.d_expert
    return LayerBytes(attn * b, dense * b, experts * b, d * cfg.n_expert * b)


def critical_paths(cfg: PNTConfig, lb: LayerBytes) -> dict[str, float]:
    """Bytes per token: total, and critical path under both schedules (see module doc)."""
    L = cfg.n_layer_eff
    post = cfg.routing_anchor == "post_dense"
    dec = cfg.residual == "decoupled"
    # ---- sequential (layer barrier)
    seq = L * max(lb.attn, lb.dense + lb.experts if post else max(lb.dense, lb.experts))
    # ---- one token's finite graph: earliest finish times, in bytes streamed
    th = [0.0] * (L + 1)  # h[j] ready
    tm = [0.0] * (L + 1)  # m[j] ready (decoupled streams)
    landing: dict[int, float] = {}  # h/m index -> latest expert finish arriving there
    for j in range(L):
        fa = max(th[j], tm[j]) + lb.attn
        fd = th[max(0, j - cfg.delta_d)] + lb.dense
        start_e = tm[j] if dec else th[j]
        if post:
            start_e = max(start_e, fd)
        tgt = min(j + cfg.delta_e, L - 1) + 1  # E[j] is part of h[tgt]
        landing[tgt] = max(landing.get(tgt, 0.0), start_e + lb.experts)
        th[j + 1] = max(th[j], fa, fd)
        if dec:
            tm[j + 1] = max(tm[j], landing.pop(j + 1, 0.0))
        else:
            th[j + 1] = max(th[j + 1], landing.pop(j + 1, 0.0))
    chains = [lb.attn, lb.dense / (cfg.delta_d + 1)]
    if post:
        chains.append((lb.dense + lb.experts) / (cfg.delta_d + cfg.delta_e + 1))
    else:
        chains.append(lb.experts / (cfg.delta_e + 1))
    total = L * (lb.attn + lb.dense + lb.experts)
    return {"total": total, "sequential": seq, "vertical_pipeline": L * max(chains), "longest_path": max(th[L], tm[L])}


def analyze(cfg: PNTConfig, quant: str = "q4") -> dict:
    """The `cflow analyze --json` record (MB = MiB) for one config."""
    cp = critical_paths(cfg, layer_bytes(cfg, quant))
    return {
        "arch": cfg.variant or cfg.arch,
        "total_mb_per_token": round(cp["total"] / MIB, 4),
        "critical_path_mb_per_token": {
            "sequential": round(cp["sequential"] / MIB, 4),
            "vertical_pipeline": round(cp["vertical_pipeline"] / MIB, 4),
        },
        "longest_path_mb_per_token": round(cp["longest_path"] / MIB, 4),
    }


def file_quant(f) -> str:
    """The BYTES_PER_PARAM key of a .cflow file's layer matrices (CflowError when they mix types:
    the per-parameter arithmetic needs one)."""
    types = {t.type.name for n, t in f.tensors.items()
             if n.startswith("blk.") and len(t.shape) == 2 and not n.endswith("ffn_gate_inp")}
    if len(types) != 1 or next(iter(types)) not in BYTES_PER_PARAM:
        raise CflowError(f"the layer matrices are stored as {sorted(types)}: analyze needs one type of {', '.join(BYTES_PER_PARAM)}")
    return types.pop()


def unique_mb(cfg: PNTConfig, quant: str = "q4") -> float:
    """Bytes of the distinct layer weights a token reads (differs from total with weight sharing)."""
    lb = layer_bytes(cfg, quant)
    return cfg.n_layer * (lb.attn + lb.dense + lb.experts) / MIB


def head_mb(cfg: PNTConfig, quant: str = "q4") -> float:
    """Output head (not counted in the per-layer figures)."""
    return cfg.vocab_size * cfg.d_model * BYTES_PER_PARAM[quant] / MIB
