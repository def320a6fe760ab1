"""`cflow bench moe-model`: a GGUF with Qwen3-30B-A3B's layer geometry and random weights.

The MoE decode benchmark needs a file of a real MoE's size, to run in cflow and llama.cpp alike:
architecture "qwen3moe", tensor names, shapes and metadata keys as llama.cpp's converter writes
them (taken from gguf-py's constants), the number of layers an argument (the real model has 48).

Weight types (--type):
  q4_0    every matrix Q4_0 (what `llama-quantize ... Q4_0` gives),
  q4_k    every matrix Q4_K,
  q4_k_m  llama-quantize's Q4_K_M mix: Q4_K, with Q6_K for attn_v and ffn_down_exps in the layers
          its use_more_bits rule picks (the first and last eighth, and every third in between);
  q5_1    every matrix Q5_1,
  q5_k_m  the Q5_K_M mix: Q5_K, with Q6_K where q4_k_m has it;
and for all of them: the output head Q6_K (as llama-quantize gives it), token_embd in the matrices'
base type, norms and the router (ffn_gate_inp) f32, as llama.cpp keeps them.

The quantized blocks are made directly as bytes (f16 scales of a magnitude that gives dequantized
weights the tensor's RMS and a mean near 0, uniform random quants): a decode's speed does not
depend on the values, and quantizing gigabytes of floats would take far longer than writing them.
Norm weights are near 1, the router is Gaussian. Every tensor draws from its own numpy Generator
seeded by (--seed, its index), so the same arguments give the same bytes.

The magnitudes keep the routing realistic. With every matrix at RMS 0.02, the residual stream of
a random model is soon dominated by the attention outputs, which average over the context and so
hardly differ from one position to the next: from layer 4 on, 128 prompt tokens chose only 20-30
of the 128 experts, consecutive tokens shared 6.5-7 of their 8, and decode steps chose the same 8
(llama.cpp's own top-k, read through its eval callback). So the embedding has RMS EMBED_RMS and
the projections back into the residual stream (attn_output, ffn_down_exps) WEIGHT_RMS /
sqrt(2 n_layer), GPT-2's rule: the token stays the larger part of the stream in every layer, and
each layer's router, a different random matrix, spreads the tokens over all experts.

The file is streamed (tensor infos first, then one tensor at a time: memory stays about the largest
tensor, the output head) to a temporary name beside the output, renamed when complete. The
tokenizer is a minimal valid byte-level BPE ("gpt2", pre-tokenizer "qwen2"): the 256 byte tokens, a
few merges, Qwen's special tokens, and unique [PAD<i>] tokens up to the vocabulary size.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from cflow.errors import CflowError

TYPES = ("q4_0", "q4_k", "q4_k_m", "q5_1", "q5_k_m")
BASE = {"q4_0": "Q4_0", "q4_k": "Q4_K", "q4_k_m": "Q4_K", "q5_1": "Q5_1", "q5_k_m": "Q5_K"}  # the matrices' type
MIXES = ("q4_k_m", "q5_k_m")  # Q6_K for attn_v and ffn_down_exps in the use_more_bits layers
WEIGHT_RMS = 0.02  # RMS of the dequantized matrices (the router's too) ...
EMBED_RMS = 1.0  # ... but token_embd's, and attn_output's and ffn_down_exps' WEIGHT_RMS / sqrt(2 n_layer)
CHUNK_BYTES = 16 << 20  # bytes of blocks generated at a time
# Qwen2/3's special tokens and their ids (used where the vocabulary is large enough)
SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r"]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Qwen3-30B-A3B's (its HF config.json) unless changed; n_layer is 48 in the real model."""

    n_layer: int = 24
    d_model: int = 2048
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    n_expert: int = 128
    n_expert_used: int = 8
    d_expert: int = 768  # moe_intermediate_size
    d_ff: int = 6144  # intermediate_size: stated in the metadata; every layer is an MoE layer
    vocab: int = 151936
    n_ctx: int = 4096  # context_length written (the real model's is 40960)
    rms_eps: float = 1e-6
    rope_base: float = 1e6


def _gguf():
    import gguf

    return gguf


# --- random quantized blocks --------------------------------------------------------------------

def _scales(rng, n: int, d0: float, signed: bool = False) -> np.ndarray:
    """n f16 scales around d0 (magnitude uniform in [0.75, 1.25] d0; signed: either sign, as real
    Q4_0 files have them, where d = max / -8 takes the sign of the block's largest weight), as (n, 2) bytes."""
    d = d0 * (0.75 + 0.5 * rng.random(n, dtype=np.float32))
    if signed:
        d *= 1 - 2 * (rng.random(n, dtype=np.float32) < 0.5)
    return d.astype(np.float16).view(np.uint8).reshape(n, 2)


def _jitter_rms() -> float:
    return float(np.sqrt(1 + 0.25 ** 2 / 3))  # RMS of the uniform [0.75, 1.25] factor


def _fill_q4_0(rng, out: np.ndarray, rms: float) -> None:
    # block_q4_0: f16 d, 16 bytes of nibbles; w = d (q - 8), q uniform in 0..15: RMS of q - 8 is sqrt(21.5).
    # q - 8 has mean -0.5, so d takes either sign: with d > 0 only, every matrix adds a common
    # all-ones direction (mean -0.5 d a weight) that grows layer by layer and swamps the token (the
    # logits then hardly change from one token to the next).
    n = out.shape[0]
    out[:] = np.frombuffer(rng.bytes(out.size), np.uint8).reshape(out.shape)
    out[:, 0:2] = _scales(rng, n, rms / (np.sqrt(21.5) * _jitter_rms()), signed=True)


def _times(d: np.ndarray, k: float) -> np.ndarray:
    """(n, 2) f16 bytes d -> the f16 bytes of k * d."""
    return (d.copy().view(np.float16).astype(np.float32) * k).astype(np.float16).view(np.uint8).reshape(d.shape)


def _fill_q5_1(rng, out: np.ndarray, rms: float) -> None:
    # block_q5_1: f16 d, f16 m, 4 bytes of fifth bits, 16 bytes of nibbles; w = d q + m, q uniform in
    # 0..31. With m = -15.5 d: w = d (q - 15.5), mean 0, RMS of q - 15.5 sqrt(85.25).
    n = out.shape[0]
    out[:] = np.frombuffer(rng.bytes(out.size), np.uint8).reshape(out.shape)
    d = _scales(rng, n, rms / (np.sqrt(85.25) * _jitter_rms()))
    out[:, 0:2], out[:, 2:4] = d, _times(d, -15.5)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins per block (n, 8) each -> the 12 bytes of ggml's get_scale_min_k4 layout."""
    s = np.empty((sc.shape[0], 12), np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return s


def _fill_k4(rng, out: np.ndarray, rms: float, levels: int) -> None:
    # block_q4_K / block_q5_K: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks
    # of 32, then the quants (Q5_K: 32 bytes of fifth bits before the 128 of nibbles), q uniform in
    # 0..levels-1; w = d sc q - dmin m. With m = sc and dmin = c d, c = (levels - 1) / 2:
    # w = d sc (q - c), mean 0, RMS of q - c sqrt((levels^2 - 1) / 12) (Q4_K 21.25, Q5_K 85.25);
    # sc uniform in 32..63 (RMS sqrt(2310)).
    n = out.shape[0]
    out[:] = np.frombuffer(rng.bytes(out.size), np.uint8).reshape(out.shape)
    d = _scales(rng, n, rms / (np.sqrt((levels**2 - 1) / 12) * np.sqrt(2310.0) * _jitter_rms()))
    sc = rng.integers(32, 64, size=(n, 8), dtype=np.uint8)
    out[:, 0:2], out[:, 2:4], out[:, 4:16] = d, _times(d, (levels - 1) / 2), _k4_scales(sc, sc)


def _fill_q4_k(rng, out: np.ndarray, rms: float) -> None:
    _fill_k4(rng, out, rms, 16)


def _fill_q5_k(rng, out: np.ndarray, rms: float) -> None:
    _fill_k4(rng, out, rms, 32)


def _fill_q6_k(rng, out: np.ndarray, rms: float) -> None:
    # block_q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d; w = d sc (q - 32), q uniform in
    # 0..63 (RMS of q - 32 is sqrt(341.5)); |sc| uniform in 4..11 (RMS sqrt(61.5)), of either sign
    # (q - 32 has mean -0.5: see _fill_q4_0). At the residual projections' RMS, d (here and in Q4_K)
    # can be an f16 subnormal, as in real files with weights that small: it converts exactly.
    n = out.shape[0]
    out[:] = np.frombuffer(rng.bytes(out.size), np.uint8).reshape(out.shape)
    sc = rng.integers(4, 12, size=(n, 16), dtype=np.int8)
    sc[rng.random((n, 16), dtype=np.float32) < 0.5] *= -1
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = _scales(rng, n, rms / (np.sqrt(341.5) * np.sqrt(61.5) * _jitter_rms()))


FILLERS = {"Q4_0": _fill_q4_0, "Q5_1": _fill_q5_1, "Q4_K": _fill_q4_k, "Q5_K": _fill_q5_k, "Q6_K": _fill_q6_k}


# --- the tensors --------------------------------------------------------------------------------

@dataclasses.dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (the row, ggml's ne0, last)
    qtype: str  # a GGMLQuantizationType name
    kind: str  # "matrix", "norm" or "router"
    rms: float = WEIGHT_RMS  # of the dequantized weights (matrices, router)

    def nbytes(self) -> int:
        gguf = _gguf()
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.qtype]]
        return int(np.prod(self.shape)) // block * size

    def byte_shape(self) -> tuple[int, ...]:
        gguf = _gguf()
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.qtype]]
        return (*self.shape[:-1], self.shape[-1] // block * size)


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quantize's rule for the layers a *_K_M mix gives more bits."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def tensor_specs(g: Geometry, wtype: str) -> list[TensorSpec]:
    """Every tensor of the file in writing order, named as gguf-py's MODEL_ARCH.QWEN3MOE list."""
    gguf = _gguf()
    T = gguf.MODEL_TENSOR
    names = gguf.TENSOR_NAMES
    arch_tensors = set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE])
    base = BASE[wtype]
    d, q, kv = g.d_model, g.n_head * g.head_dim, g.n_head_kv * g.head_dim

    residual = WEIGHT_RMS / np.sqrt(2 * g.n_layer)  # see the module's docstring

    def spec(t, shape, qtype, kind, bid=None, rms=WEIGHT_RMS):
        assert t in arch_tensors, t
        return TensorSpec(names[t].format(bid=bid) + ".weight", tuple(shape), qtype, kind, float(rms))

    out = [spec(T.TOKEN_EMBD, (g.vocab, d), base, "matrix", rms=EMBED_RMS)]
    for i in range(g.n_layer):
        more = wtype in MIXES and use_more_bits(i, g.n_layer)
        wide = "Q6_K" if more else base
        out += [
            spec(T.ATTN_NORM, (d,), "F32", "norm", i),
            spec(T.ATTN_Q, (q, d), base, "matrix", i),
            spec(T.ATTN_K, (kv, d), base, "matrix", i),
            spec(T.ATTN_V, (kv, d), wide, "matrix", i),
            spec(T.ATTN_OUT, (d, q), base, "matrix", i, rms=residual),
            spec(T.ATTN_Q_NORM, (g.head_dim,), "F32", "norm", i),
            spec(T.ATTN_K_NORM, (g.head_dim,), "F32", "norm", i),
            spec(T.FFN_NORM, (d,), "F32", "norm", i),
            spec(T.FFN_GATE_INP, (g.n_expert, d), "F32", "router", i),
            spec(T.FFN_GATE_EXP, (g.n_expert, g.d_expert, d), base, "matrix", i),
            spec(T.FFN_UP_EXP, (g.n_expert, g.d_expert, d), base, "matrix", i),
            spec(T.FFN_DOWN_EXP, (g.n_expert, d, g.d_expert), wide, "matrix", i, rms=residual),
        ]
    out += [spec(T.OUTPUT_NORM, (d,), "F32", "norm"), spec(T.OUTPUT, (g.vocab, d), "Q6_K", "matrix")]
    return out


def check_geometry(g: Geometry, wtype: str) -> None:
    gguf = _gguf()
    if g.n_layer < 1 or min(g.d_model, g.n_head, g.n_head_kv, g.head_dim, g.n_expert, g.d_expert, g.vocab) < 1:
        raise CflowError("the layers, sizes, heads, experts and vocabulary must be positive")
    if not 1 <= g.n_expert_used <= g.n_expert:
        raise CflowError(f"--experts-used must be in 1..{g.n_expert}, got {g.n_expert_used}")
    if g.n_head % g.n_head_kv:
        raise CflowError(f"--heads {g.n_head} is not a multiple of --kv-heads {g.n_head_kv}")
    if g.vocab < 256 + len(MERGES) + len(SPECIALS):
        raise CflowError(f"--vocab must be at least {256 + len(MERGES) + len(SPECIALS)} (bytes, merges, specials)")
    for s in tensor_specs(g, wtype):
        if s.qtype != "F32":
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[s.qtype]][0]
            if s.shape[-1] % block:
                raise CflowError(f"{s.name}: rows of {s.shape[-1]} are not a whole number of {s.qtype} blocks "
                                 f"({block}): choose sizes that are multiples of {block}")


def tensor_data(s: TensorSpec, rng) -> np.ndarray:
    """The tensor's bytes (quantized types: (..., row bytes) uint8; F32: float32 of its shape)."""
    if s.qtype == "F32":
        if s.kind == "norm":
            return rng.uniform(0.9, 1.1, size=s.shape).astype(np.float32)
        return (s.rms * rng.standard_normal(size=s.shape, dtype=np.float32)).astype(np.float32)
    gguf = _gguf()
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[s.qtype]][1]
    blocks = np.empty((s.nbytes() // size, size), np.uint8)
    step = max(1, CHUNK_BYTES // size)
    fill = FILLERS[s.qtype]
    for i in range(0, blocks.shape[0], step):
        fill(rng, blocks[i:i + step], s.rms)
    return blocks.reshape(s.byte_shape())


# --- tokenizer and metadata ---------------------------------------------------------------------

def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tokenizer(vocab: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """(tokens, token types, merges, special ids) of the minimal byte-level BPE vocabulary."""
    gguf = _gguf()
    tokens = _byte_tokens() + ["".join(m.split(" ")) for m in MERGES]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    first_special = min(min(SPECIALS), vocab - len(SPECIALS))
    specials = {tok: first_special + k for k, tok in enumerate(SPECIALS.values())}
    by_id = {i: tok for tok, i in specials.items()}
    for i in range(len(tokens), vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.NORMAL)
    assert len(set(tokens)) == vocab
    return tokens, [int(t) for t in types], list(MERGES), specials


def add_metadata(w, g: Geometry, wtype: str) -> None:
    gguf = _gguf()
    ftype = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
             "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
             "q5_k_m": gguf.LlamaFileType.MOSTLY_Q5_K_M}[wtype]
    w.add_name(f"qwen3moe bench, Qwen3-30B-A3B geometry, {g.n_layer} layers, random {wtype} weights")
    w.add_context_length(g.n_ctx)
    w.add_embedding_length(g.d_model)
    w.add_block_count(g.n_layer)
    w.add_feed_forward_length(g.d_ff)
    w.add_head_count(g.n_head)
    w.add_head_count_kv(g.n_head_kv)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_rope_freq_base(g.rope_base)
    w.add_layer_norm_rms_eps(g.rms_eps)
    w.add_expert_count(g.n_expert)
    w.add_expert_used_count(g.n_expert_used)
    w.add_expert_feed_forward_length(g.d_expert)
    w.add_file_type(int(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(w, g.vocab)


def add_tokenizer(w, vocab: int) -> None:
    """The minimal byte-level BPE of `tokenizer(vocab)` as GGUF tokenizer metadata."""
    tokens, types, merges, specials = tokenizer(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(specials["<|endoftext|>"])
    w.add_eos_token_id(specials["<|im_end|>"])
    w.add_pad_token_id(specials["<|endoftext|>"])
    w.add_add_bos_token(False)


# --- writing ------------------------------------------------------------------------------------

def expert_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes() for s in specs if s.name.endswith("_exps.weight"))


def write_streamed(path: str | os.PathLike, arch: str, add_meta, specs: list[TensorSpec], data, desc: str,
                   progress: bool = True) -> None:
    """A GGUF of architecture `arch` at `path`, atomically: add_meta(writer) adds the metadata, then
    the tensor infos of `specs`, then each tensor's bytes data(i, spec) (numpy, of spec.nbytes()), one
    at a time, to a temporary name beside `path`, renamed when complete."""
    from tqdm import tqdm

    gguf = _gguf()
    total = sum(s.nbytes() for s in specs)
    path = Path(path)
    parent = path.resolve().parent
    if not parent.is_dir():
        raise CflowError(f"{parent} is not a directory")
    free = shutil.disk_usage(parent).free
    if total + (1 << 30) > free:
        raise CflowError(f"{path} needs {total / 1e9:.2f} GB and {parent} has {free / 1e9:.2f} GB free "
                         f"(1 GB is kept spare)")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    w = None
    try:
        w = gguf.GGUFWriter(tmp, arch)
        add_meta(w)
        for s in specs:
            if s.qtype == "F32":
                w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes())
            else:
                w.add_tensor_info(s.name, s.byte_shape(), np.dtype(np.uint8), s.nbytes(),
                                  raw_dtype=gguf.GGMLQuantizationType[s.qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=total, desc=f"{desc} {path.name}"[:40], unit="B", unit_scale=True, disable=not progress,
                  file=sys.stderr, mininterval=1.0) as bar:
            for i, s in enumerate(specs):
                d = data(i, s)
                assert d.nbytes == s.nbytes(), s.name
                w.write_tensor_data(d)
                bar.update(d.nbytes)
                del d
        f = w.fout[0]
        f.flush()
        os.fsync(f.fileno())
        w.close()
        os.replace(tmp, path)
    except BaseException:
        for f in (w.fout or []) if w is not None else []:
            f.close()
        tmp.unlink(missing_ok=True)
        raise


def write(path: str | os.PathLike, g: Geometry = Geometry(), wtype: str = "q4_0", seed: int = 0,
          progress: bool = True) -> dict:
    """Write the model to `path` (atomically); returns its sizes: file, tensors, experts, per token."""
    gguf = _gguf()
    if wtype not in TYPES:
        raise CflowError(f"--type must be one of {', '.join(TYPES)}, got {wtype!r}")
    check_geometry(g, wtype)
    specs = tensor_specs(g, wtype)
    total = sum(s.nbytes() for s in specs)
    write_streamed(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE], lambda w: add_metadata(w, g, wtype), specs,
                   lambda i, s: tensor_data(s, np.random.default_rng([seed, i])), "moe-model", progress)
    path = Path(path)
    ex = expert_bytes(specs)
    dense = sum(s.nbytes() for s in specs[1:] if not s.name.endswith("_exps.weight"))  # all but token_embd
    embd_row = specs[0].nbytes() // g.vocab
    return {"path": str(path), "file_bytes": path.stat().st_size, "tensor_bytes": total, "expert_bytes": ex,
            "expert_bytes_per_token": ex * g.n_expert_used // g.n_expert,
            # what one decoded token reads: the chosen experts, every other matrix, one embedding row
            "bytes_per_token": ex * g.n_expert_used // g.n_expert + dense + embd_row}


# --- the command --------------------------------------------------------------------------------

def add_arguments(p):
    d = Geometry()
    p.add_argument("-o", "--output", required=True, help="output .gguf path (written atomically)")
    p.add_argument("--layers", type=int, default=d.n_layer, help=f"transformer blocks (default {d.n_layer}; the real "
                   "model has 48)")
    p.add_argument("--type", choices=TYPES, default="q4_0",
                   help="matrix types: q4_0, q4_k, q5_1, or the q4_k_m / q5_k_m mixes (Q6_K for some "
                        "attn_v/ffn_down_exps); the head is Q6_K, norms and router f32 (default q4_0)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same arguments give the same file (default 0)")
    geo = p.add_argument_group("geometry (default: Qwen3-30B-A3B's; smaller for tests)")
    geo.add_argument("--d-model", type=int, default=d.d_model, help=f"embedding length (default {d.d_model})")
    geo.add_argument("--heads", type=int, default=d.n_head, help=f"query heads (default {d.n_head})")
    geo.add_argument("--kv-heads", type=int, default=d.n_head_kv, help=f"KV heads (default {d.n_head_kv})")
    geo.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head dimension (default {d.head_dim})")
    geo.add_argument("--experts", type=int, default=d.n_expert, help=f"experts per layer (default {d.n_expert})")
    geo.add_argument("--experts-used", type=int, default=d.n_expert_used,
                     help=f"experts per token (default {d.n_expert_used})")
    geo.add_argument("--expert-ff", type=int, default=d.d_expert, help=f"expert hidden size (default {d.d_expert})")
    geo.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default {d.vocab})")
    geo.add_argument("--context-length", type=int, default=d.n_ctx, help=f"context_length written (default {d.n_ctx})")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def geometry(args) -> Geometry:
    return Geometry(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, n_head_kv=args.kv_heads,
                    head_dim=args.head_dim, n_expert=args.experts, n_expert_used=args.experts_used,
                    d_expert=args.expert_ff, vocab=args.vocab, n_ctx=args.context_length)


def main(args) -> int:
    g = geometry(args)
    r = write(args.output, g, args.type, seed=args.seed, progress=not args.quiet)
    print(f"wrote {r['path']}: {r['file_bytes'] / 1e9:.3f} GB ({r['file_bytes']:,} bytes), {g.n_layer} layers, "
          f"{args.type}")
    print(f"experts {r['expert_bytes'] / 1e9:.3f} GB; per token ({g.n_expert_used}/{g.n_expert} of them) "
          f"{r['expert_bytes_per_token'] / 1e6:.1f} MB; all weights read per token {r['bytes_per_token'] / 1e6:.1f} MB")
    return 0
