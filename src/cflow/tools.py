"""Tool calls (function calling): OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The model answers either in text or with calls of the functions it was given, each a name and
JSON arguments. How it writes them depends on its chat template, so there are two formats:
- native: a template that renders `tools` itself and writes calls as `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` (Hermes; Qwen 2, 2.5 and 3): the template gets the tools and
  the earlier turns' calls and results as it expects them; the answer's blocks are read back.
- generic, for every other template (llama.cpp's generic format): a system message lists the
  tools and asks for one JSON object, `{"tool_calls": [{"name", "arguments"}]}` or
  `{"response": "..."}`; the answer is constrained to that JSON (cflow.structured), so it is
  always one of the two, and read from it. Earlier calls and results become that JSON too.

`tool_choice`: "none" (the tools are not shown; free text), "auto" (the model decides; the
default with tools), "required" (at least one call) or `{"type": "function", "function":
{"name": n}}` (a call of n). Where the answer must be calls, or in the generic format, a grammar
constrains it: each call's name is one of the tools' (that one, when named) and its arguments
follow that tool's `parameters` schema; `parallel_tool_calls` false allows one call. In the
native format under "auto" the text is free; where `<tool_call>` is a token of its own, each
block it opens is kept to a call by a grammar from the marker on (`block_grammar`), else a block
whose JSON does not parse, or that names no given tool, stays in the text (as vLLM's hermes
parser leaves it); an answer that is nothing but one call's JSON without the markers (small
models write that) is that call.

Read as it comes (`AnswerStream`), an answer sends its content as it is written (native, the
text up to the first `<tool_call>`, a marker's first characters held back until they are seen
not to be one, an answer that starts with `{` held whole: it may be a call without markers;
generic, the `response` string decoded as it grows) and, where a grammar keeps every call a call
(`calls_constrained`), each call as it is written: its head once its name is whole, then its
arguments' JSON text in pieces, as OpenAI streams them; elsewhere calls go out at the end. An
unstreamed answer is read the same way in one piece, so a stream adds up to it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from cflow.errors import CflowError
from cflow.structured import grammar as json_grammar
from cflow.structured import BlockGrammar, lark_grammar, lark_json, matcher_tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')  # the generic format's answer in text, up to its string
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without parameters

GENERIC_PROMPT = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    "Answer with one JSON object: {{\"tool_calls\": [{{\"name\": \"a tool's name\", \"arguments\": {{...}}}}]}} "
    "to call tools{alone}, or {{\"response\": \"your answer\"}} to answer without them.")
GENERIC_REQUIRED = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    "Answer with one JSON object that calls {which}: "
    "{{\"tool_calls\": [{{\"name\": \"a tool's name\", \"arguments\": {{...}}}}]}}.")


NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # a tool's name, as OpenAI's API allows it


def native(template: str | None) -> bool:
    """Whether a chat template renders tools and writes calls in <tool_call> blocks."""
    return bool(template) and OPEN in template and re.search(r"\btools\b", template) is not None


@dataclass
class ToolCalling:
    """A chat request's tools: what they make of its messages, its grammar and its answer.

    tools: OpenAI function definitions ({"name", "description", "parameters"}); choice: "auto",
    "required" or a tool's name; parallel: whether an answer may make several calls; native: the
    template's own format (native()) or the generic one."""

    tools: list[dict]
    choice: str
    parallel: bool
    native: bool

    @property
    def must_call(self) -> bool:
        return self.choice != "auto"

    def _callable(self) -> list[dict]:
        return [t for t in self.tools if self.choice in ("auto", "required") or t["name"] == self.choice]

    # ---- the prompt
    def template_tools(self) -> list[dict] | None:
        """The `tools` a native template renders (OpenAI's shape, as transformers passes them)."""
        return [{"type": "function", "function": t} for t in self.tools] if self.native else None

    def messages(self, messages: list[dict]) -> list[dict]:
        """The conversation as the template is to see it: earlier calls and tool results in the
        native template's shape, or as the generic format's JSON after a system message that
        lists the tools."""
        names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
        out = []
        for m in messages:
            m = dict(m)
            calls = m.pop("tool_calls", None) or []
            if self.native:
                if calls:
                    m["tool_calls"] = [{"type": "function", "id": c["id"], "function": {
                        "name": c["function"]["name"], "arguments": _arguments(c)}} for c in calls]
                m["content"] = m.get("content") or ""
            elif calls:
                m["content"] = json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": _arguments(c)}
                                                          for c in calls]}, ensure_ascii=False)
            elif m["role"] == "tool":
                m = {"role": "user", "content": json.dumps({"tool_response": {
                    "name": names.get(m.get("tool_call_id")), "content": m.get("content") or ""}}, ensure_ascii=False)}
            elif m["role"] == "assistant":
                m["content"] = json.dumps({"response": m.get("content") or ""}, ensure_ascii=False)
            out.append(m)
        if not self.native:
            listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
            if self.must_call:
                which = "tools" if self.choice == "required" else f"the tool {self.choice}"
                text = GENERIC_REQUIRED.format(tools=listed, which=which)
            else:
                text = GENERIC_PROMPT.format(tools=listed, alone="" if self.parallel else " (one call)")
            if out and out[0]["role"] == "system":
                out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + text)
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    # ---- the answer
    def call_schema(self) -> dict:
        """The JSON schema of one call: a callable tool's name and its arguments."""
        return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                            "arguments": t.get("parameters") or NO_PARAMETERS},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for t in self._callable()]}

    def grammar(self, tok) -> str | None:
        """The grammar the answer follows (cflow.structured); None: free text (native, "auto").
        CflowError for a tool whose parameters schema cannot be followed."""
        try:
            return self._grammar(tok)
        except CflowError as e:
            raise CflowError(f"tools: {e}") from None

    def _grammar(self, tok) -> str | None:
        if self.native:
            if not self.must_call:
                return None
            opener = _token_or_text(tok, OPEN)
            closer = _token_or_text(tok, CLOSE)
            more = ' ("\\n" call)*' if self.parallel else ""  # a newline between calls, and one may end them
            return lark_grammar(f"start: call{more} \"\\n\"?\ncall: {opener} \"\\n\" body \"\\n\" {closer}\n"
                                f"body: {lark_json(self.call_schema())}\n")
        calls = {"type": "array", "items": self.call_schema(), "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        calling = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                   "additionalProperties": False}
        if self.must_call:
            return json_grammar(json_schema=calling)
        answering = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                     "additionalProperties": False}
        return json_grammar(json_schema={"anyOf": [calling, answering]})

    def block_grammar(self, tok) -> BlockGrammar | None:
        """Native, "auto": the grammar of each <tool_call> block the answer opens (a call of a given
        tool, then </tool_call>; one block without parallel calls), where the marker is a token of
        its own, as Qwen's is; None elsewhere (the answer is free, its blocks read as they come)."""
        if not self._lazy_blocks(tok):
            return None
        return BlockGrammar(tok.encode(OPEN)[0],
                            lark_grammar(f'start: "\\n" body "\\n" {_token_or_text(tok, CLOSE)}\n'
                                         f"body: {lark_json(self.call_schema())}\n"), once=not self.parallel)

    def calls_constrained(self, tok) -> bool:
        """Whether a grammar keeps every call the answer makes a call of a given tool (the generic
        format, calls that must be made, native blocks under block_grammar): its calls can then
        go out as they are written (AnswerStream)."""
        return not self.native or self.must_call or self._lazy_blocks(tok)

    def _lazy_blocks(self, tok) -> bool:
        """Native, "auto", and <tool_call> a token of its own: each block gets block_grammar."""
        return self.native and not self.must_call and _token_or_text(tok, OPEN) == OPEN

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of an answer: the text left (None when nothing is) and the calls, each
        {"id", "type": "function", "function": {"name", "arguments": JSON text}} as OpenAI's."""
        names = {t["name"] for t in self.tools}
        if not self.native:
            try:
                got = json.loads(text)
            except ValueError:  # unfinished (max_tokens): the response written so far, else as it came
                m = _RESPONSE.match(text)
                return (_string_piece(text, m.end())[0] if m else text) or None, []
            if isinstance(got, dict) and isinstance(got.get("tool_calls"), list):
                return None, [_call(c["name"], c["arguments"]) for c in got["tool_calls"]]
            return (got.get("response") if isinstance(got, dict) else None) or None, []
        calls, kept, at = [], [], 0
        for m in _BLOCK.finditer(text):
            try:
                c = json.loads(m.group(1))
            except ValueError:
                continue
            if not (isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments", {}), (dict, str))):
                continue
            kept.append(text[at:m.start()])
            at = m.end()
            calls.append(_call(c["name"], c.get("arguments", {})))
        kept.append(text[at:])
        content = "".join(kept).strip()
        if not calls:  # a call written without its markers (small models do): the whole answer is one
            try:
                c = json.loads(content)
            except ValueError:
                c = None
            if isinstance(c, dict) and set(c) == {"name", "arguments"} and c["name"] in names:
                return None, [_call(c["name"], c["arguments"])]
        return content or None, calls


def calling_for(tools: list[dict] | None, tool_choice=None, parallel_tool_calls: bool = True,
                template: str | None = None) -> ToolCalling | None:
    """The ToolCalling of OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (the Python
    API's; the server checks them with its request schema) for a model's chat template; None when
    no tool may be called (none given, or "none"). A tool is `{"type": "function", "function":
    {"name", "description", "parameters"}}` or the function's dict alone. CflowError names what
    is wrong."""
    fns = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else t
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and NAME.fullmatch(f["name"])):
            raise CflowError(f"tools[{i}]: a function with a name of 1-64 letters, digits, _ or - is needed")
        if not isinstance(f.get("parameters", {}), (dict, type(None))):
            raise CflowError(f"tools[{i}]: parameters must be a JSON schema (a dict)")
        fns.append({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None})
    names = [f["name"] for f in fns]
    if len(set(names)) < len(names):
        raise CflowError("tools: two tools have one name")
    choice = tool_choice or "auto"
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name")
        if choice not in names:
            raise CflowError(f"tool_choice: no tool is named {choice!r}")
    elif choice not in ("none", "auto", "required"):
        raise CflowError(f"tool_choice: 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {tool_choice!r}")
    if choice == "required" and not fns:
        raise CflowError("tool_choice: 'required' needs tools")
    if not fns or choice == "none":
        return None
    return ToolCalling(fns, choice, bool(parallel_tool_calls), native(template))


class AnswerStream:
    """An answer under tools read as its text comes: feed(piece) gives the content that is sure
    to be content and the calls' deltas, end(finish_reason) the rest of both, the finish reason
    and the whole calls. An unstreamed answer is read by one feed and end, so it says what a
    streamed one adds up to.

    constrained (ToolCalling.calls_constrained): a grammar keeps every call a call of a given
    tool, so each call goes out as it is written, as OpenAI's do: its id, type and name once the
    name is whole, then its arguments' JSON text in pieces, as the model writes it (the grammar
    keeps it valid; an answer cut by max_tokens ends with the part written). Otherwise (native
    blocks in free text, which may not parse or may name no tool) the calls are read from the
    whole answer at its end (ToolCalling.parse) and go out then."""

    def __init__(self, calling: ToolCalling, constrained: bool = False):
        self.calling, self.constrained, self.text, self.sent = calling, constrained, "", ""
        self._at = None  # generic: where the response string's undecoded part starts (once it has begun)
        self._lead = 0  # native: where the content starts (its leading whitespace skipped)
        self._open, self._sought_open = -1, 0  # native: the first marker, where to look for it next
        self.calls: list[dict] = []  # the calls that went out, OpenAI's shape, their arguments so far
        self._json = _Json() if constrained and not calling.native else None  # generic: the answer's JSON
        self._blocks: list[_Block] = []  # native, constrained: the <tool_call> blocks, in order
        self._sought = 0  # native, constrained: where the next block's marker may start

    def _new_content(self) -> str:
        """The content written since the last call that no later text can make part of a call
        (each call reads only what came since, but for trailing whitespace)."""
        if self.calling.must_call:
            return ""
        text = self.text
        if not self.calling.native:  # the response string, decoded as far as its escapes are whole
            if self._at is None:
                m = _RESPONSE.match(text)
                if m is None:
                    return ""
                self._at = m.end()
            piece, self._at = _string_piece(text, self._at)  # from where the last call stopped
            return piece
        while self._lead < len(text) and text[self._lead].isspace():  # parse strips the content
            self._lead += 1
        if self._lead == len(text) or text[self._lead] == "{":
            return ""  # nothing yet, or an answer that may be a call without markers: held whole
        if self._open < 0:  # the text up to the first marker
            self._open = text.find(OPEN, self._sought_open)
            self._sought_open = max(self._sought_open, len(text) - len(OPEN) + 1)
        end = self._open if self._open >= 0 else len(text) - _marker_begun(text)
        while end > self._lead and text[end - 1].isspace():  # whitespace waits for what follows it
            end -= 1
        start = self._lead + len(self.sent)
        return text[start:end] if end > start else ""

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """(content, call deltas) that piece of the answer lets go: deltas as OpenAI's stream has
        them, {"index", "id", "type", "function": {"name", "arguments": ""}} when a call starts,
        {"index", "function": {"arguments": piece}} as its arguments come."""
        self.text += piece
        new = self._new_content()
        self.sent += new
        return new, self._call_deltas() if self.constrained else []

    def end(self, finish: str | None) -> tuple[str, str | None, list[dict], list[dict]]:
        """(the content not sent yet, the finish reason, the call deltas not sent yet, the whole
        calls) of the whole answer."""
        deltas = self._call_deltas() if self.constrained else []
        if self.calls:
            content = self._content_besides_calls()
        else:  # no call went out: the answer read whole (a native call without markers among them)
            content, calls = self.calling.parse(self.text)
            for c in calls:
                deltas.append(dict(c, index=len(self.calls)))
                self.calls.append(c)
        content = content or ""
        rest = content[len(self.sent):] if content.startswith(self.sent) else ""
        return rest, ("tool_calls" if self.calls and finish == "stop" else finish), deltas, self.calls

    # ---- calls as they are written (constrained)
    def _call_deltas(self) -> list[dict]:
        """The deltas of the calls' text since the last: a call's head once its name is whole (a
        later call's waits for it), then its arguments' new characters."""
        out = []
        for g, (j, name_at, args_at) in enumerate(self._places()):
            if g == len(self.calls):  # its name is read once, when it is whole
                name = j.string(self.text, name_at)
                if name is None:
                    break
                self.calls.append(_call(name, ""))
                out.append({"index": g, "id": self.calls[g]["id"], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            f = self.calls[g]["function"]
            if args_at in j.ends and len(f["arguments"]) == j.ends[args_at] - j.starts[args_at]:
                continue  # all sent
            args = j.raw(self.text, args_at)
            if args is not None and len(args) > len(f["arguments"]):
                out.append({"index": g, "function": {"arguments": args[len(f["arguments"]):]}})
                f["arguments"] = args
        return out

    def _places(self):
        """(its _Json, its name's path, its arguments' path) of each call the answer has begun."""
        if self._json is not None:
            self._json.feed(self.text)
            i = 0
            while ("tool_calls", i) in self._json.starts:
                yield self._json, ("tool_calls", i, "name"), ("tool_calls", i, "arguments")
                i += 1
            return
        self._read_blocks()
        for b in self._blocks:
            yield b.json, ("name",), ("arguments",)

    def _read_blocks(self) -> None:
        """Native: the blocks read as far as the text goes, a new one at each marker after them."""
        while True:
            if self._blocks and self._blocks[-1].end is None:
                self._blocks[-1].read(self.text)
                if self._blocks[-1].end is None:
                    return
                self._sought = self._blocks[-1].end
            at = self.text.find(OPEN, self._sought)
            if at < 0:
                self._sought = max(self._sought, len(self.text) - len(OPEN) + 1)
                return
            self._blocks.append(_Block(at, _Json(at + len(OPEN))))

    def _content_besides_calls(self) -> str:
        """The answer's text but its calls', stripped (as parse reads it)."""
        if self._json is not None:
            return ""
        kept, at = [], 0
        for b in self._blocks:
            kept.append(self.text[at:b.start])
            at = len(self.text) if b.end is None else b.end  # an unclosed block: cut by max_tokens
        kept.append(self.text[at:])
        return "".join(kept).strip()


def _marker_begun(text: str) -> int:
    """How many characters at text's end are the start of a marker (held back until the next
    ones show whether they are one)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


def _string_piece(body: str, i: int) -> tuple[str, int]:
    """(the text, the index reached) of a JSON string's characters in body from index i (inside
    the string, after its opening quote or a whole escape) as far as they are written: escapes
    whole (a surrogate pair's two), up to the closing quote. A string decoded in such pieces is
    the string decoded whole."""
    start, n = i, len(body)
    while i < n and body[i] != '"':
        if body[i] != "\\":
            i += 1
            continue
        if i + 1 >= n:
            break
        if body[i + 1] != "u":
            i += 2
            continue
        if i + 6 > n:
            break
        try:
            high = 0xD800 <= int(body[i + 2:i + 6], 16) < 0xDC00
        except ValueError:
            break
        if high and (i + 8 > n or (body[i + 6:i + 8] == "\\u" and i + 12 > n)):
            break  # its low half may follow
        i += 12 if high and body[i + 6:i + 8] == "\\u" else 6
    try:
        return json.loads('"' + body[start:i] + '"'), i
    except ValueError:
        return "", start


class _Json:
    """One JSON value's structure read as its text comes (the answer's grammar keeps it valid):
    where the values down to DEPTH keys or indices deep start and end in the text, by path (a
    tuple of keys and indices; () the value itself, which starts at or after `start`)."""

    DEPTH = 3

    def __init__(self, start: int = 0):
        self.pos = start  # the next character to read
        self.starts: dict[tuple, int] = {}
        self.ends: dict[tuple, int] = {}
        self.done = False  # the value has ended
        self._stack: list[list] = []  # per open object or array: [its path, "{" or "[", expected, key or index]
        self._string: tuple | None = None  # in a string: (its start, whether a key, its path)
        self._escape = False
        self._scalar: tuple | None = None  # in a number or literal: its path

    def feed(self, text: str) -> None:
        """Read text (the whole text so far) from where the last call stopped."""
        for i in range(self.pos, len(text)):
            if self.done:
                break
            self._char(text, i, text[i])
        self.pos = max(self.pos, len(text))

    def string(self, text: str, path: tuple) -> str | None:
        """The string at path, decoded, once it has ended."""
        end = self.ends.get(path)
        if end is None or text[self.starts[path]] != '"':
            return None
        return json.loads(text[self.starts[path]:end])

    def raw(self, text: str, path: tuple) -> str | None:
        """The text of the value at path as far as it is written; None before it starts."""
        start = self.starts.get(path)
        return None if start is None else text[start:self.ends.get(path, len(text))]

    def _ended(self, path: tuple, end: int) -> None:
        if len(path) <= self.DEPTH:
            self.ends[path] = end
        if not path:
            self.done = True

    def _char(self, text: str, i: int, c: str) -> None:
        if self._string is not None:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                start, key, path = self._string
                self._string = None
                if key:
                    self._stack[-1][2], self._stack[-1][3] = ":", json.loads(text[start:i + 1])
                else:
                    self._ended(path, i + 1)
            return
        if self._scalar is not None:
            if c not in " \t\n\r,]}":
                return
            self._ended(self._scalar, i)
            self._scalar = None
            if self.done:
                return
        if c in " \t\n\r":
            return
        top = self._stack[-1] if self._stack else None
        expected = top[2] if top else "value"
        if expected == "key":  # an object's key, or its end
            if c == '"':
                self._string = (i, True, None)
            elif c == "}":
                self._close(i)
            return
        if expected == ":":
            top[2] = "value"
            return
        if expected == ",":  # the next member, or the end
            if c == ",":
                top[2] = "key" if top[1] == "{" else "value"
                if top[1] == "[":
                    top[3] += 1
            else:
                self._close(i)
            return
        if top and top[1] == "[" and c == "]":  # an empty array
            self._close(i)
            return
        path = top[0] + (top[3],) if top else ()
        if len(path) <= self.DEPTH:
            self.starts[path] = i
        if top:
            top[2] = ","
        if c in "{[":
            self._stack.append([path, c, "key" if c == "{" else "value", 0])
        elif c == '"':
            self._string = (i, False, path)
        else:
            self._scalar = path

    def _close(self, i: int) -> None:
        path = self._stack.pop()[0]
        self._ended(path, i + 1)


@dataclass
class _Block:
    """A native <tool_call> block: where its marker starts, its JSON, where it ends after its
    </tool_call> (None while open)."""

    start: int
    json: _Json
    end: int | None = None

    def read(self, text: str) -> None:
        self.json.feed(text)
        if self.json.done:
            close = text.find(CLOSE, self.json.ends[()])
            if close >= 0:
                self.end = close + len(CLOSE)


def _arguments(call: dict):
    """An earlier call's arguments as the template writes them: the JSON text parsed (templates
    write `arguments | tojson`)."""
    args = call["function"].get("arguments") or "{}"
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise CflowError(f"tool call {call.get('id')}: its arguments are not JSON") from None


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _token_or_text(tok, text: str) -> str:
    """A marker in a lark grammar: the tokenizer's special token of that text when it has one
    (Qwen's <tool_call>), else the text itself."""
    ids = tok.encode(text)
    special = len(ids) == 1 and matcher_tokenizer(tok).is_special_token(ids[0])
    return text if special else json.dumps(text)
