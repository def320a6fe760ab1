"""Sequence states apart from the engine: several states in one step, several threads on one
Engine, the token history a state keeps; and the typed plan's checks (cflow.plan)."""

import threading

import numpy as np
import pytest

from cflow import plan as P
from cflow.engine import ACTIVATIONS, Engine
from cflow.engine_ref import RefEngine
from cflow.errors import CflowError, CflowFormatError
from cflow.kernels import best_isa
from engine_util import tiny_hf, to_cflow

pytest.importorskip("transformers")

IDS = [int(i) for i in np.random.default_rng(2).integers(0, 256, size=48)]


@pytest.fixture(scope="module")
def qwen3_q4():
    return to_cflow(tiny_hf("qwen3"), wtype="q4_1", embtype="q8_0", tile=(32, 64), interleave=4, stripe_rows=16)


@pytest.mark.parametrize("engine", [Engine, RefEngine])
def test_states_advanced_together_match_one_by_one(qwen3_q4, engine):
    # three sequences at different positions, one prefilling and two decoding, in one step
    eng = engine(qwen3_q4, threads=2, fast=False)
    alone, together = [eng.new_state() for _ in range(3)], [eng.new_state() for _ in range(3)]
    for a, b, n in zip(alone, together, (0, 5, 17)):
        if n:
            eng.forward(a, IDS[:n])
            eng.forward(b, IDS[:n])
    new = [IDS[20:29], [IDS[40]], [IDS[41]]]
    want = [eng.forward(s, t, all_logits=True) for s, t in zip(alone, new)]
    got = eng.forward(together, new, all_logits=True)
    last = eng.forward([eng.new_state(), eng.new_state()], [IDS[:3], IDS[3:4]])  # last token of each
    assert [g.shape for g in got] == [(9, 256), (1, 256), (1, 256)] and [x.shape for x in last] == [(256,), (256,)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last[1], eng.forward(eng.new_state(), IDS[3:4]), rtol=1e-5, atol=1e-5)
    assert [s.tokens for s in together] == [IDS[20:29], IDS[:5] + [IDS[40]], IDS[:17] + [IDS[41]]]
    assert [s.pos for s in together] == [9, 6, 18]


@pytest.mark.parametrize("layout,acts", [
    (dict(wtype="q4_1", interleave=16, stripe_rows=16, pack="planes"), "int8x2"),
    (dict(wtype="q4_0", interleave=8, stripe_rows=16, pack="planes"), "int8x2"),  # ragged groups
    (dict(wtype="q8_0", interleave=16, stripe_rows=16, pack="planes"), "int8"),
    (dict(wtype="q5_0", interleave=16, stripe_rows=16, pack="planes"), "int8x2"),
    ({"wtype": "q5_1", "interleave": 16, "stripe_rows": 16, "pack": "planes"}, "int8x2"),
    (dict(wtype="q4_k", interleave=16, stripe_rows=16, pack="planes"), "int8x2"),
    ({"wtype": "q5_k", "interleave": 16, "stripe_rows": 16, "pack": "planes"}, "int8"),
    (dict(wtype="q6_k", interleave=16, stripe_rows=16, pack="planes"), "int8"),
    (dict(wtype="q8_0", interleave=4, stripe_rows=16), "int8x2"), (dict(wtype="f32"), "int8x2"),
    (dict(wtype="q4_1", interleave=4, stripe_rows=16), "int8x2"),  # whole blocks: m x s summed by the GEMM
    (dict(wtype="q5_0", interleave=4, stripe_rows=16), "int8")])
def test_each_row_gets_exactly_what_its_sequence_gets_alone(layout, acts):
    # bit for bit: decode rows of 11 sequences in one step (more than one batched kernel's tile
    # of tokens), a prompt split into chunks, and a chunk sharing its step with decoding sequences
    k = layout.get("wtype") in ("q4_k", "q5_k", "q6_k")  # the K-quants: columns in super-blocks of 256
    f = to_cflow(tiny_hf("llama", **(dict(d=256, hd=64, ffn=256) if k else {})), embtype="q8_0",
                 tile=(32, 256 if k else 64), **layout)
    eng = Engine(f, threads=2, **ACTIVATIONS[acts])
    prompts = [IDS[i:i + 3 + 3 * i] for i in range(11)]
    batch = [eng.new_state() for _ in prompts]
    for st, p in zip(batch, prompts):
        eng.forward(st, p)
    alone = []
    for p in prompts:
        st = eng.new_state()
        eng.forward(st, p)
        alone.append(eng.forward(st, [7]))
    assert all(np.array_equal(a, b) for a, b in zip(alone, eng.forward(batch, [[7]] * len(prompts))))
    whole = eng.forward(eng.new_state(), IDS[:45])
    chunked = eng.new_state()
    eng.forward(chunked, IDS[:20])
    eng.forward(chunked, IDS[20:31])
    assert np.array_equal(eng.forward(chunked, IDS[31:45]), whole)
    mixed, d = eng.new_state(), eng.new_state()
    eng.forward(mixed, IDS[:20])
    eng.forward(d, IDS[:3])
    out = eng.forward([d, mixed], [[9], IDS[20:31]])
    assert np.array_equal(eng.forward(mixed, IDS[31:45]), whole) and np.array_equal(out[0], alone_after(eng, IDS[:3], 9))
    # a cached prefix and the prompt's last token as a piece of one row: the whole prompt's numbers
    # wherever the engine says a prompt row computes what a decode row does (the server then
    # computes only that token again); every planes pack says so with AVX-512's int8 paths
    planes = layout.get("pack") == "planes"
    assert eng.prompt_rows_as_decode == (planes and acts != "fp32" and best_isa() == "avx512") or not planes
    if eng.prompt_rows_as_decode:
        one = eng.new_state()
        eng.forward(one, IDS[:44])
        assert np.array_equal(eng.forward(one, IDS[44:45]), whole)


@pytest.mark.parametrize("acts", ["int8x2", "fp32"])
def test_long_contexts_give_each_row_its_own_numbers_in_any_step(acts):
    # attention runs over spans of 128 keys, merged in order: a step of a few rows spreads their
    # spans over the threads, a step of many rows gives each thread whole rows. Either way a
    # token at position 300 (three spans) gets the same numbers, bit for bit: as a decode row
    # alone or among five others, as the last row of a 301-token prompt or of a 2-token piece.
    f = to_cflow(tiny_hf("qwen3"), wtype="q4_1", embtype="q8_0", tile=(32, 64), interleave=16, stripe_rows=16,
                 pack="planes")  # what `cflow convert` writes
    eng = Engine(f, threads=2, n_ctx=512, **ACTIVATIONS[acts])
    ids = [int(i) for i in np.random.default_rng(5).integers(0, 256, size=301)]
    whole = eng.forward(eng.new_state(), ids)
    piece = eng.new_state()
    eng.forward(piece, ids[:-2])
    assert np.array_equal(eng.forward(piece, ids[-2:]), whole)
    one = eng.new_state()
    eng.forward(one, ids[:-1])
    alone = eng.forward(one, ids[-1:])
    many = [eng.new_state() for _ in range(6)]
    eng.forward(many, [ids[:-1]] + [ids[:40 + i] for i in range(5)])
    assert np.array_equal(eng.forward(many, [ids[-1:]] + [[3]] * 5)[0], alone)
    ref_eng = RefEngine(f, n_ctx=512)
    ref = ref_eng.forward(ref_eng.new_state(), ids)
    for got in (whole, alone):
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (1e-5 if acts == "fp32" else 2e-2)


@pytest.mark.parametrize("acts", ["int8x2", "fp32"])
def test_prompt_rows_meet_shared_keys_in_blocks_with_their_own_numbers(acts):
    # a step with prompt rows runs attention in blocks of rows, span by span, and consecutive rows
    # of one sequence that read the same keys meet them together (a step of a few rows: a row a
    # block). However a prompt's rows fall into blocks (pieces of other sizes), and whatever rows
    # of another sequence at other positions share a block with them (two prompts of 101 rows in
    # one step after 200 tokens each: their full spans have the same keys' positions but not the
    # same keys), every row gets the numbers it gets in one whole prompt, bit for bit, and those
    # are the reference's.
    f = to_cflow(tiny_hf("qwen3"), wtype="q4_1", embtype="q8_0", tile=(32, 64), interleave=16, stripe_rows=16,
                 pack="planes")
    eng = Engine(f, threads=2, n_ctx=512, **ACTIVATIONS[acts])
    rng = np.random.default_rng(9)
    ids, other = ([int(i) for i in rng.integers(0, 256, size=301)] for _ in range(2))
    whole = [eng.forward(eng.new_state(), x, all_logits=True) for x in (ids, other)]
    pieces = eng.new_state()
    cuts = [0, 5, 155, 159, 169, 301]  # blocks fall elsewhere in each piece; the 4 rows from 155 go alone
    got = np.concatenate([eng.forward(pieces, ids[a:b], all_logits=True) for a, b in zip(cuts, cuts[1:])])
    assert np.array_equal(got, whole[0])
    two = [eng.new_state(), eng.new_state()]
    eng.forward(two, [ids[:200], other[:200]])
    got = eng.forward(two, [ids[200:], other[200:]], all_logits=True)
    for g, w in zip(got, whole):
        assert np.array_equal(g, w[200:])
    ref_eng = RefEngine(f, n_ctx=512)
    ref = ref_eng.forward(ref_eng.new_state(), ids, all_logits=True)
    assert np.linalg.norm(whole[0] - ref) / np.linalg.norm(ref) < (1e-5 if acts == "fp32" else 2e-2)


def alone_after(eng, prompt, token):
    st = eng.new_state()
    eng.forward(st, prompt)
    return eng.forward(st, [token])


def test_two_threads_on_one_engine_give_the_sequential_tokens(qwen3_q4):
    eng = Engine(qwen3_q4, threads=2)  # the default path: two-level int8

    def greedy(prompt, n=24):
        st, out = eng.new_state(), []
        logits = eng.forward(st, prompt)
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = eng.forward(st, [out[-1]])
        assert st.tokens == list(prompt) + out
        return out

    prompts = [IDS[:11], IDS[11:30]]
    sequential = [greedy(p) for p in prompts]
    results, errors = [None, None], []
    start = threading.Barrier(2)

    def worker(i):
        try:
            start.wait()
            for _ in range(3):  # long enough for the two to overlap many times
                results[i] = greedy(prompts[i])
                assert results[i] == sequential[i]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == sequential


@pytest.mark.parametrize("make", [Engine, RefEngine])
def test_a_copied_prefix_continues_exactly_as_computed(qwen3_q4, make):
    # a sequence that takes another's first tokens and KV cache (a shared system prompt) then
    # goes on as if it had computed them itself (the native engine bit for bit; numpy's matrix
    # products round differently for different row counts); the source keeps its own history
    eng = make(qwen3_q4, threads=2, n_ctx=64) if make is Engine else make(qwen3_q4, n_ctx=64)
    src, fresh = eng.new_state(), eng.new_state()
    eng.forward(src, IDS[:30])
    want = eng.forward(fresh, IDS[:12] + [5, 6, 7])
    dst = eng.new_state()
    eng.forward(dst, IDS[40:47])  # a history of its own, replaced
    dst.copy_prefix(src, 12)
    assert dst.tokens == IDS[:12] and src.tokens == IDS[:30]
    got = eng.forward(dst, [5, 6, 7])
    assert np.array_equal(got, want) if make is Engine else np.allclose(got, want, rtol=0, atol=1e-5)
    with pytest.raises(CflowError, match="copy_prefix"):
        dst.copy_prefix(src, 31)
    assert dst.tokens == IDS[:12] + [5, 6, 7]


def test_state_history_truncate_and_misuse(qwen3_q4):
    eng = Engine(qwen3_q4, threads=2, n_ctx=32)
    st = eng.new_state()
    eng.forward(st, IDS[:10])
    st.truncate(4)
    assert st.tokens == IDS[:4] and st.pos == 4
    with pytest.raises(CflowError, match="truncate"):
        st.truncate(5)
    with pytest.raises(CflowError, match="twice"):
        eng.forward([st, st], [[1], [2]])
    with pytest.raises(CflowError, match="2 states but 1 token lists"):
        eng.forward([st, eng.new_state()], [[1]])
    other = Engine(to_cflow(tiny_hf("llama")), threads=1)
    with pytest.raises(CflowError, match="another model"):
        eng.forward(other.new_state(), [1])
    assert st.tokens == IDS[:4]  # nothing lost by the refused calls


@pytest.fixture(scope="module")
def qwen3_hd64():  # head dims of 64: two q8_0 blocks each, which hold the keys' rotary pairs
    return to_cflow(tiny_hf("qwen3", hd=64), wtype="q4_1", embtype="q8_0", tile=(32, 64), interleave=16,
                    stripe_rows=16, pack="planes")


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q8_0/f16"])
def test_a_shorter_history_gives_the_longer_ones_pages_back(qwen3_hd64, kv):
    # A state that held a long history and goes on with a short one (a slot, a prompt cache
    # entry reused) keeps the short one's pages only: whole pages of each KV head's positions
    # past it go back, counted by mincore. An answer's worth of positions is kept. What the state
    # computes next is what a fresh state computes, bit for bit. What it commits is what the
    # prompt cache's budget counts (kv_bytes_held), for each cache type.
    from cflow.engine import kv_bytes_held, kv_bytes_per_token

    k, v = (kv.split("/") * 2)[:2]
    eng = Engine(qwen3_hd64, threads=2, n_ctx=4096, cache_type_k=k, cache_type_v=v)
    assert eng.kv_dtype == kv
    long = [int(i) for i in np.random.default_rng(3).integers(0, 256, 1500)]
    st = eng.new_state()
    assert st.kv_resident_bytes == 0
    eng.forward(st, long)
    full = st.kv_resident_bytes
    assert full >= 1500 * kv_bytes_per_token(eng) and full == kv_bytes_held(eng, 1500)
    st.truncate(1480)
    assert st.kv_resident_bytes == full
    st.truncate(100)
    kept = st.kv_resident_bytes
    assert 100 * kv_bytes_per_token(eng) <= kept <= full // 8
    fresh = eng.new_state()
    eng.forward(fresh, long[:100])
    np.testing.assert_array_equal(eng.forward(st, IDS[:20], all_logits=True),
                                  eng.forward(fresh, IDS[:20], all_logits=True))
    # the same when a long state becomes a short prefix of another
    other = eng.new_state()
    eng.forward(other, long)
    other.copy_prefix(fresh, 100)
    assert other.kv_resident_bytes == kept and other.tokens == long[:100]
    st.truncate(100)
    np.testing.assert_array_equal(eng.forward(other, [5]), eng.forward(st, [5]))


def test_the_int8_paths_keep_keys_and_values_as_halves(qwen3_q4):
    # int8 activations: an f16 KV cache (half the bytes per token; its values rounded once, so
    # the logits stay within the int8 path's own error of the fp32 path); fp32: an f32 cache.
    # A state is tied to its engine's cache type: crossing over is refused, nothing lost.
    from cflow.engine import kv_bytes_per_token

    fast, exact = Engine(qwen3_q4, threads=2, n_ctx=64), Engine(qwen3_q4, threads=2, n_ctx=64, fast=False)
    assert (fast.kv_dtype, exact.kv_dtype) == ("f16", "f32")
    assert 2 * kv_bytes_per_token(fast) == kv_bytes_per_token(exact) > 0
    a, b = fast.new_state(), exact.new_state()
    got, want = fast.forward(a, IDS[:40], all_logits=True), exact.forward(b, IDS[:40], all_logits=True)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    with pytest.raises(CflowError, match="another model"):
        exact.forward(a, [1])
    with pytest.raises(CflowError, match="different models"):
        b.copy_prefix(a, 10)
    assert a.tokens == IDS[:40] and b.tokens == IDS[:40]


def test_a_q8_0_cache_is_attention_over_its_rounded_keys_and_values(qwen3_hd64):
    # cache_type_k / cache_type_v "q8_0": llama.cpp's blocks of 32 int8 and a half scale, 17/32
    # of the halves' bytes. The fp32 path over such a cache computes what the numpy interpreter
    # computes with its keys and values rounded by gguf's q8_0 quantizer (ggml's reference), the
    # keys' blocks over their rotary pairs: the cache holds exactly those values and attention
    # reads them as floats. Keys alone, values alone, both. The int8 path over it stays near its f16 cache's logits, and every row still
    # gets its own numbers in any step (three spans of keys: blocks of prompt rows, spans spread
    # over the threads, whole rows of a batch).
    from cflow.engine import kv_bytes_per_token

    ids = [int(i) for i in np.random.default_rng(6).integers(0, 256, size=301)]
    for k, v in (("q8_0", "q8_0"), ("q8_0", None), (None, "q8_0")):
        exact = Engine(qwen3_hd64, threads=2, n_ctx=512, fast=False, cache_type_k=k, cache_type_v=v)
        ref_eng = RefEngine(qwen3_hd64, n_ctx=512, cache_type_k=k, cache_type_v=v)
        assert exact.kv_types == ref_eng.kv_types == (k or "f32", v or "f32")
        got = exact.forward(exact.new_state(), ids, all_logits=True)
        want = ref_eng.forward(ref_eng.new_state(), ids, all_logits=True)
        # (a key the two compute 1e-7 apart can round to neighbouring int8 steps: 3e-5 seen)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-4
        plain = RefEngine(qwen3_hd64, n_ctx=512).forward(RefEngine(qwen3_hd64, n_ctx=512).new_state(), ids,
                                                         all_logits=True)
        assert np.linalg.norm(plain - want) / np.linalg.norm(want) > 1e-3  # the rounding is there to see
    f16 = Engine(qwen3_hd64, threads=2, n_ctx=512)
    q8 = Engine(qwen3_hd64, threads=2, n_ctx=512, cache_type_k="q8_0", cache_type_v="q8_0")
    assert (f16.kv_dtype, q8.kv_dtype) == ("f16", "q8_0")
    assert 32 * kv_bytes_per_token(q8) == 17 * kv_bytes_per_token(f16)
    whole = q8.forward(q8.new_state(), ids, all_logits=True)
    near = f16.forward(f16.new_state(), ids, all_logits=True)
    assert np.linalg.norm(whole - near) / np.linalg.norm(near) < 2e-2
    assert (whole.argmax(-1) == near.argmax(-1)).mean() >= 0.9
    piece = q8.new_state()
    q8.forward(piece, ids[:-2])
    assert np.array_equal(q8.forward(piece, ids[-2:]), whole[-1])
    one = q8.new_state()
    q8.forward(one, ids[:-1])
    alone = q8.forward(one, ids[-1:])
    many = [q8.new_state() for _ in range(6)]
    q8.forward(many, [ids[:-1]] + [ids[:40 + i] for i in range(5)])
    assert np.array_equal(q8.forward(many, [ids[-1:]] + [[3]] * 5)[0], alone)
    # a state keeps its engine's cache type: another's is refused, nothing lost
    with pytest.raises(CflowError, match="another model or KV cache type"):
        f16.forward(one, [1])
    with pytest.raises(CflowError, match="different models or KV cache types"):
        f16.new_state().copy_prefix(one, 10)
    assert one.tokens == ids
    with pytest.raises(CflowError, match="cache_type_k must be one of f16, q8_0, f32"):
        Engine(qwen3_hd64, cache_type_k="q4_0")
    with pytest.raises(CflowError, match="multiples of 32 .* are 16: use f16"):
        Engine(to_cflow(tiny_hf("qwen3")), cache_type_v="q8_0")


def test_kv_caches_that_do_not_fit_name_their_type_and_the_smaller_one(qwen3_hd64):
    # the start-up check's advice: fewer tokens or sequences, or, where the heads take q8_0 blocks
    # and the cache is not q8_0 already, llama.cpp's q8_0 keys and values
    from cflow.engine import check_kv_memory

    for kv, advice in (({}, True), ({"cache_type_k": "q8_0"}, True),
                       ({"cache_type_k": "q8_0", "cache_type_v": "q8_0"}, False)):
        eng = Engine(qwen3_hd64, threads=1, n_ctx=4096, **kv)
        with pytest.raises(CflowError, match="lower --n-ctx or --parallel") as e:
            check_kv_memory(eng, 10**9)
        assert f"KV cache ({eng.kv_dtype})" in str(e.value)
        assert ("-ctk q8_0 -ctv q8_0" in str(e.value)) == advice
    with pytest.raises(CflowError) as e:  # head dims of 16: no q8_0 for these
        check_kv_memory(Engine(to_cflow(tiny_hf("qwen3")), threads=1, n_ctx=4096), 10**9)
    assert "q8_0" not in str(e.value)


def test_keys_and_values_a_step_reads_follow_the_windows():
    # `bench decode` reports the keys and values a decode step reads at its depth beside the
    # weights: the whole context for global attention, at most the window for sliding layers
    # (this Gemma 3 alternates windows of 8 positions with global layers).
    from cflow.engine import kv_bytes_per_token, kv_bytes_read

    for arch, windowed in (("llama", False), ("gemma3", True)):
        eng = Engine(to_cflow(tiny_hf(arch, n_layer=2), wtype="q8_0"), threads=1, n_ctx=64)
        per = kv_bytes_per_token(eng)
        assert kv_bytes_read(eng, 5) == 5 * per  # every window holds 5 positions
        assert kv_bytes_read(eng, 40) == (24 * per if windowed else 40 * per)  # (8 + 40) / 2 a layer


def test_the_plan_is_typed_and_checked(qwen3_q4):
    eng = Engine(qwen3_q4, threads=1)
    kinds = {type(op).__name__ for op in eng.plan.ops}
    assert kinds == {"Barrier", "Embed", "Matmul", "GateUp", "Attention"}
    mm = next(op for op in eng.plan.ops if isinstance(op, P.Matmul))
    assert "weight" in P.Matmul._fields and mm.weight >= 0 and "Matmul(weight=" in repr(mm)
    with pytest.raises(TypeError, match="unknown field 'wieght'"):
        P.Matmul(wieght=1)
    from cflow._native import core

    def run(plan):
        return core.EngineCore(qwen3_q4.buffer, qwen3_q4.buffer, plan, 64, 1, True)

    bad = eng.plan
    ops = list(bad.ops)
    att = next(i for i, op in enumerate(ops) if isinstance(op, P.Attention))
    ops[att].head_dim = 7  # odd head size
    bad.ops = ops
    with pytest.raises(RuntimeError, match=f"plan op #{att}: head_dim must be even"):
        run(bad)
    ops[att].head_dim = 16
    ops[att + 2].dst_col = 1  # the output projection no longer fits its buffer
    bad.ops = ops
    with pytest.raises(RuntimeError, match=f"plan op #{att + 2}: weight rows"):
        run(bad)
    ts = list(bad.tensors)
    ts[0].offset = qwen3_q4.buffer.size  # past the end of the mapping
    bad.tensors = ts
    with pytest.raises(RuntimeError, match="outside the mapped file"):
        run(bad)
    with pytest.raises(CflowFormatError, match="no tensor 'blk.0.attn_norm'"):
        del_norm = dict(qwen3_q4.tensors)
        del del_norm["blk.0.attn_norm"]
        Engine(type(qwen3_q4)(config=qwen3_q4.config, buffer=qwen3_q4.buffer, tensors=del_norm))
