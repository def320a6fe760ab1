"""Mixture-of-experts checkpoints: tiny random Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE (with its gated
shared expert) models of transformers,
converted from safetensors and from GGUF files in llama.cpp's layout (packed ffn_*_exps), against
transformers' own forward on both engines; bad expert tensors and metadata are one line of error.

Every matrix but the routers is put on the q8_0 grid before the model is saved, so a q8_0
conversion computes with exactly the weights transformers does: the bounds measure the engines
(and the int8 activations of the fast path), not the weights' rounding. Routers are larger than
the other weights, so that the top_k choice is far from ties.
"""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

import models_tiny  # noqa: E402

from cflow.cli import main  # noqa: E402
from cflow.convert import load_source  # noqa: E402
from cflow.engine import Engine  # noqa: E402
from cflow.engine_ref import RefEngine  # noqa: E402
from cflow.format import CflowFile  # noqa: E402
from cflow.format.spec import unfuse_rows  # noqa: E402

D, F, E, K, LAYERS, HEADS, KV_HEADS, HD = 64, 96, 8, 2, 2, 4, 2, 16
# arch: (our arch, GGUF architecture, renormalised top_k gates)
ARCHS = {"mixtral": ("llama", "llama", True), "qwen3_moe": ("qwen3moe", "qwen3moe", True),
         "olmoe": ("olmoe", "olmoe", False), "qwen2_moe": ("qwen2moe", "qwen2moe", False)}
SHARED = 160  # Qwen2-MoE's shared expert width (a multiple of 32: q8_0 blocks)
Q8 = gguf.GGMLQuantizationType.Q8_0


def hf_config(arch: str, **kw):
    import transformers as tf

    common = dict(vocab_size=models_tiny.VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=512, rms_norm_eps=1e-6,
                  num_experts_per_tok=K, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "mixtral":
        return tf.MixtralConfig(**common, head_dim=HD, intermediate_size=F, num_local_experts=E, **kw)
    if arch == "qwen3_moe":  # intermediate_size: of dense layers, which it has none of
        return tf.Qwen3MoeConfig(**common, head_dim=HD, intermediate_size=128, moe_intermediate_size=F,
                                 num_experts=E, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=F, num_experts=E,
                                 shared_expert_intermediate_size=SHARED)  # norm_topk_prob False
    return tf.OlmoeConfig(**common, intermediate_size=F, num_experts=E)  # norm_topk_prob False


def is_router(name: str) -> bool:
    return name.endswith("gate.weight")  # mlp.gate / block_sparse_moe.gate


def save_random(arch: str, d, **kw):
    """A random model of `arch` (hf_config(arch, **kw)) saved to d with a tokenizer; returns it."""
    import transformers as tf

    cfg = hf_config(arch, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif is_router(name):
                p.copy_(0.5 * torch.randn_like(p))
            else:  # on the q8_0 grid, rows along the last axis as gguf-py blocks them
                w = (0.08 * torch.randn_like(p)).numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, Q8), Q8).reshape(w.shape)))
    model.save_pretrained(d, safe_serialization=True)
    models_tiny.train_tokenizer(d)
    return model


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    """(arch, HF directory, model) of a random model saved with save_pretrained."""
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, save_random(request.param, d)


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """{quant: .cflow path} of `cflow convert` of the HF directory, keep (f32) and q8_0."""
    arch, d, _ = tiny
    out = {}
    for quant in ("keep", "q8_0"):
        out[quant] = tmp_path_factory.mktemp("conv") / f"{arch}-{quant}.cflow"
        assert main(["convert", str(d), "-o", str(out[quant]), "--quant", quant, "--quiet"]) == 0
    return out


def ids(n=64):
    return [int(i) for i in np.random.default_rng(1).integers(3, models_tiny.VOCAB, n)]


def rel_err(got, ref) -> float:
    """The largest error of a position's logits relative to that position's largest logit."""
    return float((np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).max())


def test_config_and_expert_tensors(tiny):
    arch, d, _ = tiny
    ck = load_source(d)
    c = ck.config
    ours, _, renorm = ARCHS[arch]
    assert (c.arch, c.n_expert, c.top_k, c.d_expert, c.d_ff, c.expert_renorm) == (ours, E, K, F, 0, renorm)
    assert c.qk_norm == (arch in ("qwen3_moe", "olmoe")) and c.qkv_bias == (arch == "qwen2_moe")
    assert c.d_shared == (SHARED if arch == "qwen2_moe" else 0)
    if arch == "qwen2_moe":  # the shared expert fused as any gated FFN, its gate one row
        assert ck.tensors["blk.1.shexp.ffn_gate_up"].shape == (2 * SHARED, D)
        assert ck.tensors["blk.1.shexp.ffn_down"].shape == (D, SHARED) and ck.tensors["blk.1.shexp.gate"].shape == (D,)
    assert ck.tensors["blk.1.ffn_gate_inp"].shape == (E, D) and ck.tensors["blk.1.ffn_gate_inp"].type == "f32"
    gu = ck.tensors[f"blk.1.exp.{E - 1}.ffn_gate_up"]
    assert gu.parts == [(f"blk.1.exp.{E - 1}.ffn_gate", F), (f"blk.1.exp.{E - 1}.ffn_up", F)]
    assert ck.tensors[f"blk.1.exp.{E - 1}.ffn_down"].shape == (D, F)
    assert not any(n in ck.tensors for n in ("blk.1.ffn_gate_up", "blk.1.ffn_down", f"blk.1.exp.{E}.ffn_down"))
    if arch == "olmoe":  # norms over the whole of q and of k
        assert ck.tensors["blk.0.attn_q_norm"].shape == (HEADS * HD,)
        assert ck.tensors["blk.0.attn_k_norm"].shape == (KV_HEADS * HD,)


def test_mixtral_sliding_window_is_every_layers(tmp_path):
    model = save_random("mixtral", tmp_path / "hf", sliding_window=9)  # shorter than the prompt
    out = tmp_path / "m.cflow"
    assert main(["convert", str(tmp_path / "hf"), "-o", str(out), "--quiet"]) == 0
    seq = ids(40)
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0].float().numpy()
    eng = Engine(str(out), threads=2, fast=False)
    assert eng.config.layer_types == ["sliding"] * LAYERS and eng.config.sliding_window == 9
    assert rel_err(eng.forward(eng.new_state(), seq, all_logits=True), ref) <= 1e-3


def test_packed_hf_experts_read_as_one_matrix_each(tiny, tmp_path):
    """The model's own state dict (transformers 5's 3-D experts.gate_up_proj (E, 2F, d) and
    down_proj (E, d, F)) reads as the per-expert names save_pretrained writes."""
    import shutil

    from safetensors.torch import save_file

    arch, d, model = tiny
    packed = tmp_path / "packed"
    shutil.copytree(d, packed)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(packed / "model.safetensors"))
    a, b = load_source(d), load_source(packed)
    assert a.config == b.config and sorted(a.tensors) == sorted(b.tensors)
    for name, t in a.tensors.items():
        assert t.parts == b.tensors[name].parts and np.array_equal(t.dequantize(), b.dequantize(name)), name


def test_experts_are_in_the_expert_table(tiny, converted):
    with CflowFile(converted["q8_0"]) as f:
        assert sorted(f.experts) == [(l, e) for l in range(LAYERS) for e in range(E)]
        x = f.experts[(1, 3)]
        assert x.offset % 4096 == 0 and x.section == "experts"
        assert x.tensors == ("blk.1.exp.3.ffn_gate_up", "blk.1.exp.3.ffn_down")
        gu = f.tensor("blk.1.exp.3.ffn_gate_up")
        assert (gu.type.name, gu.pack, gu.fuse) == ("q8_0", "planes", "stripe")
        assert f.tensor("blk.1.ffn_gate_inp").type.name == "f32"  # the router stays as the source has it
        expert_bytes = gu.nbytes + f.tensor("blk.1.exp.3.ffn_down").nbytes
    eng = Engine(str(converted["q8_0"]), threads=2)
    eng.forward(eng.new_state(), [5])
    assert eng.byte_counts()["bytes"]["experts"] == LAYERS * K * expert_bytes  # only the chosen ones


# (quant, engine, fast, bound)
RUNS = [("keep", "native", False, 1e-3), ("keep", "ref", False, 1e-3), ("q8_0", "native", False, 1e-3),
        ("q8_0", "native", True, 5e-3)]


@pytest.mark.parametrize("quant,engine,fast,bound", RUNS, ids=["f32-native", "f32-ref", "q8_0-native", "q8_0-int8"])
def test_logits_match_transformers(tiny, converted, quant, engine, fast, bound):
    """Teacher-forced logits of every position, then a prefill of 40 and one decode step per token."""
    _, _, model = tiny
    seq = ids()
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0].float().numpy()
    path = str(converted[quant])
    eng = Engine(path, threads=2, fast=fast) if engine == "native" else RefEngine(path)
    assert rel_err(eng.forward(eng.new_state(), seq, all_logits=True), ref) <= bound
    st = eng.new_state()
    pre = eng.forward(st, seq[:40], all_logits=True)
    steps = np.stack([eng.forward(st, [t]) for t in seq[40:]])
    assert rel_err(np.concatenate([pre, steps]), ref) <= bound


# ---------------------------------------------------------------------------- GGUF


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's permutation of llama Q/K rows (its interleaved rope)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(arch: str, model) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, experts packed (E, rows, cols) per kind."""
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for l in range(LAYERS):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "mixtral":
            q, k = permute(q, HEADS), permute(k, KV_HEADS)
        out.update({b + "attn_norm.weight": sd[p + "input_layernorm.weight"], b + "attn_q.weight": q,
                    b + "attn_k.weight": k, b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
                    b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                    b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
                    b + "ffn_gate_inp.weight": sd[p + "mlp.gate.weight"]})
        if arch in ("qwen3_moe", "olmoe"):
            out.update({b + "attn_q_norm.weight": sd[p + "self_attn.q_norm.weight"],
                        b + "attn_k_norm.weight": sd[p + "self_attn.k_norm.weight"]})
        if arch == "qwen2_moe":  # QKV biases; the shared expert and its gate vector
            out.update({b + f"attn_{x}.bias": sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"})
            out.update({b + f"ffn_{x}_shexp.weight": sd[p + f"mlp.shared_expert.{x}_proj.weight"]
                        for x in ("gate", "up", "down")})
            out[b + "ffn_gate_inp_shexp.weight"] = sd[p + "mlp.shared_expert_gate.weight"].reshape(-1)
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # (E, 2F, d): [gate; up] per expert
        out.update({b + "ffn_gate_exps.weight": gate_up[:, :F], b + "ffn_up_exps.weight": gate_up[:, F:],
                    b + "ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"]})
    return out


def write_gguf(path, arch: str, d, model, qtype=None, *, meta=None, edit=None, f32=()) -> None:
    """A GGUF as llama.cpp writes this model: matrices in qtype (None: f32), norms and routers f32.
    meta: metadata overrides {key (without the arch prefix): value}; edit(tensors) alters the tensors;
    f32: kinds of tensor (ffn_up_exps, ...) kept f32 all the same."""
    name = ARCHS[arch][1]
    w = gguf.GGUFWriter(str(path), name)
    ints = {"block_count": LAYERS, "context_length": 512, "embedding_length": D, "feed_forward_length": F,
            "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "attention.key_length": HD,
            "attention.value_length": HD, "expert_count": E, "expert_used_count": K}
    if arch in ("qwen3_moe", "qwen2_moe"):
        ints.update(feed_forward_length=128, expert_feed_forward_length=F)
    if arch == "qwen2_moe":
        ints.update(expert_shared_feed_forward_length=SHARED)
    ints.update(meta or {})
    for k, v in ints.items():
        w.add_uint32(f"{name}.{k}", v)
    w.add_float32(f"{name}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{name}.rope.freq_base", float(model.config.rope_parameters["rope_theta"]))
    bpe = json.loads((d / "tokenizer.json").read_text())["model"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(bpe["vocab"], key=bpe["vocab"].get))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    tensors = gguf_tensors(arch, model)
    if edit:
        edit(tensors)
    for tname, a in tensors.items():
        a = np.ascontiguousarray(a)
        if qtype is None or a.ndim == 1 or "ffn_gate_inp" in tname or tname.split(".")[-2] in f32:
            w.add_tensor(tname, a)
        else:
            w.add_tensor(tname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [None, Q8], ids=["f32", "q8_0"])
def test_gguf_of_the_same_model_gives_the_same_logits(tiny, converted, tmp_path, qtype):
    import dataclasses

    arch, d, model = tiny
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, d, model, qtype)
    a, b = load_source(d), load_source(path)
    assert dataclasses.replace(b.config, norm_eps=a.config.norm_eps, max_seq_len=a.config.max_seq_len) == a.config
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, t in a.tensors.items():  # the weights are on the q8_0 grid: equal in either type
        assert t.parts == b.tensors[name].parts and np.array_equal(t.dequantize(), b.dequantize(name)), name
    out = tmp_path / "m.cflow"
    assert main(["convert", str(path), "-o", str(out), "--quiet"]) == 0  # --quant keep
    seq = ids(48)
    e = Engine(str(converted["keep"]), threads=2, fast=False)
    want = e.forward(e.new_state(), seq, all_logits=True)
    for eng in (Engine(str(out), threads=2, fast=False), RefEngine(str(path))):  # the GGUF itself, unconverted
        assert rel_err(eng.forward(eng.new_state(), seq, all_logits=True), want) <= 1e-4
    if qtype is None:
        return
    r = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    with CflowFile(out) as f:  # keep: each expert's blocks are the GGUF's, byte for byte
        for l, e in ((0, 0), (1, E - 1)):
            x, b_ = f"blk.{l}.exp.{e}.", f"blk.{l}."
            gu = f.tensor(x + "ffn_gate_up")
            assert gu.type.name == "q8_0"
            gate, up = unfuse_rows(f.row_blocks(x + "ffn_gate_up"), [F, F], gu.fuse, gu.stripe_rows)
            assert np.array_equal(gate, r[b_ + "ffn_gate_exps.weight"][e])
            assert np.array_equal(up, r[b_ + "ffn_up_exps.weight"][e])
            assert np.array_equal(f.row_blocks(x + "ffn_down"), r[b_ + "ffn_down_exps.weight"][e])


def test_gguf_experts_one_matrix_each_read_as_packed(tiny, tmp_path):
    """llama.cpp's Mixtral files before it packed the experts: blk.{l}.ffn_gate.{e}.weight, ..."""
    arch, d, model = tiny

    def unpack(t):
        for l in range(LAYERS):
            for kind in ("gate", "up", "down"):
                packed = t.pop(f"blk.{l}.ffn_{kind}_exps.weight")
                t.update({f"blk.{l}.ffn_{kind}.{e}.weight": packed[e] for e in range(E)})

    write_gguf(tmp_path / "packed.gguf", arch, d, model, Q8)
    write_gguf(tmp_path / "apart.gguf", arch, d, model, Q8, edit=unpack)
    a, b = load_source(tmp_path / "packed.gguf"), load_source(tmp_path / "apart.gguf")
    assert a.config == b.config and sorted(a.tensors) == sorted(b.tensors)
    for name, t in a.tensors.items():
        assert t.parts == b.tensors[name].parts and np.array_equal(t.data, b.tensors[name].data), name


def test_experts_whose_gate_and_up_differ_in_type_run_once_requantized(tiny, converted, tmp_path):
    """An f32 ffn_up_exps beside q8_0 gate and down: `keep` stores the expert's gate and up apart,
    which the engines refuse in one line; --quant q8_0 fuses them again."""
    from cflow.errors import UnsupportedError

    arch, d, model = tiny
    path = tmp_path / "mixed.gguf"
    write_gguf(path, arch, d, model, Q8, f32=("ffn_up_exps",))
    assert "blk.0.exp.0.ffn_gate" in load_source(path).tensors
    with pytest.raises(UnsupportedError, match=r"blk\.0\.exp\.0\.ffn_gate and .*ffn_up are stored apart.*--quant q8_0"):
        Engine(str(path), threads=2)
    out = tmp_path / "mixed.cflow"
    assert main(["convert", str(path), "-o", str(out), "--quant", "q8_0", "--quiet"]) == 0
    seq = ids(32)
    got, want = (Engine(str(p), threads=2, fast=False) for p in (out, converted["q8_0"]))
    assert rel_err(got.forward(got.new_state(), seq, all_logits=True),
                   want.forward(want.new_state(), seq, all_logits=True)) <= 1e-4


# ---------------------------------------------------------------------------- bad input


def expect_error(capsys, match: str, src, out) -> None:
    """`cflow convert SRC` fails with exit status 2 and one line naming the problem; no file is left."""
    capsys.readouterr()
    rc = main(["convert", str(src), "-o", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("cflow convert: error: "), (rc, err)
    assert re.search(match, err), (match, err)
    assert not out.exists()


def fewer_experts(t):
    t["blk.1.ffn_up_exps.weight"] = t["blk.1.ffn_up_exps.weight"][:E - 1]


def wider_down(t):
    t["blk.0.ffn_down_exps.weight"] = np.concatenate([t["blk.0.ffn_down_exps.weight"]] * 2, axis=-1)


def flat_gate(t):
    t["blk.0.ffn_gate_exps.weight"] = t["blk.0.ffn_gate_exps.weight"].reshape(E * F, D)


def no_router(t):
    del t["blk.1.ffn_gate_inp.weight"]


GGUF_CASES = {  # (metadata overrides, tensor edit, the error)
    "packed tensor of one expert too few":
        (None, fewer_experts, r"blk\.1\.ffn_up_exps\.weight holds 7 experts, the config says n_expert=8"),
    "expert of the wrong width":
        (None, wider_down, r"'blk\.0\.exp\.0\.ffn_down' has shape \(64, 192\), expected \(64, 96\)"),
    "packed tensor of two dimensions":
        (None, flat_gate, r"packed expert tensor blk\.0\.ffn_gate_exps\.weight has shape"),
    "no router": (None, no_router, r"no tensor 'blk\.1\.ffn_gate_inp'"),
    "top_k above the experts":
        ({"expert_used_count": E + 1}, None, r"expert_used_count=9 must be an integer in 1\.\.8"),
    "expert_count above the tensors": ({"expert_count": E + 1}, None, r"holds 8 experts, the config says n_expert=9"),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_bad_gguf_experts_are_one_line_of_error(tiny, tmp_path, capsys, case):
    arch, d, model = tiny
    meta, edit, match = GGUF_CASES[case]
    path = tmp_path / "bad.gguf"
    write_gguf(path, arch, d, model, Q8, meta=meta, edit=edit)
    expect_error(capsys, match, path, tmp_path / "out.cflow")


HF_CASES = {  # arch -> [(config.json changes, the error)]
    "mixtral": [({"num_experts_per_tok": E + 1}, r"num_experts_per_tok=9 must be an integer in 1\.\.8")],
    "qwen3_moe": [({"mlp_only_layers": [1]}, r"Qwen3-MoE with dense layers"),
                  ({"decoder_sparse_step": 2}, r"Qwen3-MoE with dense layers"),
                  ({"norm_topk_prob": "yes"}, r"norm_topk_prob='yes' must be true or false")],
    "olmoe": [({"clip_qkv": 8.0}, r"clip_qkv .* not supported"), ({"num_experts": 0}, r"num_experts=0 must be")],
    "qwen2_moe": [({"mlp_only_layers": [0]}, r"Qwen2-MoE with dense layers"),
                  ({"shared_expert_intermediate_size": None}, r"lacks 'shared_expert_intermediate_size'")],
}


def test_refused_hf_configs_are_one_line_of_error(tiny, tmp_path, capsys):
    import shutil

    arch, d, _ = tiny
    for i, (change, match) in enumerate(HF_CASES[arch]):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(d, bad)
        c = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(dict(c, **change)))
        expect_error(capsys, match, bad, tmp_path / "out.cflow")
