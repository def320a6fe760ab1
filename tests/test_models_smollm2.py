"""SmolLM2-135M-Instruct (the real Q4_1 GGUF, fetched with `cflow pull`) against Hugging Face
transformers, which loads the same GGUF dequantized to fp32: teacher-forced logits over 256
tokens, top-1 agreement, and the greedy 64-token continuation of a fixed prompt."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from cflow import hub  # noqa: E402

TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. For forty years "
    "Margaret had climbed its spiral stairs every evening to light the lamp, even after the ships stopped coming. "
    "The village below had grown quiet; the fishermen had moved to the city, and the school had closed. Still, she "
    "believed that somewhere out on the dark water a sailor might need the light. One stormy night in November, "
    "she saw a small boat struggling against the waves. Its sail was torn and its mast was bent. Margaret grabbed "
    "her lantern and ran down to the harbor, where she rang the old bell as loudly as she could. The sound carried "
    "over the wind, and slowly the boat turned toward the shore. When it finally reached the dock, a young girl "
    "stepped out, soaked and shivering. She said her name was Lucy and that she had been trying to reach the "
    "island to find her grandfather. Margaret wrapped her in a blanket and made her a cup of hot chocolate. They "
    "talked until the sun came up, and by morning Margaret knew that her light had mattered after all. "
)


@pytest.fixture(scope="module")
def gguf_path():
    return hub.pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="module")
def reference(gguf_path):
    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    torch_dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def llm(gguf_path):
    from cflow.llm import LLM

    return LLM(str(gguf_path), engine="ref", quiet=True)


def test_teacher_forced_logits_and_top1(llm, reference):
    ids = llm.tokenizer.encode(TEXT + TEXT)[:256]  # the text is 222 tokens
    assert len(ids) == 256
    ours = llm.logits(ids)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0].float().numpy()
    err = np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)
    assert err.max() < 1e-3, f"max relative error {err.max():.2e} at position {err.argmax()}"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.98


def test_greedy_64_tokens_equal_the_reference(llm, reference):
    prompt = llm.tokenizer.encode("Once upon a time")
    with torch.no_grad():
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    got = [t for c in llm.complete(prompt, max_tokens=64) for t in c.token_ids]
    assert got == ref[: len(got)] and len(got) == 64


def test_tokenizer_matches_the_reference_tokenizer(llm, gguf_path):
    ref = tf.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for s in (TEXT[:300], "In 2024, 1234567 cats 🤗 said héllo!\n\n  ok", "<|im_start|>user\nhi<|im_end|>"):
        assert llm.tokenizer.encode(s) == ref.encode(s, add_special_tokens=False)
