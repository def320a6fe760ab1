"""Generation on a tiny llama model (numpy reference engine): samplers, UTF-8 streaming, stop
strings, context limits, and the CLI's handling of bad input and Ctrl-C."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cflow.errors import CflowError
from cflow.sampling import make_sampler, min_p_filter, top_k_filter, top_p_filter
from cflow.tokenizer import StreamDecoder, Tokenizer

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from models_tiny import build

    d = tmp_path_factory.mktemp("llama")
    build("llama", d)
    return d


@pytest.fixture(scope="module")
def llm(tiny_dir, tmp_path_factory):
    from cflow.llm import LLM

    return LLM(str(tiny_dir), engine="ref", quiet=True, cache=tmp_path_factory.mktemp("cache"))


# ------------------------------------------------------------------ samplers
def test_filters_keep_what_they_should():
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    assert np.count_nonzero(top_k_filter(p, 2)) == 2
    assert np.flatnonzero(top_p_filter(p, 0.7)).tolist() == [0, 1]
    assert np.flatnonzero(top_p_filter(p, 0.71)).tolist() == [0, 1, 2]
    assert np.flatnonzero(min_p_filter(p, 0.3)).tolist() == [0, 1, 2]


def test_sampler_greedy_seeded_and_penalised():
    logits = np.array([1.0, 3.0, 2.9, -1.0])
    assert make_sampler()(logits, []) == 1
    assert make_sampler(repetition_penalty=2.0)(logits, [1]) == 2  # 3/2 < 2.9
    s1, s2 = make_sampler(temperature=1.0, seed=7), make_sampler(temperature=1.0, seed=7)
    a, b = [s1(logits, []) for _ in range(50)], [s2(logits, []) for _ in range(50)]
    assert a == b and len(set(a)) > 1
    s = make_sampler(temperature=1.0, top_k=1, seed=3)
    assert {s(logits, []) for _ in range(20)} == {1}
    with pytest.raises(CflowError):
        make_sampler(top_p=0.0)
    with pytest.raises(CflowError):
        make_sampler(temperature=-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 40, 0.95), (0.7, 0, 0.9), (0.3, 0, 0.9), (1.0, 0, 1.0),
                                                     (1.3, 0, 0.999),
                                                     (0.5, 3000, 0.5)])
def test_sampling_on_candidates_is_the_whole_vocabulary_distribution(temperature, top_k, top_p):
    # the sampler filters only the tokens that can survive top-k / top-p; what it draws from must
    # be the distribution the filters give over the whole vocabulary
    from cflow.sampling import _top_k_top_p, softmax

    x = (np.random.default_rng(top_k).standard_normal(32000) * 4).astype(np.float32)
    full = top_p_filter(top_k_filter(softmax(x.astype(np.float64) / temperature), top_k), top_p)
    ids, p = _top_k_top_p(x, temperature, top_k, top_p)
    assert ids.tolist() == np.flatnonzero(full).tolist()
    assert np.allclose(p / p.sum(), full[ids] / full.sum(), rtol=1e-9, atol=0)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.8, 40, 0.95, 0.05), (0.7, 40, 1.0, 0.0),
                                                           (1.3, 5, 0.5, 0.2), (1e-300, 40, 0.9, 0.05),
                                                           (0.5, 3000, 0.99, 0.0), (2.0, 1, 1.0, 0.0)])
def test_the_native_draw_is_the_numpy_draw(temperature, top_k, top_p, min_p):
    # the sampler's one native call (top-k on, float32 logits) and its numpy steps pick the same
    # token for the same uniform number, over the whole range of u
    from cflow._native import core
    from cflow.sampling import _top_k_top_p, pick

    r = np.random.default_rng(top_k)
    x = (r.standard_normal(32000) * 4).astype(np.float32)
    x[r.integers(0, 32000, size=3)] += 12  # a few tokens far above the rest, as a model's logits
    ids, p = _top_k_top_p(x, temperature, top_k, top_p)
    p = min_p_filter(p, min_p)
    us = np.concatenate([[0.0, 1 - 2**-53], np.random.default_rng(1).random(400)])
    assert [core.ops.sample_top_k(x, top_k, temperature, top_p, min_p, u) for u in us] == \
        [int(ids[pick(p, u)]) for u in us]
    x[7] = np.inf  # not finite: None, and the sampler's numpy path
    assert core.ops.sample_top_k(x, top_k, temperature, top_p, min_p, 0.5) is None


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([7, 64, 5000, 49152]),
       scale=st.sampled_from([0.01, 1.0, 4.0]), offset=st.sampled_from([0.0, -20.0]), rounded=st.booleans(),
       history=st.sampled_from([0, 1, 5, 30, 90, 400, 3000]),
       penalty=st.sampled_from([1e-300, 0.5, 0.9, 1.1, 1.5, 10.0]),
       temperature=st.sampled_from([0.0, 1e-300, 0.7, 2.0]),
       top_k=st.sampled_from([1, 3, 40, 4990]), top_p=st.sampled_from([1.0, 0.95, 0.5]),
       min_p=st.sampled_from([0.0, 0.05, 0.5]))
def test_a_penalised_draw_is_the_whole_penalised_vocabularys(seed, vocab, scale, offset, rounded, history, penalty,
                                                               temperature, top_k, top_p, min_p):
    # the sampler penalises only the history's tokens and takes the k largest of the rest (one
    # native call); the token it draws for a uniform number is the one that penalising every
    # logit in float64 and filtering give. Rounded logits make ties, small vocabularies make k + h reach the
    # vocabulary (the whole path), penalties below 1 raise the history's logits, an offset makes
    # every logit negative (multiplied, not divided), and half the histories hold the largest
    # logits, where the penalty moves the k-th. Histories past 256 distinct tokens take the copy
    # with their values lowered instead of the k + h largest.
    from cflow.sampling import _penalised_draw, _top_k_top_p, apply_repetition_penalty, pick

    r = np.random.default_rng(seed)
    x = (r.standard_normal(vocab) * scale + offset).astype(np.float32)
    if rounded:
        x = np.round(x).astype(np.float32)
    x[r.integers(0, vocab, size=2)] += 8  # a few tokens far above the rest, as a model's logits
    hist = [int(t) for t in r.integers(0, vocab, size=history)]
    if r.random() < 0.5:
        hist += [int(t) for t in np.argsort(-x)[:top_k + 2]]
    z = apply_repetition_penalty(x.astype(np.float64), hist, penalty)
    if temperature == 0.0:
        assert make_sampler(0.0, top_k, top_p, min_p, penalty)(x, hist) == int(np.argmax(z))
        return
    ids, p = _top_k_top_p(z, temperature, top_k if top_k < vocab else 0, top_p)
    p = min_p_filter(p, min_p)
    u = np.random.default_rng(seed).random()  # the sampler's one draw
    assert make_sampler(temperature, top_k, top_p, min_p, penalty, seed=seed)(x, hist) == int(ids[pick(p, u)])
    us = np.concatenate([[0.0, 1 - 2**-53], r.random(60)])  # the native draw over the range of u
    native = [_penalised_draw(x, hist, penalty, top_k, temperature, top_p, min_p, u) for u in us]
    assert (native[0] is None) == (top_k + len(set(hist)) >= vocab)  # the native call where it applies
    if native[0] is not None:
        assert native == [int(ids[pick(p, u)]) for u in us]

@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), history=st.lists(st.integers(0, 63), max_size=30),
       answer=st.lists(st.integers(0, 63), max_size=30), repetition=st.sampled_from([1.0, 0.5, 1.3]),
       frequency=st.sampled_from([0.0, -2.0, 0.5, 2.0]), presence=st.sampled_from([0.0, -1.0, 0.7, 2.0]))
def test_penalties_move_each_token_as_openai_and_vllm_define_them(seed, history, answer, repetition, frequency,
                                                                  presence):
    from cflow.sampling import apply_penalties

    x = np.random.default_rng(seed).normal(0, 4, 64).astype(np.float32)
    got = apply_penalties(x, history + answer, answer, repetition, frequency, presence)
    for t in range(64):  # the multiplicative penalty on the history's tokens, then the additive ones
        want = float(x[t])
        if t in history + answer and repetition != 1.0:
            want = want / repetition if want > 0 else want * repetition
        c = answer.count(t)
        want -= frequency * c + (presence if c else 0.0)
        assert got[t] == np.float32(want), (t, got[t], want)
    assert x.dtype == np.float32 and got is not x  # the logits themselves are not moved
    # a draw under the penalties is the draw of the penalised logits
    for temperature, top_k in ((0.0, 0), (0.8, 8), (1.0, 0)):
        s1 = make_sampler(temperature, top_k, repetition_penalty=repetition, frequency_penalty=frequency,
                          presence_penalty=presence, seed=seed)
        s2 = make_sampler(temperature, top_k, seed=seed)
        pen = apply_penalties(x, history + answer, answer, repetition, frequency, presence) if answer else None
        for _ in range(3):
            want = s2(pen, []) if answer else make_sampler(temperature, top_k, repetition_penalty=repetition,
                                                           seed=seed)(x, history)
            assert s1(x, history + answer, answer) == want
            if not answer:
                break


def test_a_presence_penalty_keeps_the_answers_tokens_apart(llm):
    ids = [t for c in llm.complete("The cat", max_tokens=40, temperature=0, ignore_eos=True) for t in c.token_ids]
    assert len(set(ids)) < len(ids)  # greedy repeats itself here
    apart = [t for c in llm.complete("The cat", max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=100)
             for t in c.token_ids]
    assert len(set(apart)) == len(apart) == 40
    same = [t for c in llm.complete("The cat", max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=0.0,
                                    presence_penalty=0.0) for t in c.token_ids]
    assert same == ids
    with pytest.raises(CflowError, match="frequency_penalty"):
        llm.complete("x", frequency_penalty=float("nan"))



@pytest.mark.parametrize("scale,top_k,lead", [(0.01, 40, 0), (40.0, 40, 0), (4.0, 5000, 0), (4.0, 40, 3)])
def test_top_k_keeps_the_k_largest_and_their_ties(scale, top_k, lead):
    # whether the k largest lie near the maximum (narrow or wide logits, small or large k, a few
    # tokens far above the rest as in a real model's logits) or not, and with many equal values
    # (rounded logits), the kept set is top_k_filter's
    from cflow.sampling import _top_k_top_p, softmax

    x = np.round(np.random.default_rng(7).standard_normal(50000) * scale).astype(np.float32)
    x[[5, 17000, 49999][:lead]] += 60.0
    full = top_k_filter(softmax(x.astype(np.float64)), top_k)
    ids, _ = _top_k_top_p(x, 1.0, top_k, 1.0)
    assert ids.tolist() == np.flatnonzero(full).tolist()


# ------------------------------------------------------------------ sampling defaults
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}


def test_generation_defaults_of_a_source():
    from cflow.sampling import generation_defaults

    assert generation_defaults(None) == generation_defaults({}) == (LLAMA_CPP, "llama.cpp")
    assert generation_defaults({"eos_token_id": 2}) == (LLAMA_CPP, "llama.cpp")
    given = generation_defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.9})
    assert given == ({"temperature": 0.6, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0}, "model")
    greedy = generation_defaults({"do_sample": False, "temperature": 0.6})
    assert greedy[0]["temperature"] == 0.0 and greedy[1] == "model"


def test_default_call_samples_and_temperature_0_is_greedy(llm):
    assert (llm.generation_defaults, llm.generation_defaults_source) == (LLAMA_CPP, "llama.cpp")
    prompt = llm.tokenizer.encode("Once upon a time")

    def ids(**kw):
        return [t for c in llm.complete(prompt, max_tokens=12, ignore_eos=True, **kw) for t in c.token_ids]

    greedy = ids(temperature=0)
    assert greedy == llm.logits(prompt + greedy[:-1])[len(prompt) - 1:].argmax(-1).tolist()
    assert ids(seed=5) == ids(seed=5) == ids(seed=5, **LLAMA_CPP)  # the defaults, and seeded runs repeat
    assert ids(seed=5) != greedy and ids(seed=5) != ids(seed=6)


def _drop_header_key(src, dst, key):
    """Copy a .cflow file without one header key: the file an older cflow wrote."""
    import json

    from cflow.format.spec import PREAMBLE, Preamble, crc32

    data = src.read_bytes()
    pre = Preamble.unpack(data[:PREAMBLE.size], len(data))
    head = json.loads(data[pre.header_offset:])
    del head[key]
    raw = json.dumps(head).encode()
    new = Preamble(pre.version, 0, pre.header_offset + len(raw), pre.header_offset, len(raw), crc32(raw), pre.alignment)
    dst.write_bytes(new.pack() + data[PREAMBLE.size:pre.header_offset] + raw)


def test_a_models_generation_config_gives_the_defaults(tiny_dir, tmp_path):
    import json
    import shutil

    from cflow.cli import main
    from cflow.format import CflowFile
    from cflow.llm import LLM

    src = tmp_path / "hf"
    shutil.copytree(tiny_dir, src)
    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps(dict(gen, temperature=0.6, top_p=0.9, top_k=None)))
    out = tmp_path / "m.cflow"
    assert main(["convert", str(src), "-o", str(out), "--quiet"]) == 0
    with CflowFile(out) as f:
        assert f.generation == {"temperature": 0.6, "top_p": 0.9}
    llm = LLM(str(out), engine="ref", quiet=True)
    assert llm.generation_defaults_source == "model"
    assert llm.generation_defaults == {"temperature": 0.6, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0}
    old = tmp_path / "old.cflow"
    _drop_header_key(out, old, "generation")
    llm = LLM(str(old), engine="ref", quiet=True)
    assert (llm.generation_defaults, llm.generation_defaults_source) == (LLAMA_CPP, "llama.cpp")


# ------------------------------------------------------------------ streaming text
def test_stream_decoder_never_splits_a_character(tiny_dir):
    tok = Tokenizer((tiny_dir / "tokenizer.json").read_text(), {})
    text = "héllo wörld 🤗 ñandú 日本語 fox"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_token_bytes_spell_the_text_byte_for_byte(tiny_dir):
    tok = Tokenizer((tiny_dir / "tokenizer.json").read_text(), {})
    text = "héllo wörld 🤗 ñandú 日本語 fox\n\t  x"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.token_bytes(i).decode("utf-8", "replace") for i in ids)  # part of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


# ------------------------------------------------------------------ logprobs
@given(st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=300), st.integers(0, 20), st.data())
@settings(max_examples=60, deadline=None)
def test_a_tokens_logprob_is_the_log_softmax_of_the_logits(values, n, data):
    from cflow.sampling import token_logprob

    x = np.array(values, dtype=np.float32)
    chosen = data.draw(st.integers(0, x.size - 1))
    got = token_logprob(x, chosen, n)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64) - x.max()).sum()) - x.max()
    assert got.id == chosen and abs(got.logprob - ref[chosen]) < 1e-5
    order = sorted(range(x.size), key=lambda i: (-x[i], i))[: min(n, x.size)]
    assert [i for i, _ in got.top] == order  # most likely first, ties: the lower id
    assert all(abs(v - ref[i]) < 1e-5 for i, v in got.top)


def test_logprobs_of_a_bad_count_or_non_finite_logits_are_errors():
    from cflow.sampling import token_logprob

    x = np.zeros(8, np.float32)
    for n in (-1, 21, 2.0, True, "3"):
        with pytest.raises(CflowError, match="top logprobs"):
            token_logprob(x, 0, n)
    x[3] = np.nan
    with pytest.raises(CflowError, match="not finite"):
        token_logprob(x, 0, 2)


def test_completions_carry_each_tokens_logprob_under_the_model(llm):
    from cflow.sampling import log_softmax

    prompt = llm.encode_prompt("Once upon a time")
    chunks = list(llm.complete(prompt, max_tokens=12, temperature=0.9, seed=3, logprobs=4, repetition_penalty=1.3))
    ids = [t for c in chunks for t in c.token_ids]
    lps = [x for c in chunks for x in c.logprobs]
    assert len(ids) >= 2 and [x.id for x in lps] == ids
    # the reference: the engine's logits of each step, softmaxed in float64, before any penalty
    # or temperature (the draws above saw penalised, tempered ones)
    eng = llm.engine
    state = eng.new_state()
    logits = eng.forward(state, prompt)
    for t, x in zip(ids, lps):
        ref = log_softmax(np.asarray(logits).reshape(-1, logits.shape[-1])[-1])
        assert abs(x.logprob - ref[t]) < 1e-4
        assert [i for i, _ in x.top] == list(np.argsort(-ref, kind="stable")[:4])
        logits = eng.forward(state, [t])
    assert all(c.logprobs is None for c in llm.complete(prompt, max_tokens=3))
    with pytest.raises(CflowError, match="top logprobs"):
        llm.complete(prompt, max_tokens=3, logprobs=21)


def test_an_end_of_sequence_token_that_ends_the_answer_has_its_logprob_listed_last(llm):
    # an evaluation harness asks for one token after an echoed prompt and drops the last entry:
    # the end of sequence, when that is what was generated, must be that entry
    from cflow.generate import Decoder

    eos = min(llm.tokenizer.eos_token_ids)
    d = Decoder(llm.tokenizer, llm.encode_prompt("Once upon a time"), temperature=0, logprobs=1)
    d.begin(llm.engine.new_state())
    x = np.zeros(llm.config.vocab_size, np.float32)
    x[7] = 5.0
    first = d.feed(x)
    assert first.token_ids == [7] and [t.id for t in first.logprobs] == [7]
    x[7], x[eos] = 0.0, 5.0
    last = d.feed(x)
    assert last.finish_reason == "stop" and last.token_ids == [] and last.usage.completion_tokens == 1
    assert [t.id for t in last.logprobs] == [eos] and last.logprobs[0].top[0][0] == eos


def test_a_prompts_logprobs_score_every_token_after_the_first(llm):
    from cflow.sampling import log_softmax

    prompt = llm.encode_prompt("Once upon a time there was a fox " * 12)  # two prefill pieces
    assert len(prompt) > 64
    ref = log_softmax(llm.engine.forward(llm.engine.new_state(), prompt, all_logits=True))
    (only,) = llm.complete(prompt, max_tokens=0, prompt_logprobs=2)  # scoring: no token generated
    assert only.finish_reason == "length" and only.token_ids == [] and only.usage.completion_tokens == 0
    scored = only.prompt_logprobs
    assert scored[0] is None and [x.id for x in scored[1:]] == prompt[1:]
    assert max(abs(x.logprob - ref[j, prompt[j + 1]]) for j, x in enumerate(scored[1:])) < 1e-4
    assert all([i for i, _ in x.top] == list(np.argsort(-ref[j], kind="stable")[:2]) for j, x in enumerate(scored[1:]))
    # asking for them changes no generated token, and only the first chunk carries them
    with_lp = list(llm.complete(prompt, max_tokens=6, temperature=0, prompt_logprobs=0))
    assert [c.token_ids for c in with_lp] == [c.token_ids for c in llm.complete(prompt, max_tokens=6, temperature=0)]
    assert [c.prompt_logprobs is None for c in with_lp] == [False] + [True] * 5
    with pytest.raises(CflowError, match="max_tokens must be >= 1"):
        llm.complete(prompt, max_tokens=0)


def test_logit_bias_moves_the_draws_and_bad_ones_fail_before_any_step(llm):
    plain = list(llm.complete("Once upon a time", max_tokens=4, temperature=0))
    first = plain[0].token_ids[0]
    moved = list(llm.complete("Once upon a time", max_tokens=4, temperature=0, logit_bias={first: -100}))
    assert moved[0].token_ids[0] != first
    for bad in ({llm.config.vocab_size: 1.0}, {-1: 1.0}, {0: 200.0}, {0: float("nan")}):
        with pytest.raises(CflowError, match="logit_bias"):
            llm.complete("Once upon a time", max_tokens=4, logit_bias=bad)


def test_stop_strings_are_never_emitted(llm):
    full = llm.generate("Once upon a time", max_tokens=40, seed=0)  # seeded: the second run repeats it
    assert len(full) > 12
    stop = full[6:10]
    cut = full[: full.find(stop)]
    chunks = list(llm.complete("Once upon a time", max_tokens=40, seed=0, stop=[stop]))
    text = "".join(c.text for c in chunks)
    assert text == cut and chunks[-1].finish_reason == "stop"
    assert all(stop not in c.text for c in chunks)


def test_length_finish_usage_and_state_reuse(llm):
    chunks = list(llm.complete("Once upon a time", max_tokens=5))
    last = chunks[-1]
    assert last.finish_reason in ("length", "stop") and last.usage.completion_tokens <= 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.timings.prompt_s > 0
    st = llm.engine.new_state()
    a = llm.generate("Once upon a time", max_tokens=8, seed=0, state=st)
    b = llm.generate("Once upon a time", max_tokens=8, seed=0, state=st)  # prefix reused from the cache
    assert a == b == llm.generate("Once upon a time", max_tokens=8, seed=0)


def test_ignore_eos_runs_to_max_tokens(llm):
    eos = set(llm.tokenizer.eos_token_ids)
    for seed in range(200):  # near-uniform sampling: find a run that the end-of-sequence token ends
        short = list(llm.complete("Once upon a time", max_tokens=64, temperature=8.0, seed=seed))
        if short[-1].finish_reason == "stop":
            break
    else:
        pytest.fail("no sampled run met the end-of-sequence token")
    n = short[-1].usage.completion_tokens
    assert n < 64
    full = list(llm.complete("Once upon a time", max_tokens=64, temperature=8.0, seed=seed, ignore_eos=True))
    ids = [t for c in full for t in c.token_ids]
    assert full[-1].finish_reason == "length" and full[-1].usage.completion_tokens == len(ids) == 64
    assert ids[:n] == [t for c in short for t in c.token_ids] and ids[n] in eos


def test_chat_template_is_the_models_own(llm):
    s = llm.render_chat([{"role": "user", "content": "hi"}])
    assert s == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert isinstance(llm.chat([{"role": "user", "content": "hi"}], max_tokens=4), str)


def test_context_overflow_is_a_clear_error_before_anything(tiny_dir, tmp_path):
    from cflow.llm import LLM

    small = LLM(str(tiny_dir), engine="ref", n_ctx=16, quiet=True, cache=tmp_path)
    with pytest.raises(CflowError, match=r"exceeds the context of 16"):
        small.complete("Once upon a time " * 10, max_tokens=4)
    with pytest.raises(CflowError, match="context full"):
        small.engine.forward(small.engine.new_state(), list(range(3, 20)))


def test_unknown_model_names_the_known_ones():
    from cflow.llm import LLM

    with pytest.raises(CflowError, match="did you mean 'smollm2-135m'"):
        LLM("smollm2-13m")
    with pytest.raises(CflowError, match="no such file"):
        LLM("./missing/model.gguf")


# ------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def cli_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-cache")


def _cli(*args, cache=None, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    if cache:
        env["CFLOW_CACHE"] = str(cache)
    return subprocess.Popen([sys.executable, "-m", "cflow", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


def test_cli_generate_streams_and_reports_speed(tiny_dir, cli_cache):
    p = _cli("generate", "-m", str(tiny_dir), "--engine", "ref", "-n", "12", "Once upon a time", cache=cli_cache)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert out.strip() and "decode" in err and "tok/s" in err and "GB/s" in err


def test_bench_decode_json(tiny_dir, cli_cache):
    import json

    p = _cli("bench", "decode", "-m", str(tiny_dir), "--json", "--runs", "2", "--tokens", "4", "--prompt", "16",
             "--threads", "1", "--activations", "int8", "--batch", "3", "--depth", "1100", cache=cli_cache)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["threads"] == 1 and rec["activations"] == "int8" and rec["vs"] == {} and rec["depth"] == 1100
    assert rec["kv_cache"] == "f16"
    assert len(rec["decode_runs"]) == len(rec["prefill_runs"]) == 2
    assert min(rec["decode_runs"]) <= rec["decode_tok_s"] <= max(rec["decode_runs"])
    assert rec["bytes_per_token"] > 0 and rec["probe_gbps"] > 0 and rec["probe_model_gbps"] > 0
    assert rec["gbps"] == pytest.approx(rec["bytes_per_token"] * rec["decode_tok_s"] / 1e9, rel=0.01)
    kv = rec["kv_bytes_per_token"]  # the keys and values at the runs' mean context, 1100 + 4 / 2
    assert kv > 0 and kv % 1102 == 0
    assert rec["gbps_with_kv"] == pytest.approx((rec["bytes_per_token"] + kv) * rec["decode_tok_s"] / 1e9, rel=0.01)
    assert rec["isa"] in ("scalar", "avx2", "avx512") and rec["decode_step_ms_median"] > 0
    b = rec["batch"]  # steps of 3 sequences together, against one
    assert b["sequences"] == 3 and b["step_ms_median"] > 0 and b["one_step_ms_median"] > 0
    assert b["x_one"] == pytest.approx(3 * b["one_step_ms_median"] / b["step_ms_median"], rel=0.002)
    assert b["tok_s"] == pytest.approx(3e3 / b["step_ms_median"], rel=0.002)
    p = _cli("bench", "decode", "-m", str(tiny_dir), "--vs", "llama.cpp", cache=cli_cache)
    out, err = p.communicate(timeout=600)
    assert p.returncode != 0 and "needs the model's GGUF" in err
    p = _cli("bench", "decode", "-m", str(tiny_dir), "--depth", "0", cache=cli_cache)
    out, err = p.communicate(timeout=600)
    assert p.returncode != 0 and "--depth" in err
    p = _cli("bench", "decode", "-m", str(tiny_dir), "-ctk", "q8_0", cache=cli_cache)  # head dims of 12
    out, err = p.communicate(timeout=600)
    assert p.returncode != 0 and "multiples of 32" in err and "Traceback" not in err
    p = _cli("bench", "decode", "-m", str(tiny_dir), "-ctv", "q8_0", "--vs-flash-attn", "off", cache=cli_cache)
    out, err = p.communicate(timeout=600)
    assert p.returncode != 0 and "needs flash attention for a q8_0 V cache" in err and "Traceback" not in err


def test_cache_type_flags_reach_the_engine():
    # -ctk / -ctv (llama.cpp's spelling; --cache-type-k / -v) become the engine's cache types, on
    # generate, chat, serve and bench decode alike; no flag leaves the engine's default
    from cflow.cli import build_parser
    from cflow.commands.generate import activation_kwargs

    parser = build_parser()
    for verb in (["generate", "hi"], ["chat"], ["serve"], ["bench", "decode"]):
        kw = activation_kwargs(parser.parse_args(verb + ["-ctk", "q8_0", "--cache-type-v", "f32"]))
        assert (kw["cache_type_k"], kw["cache_type_v"]) == ("q8_0", "f32")
        assert "cache_type_k" not in activation_kwargs(parser.parse_args(verb))
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "-ctv", "q4_0"])


def test_cli_bad_model_is_exit_2(tmp_path):
    p = _cli("generate", "-m", "no-such-model", "hi", cache=tmp_path)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 2 and "cflow generate: error: unknown model 'no-such-model'" in err
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05" * 40)
    p = _cli("generate", "-m", str(bad), "hi", cache=tmp_path)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 2 and "truncated or malformed GGUF" in err


def test_cli_ctrl_c_is_a_clean_exit_130(tiny_dir, cli_cache):
    # as from a terminal: SIGINT handled by default even when this test runs in a background job
    # (which starts with SIGINT ignored, and a child would inherit that)
    p = _cli("generate", "-m", str(tiny_dir), "--engine", "ref", "-n", "480", "--temperature", "1", "--seed", "1",
             "--ignore-eos", "Once upon a time", cache=cli_cache,
             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    p.stdout.read(1)  # generation has started
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err


def test_inference_path_imports_no_torch(tiny_dir, cli_cache):
    code = ("import sys; from cflow.llm import LLM; "
            f"llm = LLM({str(tiny_dir)!r}, engine='ref', quiet=True, cache={str(cli_cache)!r}); "
            "assert llm.generate('Once', max_tokens=3) is not None; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
