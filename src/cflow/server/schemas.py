"""Request bodies of the OpenAI-compatible endpoints, their checks, and the error object.

Unknown top-level fields are ignored (clients send many), except those that would change the
answer and that cflow cannot honour (best_of > 1, tools, ...): those get a 400
rather than a silently different result. Types are strict: "5" is not a number, true is not 1.

parse_body turns the raw body into a dict without trusting it: strict UTF-8, nesting bounded
before the parser recurses, no NaN / Infinity / out-of-range numbers, no lone surrogates.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cflow.errors import CflowError
from cflow.sampling import MAX_TOP_LOGPROBS
from cflow.structured import grammar

MAX_JSON_DEPTH = 64  # arrays / objects inside each other; a request needs 4
MAX_INT_DIGITS = 40  # a JSON integer longer than this is refused (2**64 has 20 digits)
MAX_STOP_CHARS = 512  # characters of one stop string
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI's
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_CHOICES = 16  # n: choices of one request
MAX_TOOLS = 128  # tools of one chat request, as OpenAI's


class ApiError(Exception):
    """An error answered as an OpenAI-style error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        message = _printable(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, _printable(param), code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _printable(s: str | None) -> str | None:
    """s as UTF-8 can encode it (a lone surrogate from the request becomes '?'): error messages
    quote the request, and the answer must still encode."""
    return s if s is None or s.isascii() else s.encode("utf-8", "replace").decode("utf-8")


# ------------------------------------------------------------------ the raw body
JSON_TYPES = ("application/json", "text/plain", "application/x-www-form-urlencoded")


def check_content_type(value: str | None) -> None:
    """415 unless the body may be JSON: no Content-Type, application/json or */*+json, and the
    text/plain and form types that `curl -d` and simple browser requests send; any charset
    parameter must be UTF-8 (RFC 8259)."""
    if value is None:
        return
    mime, *params = [x.strip().lower() for x in value.split(";")]
    charset = next((v.strip('"') for k, _, v in (x.partition("=") for x in params) if k.strip() == "charset"), "utf-8")
    if (mime in JSON_TYPES or mime.endswith("+json")) and charset in ("utf-8", "utf8", "us-ascii"):
        return
    raise ApiError(415, f"Content-Type {value!r}: the body must be JSON in UTF-8 (send application/json)",
                   code="unsupported_media_type")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text raw, found without parsing (so
    without recursion): brackets inside strings do not count. Exact for valid JSON; for invalid
    JSON the parser's own error comes later."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # at most that deep, whatever the strings hold
    a = np.frombuffer(raw, np.uint8)
    # a quote is escaped when an odd run of backslashes stands before it
    i = np.arange(a.size, dtype=np.int32)  # (a body is at most a few MiB)
    last_plain = np.maximum.accumulate(np.where(a == 0x5C, -1, i))  # the last non-backslash at or before i
    quotes = np.flatnonzero(a == 0x22)
    before = np.where(quotes > 0, last_plain[np.maximum(quotes - 1, 0)], -1)
    quotes = quotes[(quotes - 1 - before) % 2 == 0]
    brackets = np.flatnonzero((a == 0x5B) | (a == 0x7B) | (a == 0x5D) | (a == 0x7D))
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # an even number of quotes before: outside strings
    if brackets.size == 0:
        return 0
    step = np.where((a[brackets] == 0x5B) | (a[brackets] == 0x7B), 1, -1)
    return int(np.cumsum(step).max())


class _BadNumber(ValueError):
    pass


def _constant(name: str):
    raise _BadNumber(f"{name} is not a JSON number")


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _BadNumber(f"the number {text[:40]} is out of range")
    return x


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadNumber(f"an integer of {len(text.lstrip('-'))} digits is out of range")
    return int(text)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(s: str) -> str | None:
    """The first lone surrogate in s (as U+XXXX), or None: such a string cannot be UTF-8."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"U+{ord(s[e.start]):04X}"


def _find_lone_surrogate(data) -> tuple[str | None, str, str] | None:
    """(path, what, which) for the first string of data holding a lone surrogate (a key: the
    path of its object), or None. Iterative: no recursion at all."""
    todo = [(data, None)]
    while todo:
        v, where = todo.pop()
        if isinstance(v, str):
            bad = _lone_surrogate(v)
            if bad:
                return where, where, bad
        elif isinstance(v, dict):
            for k, x in v.items():
                bad = _lone_surrogate(k)
                if bad:
                    return where, f"a key of {where or 'the body'}", bad
                todo.append((x, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            todo.extend((x, f"{where}.{i}" if where else str(i)) for i, x in enumerate(v))
    return None


def parse_body(raw: bytes) -> dict:
    """The request body as a dict, or an ApiError 400 that says what is wrong with it."""
    def bad(msg: str, param: str | None = None, code: str = "invalid_json") -> ApiError:
        return ApiError(400, msg, param=param, code=code)

    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise bad(f"the body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise bad(f"malformed JSON body: arrays and objects nest deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except RecursionError:  # invalid JSON the depth count could not follow
        raise bad(f"malformed JSON body: arrays and objects nest deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise bad(f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
        raise bad(f"the JSON body must be an object, not {kind}")
    if _SURROGATE_ESCAPE.search(text):
        found = _find_lone_surrogate(data)
        if found:
            param, what, which = found
            raise bad(f"{what}: a lone surrogate ({which}) is not a Unicode character; "
                      "encode text as UTF-8 (or escape pairs)", param=param, code="invalid_value")
    return data


def _field_path(loc) -> list:
    """loc without the union-member names pydantic adds (messages.0.content.str ->
    messages.0.content; stop.list[constrained-str].1 -> stop.1): no field name has [ or -."""
    return [p for p in loc if not (isinstance(p, str) and (p in ("str", "int", "float", "bool", "list", "none")
                                                          or "[" in p or "-" in p))]


def from_validation(e: ValidationError) -> ApiError:
    """A pydantic error as a 400 naming the offending field. For a union (stop: str | list) the
    type mismatch of one member says little; the other member's complaint is the useful one,
    and of type mismatches the deepest (content: ["hi"] -> messages.0.content.0)."""
    errs = e.errors()
    err = min(errs, key=lambda x: (x["type"].endswith("_type"), -len(_field_path(x["loc"]))))
    param = ".".join(str(p) for p in _field_path(err["loc"])) or None
    msg = err["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


_strict = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
Prob = Annotated[float, Field(ge=0.0, le=1.0)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    model_config = _strict
    include_usage: bool | None = None


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema the answer follows (cflow.structured).
    `name` and `description` are the client's labels; `strict` is accepted either way (the
    schema is always followed). No schema: any JSON value."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text"; "json_object", one JSON object; "json_schema", text
    that its JSON schema accepts (cflow.structured). A schema that cannot be followed (a keyword
    or format the compiler does not know, a broken reference) is a 400 that says why, rather than
    an answer that ignores it."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _grammar: str | None = None

    @model_validator(mode="after")
    def _compile(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object: {'name': ..., 'schema': {...}}")
        try:
            if self.type == "json_schema":
                schema = self.json_schema.json_schema
                self._grammar = grammar(json_schema={} if schema is None else schema)
            else:
                self._grammar = grammar(json_object=self.type == "json_object")
        except CflowError as e:
            raise ValueError(str(e)) from None
        return self

    def grammar(self) -> str | None:
        """The answer's grammar (cflow.structured.grammar); None for free text."""
        return self._grammar


class Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _strict
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Prob = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # {token id as a decimal string: added to its logit}, as OpenAI's
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
                               Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices: sequences decoded side by side
    response_format: ResponseFormat | None = None  # OpenAI's in chat; vLLM takes it in completions too
    # accepted only at its neutral value: anything else would change the answer
    best_of: int | None = None
    functions: Annotated[list, Field(max_length=0)] | None = None  # the deprecated form of tools

    @field_validator("best_of")
    @classmethod
    def _only_one(cls, v):
        if v not in (None, 1):
            raise ValueError("only 1 is supported")
        return v

    def top_n(self) -> int | None:
        """None: no logprobs asked for; else the most likely tokens to give with each token's."""
        return None

    def prompt_n(self) -> int | None:
        """As top_n, for the prompt's tokens (an echo with logprobs)."""
        return None

    def bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_llm(self, default_max_tokens: int, defaults: dict | None = None) -> dict:
        """Keyword arguments for the request's Decoders (docs/SERVER.md, "Parameter mapping"); `defaults`
        (the model's sampling defaults, when it has them) fill the fields the request omits."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        rp = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        kw = dict(max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
                  temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, repetition_penalty=rp,
                  frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                  seed=self.seed, stop=[s for s in stop if s] or None, logprobs=self.top_n(),
                  prompt_logprobs=self.prompt_n(), logit_bias=self.bias(),
                  grammar=self.response_format.grammar() if self.response_format else None)
        if isinstance(defaults, dict):
            kw.update({k: v for k, v in defaults.items() if k in kw and k not in self.model_fields_set})
        return kw


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _strict
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (cflow.tools)."""

    model_config = _strict
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @field_validator("function")
    @classmethod
    def _json_arguments(cls, v):
        try:
            json.loads(v.arguments)
        except ValueError:
            raise ValueError("function.arguments must be JSON text") from None
        return v


class Message(BaseModel):
    model_config = _strict
    # in this order: each check below reads the fields before its own
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = Field(None, validate_default=True)  # a tool turn's: the call it answers
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, v, info):
        if v and info.data.get("role") != "assistant":
            raise ValueError("tool_calls belong to assistant turns")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, v, info):
        if info.data.get("role") == "tool" and not v:
            raise ValueError("a tool turn needs the tool_call_id it answers")
        return v

    @field_validator("content")
    @classmethod
    def _given(cls, v, info):
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("required (null only in an assistant turn that calls tools)")
        return v

    def plain(self) -> dict:
        """{role, content} with content as one string, as chat templates expect, and the turn's
        tool calls or the call it answers (cflow.tools shapes them for the template)."""
        text = self.content if isinstance(self.content, str) or self.content is None else "".join(
            p.text for p in self.content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(BaseModel):
    model_config = _strict
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # accepted either way: the arguments always follow the schema


class Tool(BaseModel):
    model_config = _strict
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _strict
    name: str


class NamedToolChoice(BaseModel):
    model_config = _strict
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: bool = True
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    echo: bool = False  # not in the chat API: accepted only as false
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("tools")
    @classmethod
    def _named_once(cls, v):
        names = [t.function.name for t in v or []]
        if len(set(names)) < len(names):
            raise ValueError("two tools have one name")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choosable(cls, v, info):
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"no tool is named {v.function.name!r}")
        if v in ("auto", "required") and not names:
            raise ValueError(f"{v!r} needs tools")
        fmt = info.data.get("response_format")
        if names and v != "none" and fmt is not None and fmt.type != "text":
            raise ValueError("give tools or a JSON response_format, not both")
        return v

    def calling(self) -> tuple[list[dict], str, bool] | None:
        """(tools, choice, parallel) for cflow.tools.ToolCalling; None when no tool may be called
        (none given, or tool_choice "none"). choice: "auto", "required" or the tool's name."""
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        return [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools], choice, \
            self.parallel_tool_calls

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("not supported in chat completions (only false)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1)]


class CompletionRequest(Sampling):
    # text, or token ids (as OpenAI takes them: what an evaluation harness that tokenizes sends);
    # one prompt: a list of one, as some clients send it, is that prompt
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    suffix: Literal[None, ""] = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False  # the answer starts with the prompt (and, with logprobs, its tokens')
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: only with echo (Server.sampling checks)
    tools: Annotated[list, Field(max_length=0)] | None = None  # tools are the chat API's
    tool_choice: Literal["none", None] = None

    def top_n(self) -> int | None:
        return self.logprobs

    def prompt_n(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        def ids(x):
            return isinstance(x, list) and len(x) > 0 and all(type(i) is int and 0 <= i < 2**31 for i in x)

        one = v[0] if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)) else v
        if not (isinstance(one, str) or ids(one)):
            raise ValueError("must be one prompt: a string or token ids (integers from 0), or a list of one of those")
        return v

    def ids(self) -> list[int] | None:
        """The prompt's token ids when it was given as ids, else None."""
        p = self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], list) else self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], int) else None

    def text(self, tok=None) -> str:
        """The prompt's text (of ids given: their decoding by tok)."""
        ids = self.ids()
        if ids is not None:
            return tok.decode(ids)
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class TokenizeRequest(BaseModel):
    """POST /tokenize: text (`prompt` as vLLM names it, `content` as llama-server does) or chat
    messages (rendered with the model's template, the generation prompt added)."""

    model_config = _strict
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # vLLM's name; llama-server's: add_special
    add_special: bool | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if sum(x is not None for x in (self.prompt, self.content, self.messages)) != 1:
            raise ValueError("give one of prompt (or content) and messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids -> text."""

    model_config = _strict
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=1 << 20)]

