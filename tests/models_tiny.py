"""Tiny random-weight Hugging Face models of each supported architecture, saved to disk.

Odd sizes (d_model 72, d_ff 136, vocab 301) leave ragged tiles. A small byte-level BPE trained
with `tokenizers` goes with each model. Used by the model tests; needs torch + transformers.
"""

from __future__ import annotations

from pathlib import Path

TEXT = ("Once upon a time there was a little fox who lived in a forest. Every day the fox ran to the river "
        "to drink, and every night it slept under an old oak tree. One day it met a rabbit. 0123456789 ") * 20
VOCAB = 301
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def train_tokenizer(out: Path) -> None:
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 40, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([TEXT], trainer)
    tk.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML, "add_bos_token": False}))


def hf_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=72, intermediate_size=136, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=12, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   query_pre_attn_scalar=10, final_logit_softcapping=None)
    if arch == "bitnet":  # squared-ReLU FFN, as Microsoft's checkpoints
        return tf.BitNetConfig(**common, rope_theta=10000.0, hidden_act="relu2", tie_word_embeddings=False)
    raise ValueError(arch)


def build(arch: str, out: Path, seed: int = 0):
    """Save a random model of `arch` (fp32 safetensors + tokenizer) to out; returns the torch model."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(arch)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # values of a trained model's scale, norms away from their init
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.08) + (1.0 if "norm" in name and arch != "gemma3" else 0.0))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    train_tokenizer(out)
    return model
