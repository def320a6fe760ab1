"""Tool calls (cflow.tools): the two formats' prompts, grammars and answers on the tiny real model
of conftest, and the chat API's `tools`, `tool_choice` and `parallel_tool_calls` over HTTP (the
openai client reads the answers)."""

from __future__ import annotations

import json

import httpx
import pytest
from cflow.errors import CflowError
from cflow.generate import generate_step
from cflow.tools import _BLOCK, AnswerStream, ToolCalling, native
from hypothesis import example, given, settings
from hypothesis import strategies as st
from server_util import TIMEOUT, serving

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                           "required": ["tz"], "additionalProperties": False}}
PING = {"name": "ping"}  # no parameters: an empty object
TOOLS = [WEATHER, TIME, PING]

# a template in the Hermes convention (Qwen 2.5's): it renders the tools and writes calls in
# <tool_call> blocks, tool results in <tool_response> blocks
HERMES = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "Tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call them as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def follows(call: dict) -> bool:
    """Whether a call (OpenAI's shape) names a tool and its arguments follow that tool's schema."""
    args = json.loads(call["function"]["arguments"])
    name = call["function"]["name"]
    if name == "get_weather":
        return set(args) == {"city", "days"} and len(args["city"]) <= 12 and 1 <= args["days"] <= 7
    if name == "get_time":
        return args == {"tz": "UTC"} or args == {"tz": "CET"}
    return name == "ping" and isinstance(args, dict)


def answer(llm, calling: ToolCalling, messages, max_tokens=200, **sampling) -> tuple[str, str]:
    """The model's answer (text, finish_reason) to messages under calling, as the server makes it."""
    text = llm.render_chat(calling.messages(messages), tools=calling.template_tools())
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    g = calling.grammar(llm.tokenizer)
    chunks = list(generate_step(llm.engine, llm.engine.new_state(), llm.tokenizer, ids, max_tokens=max_tokens,
                                **sampling, **({} if g is None else {"grammar": g})))
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


ASK = [{"role": "user", "content": "Weather in Paris?"}]


# ------------------------------------------------------------------ the formats

def test_a_template_that_renders_tools_in_tool_call_blocks_is_native(tiny_llm):
    assert native(HERMES) and not native(tiny_llm.chat_template) and not native(None)


@pytest.mark.parametrize("is_native", [False, True])
@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), ("get_time", True),
                                              ("ping", False)])
def test_calls_that_must_be_made_name_a_tool_and_follow_its_schema(tiny_llm, is_native, choice, parallel):
    calling = ToolCalling(TOOLS, choice, parallel, native=is_native)
    ended = 0
    for seed in range(6):
        text, finish = answer(tiny_llm, calling, ASK, temperature=1.0, seed=seed)
        content, calls = calling.parse(text)
        if finish != "stop":
            continue  # cut by max_tokens: the random model may write long strings, or many calls
        ended += 1
        assert calls and content is None, text
        assert all(follows(c) for c in calls), calls
        assert len(calls) == 1 or parallel
        if choice not in ("auto", "required"):
            assert {c["function"]["name"] for c in calls} == {choice}
        assert len({c["id"] for c in calls}) == len(calls) and all(c["id"].startswith("call_") for c in calls)
    assert ended >= 2  # most answers end: the checks above ran


def test_generic_auto_answers_are_calls_or_a_response(tiny_llm):
    calling = ToolCalling(TOOLS, "auto", True, native=False)
    kinds = set()
    for seed in range(6):
        text, finish = answer(tiny_llm, calling, ASK, temperature=1.0, seed=seed)
        if finish == "stop":
            got = json.loads(text)
            content, calls = calling.parse(text)
            if "tool_calls" in got:
                assert content is None and calls and all(follows(c) for c in calls)
            else:
                assert set(got) == {"response"} and content == (got["response"] or None) and not calls
            kinds |= set(got)
    assert kinds == {"tool_calls", "response"}  # these seeds give both kinds


@pytest.mark.parametrize("is_native", [False, True])
@pytest.mark.parametrize("text, taken", [
    ('{ "name": "ping", "arguments": {} }', True),
    ('{\n  "name": "ping",\n  "arguments": {}\n}', True),
    ('{\r', False),  # the JSON whitespace rule of cflow.structured, inside the calls' grammar too
    ('{  "name"', False),
])
def test_calls_keep_the_json_whitespace_rule(tiny_llm, is_native, text, taken):
    from cflow.structured import follow

    calling = ToolCalling(TOOLS, "ping", False, native=is_native)
    head = "<tool_call>\n" if is_native else '{"tool_calls": ['
    assert (follow(tiny_llm.tokenizer, calling.grammar(tiny_llm.tokenizer), head + text) is not None) == taken


def test_native_auto_answers_are_free_text():
    calling = ToolCalling(TOOLS, "auto", True, native=True)
    assert calling.grammar(None) is None


def test_the_native_answer_is_read_as_vllms_hermes_parser_reads_it():
    calling = ToolCalling(TOOLS, "auto", True, native=True)
    text = ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n<tool_call>{"name": "ping", broken</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 2}"}</tool_call>')
    content, calls = calling.parse(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    # an unknown tool's block and one that does not parse stay in the text
    assert content == ('Let me look.\n\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n'
                       '<tool_call>{"name": "ping", broken</tool_call>')
    assert calling.parse("Sunny.") == ("Sunny.", [])
    # a whole answer that is one call's JSON without its markers
    content, calls = calling.parse(' {"name": "ping", "arguments": {}} ')
    assert content is None and calls[0]["function"] == {"name": "ping", "arguments": "{}"}
    assert calling.parse('{"name": "other", "arguments": {}}')[1] == []


def test_the_generic_answer_is_read_from_its_json():
    calling = ToolCalling(TOOLS, "auto", True, native=False)
    content, calls = calling.parse('{"tool_calls": [{"name": "ping", "arguments": {}}]}')
    assert content is None and calls[0]["function"] == {"name": "ping", "arguments": "{}"}
    assert calling.parse('{"response": "Sunny."}') == ("Sunny.", [])
    # cut by max_tokens: the response as far as it came, else the text as it came
    assert calling.parse('{"response": "Sun\\u00e9 \\u00') == ("Suné ", [])
    assert calling.parse('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])


# ---- answers streamed (AnswerStream): the content as it comes adds up to the answer's

_PIECES = ["Sure", ",", " ", "\n", "it is", " <", "tool", "<tool_", "{", "}", "<tool_call>", "</tool_call>",
           '\n{"name": "ping", "arguments": {}}\n', '{"name": "get_time", "arguments": {"tz": "UTC"}}',
           '{"name": "nope", "arguments": {}}', "é", "😀"]


def _streamed(calling: ToolCalling, text: str, cuts: list[int], finish: str, constrained: bool = False):
    """(content sent piece by piece, the rest at the end, finish, calls, every call delta) of text
    fed in pieces cut at cuts."""
    reader, sent, deltas, at = AnswerStream(calling, constrained), [], [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        piece, more = reader.feed(text[at:c])
        sent.append(piece)
        deltas += more
        at = max(at, c)
    rest, finish, more, calls = reader.end(finish)
    return "".join(sent), rest, finish, calls, deltas + more


def _gathered(deltas) -> list[tuple[str, str]]:
    """(name, arguments) of each call, its deltas gathered by index as OpenAI's clients gather them."""
    calls: dict[int, list] = {}
    for d in deltas:
        f = d.get("function", {})
        if d["index"] not in calls:
            assert d["index"] == len(calls) and d["type"] == "function" and d["id"].startswith("call_"), d
            calls[d["index"]] = [f["name"], ""]
        else:
            assert "name" not in f and "id" not in d, d  # a call's head comes once
        calls[d["index"]][1] += f.get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]


def _names(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _read(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(_PIECES), max_size=12), cuts=st.lists(st.integers(0, 300), max_size=8))
@example(parts=["Sure", _PIECES[12], "<tool_call>", _PIECES[12], "</tool_call>"], cuts=[])  # content holds a call's JSON
@example(parts=["<tool_call>", _PIECES[14], "</tool_call>", "<tool_call>", _PIECES[12], "</tool_call>"], cuts=[5])
def test_native_content_streamed_adds_up_to_the_answers_content(parts, cuts):
    calling = ToolCalling(TOOLS, "auto", True, native=True)
    text = "".join(parts)
    sent, rest, finish, calls, deltas = _streamed(calling, text, cuts, "stop")
    content, whole = calling.parse(text)
    assert sent + rest == (content or "")
    assert _names(calls) == _names(whole) == _gathered(deltas) and finish == ("tool_calls" if whole else "stop")
    # no part of a call went out as content: what went out is the text with the calls' blocks cut
    # out; the text around them stays, with any call written there without its markers
    assert sent + rest == _without_blocks(text, _names(calls))


def _without_blocks(text: str, calls: list[tuple[str, str]]) -> str:
    """text with the <tool_call> blocks that hold `calls` (in order) cut out, stripped."""
    kept, at, pending = [], 0, list(calls)
    for m in _BLOCK.finditer(text):
        try:
            c = json.loads(m.group(1))
        except ValueError:
            continue
        if pending and isinstance(c, dict) and c.get("name") == pending[0][0] \
                and c.get("arguments", {}) == json.loads(pending[0][1]):
            kept.append(text[at:m.start()])
            at = m.end()
            pending.pop(0)
    if pending and pending == calls and len(calls) == 1:  # the whole answer one call without its markers
        return ""
    assert not pending, calls
    return ("".join(kept) + text[at:]).strip()


_BLOCKS = ['<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
           '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
           '<tool_call>\n{"arguments": {"city": "Nice \\"\\u00e9\\" }", "days": 2}, "name": "get_weather"}\n</tool_call>']


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(["Sure", ",", " ", "\n", "it is", " <", "<tool_", "é", "😀"] + _BLOCKS),
                      max_size=10),
       cut=st.integers(0, 400), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_native_calls_streamed_as_written_add_up_to_the_answers_calls(parts, cut, cuts):
    """Blocks a grammar keeps valid (ToolCalling.block_grammar) go out as they are written: the
    deltas add up to the calls, whatever the pieces; uncut, they are parse's."""
    calling = ToolCalling(TOOLS, "auto", True, native=True)
    text = "".join(parts)
    text, finish = (text, "stop") if cut >= len(text) else (text[:cut], "length")
    sent, rest, finish_out, calls, deltas = _streamed(calling, text, cuts, finish, constrained=True)
    whole_sent, whole_rest, _, whole_calls, _ = _streamed(calling, text, [], finish, constrained=True)
    assert _gathered(deltas) == _names(calls) == _names(whole_calls) and sent + rest == whole_sent + whole_rest
    if finish == "stop":
        content, made = calling.parse(text)
        assert _read(calls) == _read(made) and sent + rest == (content or "")
    assert finish_out == ("tool_calls" if calls and finish == "stop" else finish)


_ARGS = st.dictionaries(st.text(st.sampled_from('ab"\\é😀 '), max_size=4),
                        st.one_of(st.integers(-10**6, 10**6), st.text(max_size=6), st.booleans(), st.none(),
                                  st.lists(st.integers(), max_size=3), st.floats(allow_nan=False, allow_infinity=False)),
                        max_size=3)


@settings(max_examples=400, deadline=None)
@given(args=st.lists(_ARGS, max_size=3), response=st.text(max_size=12), ascii_only=st.booleans(),
       indent=st.sampled_from([None, 1, 2]), cut=st.integers(0, 300), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_generic_calls_streamed_as_written_add_up_to_the_answers_calls(args, response, ascii_only, indent, cut, cuts):
    calling = ToolCalling(TOOLS, "auto", True, native=False)
    whole = {"tool_calls": [{"name": "ping", "arguments": a} for a in args]} if args else {"response": response}
    text = json.dumps(whole, ensure_ascii=ascii_only, indent=indent)
    text, finish = (text, "stop") if cut >= len(text) else (text[:cut], "length")
    sent, rest, finish_out, calls, deltas = _streamed(calling, text, cuts, finish, constrained=True)
    whole_sent, whole_rest, _, whole_calls, _ = _streamed(calling, text, [], finish, constrained=True)
    assert _gathered(deltas) == _names(calls) == _names(whole_calls) and sent + rest == whole_sent + whole_rest
    if finish == "stop":
        assert [json.loads(c["function"]["arguments"]) for c in calls] == args and sent + rest == ("" if args else response)
    elif calls:  # cut: the last call's arguments as far as they were written
        assert text.endswith(calls[-1]["function"]["arguments"]) or calls[-1]["function"]["arguments"] in text
        assert sent + rest == ""


@settings(max_examples=400, deadline=None)
@given(response=st.text(st.one_of(st.sampled_from('a é😀"\\\n'), st.characters()), max_size=20),
       ascii_only=st.booleans(), cut=st.integers(0, 200), calls=st.booleans(),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_generic_response_streamed_adds_up_to_the_answers_content(response, ascii_only, cut, calls, cuts):
    calling = ToolCalling(TOOLS, "auto", True, native=False)
    whole = {"tool_calls": [{"name": "ping", "arguments": {}}]} if calls else {"response": response}
    text = json.dumps(whole, ensure_ascii=ascii_only)
    text, finish = (text, "stop") if cut >= len(text) else (text[:cut], "length")  # max_tokens cuts it
    sent, rest, finish_out, got, _ = _streamed(calling, text, cuts, finish)
    content, made = calling.parse(text)
    assert sent + rest == (content or "") and _names(got) == _names(made)
    if finish == "stop" and not calls:
        assert sent + rest == response
    assert finish_out == ("tool_calls" if made and finish == "stop" else finish)


def test_content_goes_out_before_the_answer_ends():
    native_ = AnswerStream(ToolCalling(TOOLS, "auto", True, native=True))
    assert [native_.feed(p)[0] for p in ["It", " is", " <tool", "_call>", "\n{"]] == ["It", " is", "", "", ""]
    generic = AnswerStream(ToolCalling(TOOLS, "auto", True, native=False))
    assert [generic.feed(p)[0] for p in ['{"resp', 'onse": "Su', "n\\u00", "e9", '."}']] == ["", "Su", "n", "é", "."]
    pair = AnswerStream(ToolCalling(TOOLS, "auto", True, native=False))  # a surrogate pair's halves wait for each other
    assert [pair.feed(p)[0] for p in ['{"response": "\\ud83d', "\\ude00", '"}']] == ["", "😀", ""]
    held = AnswerStream(ToolCalling(TOOLS, "required", True, native=False))  # calls only: no content streams
    assert held.feed('{"response": "x') == ("", [])


@pytest.mark.parametrize("is_native", [False, True])
def test_calls_go_out_as_they_are_written(is_native):
    reader = AnswerStream(ToolCalling(TOOLS, "auto", True, native=is_native), constrained=True)
    head = ["Let me check.", "<tool_call>", "\n"] if is_native else ['{"tool_calls": [']
    out = [reader.feed(p) for p in head + ['{"name": "get_', 'time", "argu', 'ments": {"tz', '": "UTC"}}']]
    content = "".join(c for c, _ in out)
    assert content == ("Let me check." if is_native else "")
    deltas = [d for _, ds in out[len(head):] for d in ds]
    assert out[len(head)][1] == [] and [len(ds) for _, ds in out[len(head) + 1:]] == [1, 1, 1]
    call_id = deltas[0]["id"]
    assert deltas == [
        {"index": 0, "id": call_id, "type": "function", "function": {"name": "get_time", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"tz'}},
        {"index": 0, "function": {"arguments": '": "UTC"}'}}]
    rest, finish, more, calls = reader.end("stop")
    assert (rest, finish, more) == ("", "tool_calls", [])
    assert calls == [{"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]


CALLED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
    {"role": "tool", "content": "Snow.", "tool_call_id": "call_1"},
]


def test_generic_messages_list_the_tools_and_carry_calls_and_results_as_json():
    calling = ToolCalling(TOOLS, "auto", False, native=False)
    out = calling.messages(CALLED)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(WEATHER) in out[0]["content"] and "(one call)" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo",
                                                                                                  "days": 1}}]}
    assert out[3]["role"] == "user" and json.loads(out[3]["content"]) == {
        "tool_response": {"name": "get_weather", "content": "Snow."}}
    required = ToolCalling(TOOLS, "get_time", True, native=False).messages(CALLED[1:2])
    assert required[0]["role"] == "system" and "the tool get_time" in required[0]["content"]


def test_native_messages_go_to_the_template_in_its_shape(tiny_llm):
    calling = ToolCalling(TOOLS, "auto", True, native=True)
    out = calling.messages(CALLED)
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "days": 1}  # a dict: `| tojson`
    llm = _with_template(tiny_llm.__class__, tiny_llm, HERMES)
    text = llm.render_chat(out, tools=calling.template_tools())
    assert '"name": "get_time"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in text
    assert "<tool_response>\nSnow.\n</tool_response>" in text


def test_a_tool_whose_parameters_cannot_be_followed_is_an_error(tiny_llm):
    bad = [{"name": "f", "parameters": {"type": "objekt"}}]
    for is_native in (False, True):
        with pytest.raises(CflowError, match="tools: .*objekt"):
            ToolCalling(bad, "required", True, native=is_native).grammar(tiny_llm.tokenizer)
    with pytest.raises(CflowError, match="arguments are not JSON"):
        ToolCalling(TOOLS, "auto", True, native=True).messages(
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}])


def _with_template(cls, llm, template: str):
    """The tiny model with another chat template (a second LLM of the same file)."""
    other = cls(str(llm.file.path), n_ctx=llm.n_ctx, quiet=True)
    other.chat_template, other._template = template, None
    return other


# ------------------------------------------------------------------ the Python API: LLM.chat(tools=)

def _joined(deltas) -> dict:
    """LLM.chat's streamed deltas gathered into its message, as OpenAI's clients gather them."""
    message, calls = {"role": "assistant", "content": None}, []
    for d in deltas:
        if "content" in d:
            message["content"] = (message["content"] or "") + d["content"]
        calls += d.get("tool_calls", [])
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(_gathered(calls))]
    return message


def _without_ids(message: dict) -> dict:
    return dict(message, tool_calls=[c["function"] for c in message.get("tool_calls") or []])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_chat_with_tools_returns_a_message_with_its_calls(tiny_llm, choice):
    tools = [{"type": "function", "function": t} for t in TOOLS]
    kw = dict(tools=tools, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, max_tokens=200)
    message = tiny_llm.chat(ASK, seed=3, **kw)
    assert set(message) <= {"role", "content", "tool_calls"} and message["role"] == "assistant"
    if choice != "auto":
        assert message["content"] is None and len(message["tool_calls"]) == 1 and follows(message["tool_calls"][0])
        if isinstance(choice, dict):
            assert message["tool_calls"][0]["function"]["name"] == "get_time"
    # streamed: deltas that add up to the same message; and what the server answers
    assert _without_ids(_joined(tiny_llm.chat(ASK, seed=3, stream=True, **kw))) == _without_ids(message)
    made = ToolCalling([t["function"] for t in tools], choice if isinstance(choice, str) else "get_time", False,
                       native=False)
    sampling = dict(tiny_llm.generation_defaults, temperature=1.0, seed=3)
    content, calls = made.parse(answer(tiny_llm, made, ASK, max_tokens=200, **sampling)[0])
    assert (content, _read(calls)) == (message["content"], _read(message.get("tool_calls") or []))
    if message.get("tool_calls"):  # the message goes back as it is, the results after it
        turn = [*ASK, message, *({"role": "tool", "tool_call_id": c["id"], "content": "Sunny."}
                                 for c in message["tool_calls"])]
        assert tiny_llm.chat(turn, tools=tools, max_tokens=8, temperature=0)["role"] == "assistant"


def test_chat_with_tools_none_answers_as_without_them(tiny_llm):
    plain = tiny_llm.chat(ASK, max_tokens=8, temperature=0)
    none = tiny_llm.chat(ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert none == {"role": "assistant", "content": plain}


@pytest.mark.parametrize("kw, message", [
    ({"tools": [{"name": "bad name"}]}, "name of 1-64"),
    ({"tools": [WEATHER, WEATHER]}, "one name"),
    ({"tools": [{"name": "f", "parameters": "x"}]}, "JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "sometimes"),
    ({"tools": [], "tool_choice": "required"}, "needs tools"),
    ({"tools": [{"name": "f", "parameters": {"type": "objekt"}}]}, "objekt"),
])
def test_chat_with_tools_that_cannot_be_used_is_an_error(tiny_llm, kw, message):
    with pytest.raises(CflowError, match=message):
        tiny_llm.chat(ASK, max_tokens=4, **kw)


# ------------------------------------------------------------------ over HTTP

@pytest.fixture(scope="module")
def url(tiny_llm):
    with serving(tiny_llm, parallel=2) as u:
        yield u


def chat(url, **body):
    body.setdefault("messages", ASK)
    return httpx.post(url + "/v1/chat/completions", json=dict({"max_tokens": 120, "temperature": 0}, **body),
                      timeout=TIMEOUT)


def test_the_openai_client_reads_tool_calls_streamed_or_not(url):
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT)
    tools = [{"type": "function", "function": t} for t in TOOLS]
    # one call (the random model, free to add calls, adds them until max_tokens)
    made = client.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=200)
    choice = made.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = [c.model_dump() for c in choice.message.tool_calls]
    assert calls and all(follows(c) for c in calls)
    streamed = client.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                              parallel_tool_calls=False, temperature=0, max_tokens=200, stream=True)
    got, finish, pieces = {}, None, 0
    for chunk in streamed:
        for d in chunk.choices:
            pieces += len(d.delta.tool_calls or [])
            _gather(got, d.delta.tool_calls)
            finish = d.finish_reason or finish
    assert finish == "tool_calls"
    assert [got[i] for i in sorted(got)] == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert pieces > 2 * len(calls)  # each call's arguments in several pieces, as they were written
    # the next turn carries the call and its result
    turn = [*ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Sunny."}]
    r = chat(url, messages=turn, tools=tools)
    assert r.status_code == 200, r.text


def _gather(calls: dict, deltas) -> None:
    """The openai client's tool call deltas into calls: {index: (name, arguments so far)}."""
    for c in deltas or []:
        name, args = calls.get(c.index, (c.function.name, ""))
        calls[c.index] = (name, args + (c.function.arguments or ""))


def _answers(url, seed, **body):
    """The unstreamed answer (content, calls, finish) and the streamed one, with the content's
    pieces as they came, read by the openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT)
    body = dict(dict(model="x", messages=ASK, temperature=1.0, seed=seed, max_tokens=120,
                     tools=[{"type": "function", "function": t} for t in TOOLS]), **body)
    choice = client.chat.completions.create(**body).choices[0]
    whole = (choice.message.content or "", [(c.function.name, c.function.arguments)
                                            for c in choice.message.tool_calls or []], choice.finish_reason)
    pieces, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for d in chunk.choices:
            pieces += [d.delta.content] if d.delta.content else []
            _gather(calls, d.delta.tool_calls)
            finish = d.finish_reason or finish
    return whole, ("".join(pieces), [calls[i] for i in sorted(calls)], finish), pieces


def test_tool_answers_stream_their_content_as_it_comes(url, tiny_llm):
    """Under "auto" a streamed answer's content comes piece by piece, its calls as they are
    written, and both are the unstreamed answer's; generic format (the tiny model's template),
    then native."""
    kinds = set()
    for seed in range(6):
        whole, streamed, pieces = _answers(url, seed)
        assert streamed == whole, seed
        kinds.add("calls" if whole[1] else "streamed" if len(pieces) > 1 else "short")
    assert {"calls", "streamed"} <= kinds  # these seeds give both
    with serving(_with_template(tiny_llm.__class__, tiny_llm, HERMES)) as u:
        whole, streamed, pieces = _answers(u, 0)
    assert streamed == whole and not whole[1] and len(pieces) > 1


def test_a_named_tool_choice_calls_that_tool_once_without_parallel_calls(url):
    tools = [{"type": "function", "function": t} for t in TOOLS]
    for seed in range(3):
        r = chat(url, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}},
                 parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["function"]["name"] == "get_time" and follows(calls[0])


def test_tool_choice_none_answers_in_text(url):
    tools = [{"type": "function", "function": t} for t in TOOLS]
    plain = chat(url, max_tokens=8).json()["choices"][0]
    none = chat(url, tools=tools, tool_choice="none", max_tokens=8).json()["choices"][0]
    assert none == plain  # the tools are not shown: the same prompt, the same answer


def test_a_block_grammar_keeps_each_block_its_trigger_opens_to_a_call(tiny_llm):
    """Native, "auto": the answer is free, but each <tool_call> it writes opens a block kept to a
    call of a given tool (a logit bias makes the random model write the marker); without
    parallel calls the answer ends after the first."""
    tok = tiny_llm.tokenizer
    for parallel in (False, True):
        calling = ToolCalling(TOOLS, "auto", parallel, native=True)
        block = calling.block_grammar(tok)
        assert block is not None and block.trigger == tok.encode("<tool_call>")[0] and block.once == (not parallel)
        ids = tok.encode(tiny_llm.render_chat(calling.messages(ASK), tools=calling.template_tools()),
                         add_special_tokens=False)
        chunks = list(generate_step(tiny_llm.engine, tiny_llm.engine.new_state(), tok, ids, max_tokens=150,
                                    temperature=1.0, seed=1, logit_bias={block.trigger: 100.0}, block_grammar=block))
        text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        content, calls = calling.parse(text)
        assert calls and all(follows(c) for c in calls), text
        if parallel:  # blocks, each a call, until max_tokens cuts one
            assert finish == "length" and len(calls) >= 2 and text.count("<tool_call>") == len(calls) + 1
        else:
            assert finish == "stop" and len(calls) == 1 and content is None and text.endswith("</tool_call>")
    # without the grammar the random model writes no call after its marker
    chunks = list(generate_step(tiny_llm.engine, tiny_llm.engine.new_state(), tok, ids, max_tokens=40,
                                temperature=1.0, seed=1, logit_bias={block.trigger: 100.0}))
    assert calling.parse("".join(c.text for c in chunks))[1] == []


def test_native_calls_under_auto_stream_as_they_are_written(tiny_llm):
    llm = _with_template(tiny_llm.__class__, tiny_llm, HERMES)
    bias = {str(tiny_llm.tokenizer.encode("<tool_call>")[0]): 100}
    with serving(llm) as u:
        whole, streamed, _ = _answers(u, 2, logit_bias=bias, parallel_tool_calls=False, max_tokens=150)
        r = httpx.post(u + "/v1/chat/completions", timeout=TIMEOUT, json=dict(
            messages=ASK, tools=[{"type": "function", "function": t} for t in TOOLS], logit_bias=bias,
            parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=2, stream=True))
    assert streamed == whole and whole[0] == "" and whole[2] == "tool_calls" and len(whole[1]) == 1
    assert follows({"function": {"name": whole[1][0][0], "arguments": whole[1][0][1]}})
    deltas = [d for line in r.text.splitlines() if line.startswith("data: {")
              for c in json.loads(line[6:])["choices"] for d in c["delta"].get("tool_calls") or []]
    assert len(deltas) > 2 and deltas[0]["function"]["arguments"] == ""  # the head, then the arguments in pieces


def test_a_native_template_gets_the_tools_and_its_calls_are_read(tiny_llm):
    llm = _with_template(tiny_llm.__class__, tiny_llm, HERMES)
    with serving(llm) as u:
        r = chat(u, tools=[{"type": "function", "function": TIME}], tool_choice="required", max_tokens=200).json()
        prompt = httpx.post(u + "/tokenize", json={"messages": ASK}, timeout=TIMEOUT).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert all(follows(c) for c in choice["message"]["tool_calls"]) and choice["message"]["content"] is None
    # the tools went into the prompt: it is longer than the same messages' without them
    assert r["usage"]["prompt_tokens"] > prompt["count"]


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": WEATHER}] * 2}, "tools", "one name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "type"),
    ({"response_format": {"type": "json_object"}}, "tool_choice", "not both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, None, "objekt"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "required"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ping", "arguments": "{"}}]}]}, "messages", "JSON"),
])
def test_tools_that_cannot_be_used_are_a_400(url, body, param, message):
    full = {"tools": [{"type": "function", "function": t} for t in TOOLS], **body}
    r = chat(url, **{k: v for k, v in full.items() if v is not None})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    if param is not None:
        assert (err["param"] or "").startswith(param), err


def test_completions_take_no_tools(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                  "tools": [{"type": "function", "function": PING}]}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
