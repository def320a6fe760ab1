"""SentencePiece GGUF vocabularies rebuilt with `tokenizers` alone (cflow.convert.sentencepiece):
the same token ids as transformers' GGUF tokenizer on varied text, and no torch or transformers
import on the way."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cflow import hub
from cflow.convert.gguf import gguf_tokenizer

HERE = Path(__file__).parent

# text that exercises what differs between tokenizers: unicode (accents, CJK, emoji, RTL,
# combining marks, characters only byte fallback spells), digits, runs of spaces, tabs and
# newlines, code, and strings that look like (or are) the vocabulary's special tokens
VARIED = [
    "", " ", "  ", "\n", "\t", "a", "Hi", " Hi", "Hi ", "  two leading", "trailing two  ",
    "a  b   c    d     e      f", "tab\tseparated\tvalues", "\t\tindented with tabs", "line\nbreak",
    "para\n\npara\n\n\n\nmore", "mixed \t \n \r\n whitespace", "\r\nwindows\r\nlines", " \n ",
    "3.14159 2.71828", "1,234,567.89", "2026-11-30T06:12:21Z", "0x1F 0b1010 1e-9 -42 +7",
    "12345678901234567890", "phone: +44 (0)20 7946 0958", "v1.2.3-rc.4",
    "naïve café résumé coöperate", "Straße groß", "Ærøskøbing", "ÀÉÎÕÜ àéîõü",
    "e\u0301 combining acute", "Zürich ça ñandú", "日本語のテキストです。", "中文分词测试，标点符号！",
    "한국어 문장입니다", "Привет, мир! Как дела?", "Γειά σου κόσμε", "مرحبا بالعالم", "שלום עולם",
    "हिन्दी पाठ", "ไทย ภาษา", "emoji 😀🎉👍🏽 and 👨‍👩‍👧‍👦 family", "🤖🦀🐍", "math ∑∫√∞ ≤ ≥ ≠ ±",
    "arrows ← → ↑ ↓ ⇒", "rare 𓀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd", "control \x00 \x07 \x1b[0m", "zero\u200bwidth\u200djoin",
    "non\u00a0breaking\u2009thin", "quotes “double” ‘single’ «guillemets»", "dash – em — ellipsis …",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}', "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "SELECT * FROM t WHERE id = 'x' AND n >= 10;", "x = lambda a, b: (a<<2) | (b>>1) ^ ~a",
    "    four spaces\n        eight spaces\n\ttab", "```python\nprint('hi')\n```", "https://example.com/a?b=c&d=e#f",
    "user@example.com", "C:\\Users\\name\\file.txt", "~/.cache/cflow/models", "snake_case camelCase PascalCase",
    "ALL CAPS SENTENCE", "MiXeD cAsE", "don't won't I'm you're they'll we've it's",
    "<bos>", "<eos>", "<unk>", "<pad>", "<mask>", "<s>", "</s>", "[multimodal]", "<unused5>",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "text<bos>inside<eos>text",
    "<start_of_image>", "< bos >", "<<bos>>", "▁ already ▁▁ metaspace", "<0x41> literal byte token",
]


def corpus() -> list[str]:
    """A few hundred lines: each sample story, its first sentences, and VARIED."""
    stories = [json.loads(line)["text"] for line in (HERE / "data" / "stories_sample.jsonl").read_text().splitlines()]
    sentences = [s + "." for story in stories for s in story.split(". ")[:2]]
    return stories + sentences + VARIED


def reference_tokenizer(path):
    """transformers' GGUF tokenizer for the file (the path cflow used before this module), as
    cflow stored it: through its JSON (the live object can differ: a token added as special and
    then again as plain decodes as special until it is reloaded)."""
    from tokenizers import Tokenizer

    tf_gguf = pytest.importorskip("transformers.integrations.gguf")
    arch, tok_dict, _ = tf_gguf.get_gguf_tokenizer(str(path))
    return Tokenizer.from_str(tf_gguf.convert_gguf_tokenizer(arch, tok_dict)[0].to_str())


def assert_same_ids(path) -> int:
    """Every corpus line encodes to the same ids both ways, and decodes to the same text;
    returns how many tokens were compared."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(gguf_tokenizer(path)[0])
    ref = reference_tokenizer(path)
    n = 0
    for line in corpus():
        got, want = ours.encode(line, add_special_tokens=False).ids, ref.encode(line, add_special_tokens=False).ids
        assert got == want, f"{line!r}: {got} != {want}"
        assert ours.decode(got) == ref.decode(want), repr(line)
        n += len(got)
    return n


def write_vocab_gguf(path, arch, tokens, scores, types):
    """A GGUF file holding only a SentencePiece vocabulary (no tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)  # Gemma's ids (the vocabularies here are cut from Gemma's)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gemma_gguf():
    return hub.pull("gemma3-270m", quiet=True)


@pytest.fixture(scope="module")
def small_vocab(gemma_gguf):
    """Part of Gemma's vocabulary, with its scores and types: its first 20000 entries (specials,
    byte tokens, the most common pieces; <unk>, <s> and </s>, which Llama's backend names, among
    them) and every single character, so that text tokenizes into pieces, not bytes."""
    import gguf

    r = gguf.GGUFReader(gemma_gguf)
    tokens, scores, types = (r.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "scores", "token_type"))
    keep = [i for i, t in enumerate(tokens) if i < 20000 or len(t) == 1]
    return [tokens[i] for i in keep], [scores[i] for i in keep], [types[i] for i in keep]


def test_gemma3_ids_equal_transformers(gemma_gguf):
    assert assert_same_ids(gemma_gguf) > 30000


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_llama_and_phi3_ids_equal_transformers(tmp_path, small_vocab, arch):
    path = write_vocab_gguf(tmp_path / f"{arch}.gguf", arch, *small_vocab)
    assert assert_same_ids(path) > 30000


def test_needs_neither_transformers_nor_torch(tmp_path, small_vocab):
    """The tokenizer converts in an interpreter where importing either fails."""
    import cflow

    path = write_vocab_gguf(tmp_path / "v.gguf", "gemma3", *small_vocab)
    code = ("import sys; sys.modules['transformers'] = sys.modules['torch'] = None\n"
            "from tokenizers import Tokenizer\n"
            "from cflow.convert.gguf import gguf_tokenizer\n"
            f"tok_json, special = gguf_tokenizer({str(path)!r})\n"
            "tk = Tokenizer.from_str(tok_json)\n"
            "print(repr(tk.decode(tk.encode('Hello  world', add_special_tokens=False).ids)), special)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(cflow.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "'Hello  world' {'bos_token_id': 2, 'eos_token_ids': [1, 106], 'add_bos': True}"


def test_byte_fallback_spells_unknown_characters(tmp_path, small_vocab):
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(gguf_tokenizer(write_vocab_gguf(tmp_path / "v.gguf", "gemma3", *small_vocab))[0])
    enc = tk.encode("𓀀", add_special_tokens=False)
    assert enc.tokens == ["<0xF0>", "<0x93>", "<0x80>", "<0x80>"]
    assert tk.decode(enc.ids) == "𓀀"


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_token_bytes_spell_the_text(tmp_path, small_vocab, arch):
    # logprobs spell a token by its bytes: U+2581 a space, <0xNN> its byte (a part of a
    # character), a control token its own text; together, the decoded text (Llama's decoder
    # drops the space of the ▁ it puts before the first piece)
    from cflow.tokenizer import Tokenizer

    tok = Tokenizer(*gguf_tokenizer(write_vocab_gguf(tmp_path / "v.gguf", arch, *small_vocab)))
    for text in [t for t in VARIED if t.strip()] + ["𓀀 rare", "<start_of_turn>user\nHi<end_of_turn>"]:
        ids = tok.encode(text)
        spelt, shown = b"".join(tok.token_bytes(i) for i in ids), tok.decode(ids).encode()
        assert spelt == shown or (arch == "llama" and spelt == b" " + shown), text
    assert tok.token_bytes(tok.encode("𓀀")[-1]) == b"\x80"
