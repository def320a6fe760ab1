"""`cflow bench ternary-model`: a GGUF with BitNet b1.58 2B-4T's geometry and random ternary weights.

The ternary decode benchmark needs a BitNet-sized file that cflow and llama.cpp both run:
architecture "bitnet" with the tensor names, shapes and metadata keys of gguf-py's MODEL_ARCH.BITNET
(attn_sub_norm and ffn_sub_norm included; the head is token_embd, as llama.cpp's bitnet graph has
it), the number of layers an argument (the real model has 30).

Every layer matrix holds ternary weights s * {-1, 0, +1}, codes uniform at random, one scale s per
matrix (as BitNet trains them; the projections back into the residual stream, attn_output and
ffn_down, at the GPT-2 rule's smaller RMS, see moe_model.py), written in --type:
  tq2_0   GGUF's 2-bit ternary blocks,
  tq1_0   its 1.6-bit base-3 blocks,
  q4_0    the same weights in Q4_0 (q = t + 7, d = s: exact), for the ternary-against-4-bit A/B;
token_embd (the head too) is Q4_0 in all three with the same random values, norms f32. The same
--seed gives the same weights in every type, so the three files are one model: their logits agree
to the activations' rounding, and the decode speeds compare bytes alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cflow.bench.moe_model import EMBED_RMS, WEIGHT_RMS, TensorSpec, _fill_q4_0, _gguf, add_tokenizer, write_streamed
from cflow.errors import CflowError

TYPES = ("tq2_0", "tq1_0", "q4_0")
ROWS_PER_CHUNK = 1024  # rows of a matrix made at a time


@dataclasses.dataclass(frozen=True)
class Geometry:
    """BitNet b1.58 2B-4T's (its HF config.json) unless changed."""

    n_layer: int = 30
    d_model: int = 2560
    n_head: int = 20
    n_head_kv: int = 5
    d_ff: int = 6912
    vocab: int = 128256
    n_ctx: int = 4096
    rms_eps: float = 1e-5
    rope_base: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def tensor_specs(g: Geometry, wtype: str) -> list[TensorSpec]:
    gguf = _gguf()
    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    arch_tensors = set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.BITNET])
    d, kv = g.d_model, g.n_head_kv * g.head_dim
    residual = WEIGHT_RMS / np.sqrt(2 * g.n_layer)
    q = wtype.upper()

    def spec(t, shape, qtype, kind, bid=None, rms=WEIGHT_RMS):
        assert t in arch_tensors, t
        return TensorSpec(names[t].format(bid=bid) + ".weight", tuple(shape), qtype, kind, float(rms))

    out = [spec(T.TOKEN_EMBD, (g.vocab, d), "Q4_0", "table", rms=EMBED_RMS)]
    for i in range(g.n_layer):
        out += [
            spec(T.ATTN_NORM, (d,), "F32", "norm", i),
            spec(T.ATTN_Q, (d, d), q, "ternary", i),
            spec(T.ATTN_K, (kv, d), q, "ternary", i),
            spec(T.ATTN_V, (kv, d), q, "ternary", i),
            spec(T.ATTN_SUB_NORM, (d,), "F32", "norm", i),
            spec(T.ATTN_OUT, (d, d), q, "ternary", i, rms=residual),
            spec(T.FFN_NORM, (d,), "F32", "norm", i),
            spec(T.FFN_GATE, (g.d_ff, d), q, "ternary", i),
            spec(T.FFN_UP, (g.d_ff, d), q, "ternary", i),
            spec(T.FFN_SUB_NORM, (g.d_ff,), "F32", "norm", i),
            spec(T.FFN_DOWN, (d, g.d_ff), q, "ternary", i, rms=residual),
        ]
    return out + [spec(T.OUTPUT_NORM, (d,), "F32", "norm")]


def check_geometry(g: Geometry) -> None:
    if min(g.n_layer, g.d_model, g.n_head, g.n_head_kv, g.d_ff) < 1:
        raise CflowError("the layers, sizes and heads must be positive")
    if g.d_model % g.n_head or g.n_head % g.n_head_kv:
        raise CflowError(f"--d-model {g.d_model} must be a multiple of --heads {g.n_head}, and that of --kv-heads")
    if g.d_model % 256 or g.d_ff % 256:
        raise CflowError("--d-model and --ff must be multiples of 256 (the ternary block)")
    if g.vocab < 300:
        raise CflowError("--vocab must be at least 300 (bytes, merges, specials)")


# --- the weights: codes t in {0, 1, 2} (weight s * (t - 1)) in each type's blocks --------------

def _tq2_0(t: np.ndarray, s: float) -> np.ndarray:
    """codes (n, 256) -> TQ2_0 blocks (n, 66): bits 2l of qs[32h + m] hold weight 128h + 32l + m."""
    c = t.reshape(-1, 2, 4, 32).astype(np.uint8)
    qs = c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)  # (n, 2, 32)
    d = np.full((t.shape[0], 1), s, np.float16).view(np.uint8)
    return np.concatenate([qs.reshape(-1, 64), d], axis=1)


def _tq1_0(t: np.ndarray, s: float) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    x = (t.astype(np.float32) - 1) * np.float32(np.float16(s))  # exact ternary values: absmax d = s
    return np.asarray(quantize(x.reshape(1, -1), GGMLQuantizationType.TQ1_0)).view(np.uint8).reshape(t.shape[0], 54)


def _q4_0(t: np.ndarray, s: float) -> np.ndarray:
    """The same weights in Q4_0: q = t + 7 (q - 8 = t - 1), d = s; weight j of a block is the low
    nibble of qs[j] (j < 16), the high nibble of qs[j - 16]."""
    q = (t.reshape(-1, 32) + 7).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    d = np.full((q.shape[0], 1), s, np.float16).view(np.uint8)
    return np.concatenate([d, qs], axis=1)


ENCODERS = {"TQ2_0": _tq2_0, "TQ1_0": _tq1_0, "Q4_0": _q4_0}


def tensor_data(sp: TensorSpec, rng) -> np.ndarray:
    if sp.qtype == "F32":
        return rng.uniform(0.9, 1.1, size=sp.shape).astype(np.float32)
    if sp.kind == "table":  # random Q4_0 blocks (moe_model's), the same in every type
        size = 18
        blocks = np.empty((sp.nbytes() // size, size), np.uint8)
        step = 1 << 20
        for i in range(0, blocks.shape[0], step):
            _fill_q4_0(rng, blocks[i:i + step], sp.rms)
        return blocks.reshape(sp.byte_shape())
    rows, cols = sp.shape
    s = float(np.float16(sp.rms / np.sqrt(2.0 / 3.0)))  # RMS of s * (t - 1), t uniform in {0, 1, 2}
    enc = ENCODERS[sp.qtype]
    out = []
    for r in range(0, rows, ROWS_PER_CHUNK):
        n = min(ROWS_PER_CHUNK, rows - r)
        t = rng.integers(0, 3, size=(n * cols // 256, 256), dtype=np.uint8)
        out.append(enc(t, s).reshape(n, -1))
    return np.concatenate(out)


def add_metadata(w, g: Geometry, wtype: str) -> None:
    gguf = _gguf()
    ftype = {"tq2_0": gguf.LlamaFileType.MOSTLY_TQ2_0, "tq1_0": gguf.LlamaFileType.MOSTLY_TQ1_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[wtype]
    w.add_name(f"bitnet bench, BitNet b1.58 2B geometry, {g.n_layer} layers, random ternary weights in {wtype}")
    w.add_context_length(g.n_ctx)
    w.add_embedding_length(g.d_model)
    w.add_block_count(g.n_layer)
    w.add_feed_forward_length(g.d_ff)
    w.add_head_count(g.n_head)
    w.add_head_count_kv(g.n_head_kv)
    w.add_rope_freq_base(g.rope_base)
    w.add_layer_norm_rms_eps(g.rms_eps)
    w.add_file_type(int(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(w, g.vocab)


def write(path, g: Geometry = Geometry(), wtype: str = "tq2_0", seed: int = 0, progress: bool = True) -> dict:
    """Write the model to `path` (atomically); returns its sizes: file, layer matrices, per token."""
    from pathlib import Path

    gguf = _gguf()
    if wtype not in TYPES:
        raise CflowError(f"--type must be one of {', '.join(TYPES)}, got {wtype!r}")
    check_geometry(g)
    specs = tensor_specs(g, wtype)
    write_streamed(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BITNET], lambda w: add_metadata(w, g, wtype), specs,
                   lambda i, s: tensor_data(s, np.random.default_rng([seed, i])), "ternary-model", progress)
    layers = sum(s.nbytes() for s in specs if s.kind == "ternary")
    table = specs[0].nbytes()
    return {"path": str(path), "file_bytes": Path(path).stat().st_size, "layer_bytes": layers,
            # what one decoded token reads: every layer matrix, the head (token_embd) and one of its rows
            "bytes_per_token": layers + table + table // g.vocab}


def add_arguments(p):
    d = Geometry()
    p.add_argument("-o", "--output", required=True, help="output .gguf path (written atomically)")
    p.add_argument("--type", choices=TYPES, default="tq2_0",
                   help="layer matrix type: tq2_0, tq1_0, or q4_0 holding the same ternary weights (default tq2_0)")
    p.add_argument("--layers", type=int, default=d.n_layer, help=f"transformer blocks (default {d.n_layer})")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same weights (default 0)")
    geo = p.add_argument_group("geometry (default: BitNet b1.58 2B-4T's; smaller for tests)")
    geo.add_argument("--d-model", type=int, default=d.d_model, help=f"embedding length (default {d.d_model})")
    geo.add_argument("--heads", type=int, default=d.n_head, help=f"query heads (default {d.n_head})")
    geo.add_argument("--kv-heads", type=int, default=d.n_head_kv, help=f"KV heads (default {d.n_head_kv})")
    geo.add_argument("--ff", type=int, default=d.d_ff, help=f"FFN hidden size (default {d.d_ff})")
    geo.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default {d.vocab})")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    g = Geometry(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, n_head_kv=args.kv_heads, d_ff=args.ff,
                 vocab=args.vocab)
    r = write(args.output, g, args.type, seed=args.seed, progress=not args.quiet)
    print(f"wrote {r['path']}: {r['file_bytes'] / 1e9:.3f} GB, {g.n_layer} layers, {args.type}; layer matrices "
          f"{r['layer_bytes'] / 1e6:.1f} MB, all weights read per token {r['bytes_per_token'] / 1e6:.1f} MB")
    return 0
