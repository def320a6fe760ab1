"""A tiny random-weight Llama with a real BPE tokenizer and a ChatML chat template, saved as a
Hugging Face directory: a real model for fast server and API tests (its text is gibberish).
Greedy decoding never picks a special token, so greedy answers always run to max_tokens. Its
tokenizer has Qwen's tool call markers, <tool_call> and </tool_call>, as added tokens of their
own (text, not special), for the tool tests' Hermes template."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Once upon a time there was a little fox who lived in the green forest.",
    "The quick brown dog jumps over the lazy cat, and the sun shines on the hills.",
    "What is the capital of France? Paris is the capital of France.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Punctuation, quotes \"and\" (brackets)!",
    "Grüße aus Köln: naïve café, déjà vu, 東京, emoji 🙂 and more.",
]


def build_tiny_llama(out: Path, *, vocab: int = 512, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json to out."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    markers = ["<tool_call>", "</tool_call>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    trained = tok.get_vocab_size()
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   unk_token=None, pad_token="<|endoftext|>")
    fast.chat_template = CHATML

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=trained, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"),
                      pad_token_id=tok.token_to_id("<|endoftext|>"))
    model = LlamaForCausalLM(cfg).eval()
    model.resize_token_embeddings(tok.get_vocab_size(), mean_resizing=False)  # the markers' rows after the
    # others: every other weight as without them
    with torch.no_grad():  # special tokens and markers get logit 0, below the greedy maximum: greedy never
        # ends early nor writes a marker
        model.lm_head.weight[[tok.token_to_id(s) for s in specials + markers]] = 0.0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out
