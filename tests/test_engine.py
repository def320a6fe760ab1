"""Native engine against Hugging Face transformers on tiny random-weight models.

Each model is laid out in the tile format with the weights HF then computes with (see
engine_util), so differences come from the engine alone.
"""

import numpy as np
import pytest

from cflow.engine import Engine
from cflow.errors import CflowError, CflowFormatError
from engine_util import hf_logits, tiny_hf, to_cflow

pytest.importorskip("transformers")


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


IDS = [int(i) for i in np.random.default_rng(1).integers(0, 256, size=40)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_fp32_parity_with_hf(arch):
    model = tiny_hf(arch)
    f = to_cflow(model, wtype="f32")
    ref = hf_logits(model, IDS)
    eng = Engine(f, threads=2, fast=False)
    st = eng.new_state()
    # prefill half as one batch, then decode token by token
    got = [eng.forward(st, IDS[:20], all_logits=True)]
    got += [eng.forward(st, [t])[None] for t in IDS[20:]]
    got = np.concatenate(got)
    assert st.pos == len(IDS)
    for i in range(len(IDS)):
        assert rel_err(got[i], ref[i]) < 1e-4, (arch, i, rel_err(got[i], ref[i]))


@pytest.mark.parametrize("wtype,interleave,pack", [("q4_1", 1, "blocks"), ("q4_0", 4, "blocks"), ("q8_0", 2, "blocks"),
                                                   ("q5_0", 8, "blocks"), ("q5_1", 4, "blocks"), ("q4_1", 4, "planes"),
                                                   ("q4_0", 8, "planes"), ("q5_1", 8, "planes")])
def test_quantized_paths(wtype, interleave, pack):
    # ragged tiles: 96 columns with tc 64, 40-row stripes of 4-row groups (d=96, ffn=160); planes:
    # the matrices and the q8_0 embedding in the planes pack (prefill GEMMs unpack it, decode
    # GEMVs read it, the embedding rows are gathered from it)
    model = tiny_hf("llama", d=96, n_head=6, n_kv=2, hd=16, ffn=160)
    f = to_cflow(model, wtype=wtype, embtype="q8_0", tile=(40, 64), interleave=interleave, stripe_rows=interleave * 5,
                 pack=pack)
    assert (f.tensors["blk.0.attn_qkv"].pack == pack) and (f.tensors["tok_embd"].pack == pack)
    ref = hf_logits(model, IDS)
    exact = Engine(f, threads=2, fast=False)
    got = exact.forward(exact.new_state(), IDS, all_logits=True)
    assert max(rel_err(got[i], ref[i]) for i in range(len(IDS))) < 1e-4
    fast = Engine(f, threads=2, fast=True)
    st = fast.new_state()
    got = np.concatenate([fast.forward(st, IDS[:25], all_logits=True)] + [fast.forward(st, [t])[None] for t in IDS[25:]])
    errs = [rel_err(got[i], ref[i]) for i in range(len(IDS))]
    assert max(errs) < 0.05, errs
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.9


@pytest.mark.parametrize("wtype,pack", [("q5_k", "planes"), ("q5_k", "blocks"), ("q4_k", "planes")])
def test_k_quant_paths(wtype, pack):
    # the K-quants' super-blocks of 256: every matrix 256 columns wide (the down projection's
    # hidden layer too); prompt rows take the batched decode kernel (planes) or the fp32 GEMM
    # (blocks), decode rows the GEMV
    model = tiny_hf("llama", d=256, n_head=4, n_kv=2, hd=64, ffn=256)
    f = to_cflow(model, wtype=wtype, embtype="q8_0", tile=(128, 256), interleave=16 if pack == "planes" else 1,
                 stripe_rows=64, pack=pack)
    assert f.tensors["blk.0.ffn_down"].type.name == wtype and f.tensors["blk.0.attn_qkv"].pack == pack
    ref = hf_logits(model, IDS)
    for fast, bound in ((False, 1e-4), (True, 0.05)):
        eng = Engine(f, threads=2, fast=fast)
        st = eng.new_state()
        got = np.concatenate([eng.forward(st, IDS[:25], all_logits=True)] + [eng.forward(st, [t])[None] for t in IDS[25:]])
        errs = [rel_err(got[i], ref[i]) for i in range(len(IDS))]
        assert max(errs) < bound, (fast, errs)
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.9


SPLIT = {"attn_q": "q4_0", "attn_k": "q8_0", "attn_v": "q4_1", "ffn_gate": "q5_0", "ffn_up": "q8_0"}


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_qkv_and_gate_up_stored_apart(arch):
    # as the converter stores them when their block types differ (Gemma 3 Q4_K_M): three matvecs
    # into one (q | k | v) buffer, two into (gate | up) and act(gate) * up
    model = tiny_hf(arch)
    f = to_cflow(model, wtype="q8_0", split=SPLIT, tile=(32, 64), interleave=4)
    assert "blk.0.attn_k" in f.tensors and "blk.0.attn_qkv" not in f.tensors and "blk.1.ffn_up" in f.tensors
    ref = hf_logits(model, IDS)
    for fast, bound in ((False, 1e-4), (True, 0.05)):
        eng = Engine(f, threads=2, fast=fast)
        st = eng.new_state()
        got = np.concatenate([eng.forward(st, IDS[:20], all_logits=True)] + [eng.forward(st, [t])[None] for t in IDS[20:]])
        errs = [rel_err(got[i], ref[i]) for i in range(len(IDS))]
        assert max(errs) < bound, (fast, errs)
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.9


def test_threads_and_batching_agree():
    model = tiny_hf("qwen3")
    f = to_cflow(model, wtype="q4_1", embtype="q8_0", tile=(32, 64), interleave=4, stripe_rows=16)
    outs = []
    for threads in (1, 3):
        eng = Engine(f, threads=threads, fast=True)
        st = eng.new_state()
        outs.append(eng.forward(st, IDS, all_logits=True))
        # decode after prefill equals the batch's logits for the same positions
        st.truncate(30)
        step = np.stack([eng.forward(st, [t]) for t in IDS[30:]])
        np.testing.assert_allclose(step, outs[-1][30:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_context_full_and_bad_input():
    model = tiny_hf("llama")
    f = to_cflow(model)
    eng = Engine(f, threads=2, n_ctx=16)
    st = eng.new_state()
    eng.forward(st, IDS[:10])
    with pytest.raises(CflowError, match="context full"):
        eng.forward(st, IDS[:7])
    assert st.pos == 10  # nothing lost: the cache still holds the first 10 tokens
    eng.forward(st, IDS[10:16])
    with pytest.raises(CflowError, match="context full"):
        eng.forward(st, [1])
    with pytest.raises(CflowError, match="token ids"):
        eng.forward(eng.new_state(), [256])
    st.reset()
    assert st.pos == 0


def test_activation_settings():
    # the default is two-level int8 everywhere; a subset of roles, one level and fp32 are named so
    # (bench decode and generate report the name); an unknown role is refused
    f = to_cflow(tiny_hf("llama"), wtype="q4_1")
    named = {Engine(f, **kw).activations for kw in ({}, dict(precise=False), dict(fast=False))}
    assert named == {"int8x2", "int8", "fp32"}
    some = Engine(f, precise=("qkv", "down"))
    assert some.activations == "int8x2:qkv+down" and some.precise
    full = Engine(f).forward(Engine(f).new_state(), IDS[:8])
    part = some.forward(some.new_state(), IDS[:8])
    one = Engine(f, precise=False).forward(Engine(f, precise=False).new_state(), IDS[:8])
    assert not np.array_equal(full, part) and not np.array_equal(part, one)  # the flags reach the ops
    with pytest.raises(CflowError, match="unknown roles.*qkv, attn_output"):
        Engine(f, precise=("qkv", "lm_head"))


def test_offsets_are_checked():
    model = tiny_hf("llama")
    f = to_cflow(model)
    t = f.tensors["blk.1.ffn_down"]
    t.offset = f.buffer.size - t.nbytes + 64  # runs past the end of the mapping
    with pytest.raises(CflowFormatError, match="outside the mapped file"):
        Engine(f)
    t.offset = 0
    t.nbytes -= 4
    with pytest.raises(CflowFormatError, match="bytes"):
        Engine(f)


@pytest.mark.parametrize("wtype", ["q4_0", "q8_0", "q4_k"])
def test_decode_split_on_groups_is_thread_count_free(wtype):
    # The planes pack's decode GEMVs split rows between threads on 16-row group boundaries, not
    # whole stripes: d=96 is one 64-row stripe and a ragged one of 32 rows (2 stripes, 6 groups),
    # so 3 and 5 threads cut stripes (and a ragged group) in the middle. Each row's dot product
    # does not depend on who computes it: the logits are bit-identical to one thread's, batched
    # or alone, and match transformers as one thread's do.
    k = wtype == "q4_k"  # 256-column super-blocks: every matrix 256 wide
    model = tiny_hf("llama", d=256 if k else 96, n_head=4, n_kv=2, hd=64 if k else 16, ffn=256 if k else 160)
    f = to_cflow(model, wtype=wtype, embtype="q8_0", tile=(64, 256 if k else 64), interleave=16,
                 stripe_rows=64, pack="planes")
    assert f.tensors["blk.0.attn_output"].pack == "planes"
    runs = {}
    for threads in (1, 2, 3, 5):
        eng = Engine(f, threads=threads)
        st, st2 = eng.new_state(), eng.new_state()
        eng.forward(st, IDS[:10])
        eng.forward(st2, IDS[10:18])
        alone = np.stack([eng.forward(st, [t]) for t in IDS[18:26]])
        both = eng.forward([st, st2], [[IDS[30]], [IDS[31]]])  # a batched step of two sequences
        runs[threads] = (alone, np.stack(both))
    for threads in (2, 3, 5):
        assert np.array_equal(runs[threads][0], runs[1][0]), threads
        assert np.array_equal(runs[threads][1], runs[1][1]), threads
    ref = hf_logits(model, IDS[:26])
    assert np.mean(runs[1][0].argmax(1) == ref[18:26].argmax(1)) >= 0.75


def test_rows_handed_out_while_decoding_are_thread_count_free():
    # Matrices of 2 MB or more hand their last rows out to whichever thread is free first (the
    # executor's UnitShare): here the head (8192 x 256 q8_0, 2.2 MB) and gate+up (8192 x 256).
    # Each row's dot product does not depend on who computes it, so the logits stay bit-identical
    # to one thread's, alone and in batched steps, however the rows fall.
    model = tiny_hf("llama", d=256, n_head=4, n_kv=2, hd=64, ffn=4096, vocab=8192)
    f = to_cflow(model, wtype="q8_0", embtype="q8_0", tile=(128, 256), interleave=16, stripe_rows=64, pack="planes")
    assert f.tensors["output"].nbytes >= 2 << 20 and f.tensors["blk.0.ffn_gate_up"].nbytes >= 2 << 20
    runs = {}
    for threads in (1, 2, 3):
        eng = Engine(f, threads=threads)
        st, st2 = eng.new_state(), eng.new_state()
        eng.forward(st, IDS[:10])
        eng.forward(st2, IDS[10:18])
        alone = np.stack([eng.forward(st, [t]) for t in IDS[18:30]])
        both = np.stack(eng.forward([st, st2], [[IDS[30]], [IDS[31]]]))
        runs[threads] = (alone, both)
    for threads in (2, 3):
        assert np.array_equal(runs[threads][0], runs[1][0]), threads
        assert np.array_equal(runs[threads][1], runs[1][1]), threads


def test_attention_handed_out_is_thread_count_free():
    # From 256 KB of keys and values an attention op hands its spans (one or two sequences) or
    # its (row, KV head) pairs (decode steps of more) out in runs, to whichever thread is free
    # first (the executor's UnitShare); prompts deal pairs round the threads. Here one row reads
    # 2 KV heads x ~700 positions x 64 x 2 halves x 2 bytes, about 360 KB. Spans and pairs are
    # merged in a fixed order, so the logits are bit-identical to one thread's, alone and batched,
    # however the work falls.
    model = tiny_hf("llama", d=128, n_head=4, n_kv=2, hd=64, ffn=128)
    f = to_cflow(model, wtype="q8_0", embtype="q8_0")
    rng = np.random.default_rng(3)
    prompts = [[int(i) for i in rng.integers(0, 256, size=690 + 7 * k)] for k in range(8)]
    runs = {}
    for threads in (1, 2, 3):
        eng = Engine(f, threads=threads, n_ctx=1024)
        states = [eng.new_state() for _ in prompts]
        eng.forward(states, prompts)
        one = np.stack([eng.forward(states[0], [t]) for t in IDS[:3]])  # the spans of one sequence
        two = np.stack(eng.forward(states[:2], [[IDS[3]], [IDS[4]]]))  # ... of two
        eight = np.stack(eng.forward(states, [[t] for t in IDS[5:13]]))  # pairs of a decode step
        runs[threads] = (one, two, eight)
    for threads in (2, 3):
        for got, want in zip(runs[threads], runs[1]):
            assert np.array_equal(got, want), threads


def test_a_long_prompt_does_not_size_scratch_by_the_vocabulary():
    # A prompt's rows need their inputs normalised and quantized, and only the last row's logits
    # (unless all are asked for): the scratch of a 512-token step is sized by the widest input,
    # not the vocabulary. With a 65536-token head of width 64, sizing by the vocabulary took
    # 512 x 65536 floats of logits and as many of normalised input, about 300 MB.
    psutil = pytest.importorskip("psutil")
    model = tiny_hf("llama", d=64, n_head=4, n_kv=2, hd=16, ffn=128, vocab=65536)
    f = to_cflow(model, wtype="q8_0", embtype="q8_0")
    eng = Engine(f, threads=2, n_ctx=1024)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 65536, size=512)]
    eng.forward(eng.new_state(), ids[:4])
    proc = psutil.Process()
    before = proc.memory_info().rss
    last = eng.forward(eng.new_state(), ids)
    grew = proc.memory_info().rss - before
    assert grew < 64 << 20, f"a 512-token prompt grew the process by {grew >> 20} MB"
    st = eng.new_state()
    every = eng.forward(st, ids[:32], all_logits=True)  # every row's logits still come out whole
    assert every.shape == (32, 65536) and np.isfinite(every).all()
    # the last row alone takes the decode GEMV, all rows the GEMM: the same to rounding
    np.testing.assert_allclose(eng.forward(eng.new_state(), ids[:32]), every[-1], rtol=0, atol=1e-4)
    assert last.shape == (65536,)


@pytest.mark.parametrize("fast", [False, True])
def test_non_finite_logits_are_an_error_and_undo_the_step(fast):
    # a finite but huge head row: its logit overflows, in every step and every path (one state,
    # several, every row's logits, a prompt longer than one native call)
    import torch

    model = tiny_hf("llama")
    with torch.no_grad():
        model.lm_head.weight[7] = 3e38
    eng = Engine(to_cflow(model, wtype="f32"), threads=2, fast=fast, n_ctx=1024)
    a, b = eng.new_state(), eng.new_state()
    long = [int(i) for i in np.arange(600) % 200 + 8]  # past MAX_BATCH rows: prefilled in pieces
    for call in (lambda: eng.forward(a, [1, 2, 3]), lambda: eng.forward([a, b], [[1, 2], [3]]),
                 lambda: eng.forward(a, [4, 5], all_logits=True), lambda: eng.forward([a, b], [long, [3]])):
        with pytest.raises(CflowError, match="non-finite logits"):
            call()
        assert a.pos == b.pos == 0
    # the same model with an ordinary head row: the check passes what is finite
    with torch.no_grad():
        model.lm_head.weight[7] = 0.5
    ok = Engine(to_cflow(model, wtype="f32"), threads=2, fast=fast, n_ctx=1024)
    a, b = ok.new_state(), ok.new_state()
    outs = ok.forward([a, b], [[1, 2, 3], long])
    assert all(np.isfinite(o).all() for o in outs) and (a.pos, b.pos) == (3, 600)
