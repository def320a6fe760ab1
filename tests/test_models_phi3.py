"""Phi-3: a tiny random Phi3ForCausalLM (fused qkv_proj and gate_up_proj, a sliding window shorter
than the prompt) converted from safetensors, against transformers itself on both engines."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import models_tiny  # noqa: E402

from cflow.convert import load_source  # noqa: E402
from cflow.llm import LLM  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers as tf

    def phi3_config(arch):
        return tf.Phi3Config(vocab_size=models_tiny.VOCAB, hidden_size=72, intermediate_size=136, num_hidden_layers=3,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                             rms_norm_eps=1e-6, sliding_window=9, bos_token_id=1, eos_token_id=2, pad_token_id=0)

    d = tmp_path_factory.mktemp("phi3")
    with pytest.MonkeyPatch.context() as mp:  # models_tiny.build with this config
        mp.setattr(models_tiny, "hf_config", phi3_config)
        return d, models_tiny.build("phi3", d)


def test_config_and_fused_tensors(tiny):
    d, _ = tiny
    ck = load_source(d)
    c = ck.config
    assert c.arch == "phi3" and (c.d_model, c.d_ff, c.n_head, c.n_kv_head, c.head_dim) == (72, 136, 6, 2, 12)
    assert c.layer_types == ["sliding"] * 3 and c.sliding_window == 9 and not c.tie_embeddings
    assert [r for _, r in ck.tensors["blk.1.attn_qkv"].parts] == [72, 24, 24] and "blk.1.attn_q" not in ck.tensors
    assert [n for n, _ in ck.tensors["blk.1.ffn_gate_up"].parts] == ["blk.1.ffn_gate", "blk.1.ffn_up"]


@pytest.mark.parametrize("engine", ["native", "ref"])
def test_logits_and_greedy_continuation_match_transformers(tiny, engine):
    d, model = tiny
    llm = LLM(str(d), engine=engine, fast=False, quiet=True, cache=d / "cache")
    ids = [int(i) for i in np.random.default_rng(1).integers(3, models_tiny.VOCAB, 64)]
    ours = llm.engine.forward(llm.engine.new_state(), ids, all_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    assert (np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)).max() < 1e-3
    prompt = llm.tokenizer.encode("Once upon a time", add_special_tokens=True)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    n = next((i for i, t in enumerate(want) if t in llm.tokenizer.eos_token_ids), len(want))
    assert [t for c in llm.complete(prompt, max_tokens=24, temperature=0) for t in c.token_ids] == want[:n]


def test_gguf_of_the_same_model_reads_the_same(tiny, tmp_path):
    """llama.cpp's phi3 layout: attn_qkv, and ffn_up holding [gate; up]."""
    import dataclasses
    import json

    import gguf

    d, model = tiny
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "phi3")
    for k, v in (("block_count", 3), ("embedding_length", 72), ("feed_forward_length", 136), ("context_length", 512),
                 ("attention.head_count", 6), ("attention.head_count_kv", 2), ("attention.sliding_window", 9)):
        w.add_uint32(f"phi3.{k}", v)
    w.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-6)
    bpe = json.loads((d / "tokenizer.json").read_text())["model"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(bpe["vocab"], key=bpe["vocab"].get))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    ours = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
            "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, p in model.state_dict().items():
        key = name.removeprefix("model.").removesuffix(".weight")
        parts = key.split(".", 2)
        gg = "output" if key == "lm_head" else ours[key] if parts[0] != "layers" else f"blk.{parts[1]}.{ours[parts[2]]}"
        w.add_tensor(gg + ".weight", p.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    a, b = load_source(d), load_source(tmp_path / "m.gguf")
    assert dataclasses.replace(b.config, norm_eps=a.config.norm_eps) == a.config
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, t in a.tensors.items():
        assert t.parts == b.tensors[name].parts and np.array_equal(t.dequantize(), b.dequantize(name)), name
