"""The pre-norm decoder of llama and its relatives, as a step plan (cflow.plan).

One layer, with the switches of ModelConfig (qkv_bias, qk_norm, post_norms, layer_types ...):

    h = x + post_attn_norm?( Wo @ sub_norm?( attn( rope( qk_norm?( Wqkv @ rms(x) + b? ) ) ) ) )
    x = h + post_ffn_norm?( Wd @ sub_norm?( act(Wg @ rms(h)) * (Wu @ rms(h)) ) )

(sub_norm: BitNet b1.58's RMSNorms blk.{l}.attn_sub_norm and ffn_sub_norm, the Matmul's input norm.)

or, in a mixture-of-experts model (cfg.n_expert), the FFN is the top_k of n_expert such gated
FFNs, chosen per token by the router R (blk.{l}.ffn_gate_inp; softmax, top_k, the gates
renormalised over the top_k when cfg.expert_renorm):

    x = h + sum over the top_k experts i of gate_i * Wd_i @ ( act(Wg_i @ rms(h)) * (Wu_i @ rms(h)) )
          (+ sigmoid(g . rms(h)) * shared(rms(h)): Qwen2-MoE's shared expert, when cfg.d_shared)

Tensor names are cflow's (docs/FORMAT.md): blk.{l}.attn_qkv (or attn_q/k/v apart when their
block types differ), blk.{l}.ffn_gate_up (or ffn_gate/ffn_up apart), ...; experts'
blk.{l}.exp.{e}.ffn_gate_up and ffn_down, in the plan's expert table. Buffers, per token: x (d),
qkv (q + 2 kv), att (q), h (d_ff), gate_up (2 d_ff, only when gate/up are apart), tmp (d, only
with post norms), route (2 top_k: expert ids and gates, only with experts), logits (vocab).
"""

from __future__ import annotations

from cflow.errors import CflowFormatError, UnsupportedError
from cflow.plan import ACTS, ActMul, Add, Attention, Embed, Experts, GateUp, Matmul, Plan, PlanBuilder, Router


def build_decoder(b: PlanBuilder, cfg) -> Plan:
    if cfg.rope_style != "neox":
        raise UnsupportedError(f"rope style {cfg.rope_style!r}: the engines run neox rope (rotate halves)")
    if cfg.n_expert and (cfg.post_norms or cfg.sub_norms):
        raise UnsupportedError("mixture-of-experts layers with post norms or sub norms are not supported")
    act = ACTS[cfg.act]
    d, q, kv = cfg.d_model, cfg.q_dim, cfg.kv_dim
    X = b.buffer("x", d)
    QKV = b.buffer("qkv", q + 2 * kv)
    ATT = b.buffer("att", q)
    H = b.buffer("h", cfg.d_ff) if not cfg.n_expert else -1
    ROUTE = b.buffer("route", 2 * cfg.top_k) if cfg.n_expert else -1
    GU = None  # (gate | up) of layers that store them apart
    TMP = b.buffer("tmp", d) if cfg.post_norms else -1
    if cfg.d_shared:  # Qwen2-MoE's shared expert: its hidden, its gate (one per token), its output
        SH, SG, SO = b.buffer("shared_h", cfg.d_shared), b.buffer("shared_gate", 1), b.buffer("shared_out", d)
    LOGITS = b.buffer("logits", cfg.vocab_size)

    b.op(Embed, table="tok_embd", dst=X, scale=cfg.embed_scale)
    b.barrier()

    def chunk_of(p: str) -> int:
        """GateUp's chunk of the fused {p}ffn_gate_up: its stripe rows, or all of gate (stacked)."""
        gu = b.entry(p + "ffn_gate_up")
        if getattr(gu, "fuse", None) != "stripe":
            return gu.shape[0] // 2
        if not gu.stripe_rows:
            raise CflowFormatError(f"{p}ffn_gate_up: stripe fusion without stripe rows")
        return gu.stripe_rows

    def residual_out(weight: str, src: int, post_norm: str, sub_norm: str, role: str) -> None:
        """x += W @ sub_norm?(src), or (post norms) x += post_norm(W @ src)."""
        norm = sub_norm if cfg.sub_norms else -1
        if cfg.post_norms:
            b.op(Matmul, weight=weight, norm=norm, src=src, dst=TMP, role=role)
            b.barrier()
            b.op(Add, norm=post_norm, src=TMP, dst=X)
        else:
            b.op(Matmul, weight=weight, norm=norm, src=src, dst=X, accumulate=True, role=role)
        b.barrier()

    for l in range(cfg.n_layer):
        p = f"blk.{l}."
        # Q/K/V: one fused weight, or three (block types differ) writing their columns of (q | k | v);
        # no barrier between them: they read the same input.
        parts = ["attn_qkv"] if b.has(p + "attn_qkv") or not b.has(p + "attn_q") else ["attn_q", "attn_k", "attn_v"]
        col = 0
        for part in parts:
            b.op(Matmul, weight=p + part, norm=p + "attn_norm", src=X, dst=QKV, dst_col=col,
                 bias=b.tensor(p + part + ".bias", optional=not cfg.qkv_bias), role="qkv")
            col += b.rows(p + part)
        b.barrier()
        sliding = cfg.layer_type(l) == "sliding"
        b.op(Attention, kv=l, src=QKV, dst=ATT, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim,
             q_norm=p + "attn_q_norm" if cfg.qk_norm else -1, k_norm=p + "attn_k_norm" if cfg.qk_norm else -1,
             window=cfg.sliding_window if sliding else 0, scale=cfg.attn_scale,
             rope_theta=(cfg.rope_local_theta or cfg.rope_theta) if sliding else cfg.rope_theta)
        b.barrier()
        residual_out(p + "attn_output", ATT, p + "attn_post_norm", p + "attn_sub_norm", "attn_output")
        if cfg.n_expert:  # route rms(h); x += the chosen experts' gated sum (inputs gathered before x is written)
            b.expert_table(l, cfg.n_expert)
            if cfg.d_shared:  # the shared expert and its gate read rms(h) before x changes
                sh = p + "shexp."
                b.op(GateUp, weight=sh + "ffn_gate_up", norm=p + "ffn_norm", src=X, dst=SH, chunk=chunk_of(sh),
                     act=act, role="gate_up")
                b.op(Matmul, weight=sh + "gate", norm=p + "ffn_norm", src=X, dst=SG, role="gate_up")
                b.barrier()
                b.op(Matmul, weight=sh + "ffn_down", src=SH, dst=SO, role="down")
            b.op(Router, weight=p + "ffn_gate_inp", norm=p + "ffn_norm", src=X, dst=ROUTE, top_k=cfg.top_k,
                 renorm=cfg.expert_renorm)
            b.barrier()
            b.op(Experts, layer=l, n_expert=cfg.n_expert, src=X, norm=p + "ffn_norm", route=ROUTE, dst=X,
                 accumulate=True, act=act, role="experts")
            b.barrier()
            if cfg.d_shared:  # x += sigmoid(g . rms(h)) * shared(rms(h))
                b.op(Add, src=SO, dst=X, gate=SG, stream="dense")
                b.barrier()
            continue
        if b.has(p + "ffn_gate_up") or not b.has(p + "ffn_gate"):
            b.op(GateUp, weight=p + "ffn_gate_up", norm=p + "ffn_norm", src=X, dst=H, chunk=chunk_of(p), act=act,
                 role="gate_up")
        else:  # gate and up apart: two matmuls into (gate | up), then act(gate) * up
            if GU is None:
                GU = b.buffer("gate_up", 2 * cfg.d_ff)
            for col, part in ((0, "ffn_gate"), (cfg.d_ff, "ffn_up")):
                b.op(Matmul, weight=p + part, norm=p + "ffn_norm", src=X, dst=GU, dst_col=col, role="gate_up")
            b.barrier()
            b.op(ActMul, src=GU, dst=H, act=act)
        b.barrier()
        residual_out(p + "ffn_down", H, p + "ffn_post_norm", p + "ffn_sub_norm", "down")
    head = "tok_embd" if cfg.tie_embeddings and not b.has("output") else "output"
    b.op(Matmul, weight=head, norm="output_norm", src=X, dst=LOGITS, last_token=True,
         softcap=cfg.final_logit_softcap, role="head")
    return b.finish(logits=LOGITS, norm_eps=cfg.norm_eps, norm_offset=cfg.norm_offset)
