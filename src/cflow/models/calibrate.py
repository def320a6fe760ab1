"""Quantization that knows the model's activations: measured on calibration text by running the
PyTorch model (cflow.models.pnt, or the llama-shaped baselines of models/dense.py), used by the
export's 4-bit writers (format/quant.py).

A matrix W applied to activations x makes the output error (W - Q) x. measure() records, per
matrix, the mean of x x^T over the calibration tokens (every product of pnt's `linear`, and the
head's input): its diagonal E[x_j^2] is llama.cpp's importance matrix, which weights each
column's squared error in the fitted quantizer (quant.encode_fit); the whole matrix drives
gptq_encode, which rounds the columns in turn and lets the columns not yet rounded take up each
rounding error where the activations make up for it. On the trained presets (docs/RESULTS.md)
GPTQ cut the Q4 logits' error by 8-36% against the unweighted fit; the diagonal alone changed it
by -19% to +6%.

Keys are the export's tensor names (models/export.py tensor_map): "blk.0.attn_qkv",
"blk.0.ffn_gate_up", "blk.0.exp.3.ffn_down", "output", ... (the fused QKV and gate+up parts
share their input, so one measurement serves them all; a matrix that several layers share, as
arch5's, gathers the inputs of every use). A matrix no token reached (an expert never routed)
has no entry and is quantized unweighted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cflow.errors import CflowError


def _owner(model, w: torch.Tensor) -> tuple[str, int | None] | None:
    """(parameter name, expert index or None) of the parameter whose storage holds w."""
    ptr = w.data_ptr()
    for name, p in model.named_parameters():
        base = p.data_ptr()
        if base <= ptr < base + p.numel() * p.element_size():
            if p.dim() == 3:  # experts stacked: (E, rows, cols)
                return name, (ptr - base) // (p[0].numel() * p.element_size())
            return name, None
    return None


def pnt_name(pname: str, expert: int | None) -> str | None:
    """The export's tensor name of a PNT parameter (models/export.py tensor_map)."""
    parts = pname.split(".")
    if parts[0] != "layers":
        return None
    b = f"blk.{parts[1]}."
    rest = ".".join(parts[2:])
    if expert is not None:
        return {"moe.w_gate_up": f"{b}exp.{expert}.ffn_gate_up", "moe.w_down": f"{b}exp.{expert}.ffn_down"}.get(rest)
    return {"attn.wqkv.weight": b + "attn_qkv", "attn.wo.weight": b + "attn_output",
            "ffn_gate_up": b + "ffn_gate_up", "ffn_down": b + "ffn_down"}.get(rest)


@dataclass
class Calib:
    """What the calibration measured for one matrix: diag, float32 (cols,), the mean square of
    each input column's activation (floored at 1e-6 of its mean, so no column counts for
    nothing); hessian, float64 (cols, cols), the mean of x x^T (None where it would not fit the
    budget); tokens, how many rows of activations it saw."""

    diag: np.ndarray
    hessian: np.ndarray | None
    tokens: int


def dense_name(pname: str, expert: int | None) -> str | None:
    """The engine's tensor name of a llama-shaped model's matrix (models/dense.py Dense.tensors)."""
    return "blk." + pname[len("layers."):] if pname.startswith("layers.") and expert is None else None


def measure(model, windows: list[list[int]], max_hessian_bytes: int = 1 << 30, names=None) -> dict[str, Calib]:
    """{export tensor name: Calib} over every token of `windows` (lists of token ids, each at most
    the model's max_seq_len). The second moments x x^T are kept per matrix while their total stays
    within max_hessian_bytes (float64), in the order first met; the rest keep the diagonal only.
    names: (parameter name, expert or None) -> tensor name; default the PNT export's
    (pnt_name), dense_name for the llama-shaped models."""
    from cflow.models import dense, pnt

    names_of = names or pnt_name

    if not windows or not any(windows):
        raise CflowError("calibration needs at least one token")
    sums: dict[str, list] = {}
    budget = [max_hessian_bytes]

    def add(name: str | None, x: torch.Tensor) -> None:
        if name is None:
            return
        x = x.detach().reshape(-1, x.shape[-1]).double()
        s = sums.get(name)
        if s is None:
            c = x.shape[-1]
            full = c * c * 8 <= budget[0]
            budget[0] -= c * c * 8 if full else 0
            s = sums[name] = [torch.zeros(c, dtype=torch.float64),
                              torch.zeros(c, c, dtype=torch.float64) if full else None, 0]
        s[0] += x.pow(2).sum(0)
        if s[1] is not None:
            s[1] += x.T @ x
        s[2] += x.shape[0]

    plain = pnt.linear
    owners: dict[tuple[int, tuple], tuple[str, int | None] | None] = {}

    def recording(x, w, ternary=False):
        key = (w.data_ptr(), tuple(w.shape))
        if key not in owners:
            owners[key] = _owner(model, w)
        owner = owners[key]
        if owner is not None:
            add(names_of(*owner), x)
        return plain(x, w, ternary)

    hook = model.output_norm.register_forward_hook(lambda m, i, out: add("output", out))
    pnt.linear = dense.linear = recording  # both models' matrix products (dense imports pnt's)
    try:
        with torch.no_grad():
            for ids in windows:
                if ids:
                    model(torch.tensor([ids]))
    finally:
        pnt.linear = dense.linear = plain
        hook.remove()
    out = {}
    for name, (sq, xx, n) in sums.items():
        v = (sq / max(n, 1)).float().numpy()
        mean = float(v.mean())
        diag = np.maximum(v, 1e-6 * mean if mean > 0 else 1e-30).astype(np.float32)
        out[name] = Calib(diag, None if xx is None else (xx / max(n, 1)).numpy(), n)
    return out


def gptq_encode(w: np.ndarray, calib: Calib, type_name: str, damp: float = 0.01) -> np.ndarray:
    """float (R, C) -> uint8 (R, C / 32 * block bytes): Q4_0 or Q4_1 blocks by GPTQ (Frantar et
    al., 2022) over the calibration's second moments H = E[x x^T]: the columns are rounded in
    order, and each one's rounding error, scaled by the inverse of H, is taken up by the columns
    not yet rounded, so that the error of the product W x, not of W, is what is kept small. Per
    block of 32 columns the grid (d, and m for Q4_1) is the fitted quantizer's (quant.encode_fit,
    weighted by H's diagonal) on the block's weights as the earlier blocks left them; the errors
    of a block reach the later columns in one product (GPTQ's lazy batch). H gets damp x its mean
    diagonal added (a column no token reached is then rounded alone)."""
    from cflow.format.quant import encode_fit

    if calib.hessian is None:
        raise CflowError("gptq_encode needs the calibration's second moments (hessian)")
    if type_name not in ("q4_0", "q4_1"):
        raise CflowError(f"gptq_encode: type must be q4_0 or q4_1, got {type_name!r}")
    W = torch.tensor(np.asarray(w, dtype=np.float32), dtype=torch.float64)
    R, C = W.shape
    if C % 32 or calib.hessian.shape != (C, C):
        raise CflowError(f"gptq_encode: weights (R, {C}) against second moments of shape {calib.hessian.shape}")
    H = torch.tensor(calib.hessian, dtype=torch.float64)
    d = torch.diagonal(H)
    d[d <= 0] = 1.0
    H += damp * float(d.mean()) * torch.eye(C, dtype=torch.float64)
    # the upper Cholesky factor of H^-1: row i holds how column i's error spreads to i + 1 ..
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    q4_1 = type_name == "q4_1"
    bb, lo, hi = (20, 0.0, 15.0) if q4_1 else (18, -8.0, 7.0)
    out = np.empty((R, C // 32, bb), dtype=np.uint8)
    for g in range(0, C, 32):
        blk = encode_fit(W[:, g:g + 32].float().numpy(), type_name, calib.diag[g:g + 32])  # (R, bb): the grid
        out[:, g // 32, :(4 if q4_1 else 2)] = blk[:, :(4 if q4_1 else 2)]
        scale = torch.tensor(blk[:, :2].copy().view("<f2")[:, 0].astype(np.float32), dtype=torch.float64)
        offset = (torch.tensor(blk[:, 2:4].copy().view("<f2")[:, 0].astype(np.float32), dtype=torch.float64)
                  if q4_1 else torch.zeros(R, dtype=torch.float64))
        inv = torch.where(scale != 0, 1.0 / torch.where(scale != 0, scale, 1.0), 0.0)
        err = torch.empty(R, 32, dtype=torch.float64)
        L = np.empty((R, 32), dtype=np.uint8)
        for j in range(32):
            i = g + j
            q = torch.clamp(torch.round((W[:, i] - offset) * inv), lo, hi)
            L[:, j] = (q - lo).to(torch.uint8).numpy()
            e = (W[:, i] - (scale * q + offset)) / U[i, i]
            W[:, i + 1:g + 32] -= e[:, None] * U[i, i + 1:g + 32][None, :]
            err[:, j] = e
        W[:, g + 32:] -= err @ U[g:g + 32, g + 32:]
        out[:, g // 32, bb - 16:] = L[:, :16] | (L[:, 16:] << 4)
    return out.reshape(R, -1)


def encode(w: np.ndarray, type_name: str, calib: Calib | None) -> np.ndarray:
    """float (R, C) -> uint8 rows of `type_name` (a fitted 4-bit type, quant.FITTED): by GPTQ where
    the calibration kept the second moments, else fitted with its diagonal as the importance, or
    unweighted without a calibration."""
    from cflow.format.quant import encode as encode_rows
    from cflow.format.tiles import block_type

    if calib is not None and calib.hessian is not None:
        return gptq_encode(w, calib, type_name)
    return encode_rows(w, block_type(type_name), None if calib is None else calib.diag)


def windows_of(tokenizer_json: str, texts, n_tokens: int, window: int) -> list[list[int]]:
    """The first n_tokens ids of `texts` (each text's ids in turn), cut into windows of `window`."""
    from tokenizers import Tokenizer

    if n_tokens < 1 or window < 1:
        raise CflowError(f"calibration needs a positive token count and window, got {n_tokens}, {window}")
    tok = Tokenizer.from_str(tokenizer_json)
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t).ids
        if len(ids) >= n_tokens:
            break
    ids = ids[:n_tokens]
    if not ids:
        raise CflowError("the calibration text gave no tokens")
    return [ids[i:i + window] for i in range(0, len(ids), window)]
