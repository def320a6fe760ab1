"""`cflow bench moe-model`: the random-weight qwen3moe GGUF, at a reduced geometry (2 layers of
d_model 256, 4 experts, vocabulary 512): names, shapes, types and metadata as gguf-py's constants
have them, weights of the intended magnitude, the same bytes for the same seed, and, where
llama-cpp-python is installed, a file llama.cpp loads and decodes."""

import hashlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from cflow.bench import moe_model  # noqa: E402
from cflow.errors import CflowError  # noqa: E402

SMALL = dict(n_layer=2, d_model=256, n_head=2, n_head_kv=1, head_dim=128, n_expert=4, n_expert_used=2,
             d_expert=256, vocab=512, n_ctx=512)
ARGS = ["--layers", "2", "--d-model", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "128",
        "--experts", "4", "--experts-used", "2", "--expert-ff", "256", "--vocab", "512", "--context-length", "512"]
ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _value(reader, key):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """{type: path} of the reduced-geometry file of each --type, written by the command."""
    from cflow.cli import main

    d = tmp_path_factory.mktemp("moe-model")
    out = {}
    for t in moe_model.TYPES:
        out[t] = d / f"moe-{t}.gguf"
        assert main(["bench", "moe-model", *ARGS, "--type", t, "-q", "-o", str(out[t])]) == 0
    return out


def _expected_types(t: str, name: str, layer: int | None) -> str:
    if name.endswith("norm.weight") or name.endswith("ffn_gate_inp.weight"):
        return "F32"
    if name == "output.weight":
        return "Q6_K"
    if t in ("q4_0", "q5_1"):
        return t.upper()
    if t in ("q4_k_m", "q5_k_m") and (name.endswith("attn_v.weight") or name.endswith("ffn_down_exps.weight")) \
            and moe_model.use_more_bits(layer, SMALL["n_layer"]):
        return "Q6_K"
    return "Q5_K" if t == "q5_k_m" else "Q4_K"


@pytest.mark.parametrize("t", moe_model.TYPES)
def test_tensors_read_back_with_llama_cpp_names_shapes_and_types(small, t):
    r = gguf.GGUFReader(small[t])
    g = moe_model.Geometry(**SMALL)
    d, q, kv, e, f = g.d_model, g.n_head * g.head_dim, g.n_head_kv * g.head_dim, g.n_expert, g.d_expert
    N = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    # ggml order (ne0, the row, first), as llama.cpp's loader checks them
    per_layer = {T.ATTN_NORM: [d], T.ATTN_Q: [d, q], T.ATTN_K: [d, kv], T.ATTN_V: [d, kv], T.ATTN_OUT: [q, d],
                 T.ATTN_Q_NORM: [g.head_dim], T.ATTN_K_NORM: [g.head_dim], T.FFN_NORM: [d],
                 T.FFN_GATE_INP: [d, e], T.FFN_GATE_EXP: [d, f, e], T.FFN_UP_EXP: [d, f, e],
                 T.FFN_DOWN_EXP: [f, d, e]}
    assert set(per_layer) | {T.TOKEN_EMBD, T.OUTPUT_NORM, T.OUTPUT} == set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE])
    want = {N[T.TOKEN_EMBD] + ".weight": ([d, g.vocab], None), N[T.OUTPUT_NORM] + ".weight": ([d], None),
            N[T.OUTPUT] + ".weight": ([d, g.vocab], None)}
    for i in range(g.n_layer):
        for k, shape in per_layer.items():
            want[N[k].format(bid=i) + ".weight"] = (shape, i)
    got = {x.name: x for x in r.tensors}
    assert set(got) == set(want)
    for name, (shape, layer) in want.items():
        x = got[name]
        assert [int(v) for v in x.shape] == shape, name
        assert x.tensor_type.name == _expected_types(t, name, layer), name
        assert x.n_bytes == moe_model.TensorSpec(name, tuple(reversed(shape)), x.tensor_type.name, "").nbytes()
    ftype = {"q4_0": "MOSTLY_Q4_0", "q4_k": "MOSTLY_Q4_K_S", "q4_k_m": "MOSTLY_Q4_K_M", "q5_1": "MOSTLY_Q5_1",
             "q5_k_m": "MOSTLY_Q5_K_M"}[t]  # the file type follows the matrices
    assert _value(r, gguf.Keys.General.FILE_TYPE) == int(gguf.LlamaFileType[ftype])


def test_metadata_is_qwen3_30b_a3b_s_by_gguf_keys(small):
    r = gguf.GGUFReader(small["q4_k"])
    K = gguf.Keys.LLM
    A = gguf.Keys.Attention
    key = lambda k: k.format(arch=ARCH)  # noqa: E731
    assert _value(r, gguf.Keys.General.ARCHITECTURE) == "qwen3moe"
    want = {K.CONTEXT_LENGTH: 512, K.EMBEDDING_LENGTH: 256, K.BLOCK_COUNT: 2, K.FEED_FORWARD_LENGTH: 6144,
            K.EXPERT_FEED_FORWARD_LENGTH: 256, K.EXPERT_COUNT: 4, K.EXPERT_USED_COUNT: 2, A.HEAD_COUNT: 2,
            A.HEAD_COUNT_KV: 1, A.KEY_LENGTH: 128, A.VALUE_LENGTH: 128}
    for k, v in want.items():
        assert _value(r, key(k)) == v, k
    assert _value(r, key(A.LAYERNORM_RMS_EPS)) == pytest.approx(1e-6)
    assert _value(r, key(gguf.Keys.Rope.FREQ_BASE)) == pytest.approx(1e6)
    Tk = gguf.Keys.Tokenizer
    assert _value(r, Tk.MODEL) == "gpt2"
    tokens = _value(r, Tk.LIST)
    assert len(tokens) == 512 == len(set(tokens)) == len(_value(r, Tk.TOKEN_TYPE))
    assert _value(r, Tk.MERGES) == moe_model.MERGES
    assert tokens[_value(r, Tk.EOS_ID)] == "<|im_end|>" and tokens[_value(r, Tk.BOS_ID)] == "<|endoftext|>"


def test_real_geometry_defaults():
    g = moe_model.Geometry()
    assert (g.d_model, g.n_head, g.n_head_kv, g.head_dim, g.n_expert, g.n_expert_used, g.d_expert, g.d_ff,
            g.vocab, g.n_layer) == (2048, 32, 4, 128, 128, 8, 768, 6144, 151936, 24)
    specs = moe_model.tensor_specs(g, "q4_0")
    # 8/128 of the experts a token: 24 layers of 3 matrices of 768 x 2048 Q4_0 (18 bytes per 32 weights)
    assert moe_model.expert_bytes(specs) * 8 // 128 == 24 * 3 * 8 * 768 * 2048 // 32 * 18


@pytest.mark.parametrize("t", moe_model.TYPES)
def test_weights_are_sane(small, t):
    """Dequantized matrices: the RMS intended (the embedding's EMBED_RMS, the projections into the
    residual stream WEIGHT_RMS / sqrt(2 n_layer), the rest WEIGHT_RMS), mean near 0 (no common
    direction), finite; norms near 1."""
    r = gguf.GGUFReader(small[t])
    g = moe_model.Geometry(**SMALL)
    rms = {s.name: s.rms for s in moe_model.tensor_specs(g, t)}
    assert rms["token_embd.weight"] == moe_model.EMBED_RMS
    assert rms["blk.1.attn_output.weight"] == rms["blk.1.ffn_down_exps.weight"] == pytest.approx(
        moe_model.WEIGHT_RMS / np.sqrt(2 * g.n_layer))
    assert rms["blk.1.attn_q.weight"] == rms["blk.1.ffn_gate_inp.weight"] == rms["output.weight"] == moe_model.WEIGHT_RMS
    for x in r.tensors:
        w = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type).astype(np.float64)
        assert np.isfinite(w).all(), x.name
        if x.name.endswith("norm.weight"):
            assert 0.85 < w.min() and w.max() < 1.15, x.name
        else:
            assert abs(w.std() / rms[x.name] - 1) < 0.1, (x.name, w.std())
            assert abs(w.mean()) < 0.05 * rms[x.name], (x.name, w.mean())


def test_same_seed_same_bytes(small, tmp_path):
    g = moe_model.Geometry(**SMALL)
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    moe_model.write(a, g, "q4_0", seed=0, progress=False)
    moe_model.write(b, g, "q4_0", seed=0, progress=False)
    moe_model.write(c, g, "q4_0", seed=1, progress=False)
    assert _sha(a) == _sha(b) == _sha(small["q4_0"]) != _sha(c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]  # no temp file left


def test_rows_must_be_whole_blocks(tmp_path):
    g = moe_model.Geometry(**{**SMALL, "d_expert": 96})  # Q4_0's 32 divides it, Q4_K's 256 does not
    with pytest.raises(CflowError, match="ffn_down_exps.*Q4_K"):
        moe_model.write(tmp_path / "x.gguf", g, "q4_k", progress=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("t", ["q5_1", "q5_k_m"])
def test_cflow_converts_and_runs_it(small, t, tmp_path):
    """The Q5_1 and Q5_K (with Q6_K) files end to end: `cflow convert` keeps their blocks (in the
    planes pack), and the native engine on the .cflow gives the reference engine's logits on the
    GGUF itself (gguf-py's dequantization); the default two-level int8 path stays close."""
    from cflow.cli import main
    from cflow.engine import Engine
    from cflow.engine_ref import RefEngine
    from cflow.format import CflowFile

    out = tmp_path / "m.cflow"
    assert main(["convert", str(small[t]), "-o", str(out), "--quiet"]) == 0
    base = {"q5_1": "q5_1", "q5_k_m": "q5_k"}[t]
    with CflowFile(out, verify=True) as f:
        types = {x.type.name for x in f.tensors.values()}
        assert base in types and all(x.pack == "planes" for x in f.tensors.values() if x.type.name == base)
        if t == "q5_k_m":
            assert "q6_k" in types
        r = {x.name: np.asarray(x.data) for x in gguf.GGUFReader(small[t]).tensors}
        assert np.array_equal(f.row_blocks("blk.1.exp.3.ffn_down"), r["blk.1.ffn_down_exps.weight"][3])
    seq = [300, 301, 302, 303, 17, 99, 500, 42, 7, 256]

    def rel(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())

    ref = RefEngine(str(small[t]))
    want = ref.forward(ref.new_state(), seq, all_logits=True)
    exact = Engine(str(out), threads=2, fast=False)
    assert rel(exact.forward(exact.new_state(), seq, all_logits=True), want) <= 1e-4
    fast = Engine(str(out), threads=2)
    st = fast.new_state()
    got = np.concatenate([fast.forward(st, seq[:6], all_logits=True)] + [fast.forward(st, [x])[None] for x in seq[6:]])
    assert np.isfinite(got).all() and rel(got, want) < 1e-3, rel(got, want)  # two int8 levels: about 2e-5


def _as_version_2(path) -> None:
    """Rewrite a .cflow file's version fields (preamble and header) to 2, its checksums fixed up:
    a file as cflow wrote it before version 3 reordered the q6_k planes."""
    import json
    import os

    from cflow.format.spec import PREAMBLE, Preamble, crc32

    with open(path, "r+b") as f:
        pre = Preamble.unpack(f.read(PREAMBLE.size), os.path.getsize(path))
        f.seek(pre.header_offset)
        h = json.loads(f.read())
        h["version"] = 2
        raw = json.dumps(h).encode()
        f.truncate(pre.header_offset)
        f.seek(pre.header_offset)
        f.write(raw)
        f.seek(0)
        f.write(Preamble(2, 0, pre.header_offset + len(raw), pre.header_offset, len(raw), crc32(raw), pre.alignment).pack())


def test_q6_k_planes_of_a_version_2_file_are_refused_and_a_cached_one_converted_again(small, tmp_path):
    """Version 3 stores q6_k planes in the order the kernels read them. A version-2 file holding q6_k
    planes (the earlier order) is refused with a clear error instead of being misread, and a cached
    conversion of that kind is converted again on load, giving the fresh conversion's logits."""
    from cflow.engine import Engine
    from cflow.errors import CflowFormatError
    from cflow.format import CflowFile
    from cflow.llm import converted_path, load_model

    src = small["q4_k_m"]
    load_model(str(src), cache=tmp_path, quiet=True).close()
    cached = converted_path(src, tmp_path)
    with CflowFile(cached) as f:
        assert f.preamble.version == 3 and any(t.type.name == "q6_k" and t.pack == "planes" for t in f.tensors.values())
    seq = [300, 301, 17, 99, 500, 42]
    fresh = Engine(str(cached), threads=2)
    want = fresh.forward(fresh.new_state(), seq, all_logits=True)
    del fresh
    _as_version_2(cached)
    with pytest.raises(CflowFormatError, match=r"q6_k planes in a version-2 file .* convert the model again"):
        CflowFile(cached)
    f = load_model(str(src), cache=tmp_path, quiet=True)
    assert f.preamble.version == 3
    f.close()
    again = Engine(str(cached), threads=2)
    assert np.array_equal(again.forward(again.new_state(), seq, all_logits=True), want)


@pytest.mark.parametrize("t", moe_model.TYPES)
def test_llama_cpp_loads_and_decodes(small, t):
    llama_cpp = pytest.importorskip("llama_cpp")
    from cflow.bench.decode import LlamaCppRunner

    # as `bench decode --vs llama.cpp` opens it: on AMX CPUs without ggml's AMX buffer type, whose
    # mul_mat segfaults on these files (Q4_0, Q4_K; llama-cpp-python 0.3.36)
    llm = LlamaCppRunner(str(small[t]), 1, 256).llm
    assert llm.n_vocab() == 512 and llm.n_embd() == 256
    seen = []
    llm.eval([300, 301, 302, 303])
    for _ in range(4):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(512,)).copy()
        assert np.isfinite(logits).all() and logits.std() > 0.1
        seen.append(logits)
        llm.eval([int(np.argmax(logits))])
    assert not np.allclose(seen[0], seen[1])
