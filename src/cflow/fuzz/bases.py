"""The base files the fuzzer mutates, made from the real SmolLM2 GGUF.

Kept small so that a mutant costs milliseconds: 2 layers, d_model 64, 4 query / 2 KV heads of
16, d_ff 128, and SmolLM2's tokenizer cut to its first 512 tokens (the merges among them kept),
with its chat template. Weights are random (seeded), in the block types a GGUF carries: Q8_0
embeddings, Q4_1 / Q4_0 / Q5_0 / F16 matrices, F32 norms.

  base.gguf       the GGUF (gguf-py's writer)
  base.cflow      `cflow convert base.gguf`
  hf/             config.json, model.safetensors (F32/F16/BF16 tensors), tokenizer.json,
                  tokenizer_config.json, generation_config.json
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

N_VOCAB, D, N_HEAD, N_KV, HEAD_DIM, D_FF, N_LAYER = 512, 64, 4, 2, 16, 128, 2
KINDS = ("gguf", "cflow", "safetensors")


def _vocab(src: Path):
    """(tokens, token types, merges, chat template) of the SmolLM2 GGUF cut to N_VOCAB tokens."""
    import gguf

    r = gguf.GGUFReader(src)
    f = r.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data[:N_VOCAB]]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data[:N_VOCAB]]
    have = set(tokens)
    merges = []
    for i in f["tokenizer.ggml.merges"].data:
        m = bytes(f["tokenizer.ggml.merges"].parts[i]).decode()
        a, _, b = m.partition(" ")
        if a in have and b in have and a + b in have:
            merges.append(m)
    template = bytes(f["tokenizer.chat_template"].parts[-1]).decode()
    return tokens, types, merges, template


def _weights(rng):
    """name -> fp32 array in HF orientation (out, in), and the GGUF block type of each."""
    w, types = {}, {}

    def put(name, shape, qtype, scale=0.08):
        w[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        types[name] = qtype

    put("token_embd.weight", (N_VOCAB, D), "Q8_0", 0.5)
    put("output_norm.weight", (D,), "F32", 0.0)
    w["output_norm.weight"] += 1.0
    for l in range(N_LAYER):
        p = f"blk.{l}."
        put(p + "attn_norm.weight", (D,), "F32", 0.0)
        put(p + "ffn_norm.weight", (D,), "F32", 0.0)
        w[p + "attn_norm.weight"] += 1.0
        w[p + "ffn_norm.weight"] += 1.0
        put(p + "attn_q.weight", (N_HEAD * HEAD_DIM, D), "Q4_1")
        put(p + "attn_k.weight", (N_KV * HEAD_DIM, D), "Q4_0")
        put(p + "attn_v.weight", (N_KV * HEAD_DIM, D), "Q5_0")
        put(p + "attn_output.weight", (D, N_HEAD * HEAD_DIM), "Q8_0")
        put(p + "ffn_gate.weight", (D_FF, D), "Q4_1")
        put(p + "ffn_up.weight", (D_FF, D), "F16")
        put(p + "ffn_down.weight", (D, D_FF), "Q4_0")
    return w, types


HF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.weight"
    return HF_NAMES[parts[0]] + ".weight"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF's llama Q/K rows are permuted for its rope layout; HF keeps halves: undo it."""
    out, d = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, d).swapaxes(1, 2).reshape(out, d)


def write_gguf(path: Path, src_gguf: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """The base GGUF; returns its weights dequantized (HF orientation, GGUF names)."""
    import gguf
    from gguf import quants

    tokens, types, merges, template = _vocab(src_gguf)
    rng = np.random.default_rng(seed)
    w, qtypes = _weights(rng)
    g = gguf.GGUFWriter(str(path), "llama")
    g.add_name("cflow fuzz base")
    g.add_block_count(N_LAYER)
    g.add_context_length(256)
    g.add_embedding_length(D)
    g.add_feed_forward_length(D_FF)
    g.add_head_count(N_HEAD)
    g.add_head_count_kv(N_KV)
    g.add_rope_freq_base(10000.0)
    g.add_layer_norm_rms_eps(1e-5)
    g.add_rope_dimension_count(HEAD_DIM)
    g.add_vocab_size(N_VOCAB)
    g.add_tokenizer_model("gpt2")
    g.add_tokenizer_pre("smollm")
    g.add_token_list(tokens)
    g.add_token_types(types)
    g.add_token_merges(merges)
    g.add_bos_token_id(1)
    g.add_eos_token_id(2)
    g.add_add_bos_token(False)
    g.add_chat_template(template)
    deq = {}
    for name, a in w.items():
        qt = getattr(gguf.GGMLQuantizationType, qtypes[name])
        if qt == gguf.GGMLQuantizationType.F32:
            data = a
        elif qt == gguf.GGMLQuantizationType.F16:
            data = a.astype(np.float16)
        else:
            data = quants.quantize(a, qt)
        g.add_tensor(name, data, raw_dtype=qt)
        deq[name] = quants.dequantize(data, qt).reshape(a.shape).astype(np.float32) \
            if qt not in (gguf.GGMLQuantizationType.F32,) else a
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return deq


def write_hf(out: Path, src_gguf: Path, deq: dict[str, np.ndarray]) -> None:
    """The same weights as a Hugging Face llama directory (Q/K rows back in HF order)."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, _types, merges, template = _vocab(src_gguf)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, a in deq.items():
        if name.endswith("attn_q.weight"):
            a = _unpermute(a, N_HEAD)
        elif name.endswith("attn_k.weight"):
            a = _unpermute(a, N_KV)
        dtype = np.float16 if ".ffn_" in name else np.float32  # two dtypes, as real checkpoints mix
        tensors[_hf_name(name)] = np.ascontiguousarray(a.astype(dtype))
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": N_VOCAB, "hidden_size": D,
        "intermediate_size": D_FF, "num_hidden_layers": N_LAYER, "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV, "head_dim": HEAD_DIM, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32"}))
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                              merges=[tuple(m.split(" ", 1)) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([t for t in tokens[:17] if t.startswith("<")])
    tk.save(str(out / "tokenizer.json"))
    # JSON files are written as the mutator writes them back, so a corpus entry (an edit of
    # its base) holds only the change
    (out / "tokenizer.json").write_text(json.dumps(json.loads((out / "tokenizer.json").read_text())))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tokens[1], "eos_token": tokens[2], "chat_template": template, "add_bos_token": False}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": True,
                                                            "temperature": 0.7, "top_p": 0.9}))


def make(out: Path, src_gguf: Path | None = None) -> dict[str, Path]:
    """Write the three bases into `out` (once; kept between runs). src_gguf: the SmolLM2 GGUF
    (pulled when not given)."""
    from cflow import hub
    from cflow.cli import main

    out.mkdir(parents=True, exist_ok=True)
    paths = {"gguf": out / "base.gguf", "cflow": out / "base.cflow", "safetensors": out / "hf"}
    if all(p.exists() for p in paths.values()):
        return paths
    src_gguf = Path(src_gguf or hub.pull("smollm2-135m", quiet=True))
    deq = write_gguf(paths["gguf"], src_gguf)
    write_hf(paths["safetensors"], src_gguf, deq)
    if main(["convert", str(paths["gguf"]), "-o", str(paths["cflow"]), "--quiet"]) != 0:
        raise RuntimeError("the fuzz base GGUF does not convert")
    return paths
