"""Structured outputs (cflow.structured): the grammars of one JSON object and of JSON schemas
against Python's json module, fed byte by byte through the tiny real model's tokenizer; the
constrained draw; constrained generation on that model alone, batched in the server, and over HTTP."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from cflow.errors import CflowError
from cflow.structured import MAX_INDENT, Constraint, follow, grammar
from hypothesis import example, given, settings
from hypothesis import strategies as st
from server_util import TIMEOUT, serving

OBJECT = grammar(json_object=True)

# any character but DEL, which the grammar wants escaped (cflow.structured), and lone surrogates
chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x7f")
scalars = st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.text(chars, max_size=8) | \
    st.floats(allow_nan=False, allow_infinity=False)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(chars, max_size=5), inner, max_size=3), max_leaves=8)
objects = st.dictionaries(st.text(chars, max_size=5), values, max_size=4)


@pytest.fixture(scope="module")
def byte_token(tiny_llm):
    """The id of each byte's own token (a byte-level vocabulary has one for every byte), so that a
    text can be fed byte by byte whatever the tokenizer's merges."""
    tok = tiny_llm.tokenizer
    ids: dict[int, int] = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if len(b) == 1 and i not in tok.eos_token_ids:
            ids.setdefault(b[0], i)
    assert len(ids) == 256
    return ids


def states_of(tok, byte_token, g: str, data: bytes):
    """Whether the grammar took each byte of data in turn (False from the first refused one on),
    and whether it was complete after it."""
    c = Constraint(tok, g)
    for b in data:
        t = byte_token[b]
        if c is None or not c.allows(t):
            c = None
            yield False, False
            continue
        c.advance(t)
        yield True, c.complete


# ------------------------------------------------------------------ one JSON object

@settings(max_examples=150, deadline=None)
@given(objects, st.sampled_from([None, 0, 1, 2]), st.booleans(), st.booleans())
def test_every_prefix_of_a_json_object_is_taken_and_only_the_whole_is_complete(tiny_llm, byte_token, obj, indent,
                                                                               ascii_only, compact):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only, separators=(",", ":") if compact else None)
    states = list(states_of(tiny_llm.tokenizer, byte_token, OBJECT, text.encode()))
    assert all(took for took, _ in states), text
    assert [done for _, done in states] == [False] * (len(states) - 1) + [True]
    c = follow(tiny_llm.tokenizer, OBJECT, text)  # the tokens as the tokenizer splits it: the same
    assert c is not None and c.complete


JSONISH = st.text(alphabet='{}[]":,-+.0159eEtrufalsn\\u', max_size=24)  # whitespace: its own test below


@settings(max_examples=600, deadline=None)
@given(JSONISH)
@example('{"a":[1,-0.5e+9,true]}')
@example('{"\\u00e9" : {}}')
@example(' {"a":1}')
@example('{"a":1}\n')
@example('{"a":[1,-0.5e+9,true,}')
def test_a_text_is_complete_exactly_when_python_parses_it_as_an_object(tiny_llm, byte_token, text):
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    states = list(states_of(tiny_llm.tokenizer, byte_token, OBJECT, text.encode()))
    whole = bool(states) and all(took for took, _ in states) and states[-1][1]
    # the answer starts at its "{" and ends at its "}": no whitespace before or after it
    assert whole == (isinstance(parsed, dict) and text[:1] == "{" and text[-1:] == "}"), text


@pytest.mark.parametrize("text", [
    "[1]", '"a"', "1", "x", '{"a" 1}', '{"a":01}', '{"a":1,}', "{,", '{"a":tru e}', '{"a":"\x01"}',
    '{"a":"\n"}', '{"a":"\\x"}', '{"a":"\\u12G4"}', '{"a":1}}', '{"a":1} x', '{"a":-}', '{"a":1.}',
    '{"a":1e}', '{"a":.5}', '{"a":+1}', "{]", '{"a":[1,]}', '{"a":[,1]}', '{"a":nul1}', '{"a":[}', "{'a':1}",
    '{"a":NaN}', '{"a":Infinity}', "{a:1}", '{"a":1 2}', '{"a"::1}',
])
def test_texts_no_object_starts_with_are_refused(tiny_llm, byte_token, text):
    assert not all(took for took, _ in states_of(tiny_llm.tokenizer, byte_token, OBJECT, text.encode()))


@pytest.mark.parametrize("text, taken", [
    ('{ "a": [ 1, 2 ] }', True),
    ('{\n\t\t"a":\n' + " " * MAX_INDENT + '1\n}', True),
    ('{"k' + " " * 40 + '": 1}', True),  # inside strings any run of spaces
    ('{  "a": 1}', False),  # one space at most, or a newline and an indent
    ('{\n' + " " * (MAX_INDENT + 1) + '"a": 1}', False),
    ('{\n\n"a": 1}', False),
    ('{\r\n"a": 1}', False),
    ('{\t"a": 1}', False),
    (' {"a": 1}', False),  # nothing before the object
])
def test_whitespace_between_tokens_is_a_space_or_a_newline_and_an_indent(tiny_llm, byte_token, text, taken):
    states = list(states_of(tiny_llm.tokenizer, byte_token, OBJECT, text.encode()))
    assert all(took for took, _ in states) == taken
    if taken:
        assert states[-1][1]


# ------------------------------------------------------------------ JSON schemas

def schema_of(value) -> dict:
    """A strict schema that `value` follows: its types, every key required, no other keys."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: schema_of(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [schema_of(v) for v in value], "items": False,
                "minItems": len(value)}
    if value is None:
        return {"type": "null"}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[type(value)]}


def wrong(value):
    """A value of another type, which schema_of(value) refuses."""
    return "x" if value is None or isinstance(value, (bool, dict, list)) else None


@settings(max_examples=100, deadline=None)
@given(objects, st.sampled_from([None, 1]))
def test_a_schema_takes_the_objects_it_describes_and_refuses_a_wrong_type(tiny_llm, obj, indent):
    g = grammar(json_schema=schema_of(obj))
    c = follow(tiny_llm.tokenizer, g, json.dumps(obj, indent=indent, ensure_ascii=False))  # keys spelt as given
    assert c is not None and c.complete
    if obj:
        key = next(iter(obj))
        assert follow(tiny_llm.tokenizer, g, json.dumps({**obj, key: wrong(obj[key])})) is None
        assert follow(tiny_llm.tokenizer, g, json.dumps({**obj, key + "?": 1})) is None  # a key it does not have
        missing = {k: v for k, v in obj.items() if k != key}
        end = follow(tiny_llm.tokenizer, g, json.dumps(missing))
        assert end is None or not end.complete  # a required key left out


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog"]},
        "friends": {"type": "array", "items": {"$ref": "#/$defs/friend"}, "maxItems": 2},
    },
    "required": ["name", "age", "pet", "friends"],
    "additionalProperties": False,
    "$defs": {"friend": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                         "additionalProperties": False}},
}


@pytest.mark.parametrize("text, whole", [
    ('{"name": "Ann", "age": 31, "pet": "dog", "friends": [{"name": "Bo"}]}', True),
    ('{"name":"A","age":0,"pet":"cat","friends":[]}', True),
    ('{"name": "Ann", "age": 31, "pet": "dog"', False),  # a start, not the whole
    ('{"name": "Ann", "age": 31.5', None),  # an integer
    ('{"name": "Ann", "age": 151', None),  # its maximum
    ('{"name": "Ann", "age": 31, "pet": "fish"', None),  # not in the enum
    ('{"name": "", ', None),  # minLength
    ('{"name": "Ann", "age": 31, "pet": "dog", "friends": [{"name": "B"}, {"name": "C"}, ', None),  # maxItems
    ('{"name": "Ann", "age": 31, "pet": "dog", "friends": [{"nick": "B"}]', None),  # the $ref's keys
    ('{"age": 31', None),  # the schema's order: name first
    ('{"name": "Ann", "age": 31, "pet": "dog", "friends": [], "x": 1}', None),  # no other keys
])
def test_a_schema_with_refs_enums_and_bounds(tiny_llm, text, whole):
    c = follow(tiny_llm.tokenizer, grammar(json_schema=PERSON), text)
    assert (None if c is None else c.complete) == whole, text


@pytest.mark.parametrize("schema, message", [
    ({"type": "strin"}, "strin"),
    ({"type": "string", "format": "weird"}, "weird"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ("{not json", "not JSON"),
    (5, "object"),
])
def test_a_schema_that_cannot_be_followed_is_an_error(schema, message):
    with pytest.raises(CflowError, match="JSON schema") as e:
        grammar(json_schema=schema)
    assert message in str(e.value)


# ------------------------------------------------------------------ the draw

@settings(max_examples=40, deadline=None)
@given(objects, st.integers(0, 10 ** 6), st.integers(0, 2 ** 32 - 1))
def test_a_refused_draw_is_redrawn_among_the_allowed_tokens(tiny_llm, byte_token, obj, cut, seed):
    from cflow.sampling import make_sampler

    tok = tiny_llm.tokenizer
    text = json.dumps(obj, indent=1).encode()

    def at_cut():  # somewhere inside an object
        c = Constraint(tok, OBJECT)
        for b in text[:cut % len(text)]:
            c.advance(byte_token[b])
        return c

    c = at_cut()
    x = np.random.default_rng(seed).standard_normal(tiny_llm.config.vocab_size + 7).astype(np.float32)
    allowed = [t for t in range(x.size) if c.allows(t)]
    masked = c.allowed(x.size).nonzero()[0].tolist()
    # the mask: tokens the check allows; all of them but where the next bytes are forced, there
    # the tokenizer's own spelling of them ("ll" after "nu", not "l")
    assert masked and set(masked) <= set(allowed)
    top = int(np.argmax(x))  # greedy: the most likely token if allowed, else the likeliest of the mask
    assert at_cut().draw(make_sampler(temperature=0), x, []) == (top if top in allowed else max(masked, key=lambda t: x[t]))
    drawn = [at_cut().draw(make_sampler(temperature=1.0, top_k=40, seed=seed), x, []) for _ in range(2)]
    assert drawn[0] == drawn[1] and drawn[0] in allowed  # seeded: the same draw
    c.advance(drawn[0])  # and the draw took it: the same state as advancing by it
    d = at_cut()
    assert d.draw(make_sampler(temperature=1.0, top_k=40, seed=seed), x, []) == drawn[0]
    assert d.allowed(x.size).tolist() == c.allowed(x.size).tolist() and d.complete == c.complete


# ------------------------------------------------------------------ constrained generation

def test_greedy_and_seeded_answers_are_json_or_its_unfinished_start(tiny_llm):
    for kw in ({"temperature": 0}, {"seed": 1}, {"seed": 2, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}):
        chunks = list(tiny_llm.complete("Give me JSON:", max_tokens=60, json_object=True, **kw))
        ids = [i for c in chunks for i in c.token_ids]
        text = "".join(c.text for c in chunks)
        assert text == tiny_llm.tokenizer.decode(ids, skip_special_tokens=True)
        c = Constraint(tiny_llm.tokenizer, OBJECT)
        for t in ids:
            c.advance(t)  # its own tokens: each one allowed
        if chunks[-1].finish_reason == "stop":
            assert c.complete and isinstance(json.loads(text), dict)
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


def test_the_end_of_sequence_token_is_drawn_only_where_the_text_may_end(tiny_llm):
    # an integer may end after any digit: with the end favoured above all, one digit and the end
    tok = tiny_llm.tokenizer
    eos = next(iter(tok.eos_token_ids))
    chunks = list(tiny_llm.complete("x", max_tokens=30, temperature=0, json_schema={"type": "integer"},
                                    logit_bias={eos: 100}))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and isinstance(json.loads(text), int)
    assert chunks[-1].usage.completion_tokens == 1  # one digit, then the end (not counted, as OpenAI's)


def test_seeded_answers_follow_the_schema(tiny_llm):
    for seed in range(3):
        chunks = list(tiny_llm.complete("Someone:", max_tokens=120, seed=seed, temperature=1.0,
                                        json_schema=json.dumps(PERSON)))
        text = "".join(c.text for c in chunks)
        c = follow(tiny_llm.tokenizer, grammar(json_schema=PERSON), text)
        assert c is not None, text
        if chunks[-1].finish_reason == "stop":
            person = json.loads(text)
            assert list(person) == ["name", "age", "pet", "friends"] and person["pet"] in ("cat", "dog")
            assert isinstance(person["age"], int) and 0 <= person["age"] <= 150 and len(person["friends"]) <= 2


def test_a_bad_schema_fails_before_any_token(tiny_llm):
    with pytest.raises(CflowError, match="strin"):
        tiny_llm.complete("x", json_schema={"type": "strin"})


# ------------------------------------------------------------------ over HTTP

@pytest.fixture(scope="module")
def url(tiny_llm):
    with serving(tiny_llm, parallel=4) as u:
        yield u


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, SCHEMA_FORMAT])
def test_structured_outputs_over_http_batched_give_the_alone_answer(url, tiny_llm, fmt):
    import threading

    g = grammar(json_object=True) if fmt["type"] == "json_object" else grammar(json_schema=PERSON)
    body = {"messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 40,
            "temperature": 0, "response_format": fmt}
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
    c = follow(tiny_llm.tokenizer, g, text)
    assert c is not None
    if alone["choices"][0]["finish_reason"] == "stop":
        assert c.complete and isinstance(json.loads(text), dict)
    # the completions endpoint takes it too (as vLLM's)
    r = httpx.post(url + "/v1/completions", json={"prompt": "JSON:", "max_tokens": 20, "temperature": 0,
                                                  "response_format": fmt}, timeout=TIMEOUT)
    assert r.status_code == 200 and follow(tiny_llm.tokenizer, g, r.json()["choices"][0]["text"]) is not None


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ({"type": "json_schema", "json_schema": {"schema": 5}}, "schema"),
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
