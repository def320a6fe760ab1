"""Export a PNT training checkpoint to `.cflow` (tensor names: docs/ARCHITECTURES.md, "Export").

The header carries the PNTConfig (delta_d, delta_e, routing_anchor, combine, residual,
n_iter ...) and the tokenizer; experts sit behind the expert offset table, one contiguous
range per (layer, expert), so the engine reads only the top-k chosen.
"""

from __future__ import annotations

import numpy as np

from cflow.format.quant import FITTED
from cflow.format.writer import CflowWriter
from cflow.models.pnt import ternarized
from cflow.train import checkpoint


def tensor_map(sd: dict, cfg) -> tuple[list, dict]:
    """(dense tensors [(name, kind, data)], experts {(layer, e): {name: (kind, data)}}) from a
    PNT state dict. kind: "mat" (quantized), "norm" (f32), ("stack"|"stripe", parts)."""
    f = lambda k: sd[k].float().numpy()  # noqa: E731
    out = [("tok_embd", "embd", f("tok_embd.weight"))]
    experts = {}
    q, kv = cfg.q_dim, cfg.kv_dim
    for l in range(cfg.n_layer):
        p = f"layers.{l}."
        b = f"blk.{l}."
        wqkv = f(p + "attn.wqkv.weight")
        out += [(b + "attn_norm", "norm", f(p + "attn_norm.weight")),
                (b + "attn_qkv", "stack", [(b + "attn_q", wqkv[:q]), (b + "attn_k", wqkv[q:q + kv]),
                                           (b + "attn_v", wqkv[q + kv:])]),
                (b + "attn_output", "mat", f(p + "attn.wo.weight"))]
        if cfg.post_norms:
            out.append((b + "attn_post_norm", "norm", f(p + "attn_post_norm.weight")))
        gu = f(p + "ffn_gate_up")
        out += [(b + "ffn_norm", "norm", f(p + "ffn_norm.weight")),
                (b + "ffn_gate_up", "stripe", [(b + "ffn_gate", gu[:cfg.d_ff]), (b + "ffn_up", gu[cfg.d_ff:])]),
                (b + "ffn_down", "mat", f(p + "ffn_down"))]
        if cfg.post_norms:
            out.append((b + "ffn_post_norm", "norm", f(p + "ffn_post_norm.weight")))
        out += [(b + "exp_norm", "norm", f(p + "exp_norm.weight")),
                (b + "ffn_gate_inp", "norm", f(p + "moe.router.weight"))]  # router kept f32
        if cfg.post_norms:
            out.append((b + "exp_post_norm", "norm", f(p + "exp_post_norm.weight")))
        if cfg.combine == "async_experts":
            out.append((b + "exp_gain", "norm", f(p + "exp_gain")))
        wgu, wd = f(p + "moe.w_gate_up"), f(p + "moe.w_down")
        for e in range(cfg.n_expert):
            x = f"{b}exp.{e}."
            experts[(l, e)] = {x + "ffn_gate_up": ("stripe", [(x + "ffn_gate", wgu[e, :cfg.d_expert]),
                                                              (x + "ffn_up", wgu[e, cfg.d_expert:])]),
                               x + "ffn_down": ("mat", wd[e])}
    out.append(("output_norm", "norm", f("output_norm.weight")))
    out.append(("output", "embd", f("tok_embd.weight") if cfg.tie_embeddings else f("output.weight")))
    return out, experts


def _spec(kind, data, wtype, etype, calib=None):
    """add_tensor's arguments: norms (and the router) f32, matrices in the layout convert writes
    (the planes pack where the type has one: the fast decode GEMV's). With a calibration
    (calibrate.Calib) a fitted 4-bit type's rows are encoded here, against it (calibrate.encode)."""
    from cflow.convert.write import tensor_layout
    from cflow.models.calibrate import encode

    if kind == "norm":
        return dict(type="f32", data=np.ascontiguousarray(data))
    typ = etype if kind == "embd" else wtype
    fused = kind in ("stack", "stripe")
    cols = data[0][1].shape[1] if fused else data.shape[1]
    spec = dict(type=typ, **tensor_layout(typ, 2, cols=cols))
    if fused:
        spec["fuse"] = kind
    if calib is not None and typ in FITTED:
        data = [(n, encode(a, typ, calib)) for n, a in data] if fused else encode(data, typ, calib)
    spec["data"] = data
    return spec


def export_dense(ck: dict, path: str, wtype: str, etype: str, calibration: list[list[int]] | None = None) -> int:
    """A llama-shaped checkpoint (models/dense.py) through the converter's writer: the layers'
    matrices in wtype (a ternary type stores a ternary-trained model's values exactly), the
    embedding table and the head in etype; with calibration windows, Q4_0 / Q4_1 matrices against
    the activations measured on them (calibrate.py). Returns the number of tensors written."""
    from cflow.convert import Checkpoint, Tensor, quantize, requantize
    from cflow.convert.write import write_cflow
    from cflow.models.calibrate import dense_name, encode, measure
    from cflow.models.dense import Dense

    cfg = ck["config"]
    model = Dense(cfg, ternary=bool(ck["train_args"].get("ternary", False)))
    model.load_state_dict(ck["model"])
    calib = {}
    if calibration is not None and (wtype in FITTED or etype in FITTED):
        calib = measure(model.eval(), calibration, names=dense_name)
    tensors = {}
    for name, t in model.tensors().items():
        a = t.numpy()
        parts = []
        if name.endswith("attn_qkv"):
            b = name[:-len("attn_qkv")]
            parts = [(b + "attn_q", cfg.q_dim), (b + "attn_k", cfg.kv_dim), (b + "attn_v", cfg.kv_dim)]
        if name in calib and wtype in FITTED and name.startswith("blk."):  # requantize keeps it
            tensors[name] = Tensor(wtype, a.shape, encode(a, wtype, calib[name]), parts)
        else:
            tensors[name] = Tensor("f32", a.shape, a, parts)
    meta = {"source": "cflow train", "step": ck["step"], "ternary_qat": model.ternary}
    out = requantize(Checkpoint(cfg, tensors, tokenizer_json=ck["tokenizer"], special_tokens={"eos": "<|endoftext|>"},
                                metadata=meta), wtype)
    for name in ("tok_embd", "output"):
        a = tensors[name].data
        head = name == "output" and name in calib and etype in FITTED
        out.tensors[name] = Tensor(etype, tensors[name].shape, encode(a, etype, calib[name]) if head else
                                   quantize(etype, a))
    write_cflow(out, path, progress=False)
    return len(out.tensors)


def export_checkpoint(ckpt, path: str, wtype: str = "q8_0", etype: str = "q8_0",
                      calibration: list[list[int]] | None = None) -> int:
    """Write `path` from `ckpt` (a ckpt.pt path or run folder, or what checkpoint.load returned);
    returns the number of tensors written. calibration: token windows (lists of ids,
    calibrate.windows_of) the model runs first, so that Q4_0 and Q4_1 weights are written by GPTQ
    against the activations measured (calibrate.py); None: each block fitted on its own."""
    ck = ckpt if isinstance(ckpt, dict) else checkpoint.load(ckpt)
    cfg = ck["config"]
    if cfg.arch != "pnt":
        return export_dense(ck, path, wtype, etype, calibration)
    ternary = bool(ck["train_args"].get("ternary", False))
    sd = ternarized(ck["model"]) if ternary else ck["model"]  # what a ternary QAT model computed with
    dense, experts = tensor_map(sd, cfg)
    calib = {}
    if calibration is not None and (wtype in FITTED or etype in FITTED):
        from cflow.models.calibrate import measure
        from cflow.models.pnt import PNT

        model = PNT(cfg, ternary=ternary).eval()
        model.load_state_dict(ck["model"])
        calib = measure(model, calibration)
    n = 0
    meta = {"source": "cflow train", "step": ck["step"], "ternary_qat": ternary}
    with CflowWriter(path, cfg, tokenizer_json=ck["tokenizer"], special_tokens={"eos": "<|endoftext|>"},
                     metadata=meta) as w:
        for name, kind, data in dense:
            s = _spec(kind, data, wtype, etype, calib.get(name))
            typ, data = s.pop("type"), s.pop("data")
            if "fuse" in s:
                w.add_fused(name, typ, data, s.pop("fuse"), **s)
            else:
                w.add_tensor(name, typ, data, **s)
            n += 1
        for (l, e), ts in experts.items():
            w.add_expert(l, e, {name: _spec(kind, data, wtype, etype, calib.get(name))
                                for name, (kind, data) in ts.items()})
            n += len(ts)
    return n


def random_pnt(preset_name: str, path: str, wtype: str = "q4_0", seed: int = 0, **geometry) -> str:
    """A pipeline-native model of a preset with random weights, exported to `path` (matrices in
    `wtype`, embedding and head Q8_0): decode speed does not depend on the weights' values, so it
    measures the runtime at a real geometry (default: the paper's). Returns a one-line summary."""
    import tempfile

    import torch

    from cflow.models.pnt import PNT
    from cflow.models.presets import preset
    from cflow.train import tokenizer

    torch.manual_seed(seed)
    cfg = preset(preset_name, **{k: v for k, v in geometry.items() if v is not None}, max_seq_len=2048)
    tok = tokenizer.train_bpe(["once upon a time there was a little cat who lived in a big house"] * 20, 512)
    m = PNT(cfg)
    with tempfile.TemporaryDirectory() as d:
        ck = f"{d}/ckpt.pt"
        checkpoint.save(ck, model_state=m.state_dict(), optim_state=None, step=0, cfg=cfg, tokenizer_json=tok.to_str(),
                        train_args={})
        n = export_checkpoint(ck, path, wtype=wtype, etype="q8_0")
    return (f"wrote {path}: {n} tensors, {m.n_params() / 1e6:.1f}M parameters "
            f"({m.n_params(active=True) / 1e6:.1f}M active)")
