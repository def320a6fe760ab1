"""Conversion of existing checkpoints (GGUF files, Hugging Face directories) to cflow.

    ckpt = load_source("model.gguf")          # or an HF directory: config.json + *.safetensors
    convert("model.gguf", "model.cflow", quant="keep")

A Checkpoint is the model in cflow's terms, in memory (arrays may be views of a mapped file):
its ModelConfig, tensors under our names (see names.py) with the Q/K/V and gate/up matrices
fused, the tokenizer (a Hugging Face tokenizers JSON string), the chat template, the special
token ids and the sampling defaults the source gives (`generation`, see generation_fields). What
differs by architecture (config keys, tensor names, tensor transforms, the tensors expected)
comes from its module in cflow.models. It reads like a CflowFile (config, tokenizer_json,
chat_template, tensors, dequantize), so the reference engine runs either.

Fused tensors: blk.{l}.attn_qkv stacks [Wq; Wk; Wv] by rows (biases likewise), and
blk.{l}.ffn_gate_up stacks [W_gate; W_up]; `parts` records the row counts. Blocks are never
re-encoded by fusion, so `keep` stays bit-identical to GGUF. When the parts have different
block types (Q4_K_M files store some attn_v / ffn_up as Q6_K), `keep` stores them unfused
(attn_q / attn_k / attn_v, ffn_gate / ffn_up) and readers accept both forms.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cflow.config import ModelConfig
from cflow.errors import CflowError, CflowFormatError, UnsupportedError
from cflow.format.tiles import BLOCK_TYPES, block_type

QUANTS = ("keep", "q4_0", "q4_1", "q8_0", "f16", "f32", "tq1_0", "tq2_0")
# Ternary targets: the layers' matrices become d * {-1, 0, 1} (format.quant.ternarize); the
# embedding table and the head, which BitNet b1.58 keeps in high precision too, become q8_0.
TERNARY_TABLES_QUANT = "q8_0"
FLOAT_TYPES = {"f32": np.float32, "f16": np.float16}


@dataclass
class Tensor:
    """One tensor: type (block-type name), shape (rows, cols) or (n,), data.

    data: float types -> float array of `shape` (bf16 as uint16 bits); quantized types ->
    uint8 (rows, cols / QK * block_bytes), each row GGUF-encoded.
    parts: for fused tensors, [(name, rows), ...] in row order.
    """

    type: str
    shape: tuple[int, ...]
    data: np.ndarray
    parts: list[tuple[str, int]] = field(default_factory=list)

    def dequantize(self) -> np.ndarray:
        return dequantize(self.type, self.data, self.shape)


def dequantize(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Row blocks or float data -> float32 array of `shape`."""
    if type_name in ("f32", "f16"):
        return np.asarray(data, dtype=np.float32).reshape(shape)
    if type_name == "bf16":
        return (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gg_dequantize

    qt = GGMLQuantizationType(block_type(type_name).code)
    return gg_dequantize(np.asarray(data), qt).reshape(shape).astype(np.float32, copy=False)


def quantize(type_name: str, w: np.ndarray) -> np.ndarray:
    """float array (rows, cols) -> data for Tensor(type_name) (row blocks for quantized types):
    format.quant.encode's (Q4_0 and Q4_1 with fitted scales per block, never a larger error
    than gguf-py's; the other types gguf-py's quantizers)."""
    if type_name in FLOAT_TYPES:
        return np.ascontiguousarray(w, dtype=FLOAT_TYPES[type_name])
    from cflow.format.quant import encode

    return encode(w, block_type(type_name))


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, Tensor]
    tokenizer_json: str | None = None
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)  # bos_token_id, eos_token_ids, ...
    metadata: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)  # the source's sampling defaults (generation_fields)

    def dequantize(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise CflowFormatError(f"model has no tensor {name!r}")
        return self.tensors[name].dequantize()

    def unfuse(self, name: str) -> dict[str, np.ndarray]:
        """A fused tensor's parts, dequantized: {part name: float32 (rows_p, cols)} (as CflowFile)."""
        t = self.tensors[name]
        if not t.parts:
            raise CflowError(f"tensor {name!r} is not fused")
        return split_parts(name, t, t.dequantize())

    def close(self) -> None:
        pass


GENERATION_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def generation_fields(settings: dict) -> dict:
    """The sampling defaults among a source's generation settings, under Hugging Face
    generation_config.json's names: those present with a value a .cflow reader accepts
    (docs/FORMAT.md 3.4). Nulls and values out of range are left out."""
    from cflow.format.spec import generation_error

    return {k: settings[k] for k in GENERATION_KEYS
            if settings.get(k) is not None and generation_error(k, settings[k]) is None}


# ---------------------------------------------------------------------------- loading


def source_kind(path: str | os.PathLike) -> str:
    """'gguf', 'hf' or 'cflow' for a local path; a clear error otherwise."""
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf"
        raise CflowError(f"{p} is a directory without config.json (expected a Hugging Face model directory)")
    if not p.is_file():
        raise CflowError(f"no such file or directory: {p}")
    try:
        with open(p, "rb") as f:
            magic = f.read(8)
    except OSError as e:
        raise CflowError(f"cannot read {p}: {e.strerror or e}") from None
    if magic[:4] == b"GGUF":
        return "gguf"
    if p.suffix in (".cflow", ".vflow") or magic == b"\x89CFLOW\r\n":
        return "cflow"
    raise CflowFormatError(f"{p}: not a GGUF file, .cflow file or Hugging Face directory")


def load_source(path: str | os.PathLike) -> Checkpoint:
    """Read a GGUF file or an HF directory into a Checkpoint (weights stay mapped where possible)."""
    kind = source_kind(path)
    if kind == "gguf":
        from cflow.convert.gguf import load_gguf

        return load_gguf(path)
    if kind == "hf":
        from cflow.convert.hf import load_hf

        return load_hf(path)
    raise CflowError(f"{path} is already a .cflow file")


# A checkpoint's packed experts (one 3-D tensor (n_expert, rows, cols) per layer and kind, experts
# on the outer axis: llama.cpp's ffn_*_exps, transformers' experts.gate_up_proj / down_proj) ->
# the name of each expert's matrix, blk.{l}.exp.{e}.{kind}.
PACKED_EXPERTS = {"ffn_gate_exps": "ffn_gate", "ffn_up_exps": "ffn_up", "ffn_down_exps": "ffn_down",
                  "ffn_gate_up_exps": "ffn_gate_up"}


def split_experts(name: str, t: Tensor, n_expert: int, source_name: str) -> dict[str, Tensor]:
    """A packed expert tensor blk.{l}.{kind}_exps (n_expert, rows, cols) -> {blk.{l}.exp.{e}.{kind}:
    Tensor (rows, cols)}, views of its data (quantized rows keep their blocks); gate_up_exps holds
    [gate; up] per expert and is marked with those parts. Any other tensor: {name: t}, if it has at
    most 2 dimensions. source_name: the checkpoint's name, for the errors."""
    layer, _, kind = name.rpartition(".")
    if kind not in PACKED_EXPERTS:
        if len(t.shape) > 2:
            raise UnsupportedError(f"tensor {source_name} has {len(t.shape)} dimensions {tuple(t.shape)}; only "
                                   "matrices, vectors and packed experts are supported")
        return {name: t}
    if len(t.shape) != 3:
        raise CflowFormatError(f"packed expert tensor {source_name} has shape {tuple(t.shape)}; expected "
                               f"(n_expert={n_expert}, rows, cols)")
    if t.shape[0] != n_expert:
        raise CflowFormatError(f"packed expert tensor {source_name} holds {t.shape[0]} experts, the config says "
                               f"n_expert={n_expert}")
    rows = t.shape[1]
    if kind == "ffn_gate_up_exps" and rows % 2:
        raise CflowFormatError(f"packed expert tensor {source_name}: {rows} rows do not split into gate and up")
    data = t.data  # (n_expert, rows, cols or row bytes): each expert a view
    out = {}
    for e in range(n_expert):
        x = f"{layer}.exp.{e}."
        parts = [(x + "ffn_gate", rows // 2), (x + "ffn_up", rows // 2)] if kind == "ffn_gate_up_exps" else []
        out[x + PACKED_EXPERTS[kind]] = Tensor(t.type, tuple(t.shape[1:]), data[e], parts)
    return out


def fuse_layers(cfg: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fuse {p}attn_q/k/v -> attn_qkv and {p}ffn_gate/up -> ffn_gate_up where the types agree, for
    the layers (p = blk.{l}.) and the experts (p = blk.{l}.exp.{e}.) the tensors have. The prefixes
    are found among the names, so the work is bounded by the tensors, whatever the config says."""
    out = dict(tensors)
    for fused, names in (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_gate_up", ("ffn_gate", "ffn_up"))):
        for b in [n[:-len(names[0])] for n in tensors if n.startswith("blk.") and n.endswith("." + names[0])]:
            ts = [out.get(b + n) for n in names]
            if any(t is None for t in ts):
                continue
            if len({t.type for t in ts}) == 1:
                out[b + fused] = _stack(ts, [b + n for n in names])
                for n in names:
                    del out[b + n]
            if fused == "attn_qkv" and all(b + n + ".bias" in out for n in names):
                bs = [out.pop(b + n + ".bias") for n in names]
                if b + fused in out:  # [bq; bk; bv], one f32 vector
                    out[b + fused + ".bias"] = Tensor("f32", (sum(t.shape[0] for t in bs),),
                                                      np.concatenate([t.dequantize() for t in bs]))
                else:
                    out.update({b + n + ".bias": t for n, t in zip(names, bs)})
    return out


def _stack(ts: list[Tensor], names: list[str]) -> Tensor:
    widths = {tuple(t.shape[1:]) for t in ts}
    if len(widths) != 1 or any(len(t.shape) != 2 for t in ts):
        raise CflowFormatError("tensors " + ", ".join(f"'{n}' {tuple(t.shape)}" for n, t in zip(names, ts)) +
                               " must be matrices of the same width")
    rows = [t.shape[0] for t in ts]
    shape = (sum(rows),) + tuple(ts[0].shape[1:])
    data = np.concatenate([np.asarray(t.data) for t in ts], axis=0)
    return Tensor(ts[0].type, shape, data, list(zip(names, rows)))


def split_parts(name: str, t: Tensor, w: np.ndarray) -> dict[str, np.ndarray]:
    """Dequantized fused tensor -> {part name: rows}; an unfused tensor maps to itself."""
    if not t.parts:
        return {name: w}
    out, r = {}, 0
    for pname, n in t.parts:
        out[pname] = w[r : r + n]
        r += n
    return out


def requantize(ckpt: Checkpoint, quant: str) -> Checkpoint:
    """Re-encode every matrix to `quant` (norms and biases stay f32); 'keep' returns ckpt."""
    if quant not in QUANTS:
        raise UnsupportedError(f"unknown quantization {quant!r}; supported: {', '.join(QUANTS)}")
    if quant == "keep":
        return ckpt
    from cflow.format.quant import TERNARY, ternarize

    out = {}
    err2 = norm2 = 0.0  # ternary targets: squared error and squared norm over the ternarized matrices
    for name, t in ckpt.tensors.items():
        if len(t.shape) != 2:
            out[name] = t if t.type == "f32" else Tensor("f32", t.shape, t.dequantize(), t.parts)
            continue
        if name.endswith(".ffn_gate_inp"):  # a router (n_expert, d): small, and kept as the source has it
            out[name] = t
            continue
        q = TERNARY_TABLES_QUANT if quant in TERNARY and not name.startswith("blk.") else quant
        if q in TERNARY and t.shape[1] % BLOCK_TYPES[q].block_elems:  # rows not in blocks of 256
            q = TERNARY_TABLES_QUANT
        target = q if t.shape[1] % BLOCK_TYPES[q].block_elems == 0 else "f16" if q != "f32" else "f32"
        if t.type == target:
            out[name] = t
            continue
        w = t.dequantize()
        if target in TERNARY:
            tw = ternarize(w)
            err2 += float(np.square(tw - w, dtype=np.float64).sum())
            norm2 += float(np.square(w, dtype=np.float64).sum())
            w = tw
        out[name] = Tensor(target, t.shape, quantize(target, w), t.parts)
    meta = dict(ckpt.metadata, quant=quant)
    if norm2:  # how far the ternary weights are from the source's, the first measure of what was lost
        meta["ternarize_weight_error"] = round((err2 / norm2) ** 0.5, 6)
    # parts kept apart for their different block types now share one: fused (experts need it)
    return dataclasses.replace(ckpt, tensors=fuse_layers(ckpt.config, out), metadata=meta)


# ---------------------------------------------------------------------------- writing


def check_output(src: str | os.PathLike, out: str | os.PathLike) -> None:
    """Refuse an output path whose replacement would destroy the source: the source file itself
    (also through a symlink or a hard link), or an existing file inside a source directory. The
    write is a rename onto `out`, so it would replace the source in one atomic step."""
    if not (os.path.exists(src) and os.path.exists(out)):
        return
    if os.path.samefile(src, out):
        raise CflowError(f"the output {out} is the input file; write the .cflow file to another path")
    real_src, real_out = os.path.realpath(src), os.path.realpath(out)
    if os.path.isdir(real_src) and os.path.commonpath([real_src, real_out]) == real_src:
        raise CflowError(f"the output {out} is a file of the input directory {src}; write the .cflow file elsewhere")


def convert(src: str | os.PathLike, out: str | os.PathLike, *, quant: str = "keep", progress: bool = True,
            pack: str = "planes") -> Path:
    """Convert a GGUF file or an HF directory into a .cflow file (atomic: no partial file; the
    source is never the file replaced). pack: "planes" (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices in
    the planes pack) or "blocks" (convert/write.py). An output ending in .vflow is written stage-major
    (format/vflow.py); a .cflow source is then laid out again with its tensors' bytes unchanged."""
    from cflow.convert.write import write_cflow

    check_output(src, out)
    if Path(out).suffix == ".vflow":
        return _convert_vflow(src, out, quant=quant, progress=progress, pack=pack)
    ckpt = requantize(load_source(src), quant)
    write_cflow(ckpt, out, progress=progress, pack=pack)
    return Path(out)


def _convert_vflow(src, out, *, quant: str, progress: bool, pack: str) -> Path:
    import tempfile

    from cflow.format import CflowFile
    from cflow.format.vflow import write_vflow

    if source_kind(src) == "cflow":
        if quant != "keep":
            raise CflowError("a .cflow source is laid out stage-major as it is: --quant keep only")
        with CflowFile(src) as f:
            write_vflow(f, out, progress=progress)
        return Path(out)
    fd, tmp = tempfile.mkstemp(prefix=Path(out).name + ".layer-major-", suffix=".cflow", dir=Path(out).parent or ".")
    os.close(fd)
    try:
        convert(src, tmp, quant=quant, progress=progress, pack=pack)
        with CflowFile(tmp) as f:
            write_vflow(f, out, progress=progress)
    finally:
        os.unlink(tmp)
    return Path(out)
