"""JSON mode (cflow.json_mode): the recogniser against Python's json module, and constrained
generation on the tiny real model of conftest, alone, batched in the server, and over HTTP."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from cflow.json_mode import MAX_WS, START, complete, feed
from hypothesis import example, given, settings
from hypothesis import strategies as st
from server_util import TIMEOUT, serving

# ------------------------------------------------------------------ the recogniser

scalars = st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.text(max_size=8) | \
    st.floats(allow_nan=False, allow_infinity=False)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=3), max_leaves=8)
objects = st.dictionaries(st.text(max_size=5), values, max_size=4)


def states_of(data: bytes):
    s = START
    for c in data:
        s = feed(s, bytes([c]))
        yield s


@settings(max_examples=300, deadline=None)
@given(objects, st.sampled_from([None, 0, 1, 2]), st.booleans(), st.booleans())
def test_every_prefix_of_a_json_object_is_taken_and_only_the_whole_is_complete(obj, indent, ascii_only, compact):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only, separators=(",", ":") if compact else None)
    states = list(states_of(text.encode()))
    assert all(s is not None for s in states), text
    assert [complete(s) for s in states] == [False] * (len(states) - 1) + [True]
    assert feed(START, text.encode()) == states[-1]  # a token's bytes at once or byte by byte


JSONISH = st.text(alphabet='{}[]":,-+.0159eEtrufalsn \n\\u', max_size=MAX_WS)  # no run of whitespace over the bound


@settings(max_examples=2000, deadline=None)
@given(JSONISH)
@example('{"a":[1,-0.5e+9,true]}')
@example(' {"\\u00e9" : {}}\n')
@example('{"a":[1,-0.5e+9,true,}')
@example('{"":"\\uD83D"}')
def test_a_text_is_complete_exactly_when_python_parses_it_as_an_object(text):
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    s = feed(START, text.encode())
    assert (s is not None and complete(s)) == isinstance(parsed, dict), text


@pytest.mark.parametrize("text", [
    "[1]", '"a"', "1", "x", '{"a" 1}', '{"a":01}', '{"a":1,}', "{,", '{"a":tru e}', '{"a":"\x01"}',
    '{"a":"\n"}', '{"a":"\\x"}', '{"a":"\\u12G4"}', '{"a":1}}', '{"a":1} x', '{"a":-}', '{"a":1.}',
    '{"a":1e}', '{"a":.5}', '{"a":+1}', "{]", '{"a":[1,]}', '{"a":[,1]}', '{"a":nul1}', '{"a":[}', "{'a':1}",
    '{"a":NaN}', '{"a":Infinity}', "{a:1}", '{"a":1 2}', '{"a"::1}', "{" + " " * (MAX_WS + 1),
])
def test_texts_no_object_starts_with_are_refused(text):
    assert feed(START, text.encode()) is None


def test_whitespace_runs_are_bounded_but_reset_by_any_other_byte():
    s = feed(START, b"{" + b" " * MAX_WS)
    assert s is not None and feed(s, b" ") is None
    s = feed(s, b'"k"' + b"\n" * MAX_WS + b":" + b" " * MAX_WS + b"1" + b" " * MAX_WS + b"}")
    assert s is not None and complete(s)


# ------------------------------------------------------------------ constrained generation

def test_greedy_and_seeded_answers_are_json_or_its_unfinished_start(tiny_llm):
    for kw in ({"temperature": 0}, {"seed": 1}, {"seed": 2, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}):
        chunks = list(tiny_llm.complete("Give me JSON:", max_tokens=60, json_object=True, **kw))
        ids = [i for c in chunks for i in c.token_ids]
        text = "".join(c.text for c in chunks)
        assert text == tiny_llm.tokenizer.decode(ids, skip_special_tokens=True)
        state = feed(START, b"".join(tiny_llm.tokenizer.token_bytes(i) for i in ids))
        assert state is not None, text
        if chunks[-1].finish_reason == "stop":
            assert complete(state) and isinstance(json.loads(text), dict)
        else:
            assert chunks[-1].finish_reason == "length" and len(ids) == 60
        again = list(tiny_llm.complete("Give me JSON:", max_tokens=60, json_object=True, **kw))
        assert [i for c in again for i in c.token_ids] == ids  # greedy, or seeded: the same draws


def test_the_answer_ends_as_soon_as_the_object_closes(tiny_llm):
    # "}" favoured above all, then "{": "}" is refused until "{" opened the object, then closes it
    tok = tiny_llm.tokenizer
    one = {tok.token_bytes(i): i for i in range(tiny_llm.config.vocab_size)}
    chunks = list(tiny_llm.complete("x", max_tokens=30, temperature=0, json_object=True,
                                    logit_bias={one[b"}"]: 100, one[b"{"]: 50}))
    assert "".join(c.text for c in chunks) == "{}" and chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == 2


@pytest.fixture(scope="module")
def url(tiny_llm):
    with serving(tiny_llm, parallel=4) as u:
        yield u


def test_json_mode_over_http_batched_gives_the_alone_answer(url, tiny_llm):
    import threading

    body = {"messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_object"}}
    alone = httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    out = [None] * 4

    def run(i):  # three plain answers decode beside it
        b = body if i == 0 else {**body, "response_format": {"type": "text"}, "seed": i, "temperature": 1.0}
        out[i] = httpx.post(url + "/v1/chat/completions", json=b, timeout=TIMEOUT).json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    text = alone["choices"][0]["message"]["content"]
    assert out[0]["choices"][0]["message"]["content"] == text
    assert feed(START, text.encode()) is not None
    if alone["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    # the completions endpoint takes it too (as vLLM's), streamed or not
    r = httpx.post(url + "/v1/completions", json={"prompt": "JSON:", "max_tokens": 20, "temperature": 0,
                                                  "response_format": {"type": "json_object"}}, timeout=TIMEOUT)
    assert r.status_code == 200 and feed(START, r.json()["choices"][0]["text"].encode()) is not None


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}, "JSON schema is not supported"),
    ({"type": "xml"}, "type"),
    ({"type": 5}, "type"),
    ("json_object", "response_format"),
])
def test_a_response_format_that_cannot_be_kept_is_a_400(url, fmt, message):
    r = httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("response_format") and message in err["message"], err


@settings(max_examples=60, deadline=None)
@given(objects, st.integers(0, 10 ** 6), st.integers(0, 2 ** 32 - 1))
def test_the_fallback_finds_the_most_likely_allowed_tokens_as_a_whole_check_would(tiny_llm, obj, cut, seed):
    from cflow.json_mode import JsonConstraint

    tok = tiny_llm.tokenizer
    text = json.dumps(obj, indent=1).encode()
    c = JsonConstraint(tok)
    c.state = feed(START, text[:cut % len(text)])  # somewhere inside an object: any mode
    x = np.random.default_rng(seed).standard_normal(tiny_llm.config.vocab_size + 7).astype(np.float32)
    whole = [t for t in np.argsort(-x, kind="stable").tolist() if t < tok.vocab_size and c.allows(t)]
    assert c._allowed_first(x, 64) == whole[:64]
    assert [tok.token_bytes(i) for i in range(tok.vocab_size)] == tok.all_token_bytes()
