"""`cflow serve` over real HTTP: a uvicorn server on a loopback port, the official `openai`
client, and a tiny real model (conftest). Waits are on server state (/health, /metrics); the
only clock is TIMEOUT, a bound on a hang."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from server_util import FOREVER, TIMEOUT, health, http, long_llm, metric, serving, wait_for

HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url(tiny_llm):
    with serving(tiny_llm, max_body=64 * 1024) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def long(tiny_cflow):
    """The tiny model with a context so long that a FOREVER stream never ends by itself: it holds
    its slot until the test lets go."""
    return long_llm(tiny_cflow)


def chat_prompt_tokens(llm, messages):
    return len(llm.tokenizer.encode(llm.render_chat(messages), add_special_tokens=False))


def test_chat_completion(client, tiny_llm):
    r = client.chat.completions.create(model="any", messages=HI, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny-llama"
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason == "length"  # the tiny model's greedy answer never ends early (tiny_model.py)
    assert r.usage.prompt_tokens == chat_prompt_tokens(tiny_llm, HI)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streamed_chat_equals_the_whole_answer(client):
    whole = client.chat.completions.create(model="any", messages=HI, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="any", messages=HI, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_logprobs_whole_and_streamed_spell_the_answer(client, tiny_llm):
    # the model's own log-probabilities, whatever the sampling: a tempered, seeded draw's tokens
    # get the logprobs greedy decoding would see, and the most likely tokens of each step
    kw = dict(model="any", messages=HI, max_tokens=12, temperature=1.5, seed=11, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 12
    spelt = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")  # the draws end mid-character
    assert spelt == whole.choices[0].message.content
    for t in content:
        assert t.token == bytes(t.bytes).decode("utf-8", "replace") and t.logprob <= 0
        top = [x.logprob for x in t.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and t.logprob <= top[0]
        assert sum(np.exp(top)) <= 1 + 1e-6
    assert any(t.logprob < t.top_logprobs[0].logprob for t in content)  # the draw left greedy somewhere
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in streamed] == \
           [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in content]
    plain = client.chat.completions.create(model="any", messages=HI, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_completions_shape(url):
    r = http().post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10,
                                                   "temperature": 0, "logprobs": 2})
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"] and len(lp["tokens"]) == 10
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # greedy: the most likely (two tokens that hold parts of characters both read U+FFFD: one entry)
        assert 1 <= len(top) <= 2 and top[tok] == v == max(top.values())


def test_an_echo_scores_the_prompt_as_an_evaluation_harness_asks(url, tiny_llm):
    # lm-evaluation-harness's loglikelihood: prompt = context + continuation, echo, logprobs 1,
    # max_tokens 0 or 1; the continuation's logprob is the sum over its tokens
    from cflow.sampling import log_softmax

    text = "Once upon a time there was a little fox"
    r = http().post(url + "/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1})
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == text and "".join(lp["tokens"]) == text and r.json()["usage"]["completion_tokens"] == 0
    ids = tiny_llm.tokenizer.encode(text, add_special_tokens=True)
    ref = log_softmax(tiny_llm.engine.forward(tiny_llm.engine.new_state(), ids, all_logits=True))
    bos = int(ids[0] == tiny_llm.tokenizer.bos_token_id and tiny_llm.tokenizer.add_bos)
    want = [None if j == 0 else ref[j - 1, ids[j]] for j in range(bos, len(ids))]
    got = lp["token_logprobs"]
    assert len(got) == len(want) and (got[0] is None) == (want[0] is None)
    assert all(abs(g - w) < 1e-4 for g, w in zip(got, want) if w is not None)
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
    # with a token generated and streamed: the prompt comes first, then the completion
    body = {"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    whole = http().post(url + "/v1/completions", json=body).json()["choices"][0]
    assert whole["text"].startswith(text) and whole["logprobs"]["token_logprobs"][:len(got)] == got
    with http().stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as s:
        chunks = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(x["text"] for x in chunks) == whole["text"]
    assert [v for x in chunks for v in x["logprobs"]["token_logprobs"]] == whole["logprobs"]["token_logprobs"]
    bad = http().post(url + "/v1/completions", json={"prompt": text, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_prompt_of_token_ids_is_that_prompt(url, tiny_llm):
    text = "Once upon a time there was"
    ids = tiny_llm.tokenizer.encode(text, add_special_tokens=True)

    def answer(prompt, **kw):
        r = http().post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    assert answer(ids)["text"] == answer([ids])["text"] == answer(text)["text"]
    echo = answer(ids, echo=True, logprobs=0, max_tokens=0)
    lp = echo["logprobs"]
    assert echo["text"] == tiny_llm.tokenizer.decode(ids) and len(lp["tokens"]) == len(ids)  # every id, a BOS too
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]


def test_the_tokenizer_endpoints_are_the_models_tokenizer(client, url, tiny_llm):
    # vLLM's /tokenize, /detokenize, /tokenizer_info (llama-server's field names too): what
    # lm-evaluation-harness's remote tokenizer reads, and what the completions count
    tok = tiny_llm.tokenizer
    text = "Once upon a time, héllo 🤗"
    got = http().post(url + "/tokenize", json={"prompt": text}).json()
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == tiny_llm.n_ctx
    special = http().post(url + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert special == tok.encode(text, add_special_tokens=True)
    back = http().post(url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == back["content"] == text
    chat = http().post(url + "/tokenize", json={"messages": HI}).json()
    used = client.chat.completions.create(model="any", messages=HI, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used
    info = http().get(url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.token_text(min(tok.eos_token_ids)) and info["add_bos_token"] == tok.add_bos
    assert "messages" in info["chat_template"]
    for path, body, param in [("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": HI}, None),
                              ("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens.0"),
                              ("/detokenize", {"tokens": [10 ** 6]}, "tokens"), ("/detokenize", {}, "tokens")]:
        r = http().post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_logit_bias_bans_and_forces_tokens_and_leaves_logprobs_the_models(url):
    def answer(**kw):
        r = http().post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 6,
                                                       "temperature": 0, "logprobs": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    plain = answer()
    first = plain["logprobs"]["tokens"][0]
    tok_id = http().post(url + "/tokenize", json={"prompt": first}).json()["tokens"]
    assert len(tok_id) == 1
    banned = answer(logit_bias={str(tok_id[0]): -100})
    assert banned["logprobs"]["tokens"][0] != first
    forced = answer(logit_bias={str(tok_id[0]): 100}, temperature=1.0, seed=1)
    assert forced["logprobs"]["tokens"] == [first] * 6  # +100 all but forces it, even when sampling
    assert forced["logprobs"]["token_logprobs"][0] == plain["logprobs"]["token_logprobs"][0]  # the model's own
    assert max(forced["logprobs"]["token_logprobs"][1:]) < -0.01  # not the biased distribution's ~0


def test_n_choices_each_draw_as_their_own_request_with_the_next_seed(client):
    # n choices decode side by side; choice i of a seeded request is the n=1 request of seed + i
    kw = dict(model="any", messages=HI, max_tokens=10, temperature=1.2)
    many = client.chat.completions.create(**kw, n=3, seed=40)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**kw, seed=40 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == alone and len(set(alone)) > 1
    one = client.chat.completions.create(**kw, seed=40)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 30 and many.usage.total_tokens == many.usage.prompt_tokens + 30
    chunks = list(client.chat.completions.create(**kw, n=3, seed=40, stream=True, stream_options={"include_usage": True}))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(d.delta.content or "" for d in mine) == alone[i]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    greedy = client.completions.create(model="any", prompt="Once upon a time", max_tokens=8, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text and [c.index for c in greedy.choices] == [0, 1]


def test_stream_ends_with_done(url):
    body = {"messages": HI, "max_tokens": 3, "stream": True}
    with http().stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_completion_and_stop_string(client, tiny_llm):
    r = client.completions.create(model="any", prompt="Once upon a time", max_tokens=20, temperature=0)
    text = r.choices[0].text
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20
    assert r.usage.prompt_tokens == len(tiny_llm.tokenizer.encode("Once upon a time", add_special_tokens=True))
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    r2 = client.completions.create(model="any", prompt="Once upon a time", max_tokens=20, temperature=0, stop=[stop])
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt="Once upon a time", max_tokens=20, temperature=0, stop=stop, stream=True))
    assert streamed == r2.choices[0].text


def test_seed_makes_sampling_repeatable(client):
    kw = dict(model="any", prompt="The quick", max_tokens=12, temperature=1.0, top_p=0.9,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b


def test_frequency_and_presence_penalties_are_openais(client, tiny_llm):
    """Additive, on the answer's tokens (as vLLM and llama.cpp apply them): the tokens of
    LLM.complete with the same penalties, beside a repetition penalty too."""
    def tokens(**kw):
        r = client.completions.create(model="any", prompt="Once upon a time", max_tokens=24, temperature=0,
                                      logprobs=0, **kw)
        return r.choices[0].logprobs.tokens

    def alone(**kw):
        chunks = tiny_llm.complete("Once upon a time", max_tokens=24, temperature=0, **kw)
        return [tiny_llm.tokenizer.token_bytes(t).decode("utf-8", "replace") for c in chunks for t in c.token_ids]

    plain = tokens()
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 1.5, "frequency_penalty": -0.5}):
        assert tokens(**kw) == alone(**kw)
    both = {"frequency_penalty": 1.0, "presence_penalty": 1.0}
    assert tokens(**both, extra_body={"repetition_penalty": 1.3}) == alone(**both, repetition_penalty=1.3)
    assert tokens(presence_penalty=2.0) != plain  # the random model repeats itself greedily


def test_models_health_metrics(client, url, tiny_llm):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    h = health(url)
    assert h["status"] == "ok" and h["slots"] == 1 and h["queued"] == 0
    m = http().get(url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("cflow_requests_total", "cflow_completion_tokens_total", "cflow_decode_tokens_per_second_bucket",
                 "cflow_queue_length", "cflow_active_generations"):
        assert name in m.text


@pytest.mark.parametrize("body, status, param, code", [
    ({"messages": HI, "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ({"messages": HI, "max_tokens": "12"}, 400, "max_tokens", "invalid_value"),
    ({"messages": HI, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ({"messages": HI, "temperature": 7}, 400, "temperature", "invalid_value"),
    ({"messages": HI, "n": 17}, 400, "n", "invalid_value"),
    ({"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content.0.type", "invalid_value"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"max_tokens": 5}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x" * 20000}]}, 400, "messages", "context_length_exceeded"),
])
def test_bad_chat_requests_get_openai_errors(client, body, status, param, code):
    extra = {k: v for k, v in body.items() if k != "messages"}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="any", messages=body.get("messages", openai.NOT_GIVEN),
                                       extra_body=extra)
    assert e.value.status_code == status
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["param"] == param
    assert err["message"]


@pytest.mark.parametrize("data, status, code", [
    (b'{"prompt": "hi", ', 400, "invalid_json"),
    (b'["prompt"]', 400, "invalid_json"),
    (b"\xff\xfe", 400, "invalid_json"),
    (b'{"prompt": 42}', 400, "invalid_value"),
    (b'{"prompt": "' + b"a" * 70000 + b'"}', 413, "body_too_large"),
])
def test_bad_bodies(url, data, status, code):
    r = http().post(url + "/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


def test_chunked_body_over_the_limit(url):
    def body():
        for _ in range(100):
            yield b"x" * 1024
    r = http().post(url + "/v1/completions", content=body())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_unknown_routes_and_methods(url):
    r = http().get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http().get(url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = http().get(url + "/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_server_survives_bad_requests(client, url):
    for _ in range(3):
        assert http().post(url + "/v1/chat/completions", content=b"{bad").status_code == 400
        assert http().post(url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    r = client.completions.create(model="any", prompt="still alive?", max_tokens=3)
    assert r.usage.completion_tokens == 3
    assert health(url)["active"] == 0


def test_api_key(tiny_llm):
    with serving(tiny_llm, api_key="s3cret") as u:
        bad = openai.OpenAI(base_url=u + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert http().post(u + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert http().get(u + "/metrics").status_code == 401
        assert http().post(u + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert http().get(u + "/tokenizer_info").status_code == 401
        assert http().get(u + "/health").status_code == 200  # liveness stays open
        good = openai.OpenAI(base_url=u + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="any", prompt="x", max_tokens=2).usage.completion_tokens == 2


def _raw_request(url, path, body):
    """A POST sent on a plain socket, its answer never read: the caller hangs up with close()."""
    import json
    import socket
    from urllib.parse import urlsplit

    host, port = urlsplit(url).hostname, urlsplit(url).port
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _long_stream(url):
    """A streamed chat request of FOREVER tokens (served by the `long` model it never ends by
    itself); returns (client, response) once its first token has arrived. (The line iterator is
    kept on the response: collecting it would close the stream.)"""
    c = httpx.Client(timeout=TIMEOUT)
    body = {"messages": HI, "max_tokens": FOREVER, "temperature": 0, "stream": True}
    r = c.send(c.build_request("POST", url + "/v1/chat/completions", json=body), stream=True)
    r.lines = r.iter_lines()
    assert next(r.lines).startswith("data: ")
    return c, r


def test_disconnect_frees_the_slot_for_the_next_queued_request(long):
    with serving(long, max_concurrency=1) as u:
        client = openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        c, stream = _long_stream(u)
        done = {}

        def queued():
            done["r"] = client.completions.create(model="any", prompt="next", max_tokens=5, temperature=0)

        t = threading.Thread(target=queued)
        t.start()
        wait_for(lambda: health(u)["queued"] == 1, what="the second request to queue")
        assert health(u)["active"] == 1 and "r" not in done
        stream.close()  # the client leaves mid-stream
        c.close()
        t.join(TIMEOUT)
        assert done["r"].usage.completion_tokens == 5
        assert metric(u, "cflow_generations_cancelled_total") == 1
        assert metric(u, "cflow_completion_tokens_total") == 5  # the long one never finished
        wait_for(lambda: health(u)["active"] == 0, what="the slot to free")


def test_queue_is_first_come_first_served_and_a_queued_client_can_leave(long):
    with serving(long, max_concurrency=1) as u:
        c, stream = _long_stream(u)
        order = []

        def ask(i):
            # Each queued client streams a long answer and, at its first token, notes its turn and
            # leaves: the next client's generation can only start after that, so `order` is the
            # server's order, whatever the client threads' scheduling.
            c, r = _long_stream(u)
            order.append(i)
            r.close()
            c.close()

        threads = []
        for i in range(3):
            threads.append(threading.Thread(target=ask, args=(i,)))
            threads[-1].start()
            wait_for(lambda: health(u)["queued"] == i + 1, what=f"request {i} to queue")
        # a fourth client gives up while queued (it hangs up once it is in the queue): it leaves the queue
        impatient = _raw_request(u, "/v1/completions", {"prompt": "impatient", "max_tokens": 3})
        wait_for(lambda: health(u)["queued"] == 4, what="the impatient client to queue")
        impatient.close()
        wait_for(lambda: health(u)["queued"] == 3, what="the impatient client to leave the queue")
        stream.close()
        c.close()
        for th in threads:
            th.join(TIMEOUT)
        assert order == [0, 1, 2]
        # all five left early: the long stream, the three queued streams and the impatient client
        wait_for(lambda: metric(u, "cflow_generations_cancelled_total") == 5, what="five cancelled requests")
        assert metric(u, "cflow_completion_tokens_total") == 0
        assert health(u)["queued"] == 0


@pytest.mark.parametrize("parallel", [2, 1])
def test_choices_stream_as_slots_allow_and_a_client_that_leaves_cancels_them_all(long, parallel):
    # two choices of endless streams: with two slots both stream; with one the first streams at
    # once and the second waits in the queue for its slot. Hanging up takes both away.
    with serving(long, parallel=parallel) as u:
        c = httpx.Client(timeout=TIMEOUT)
        body = {"messages": HI, "max_tokens": FOREVER, "temperature": 0, "stream": True, "n": 2}
        r = c.send(c.build_request("POST", u + "/v1/chat/completions", json=body), stream=True)
        indexes = (json.loads(x[6:])["choices"][0]["index"] for x in r.iter_lines() if x.startswith("data: {"))
        if parallel == 2:
            seen = set()
            while seen != {0, 1}:
                seen.add(next(indexes))
        else:
            assert list(itertools.islice(indexes, 3)) == [0, 0, 0]
        h = health(u)
        assert (h["active"], h["queued"]) == ((2, 0) if parallel == 2 else (1, 1))
        r.close()
        c.close()
        wait_for(lambda: health(u)["active"] == 0 and health(u)["queued"] == 0, what="both choices to leave")
        assert metric(u, "cflow_generations_cancelled_total") == 2


def test_queue_limit_gives_503(long):
    with serving(long, max_concurrency=1, max_queue=0) as u:
        c, stream = _long_stream(u)
        r = http().post(u + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        stream.close()
        c.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_engine_threads_carry_their_names(url, tiny_cflow):
    """The OS names of the threads that run the model (top -H, perf, and bench load's CPU split
    read them): the batcher thread of a running server, the pool's workers, and any thread that
    names itself (cut at 15 characters as Linux keeps them)."""
    from cflow._native import core

    def names():
        out = set()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                out.add(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        return out

    assert http().post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert "cflow-batcher" in names()
    got = {}

    def named():
        core.set_thread_name("cflow-a-name-longer-than-15")
        got["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert got["comm"] == "cflow-a-name-lo"
    from cflow.llm import LLM

    two = LLM(str(tiny_cflow), threads=2, quiet=True)  # a pool of two: one worker, alive while it is
    two.generate("x", max_tokens=1)
    assert "cflow-pool" in names()
    del two


def test_bench_load_reports_a_clean_run(url, capsys):
    import os

    from cflow.cli import main

    # the server runs in a thread of this process: its memory is this process's
    rc = main(["bench", "load", "--url", url, "--pid", str(os.getpid()), "--clients", "3", "--requests", "2",
               "--max-tokens", "4", "--stream"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "3 clients x 2 requests = 6" in out
    assert "errors      0 server (5xx or dropped), 0 other" in out
    assert "latency     p50" in out and "server RSS  before" in out
    assert "  cpu         server and load clients (one process) " in out
    tokens = int(out.split("throughput  ")[1].split()[0])
    assert 6 <= tokens <= 24  # 1..4 completion tokens per request, summed from the streamed usage
    # choices and logprobs, streamed and not: every choice's tokens are counted
    for stream in (["--stream"], []):
        rc = main(["bench", "load", "--url", url, "--clients", "2", "--requests", "2", "--max-tokens", "4",
                   "--n", "3", "--logprobs", "2", *stream])
        out = capsys.readouterr().out
        assert rc == 0 and "n 3, logprobs 2" in out and "errors      0 server (5xx or dropped), 0 other" in out
        assert 12 <= int(out.split("throughput  ")[1].split()[0]) <= 48
    # JSON mode: every answer is checked (a closed object must parse)
    for stream in (["--stream"], []):
        rc = main(["bench", "load", "--url", url, "--clients", "2", "--requests", "2", "--max-tokens", "24",
                   "--json", "1", *stream])
        out = capsys.readouterr().out
        assert rc == 0 and "JSON json_object 1 of them" in out, out
        assert "json mode   4 answers" in out and ", 0 do not)" in out
        assert "errors      0 server (5xx or dropped, or JSON that does not parse), 0 other" in out
    # a JSON schema: its answers too (an array of at most two integers)
    rc = main(["bench", "load", "--url", url, "--clients", "2", "--requests", "2", "--max-tokens", "24",
               "--json", "1", "--json-schema", '{"type": "array", "items": {"type": "integer"}, "maxItems": 2}'])
    out = capsys.readouterr().out
    assert rc == 0 and "JSON json_schema 1 of them" in out and "json schema 4 answers" in out, out
    assert ", 0 do not)" in out and "errors      0 server (5xx or dropped, or JSON that does not parse), 0 other" in out
    assert main(["bench", "load", "--url", url, "--json-schema", "{}"]) == 2  # a schema for no requests
    # tools: every call is checked (a named tool, arguments that parse as an object)
    rc = main(["bench", "load", "--url", url, "--clients", "2", "--requests", "2", "--max-tokens", "60",
               "--tools", "1", "--stream"])
    out = capsys.readouterr().out
    assert rc == 0 and "tools 1 of them" in out and "tools       4 answers" in out, out
    assert ", 0 not;" in out and "errors      0 server (5xx or dropped, or calls that do not), 0 other" in out
    assert main(["bench", "load", "--url", url, "--json", "0.5", "--tools", "0.6"]) == 2  # more than all
