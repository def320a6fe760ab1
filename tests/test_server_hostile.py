"""Hostile requests against a real `cflow serve` (uvicorn on a loopback port, the tiny real model
of conftest): every one gets a 4xx with an OpenAI error object, never a 500, a traceback, a hang
or a reset connection, and a normal request right after still gets the right answer."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from server_util import FOREVER, LONG_CTX, TIMEOUT, health, http, long_llm, metric, serving, wait_for

MAX_BODY = 256 * 1024
C, T = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
NORMAL = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def url(tiny_cflow):
    # the long context: a stream that a test leaves mid-way cannot have ended before it leaves
    with serving(long_llm(tiny_cflow), max_body=MAX_BODY) as u:
        yield u


@pytest.fixture(scope="module")
def greedy(url):
    """The normal request's answer, as the server gives it before any hostile request."""
    r = http().post(url + T, json=NORMAL)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_error(r, status, code=None, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_healthy(url, greedy):
    """A normal request right after is answered, and answered correctly."""
    r = http().post(url + T, json=NORMAL)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy and r.json()["usage"]["completion_tokens"] == 3


def post(url, path, body, headers=None):
    """body: a dict (sent as JSON) or bytes (sent as they are)."""
    if isinstance(body, (bytes, bytearray)):
        h = {"content-type": "application/json", **(headers or {})}
        return http().post(url + path, content=bytes(body), headers=h)
    return http().post(url + path, json=body, headers=headers)


# ------------------------------------------------------------------ fields of the wrong type or range
STRINGY = ["12", [1], {"a": 1}, True]  # wrong types for a number field
FIELDS = {
    "max_tokens": STRINGY + [12.5, 0, -1, -(2 ** 63)],
    "temperature": ["hot", [1.0], {}, True, -0.1, -1e-300, 2.000001, 1e308, -1e308],
    "top_p": ["1", [0.5], False, -0.1, 0, 1.5, 1e308],
    "top_k": ["5", 5.5, True, [5], -1, -(2 ** 70)],
    "min_p": ["0.1", True, -0.1, 1.01, 1e300],
    "repetition_penalty": ["1.1", True, 0, -1, -1e-320, 10.5, 1e308],
    "frequency_penalty": ["0", True, -2.5, 2.5, 1e300],
    "presence_penalty": ["0", [0], -2.01, 2.01],
    "seed": ["7", 7.5, True, [7], -1, -(2 ** 63), 2 ** 64, 10 ** 30],
    "stop": [5, True, [5], ["a", 5], {"a": 1}, ["a", "b", "c", "d", "e"], "x" * 600, ["y" * 513]],
    "n": [17, 0, -1, 10 ** 6, "1", True, 1.0],
    "stream": ["true", 1, [True], {}],
    "stream_options": ["x", [1], True, {"include_usage": "yes"}, {"include_usage": 1}],
    "model": [5, ["m"], {}, True],
    "logit_bias": [{"5": "x"}, "x", [1], 5, {"x": 1}, {"-1": 1}, {"05": 1}, {"5": 101}, {"5": -100.5}, {"5": True},
                   {str(i): 1 for i in range(1025)}, {"1000000": 1}],
    "best_of": [2, True, "1"],
    "tools": [[{"type": "function"}], "x", {}],
    "functions": [[{"name": "f"}], 3],
    "tool_choice": ["auto", {"type": "function"}, 1],
    "response_format": [{"type": 5}, "text", 5, {}, {"type": "xml"}, {"type": "json_schema"}, [{"type": "text"}]],
}
CHAT_ONLY = {
    "max_completion_tokens": ["5", True, 0, -1],
    "logprobs": ["false", 1, [True], {}],
    "top_logprobs": [1, "0", True, -1, 21, 2.0],  # 1: without logprobs true
    "echo": [True, 1, "no"],
    "parallel_tool_calls": ["true", 1, [True]],
}
COMPLETION_ONLY = {"suffix": ["x", 5, True], "logprobs": [True, "1", 6, -1, 1.5, [1]], "echo": [1, "no", [True]]}


def field_cases():
    for field, values in FIELDS.items():
        for v in values:
            yield pytest.param(C, {"messages": HI, "max_tokens": 3, field: v}, field, id=f"chat-{field}-{v!r:.20}")
            yield pytest.param(T, {"prompt": "hi", "max_tokens": 3, field: v}, field, id=f"text-{field}-{v!r:.20}")
    for field, values in CHAT_ONLY.items():
        for v in values:
            yield pytest.param(C, {"messages": HI, field: v}, field, id=f"chat-{field}-{v!r:.20}")
    for field, values in COMPLETION_ONLY.items():
        for v in values:
            yield pytest.param(T, {"prompt": "hi", field: v}, field, id=f"text-{field}-{v!r:.20}")


FIELD_CASES = list(field_cases())


@pytest.mark.parametrize("path, body, field", FIELD_CASES)
def test_a_field_of_the_wrong_type_or_range_is_a_400_naming_it(url, greedy, path, body, field):
    err = assert_error(post(url, path, body), 400, "invalid_value")
    assert err["param"] is None or err["param"].split(".")[0] == field or field in err["message"], err
    assert_healthy(url, greedy)


@pytest.mark.parametrize("max_tokens", [LONG_CTX, 2 ** 63, 10 ** 30])
def test_a_huge_max_tokens_exceeds_the_context(url, greedy, max_tokens):
    for path, body in ((C, {"messages": HI}), (T, {"prompt": "hi"})):
        assert_error(post(url, path, dict(body, max_tokens=max_tokens)), 400, "context_length_exceeded", "max_tokens")
    assert_healthy(url, greedy)


# ------------------------------------------------------------------ messages and prompts
MESSAGES = [
    ([], "messages"),
    ("hi", "messages"),
    ({"role": "user", "content": "hi"}, "messages"),
    ([5], "messages.0"),
    ([["user", "hi"]], "messages.0"),
    ([{"role": "robot", "content": "hi"}], "messages.0.role"),
    ([{"role": 5, "content": "hi"}], "messages.0.role"),
    ([{"role": "tool", "content": "hi"}], "messages.0.tool_call_id"),
    ([{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages.0.tool_calls"),
    ([{"content": "hi"}], "messages.0.role"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
    ([{"role": "user", "content": True}], "messages.0.content"),
    ([{"role": "user", "content": {"text": "hi"}}], "messages.0.content"),
    ([{"role": "user", "content": ["hi"]}], "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}], "messages.0.content.0.extra"),
    ([{"role": "user", "content": "hi", "name": 5}], "messages.0.name"),
    (HI + [{"role": "user", "content": 5}], "messages.1.content"),
]


@pytest.mark.parametrize("messages, param", MESSAGES, ids=[f"{m!r:.40}" for m, _ in MESSAGES])
def test_bad_messages(url, greedy, messages, param):
    assert_error(post(url, C, {"messages": messages, "max_tokens": 3}), 400, "invalid_value", param)
    assert_healthy(url, greedy)


def test_no_messages_and_no_prompt(url, greedy):
    assert_error(post(url, C, {"max_tokens": 3}), 400, "invalid_value", "messages")
    assert_error(post(url, T, {"max_tokens": 3}), 400, "invalid_value", "prompt")
    assert_healthy(url, greedy)


@pytest.mark.parametrize("prompt", [5, None, True, [], ["a", "b"], {"text": "hi"}, "", [-1], [1.5], [True],
                                    [[1], [2]], [[]], [1, "a"], [10 ** 6], [2 ** 40]])
def test_bad_prompts(url, greedy, prompt):
    assert_error(post(url, T, {"prompt": prompt, "max_tokens": 3}), 400, param="prompt")
    assert_healthy(url, greedy)


def test_content_as_parts_is_the_same_chat_as_a_string(url):
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    a = post(url, C, {"messages": HI, "max_tokens": 4, "temperature": 0}).json()
    b = post(url, C, {"messages": parts, "max_tokens": 4, "temperature": 0}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


# ------------------------------------------------------------------ bodies that are not a JSON object
BODIES = [
    (b"", "invalid_json"),
    (b"hello", "invalid_json"),
    (b"{bad", "invalid_json"),
    (b'{"prompt": "hi",}', "invalid_json"),
    (b'{"prompt": "hi"} {"prompt": "again"}', "invalid_json"),
    (b"\x00\x01\x02", "invalid_json"),
    (b"[]", "invalid_json"),
    (b'[{"prompt": "hi"}]', "invalid_json"),
    (b'"prompt"', "invalid_json"),
    (b"42", "invalid_json"),
    (b"null", "invalid_json"),
    (b"true", "invalid_json"),
    # not UTF-8: a stray byte, a cut sequence, an overlong form, an encoded surrogate, UTF-16
    (b'{"prompt": "\xff"}', "invalid_json"),
    (b'{"prompt": "\xc3"}', "invalid_json"),
    (b'{"prompt": "\xc0\xaf"}', "invalid_json"),
    (b'{"prompt": "\xed\xa0\x80"}', "invalid_json"),
    ('{"prompt": "hi"}'.encode("utf-16"), "invalid_json"),
    # numbers JSON does not have, or that no field can hold
    (b'{"prompt": "hi", "temperature": NaN}', "invalid_json"),
    (b'{"prompt": "hi", "temperature": Infinity}', "invalid_json"),
    (b'{"prompt": "hi", "temperature": -Infinity}', "invalid_json"),
    (b'{"prompt": "hi", "temperature": 1e400}', "invalid_json"),
    (b'{"prompt": "hi", "top_p": -1e999}', "invalid_json"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
    (b'{"prompt": "hi", "ignored": -' + b"9" * 100 + b"}", "invalid_json"),
]


@pytest.mark.parametrize("data, code", BODIES, ids=[repr(d[:30]) for d, _ in BODIES])
def test_a_body_that_is_not_a_json_object(url, greedy, data, code):
    assert_error(post(url, T, data), 400, code)
    assert_error(post(url, C, data), 400, code)
    assert_healthy(url, greedy)


def test_a_utf8_bom_and_escaped_pairs_are_fine(url, greedy):
    r = post(url, T, b"\xef\xbb\xbf" + json.dumps(NORMAL).encode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy
    emoji = json.dumps({"messages": [{"role": "user", "content": "\U0001f600 \u00e9"}], "max_tokens": 2})  # \ud83d\ude00
    assert "\\ud83d\\ude00" in emoji
    assert post(url, C, emoji.encode()).status_code == 200


# ------------------------------------------------------------------ lone surrogates
LONE = [
    (T, '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (T, '{"prompt": "abc\\udfff", "max_tokens": 2}', "prompt"),
    (T, '{"prompt": ["\\udc00"], "max_tokens": 2}', "prompt.0"),
    (T, '{"prompt": "\\ude00\\ud83d", "max_tokens": 2}', "prompt"),  # a pair in the wrong order
    (C, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (C, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud800"}]}]}',
     "messages.0.content.0.text"),
    (C, '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}', "messages.0.name"),
    (C, '{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages.0.role"),
    (T, '{"prompt": "hi", "stop": "\\udc00"}', "stop"),
    (T, '{"prompt": "hi", "stop": ["a", "\\udc00"]}', "stop.1"),
    (T, '{"prompt": "hi", "model": "\\ud800"}', "model"),
    (T, '{"prompt": "hi", "user": "\\ud800"}', "user"),  # an ignored field
    (T, '{"prompt": "hi", "metadata": {"a": [{"b": "\\ud800"}]}}', "metadata.a.0.b"),
    (T, '{"prompt": "hi", "\\ud800": 1}', None),  # a key
]


@pytest.mark.parametrize("path, text, param", LONE, ids=[t for _, t, _ in LONE])
def test_a_lone_surrogate_anywhere_is_a_400(url, greedy, path, text, param):
    err = assert_error(post(url, path, text.encode()), 400, "invalid_value", param)
    assert "surrogate" in err["message"]
    assert_healthy(url, greedy)


# ------------------------------------------------------------------ deep nesting
def nested(depth, open_=b"[", close=b"]", inner=b"1"):
    return open_ * depth + inner + close * depth


DEEP = [
    ("ignored-array-1000", b'{"prompt": "hi", "x": ' + nested(1000) + b"}"),
    ("ignored-array-100000", b'{"prompt": "hi", "x": ' + nested(100000) + b"}"),
    ("ignored-object-1000", b'{"prompt": "hi", "x": ' + nested(1000, b'{"a":', b"}") + b"}"),
    ("ignored-object-10000", b'{"prompt": "hi", "x": ' + nested(10000, b'{"a":', b"}") + b"}"),
    ("used-prompt", b'{"prompt": ' + nested(1000, inner=b'"hi"') + b"}"),
    ("used-stream-options", b'{"prompt": "hi", "stream_options": ' + nested(1000, b'{"a":', b"}") + b"}"),
    ("used-messages", b'{"messages": ' + nested(1000, inner=b'{"role": "user", "content": "hi"}') + b"}"),
    ("just-over", b'{"prompt": "hi", "x": ' + nested(64) + b"}"),  # 65 levels with the body's own object
    ("unclosed", b'{"prompt": "hi", "x": ' + b"[" * 100000),
    ("unbalanced", b"]" * 1000 + b"[" * 1000),
]


@pytest.mark.parametrize("data", [d for _, d in DEEP], ids=[n for n, _ in DEEP])
def test_deep_nesting_is_a_400_without_recursion(url, greedy, data):
    for path in (T, C):
        assert_error(post(url, path, data), 400, "invalid_json")
    assert_healthy(url, greedy)


def test_nesting_up_to_the_limit_and_brackets_in_strings_are_fine(url, greedy):
    at_limit = b'{"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "x": ' + nested(63) + b"}"
    r = post(url, T, at_limit)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy
    # brackets in strings (escaped quotes and backslashes among them) are text, not nesting
    for text in ("[" * 1000, '\\"' + "{" * 1000, "\\\\" + "[" * 1000, '"\\' * 500 + "[" * 1000):
        body = {"prompt": text, "max_tokens": 2, "stop": ["[" * 3], "user": "{" * 500}
        assert post(url, T, json.dumps(body).encode()).status_code == 200, text[:10]


# ------------------------------------------------------------------ content types, endpoints, methods
@pytest.mark.parametrize("ctype", ["multipart/form-data; boundary=x", "application/xml", "image/png",
                                   "application/octet-stream", "application/json; charset=latin-1",
                                   "application/json; charset=utf-16"])
def test_a_content_type_that_is_not_json_is_a_415(url, greedy, ctype):
    for path in (T, C):
        r = http().post(url + path, content=json.dumps(NORMAL).encode(), headers={"content-type": ctype})
        assert_error(r, 415, "unsupported_media_type")
    assert_healthy(url, greedy)


@pytest.mark.parametrize("ctype", [None, "application/json; charset=UTF-8", "text/plain",
                                   "application/x-www-form-urlencoded", "application/vnd.api+json"])
def test_json_under_another_type_curl_sends_is_read(url, greedy, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    r = http().post(url + T, content=json.dumps(NORMAL).encode(), headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/nothing", 404, "not_found"),
    ("POST", "/v1/nothing", 404, "not_found"),
    ("POST", "/v1/chat/completions/extra", 404, "not_found"),
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("PUT", C, 405, "method_not_allowed"),
    ("DELETE", C, 405, "method_not_allowed"),
    ("PATCH", "/health", 405, "method_not_allowed"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
    ("OPTIONS", T, 405, "method_not_allowed"),
    ("PROPFIND", T, 405, "method_not_allowed"),
    ("GET", "/v1/models/no-such-model", 404, "model_not_found"),
    ("GET", "/v1/models/%ff%fe", 404, "model_not_found"),
    ("GET", "/static/../../../etc/passwd", 404, "not_found"),
    ("GET", "/static/%2e%2e/%2e%2e/etc/passwd", 404, "not_found"),
    ("GET", "/static/no-such-file.js", 404, "not_found"),
])
def test_unknown_endpoints_and_methods(url, greedy, method, path, status, code):
    r = http().request(method, url + path, content=json.dumps(NORMAL).encode())
    assert_error(r, status, code)
    assert_healthy(url, greedy)


def test_a_method_no_http_parser_knows_is_refused(url, greedy):
    """httptools (the C parser `cflow serve` runs) refuses a method token it does not know before
    the app sees it; h11 passes it on and the app says 405."""
    from cflow.commands.serve import http_stack

    r = http().request("BREW", url + T, content=json.dumps(NORMAL).encode())
    if http_stack()[1] == "httptools":
        assert r.status_code == 400 and "Invalid HTTP request" in r.text, (r.status_code, r.text)
    else:
        assert_error(r, 405, "method_not_allowed")
    assert_healthy(url, greedy)


# ------------------------------------------------------------------ sampling settings at the edges
@pytest.mark.parametrize("settings", [{"temperature": 5e-324}, {"temperature": 1e-310}, {"temperature": 1e-300},
                                      {"temperature": 5e-324, "top_k": 40, "top_p": 0.5}])
def test_a_denormal_temperature_is_greedy(url, greedy, settings):
    r = post(url, T, dict(NORMAL, **settings))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy  # the limit of softmax(logits / T) as T -> 0


@pytest.mark.parametrize("settings", [{"repetition_penalty": 1e-320, "temperature": 1},
                                      {"repetition_penalty": 1e-320, "temperature": 5e-324},
                                      {"repetition_penalty": 1e-300, "temperature": 1e-10, "top_k": 5},
                                      {"repetition_penalty": 10, "temperature": 2, "top_p": 5e-324, "min_p": 1},
                                      {"frequency_penalty": 5e-324, "presence_penalty": -5e-324, "temperature": 1},
                                      {"top_k": 2 ** 70, "temperature": 1}, {"top_k": 1, "temperature": 2},
                                      {"seed": 0, "temperature": 1}, {"seed": 2 ** 64 - 1, "temperature": 1}])
def test_extreme_but_valid_settings_generate(url, greedy, settings):
    # seeded where the case sets no seed of its own, so that a failure can be replayed; a draw
    # at temperature 1 may pick the end-of-sequence token before the 8th token (unseeded, about
    # one run in ten), and that is a valid end too
    body = {"prompt": "Once upon a time once upon a time", "max_tokens": 8, "seed": 1, **settings}
    r = post(url, T, body)
    assert r.status_code == 200, r.text
    n, finish = r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]
    assert (n, finish) == (8, "length") or (n < 8 and finish == "stop")
    assert_healthy(url, greedy)


# ------------------------------------------------------------------ bodies over the limit
def _exchange(url, head: str, pieces):
    """Send a request on a plain socket as a client that writes its whole body before reading
    (urllib does): the head, then each piece; then read the answer to the end. Returns (status,
    headers, body). A connection reset (the server closing with unread data) raises."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode())
        for piece in pieces:
            sock.sendall(piece)
        data = bytearray()
        while chunk := sock.recv(1 << 16):
            data += chunk
    head_bytes, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body


def _assert_413(status, headers, body):
    assert status == 413
    assert len(body) == int(headers["content-length"])  # all of it arrived before the connection closed
    err = json.loads(body)["error"]
    assert err["code"] == "body_too_large" and err["type"] == "invalid_request_error" and err["message"]


def test_a_50_mb_body_gets_a_readable_413(url, greedy):
    big = b"x" * (50 << 20)
    # urllib asks to close the connection and writes the whole body before it reads
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url + T, data=big, method="POST",
                                                      headers={"Content-Type": "application/json"}), timeout=TIMEOUT)
    assert e.value.code == 413 and json.loads(e.value.read())["error"]["code"] == "body_too_large"
    # the same with keep-alive, and with a plain socket that reads only after its last byte
    r = http().post(url + C, content=big, headers={"content-type": "application/json"})
    assert_error(r, 413, "body_too_large")
    head = (f"POST {T} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(big)}\r\n"
            "Connection: close\r\n\r\n")
    _assert_413(*_exchange(url, head, [big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]))
    assert_healthy(url, greedy)


def _chunked(total, piece=64 * 1024):
    for _ in range(total // piece):
        yield b"%x\r\n" % piece + b"x" * piece + b"\r\n"
    yield b"0\r\n\r\n"


@pytest.mark.parametrize("close", [True, False])
def test_a_chunked_body_over_the_limit_gets_a_readable_413(url, greedy, close):
    head = (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            f"{'Connection: close' if close else 'X-Keep: alive'}\r\n\r\n")
    _assert_413(*_exchange(url, head, _chunked(8 * MAX_BODY)))
    r = http().post(url + T, content=(b"x" * 4096 for _ in range(2 * MAX_BODY // 4096)))  # httpx streams it chunked
    assert_error(r, 413, "body_too_large")
    assert_healthy(url, greedy)


def test_a_413_before_100_continue_is_read_without_sending_the_body(url, greedy):
    head = (f"POST {T} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {50 << 20}\r\n"
            "Expect: 100-continue\r\n\r\n")
    _assert_413(*_exchange(url, head, []))  # the server answers and closes: no body was ever sent
    assert_healthy(url, greedy)


def test_a_body_just_under_the_limit_is_read(url, greedy):
    pad = MAX_BODY - len(json.dumps(dict(NORMAL, user=""))) - 1
    r = post(url, T, json.dumps(dict(NORMAL, user="u" * pad)).encode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy


# ------------------------------------------------------------------ clients that leave
def _requests(url, endpoint, status):
    return metric(url, "cflow_requests_total", f'endpoint="{endpoint}",status="{status}"')


def test_a_client_that_leaves_mid_body(url, greedy):
    before = _requests(url, "completions", "499")
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST {T} HTTP/1.1\r\nHost: x\r\nContent-Length: 10000\r\nExpect: 100-continue\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 100")  # the server is reading the body now
        sock.sendall(b'{"prompt": "hi')
    wait_for(lambda: _requests(url, "completions", "499") == before + 1, what="the abandoned body to be counted")
    assert_healthy(url, greedy)


@pytest.mark.parametrize("path, body", [(C, {"messages": HI}), (T, {"prompt": "Once upon a time"})])
def test_a_client_that_leaves_mid_stream(url, greedy, path, body):
    cancelled = metric(url, "cflow_generations_cancelled_total")
    with http().stream("POST", url + path, json=dict(body, max_tokens=FOREVER, stream=True, temperature=0)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
    # the stream is closed mid-answer: the generation stops and its slot frees
    wait_for(lambda: metric(url, "cflow_generations_cancelled_total") == cancelled + 1, what="the cancel")
    wait_for(lambda: health(url)["active"] == 0, what="the slot to free")
    assert_healthy(url, greedy)


def test_a_client_that_leaves_before_a_whole_answer(url, greedy):
    cancelled = metric(url, "cflow_generations_cancelled_total")
    u = urlsplit(url)
    data = json.dumps({"prompt": "Once upon a time", "max_tokens": FOREVER}).encode()
    with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST {T} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_for(lambda: health(url)["active"] == 1, what="the generation to start")
    wait_for(lambda: metric(url, "cflow_generations_cancelled_total") == cancelled + 1, what="the cancel")
    wait_for(lambda: health(url)["active"] == 0, what="the slot to free")
    assert_healthy(url, greedy)


def test_garbage_http_does_not_hurt_the_server(url, greedy):
    # not HTTP at all: uvicorn answers 400 (plain text: the app never sees it) and closes
    for junk in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello
                 b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"):
        u = urlsplit(url)
        with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT) as sock:
            sock.sendall(junk)
            answer = bytearray()
            while chunk := sock.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
    assert_healthy(url, greedy)


# ------------------------------------------------------------------ the whole suite, for memory
def _suite_once(url):
    """One pass over the hostile requests above that stay small (the client's own buffers would
    blur the server's memory)."""
    for p in FIELD_CASES:
        path, body, _ = p.values
        assert 400 <= post(url, path, body).status_code < 500
    for messages, _ in MESSAGES:
        assert post(url, C, {"messages": messages, "max_tokens": 3}).status_code == 400
    for data, _ in BODIES:
        assert post(url, T, data).status_code == 400
    for path, text, _ in LONE:
        assert post(url, path, text.encode()).status_code == 400
    for _, data in DEEP:
        assert post(url, T, data).status_code == 400
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    _assert_413(*_exchange(url, head, _chunked(2 * MAX_BODY)))
    with http().stream("POST", url + T, json=dict(NORMAL, max_tokens=FOREVER, stream=True)) as r:
        next(r.iter_lines())
    wait_for(lambda: health(url)["active"] == 0, what="the stream's slot to free")


def test_memory_stays_flat_over_the_hostile_suite(url, greedy):
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()  # the server runs in a thread of this process
    _suite_once(url)  # warm-up: every code path, allocator and cache has run once
    _suite_once(url)
    before = proc.memory_info().rss
    for _ in range(3):
        _suite_once(url)
    after = proc.memory_info().rss
    print(f"RSS over three passes of the hostile suite: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    assert after < before * 1.05, f"RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB"
    assert_healthy(url, greedy)
    assert health(url)["queued"] == 0
