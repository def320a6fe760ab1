"""Request bodies of the OpenAI-compatible endpoints, their checks, and the error object.

Unknown top-level fields are ignored (clients send many), except those that would change the
answer and that cflow cannot honour (n > 1, logprobs, tools, logit_bias, ...): those get a 400
rather than a silently different result. Types are strict: "5" is not a number.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ApiError(Exception):
    """An error answered as an OpenAI-style error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_validation(e: ValidationError) -> ApiError:
    """A pydantic error as a 400 naming the offending field. For a union (stop: str | list) the
    type mismatch of one member says little; the other member's complaint is the useful one."""
    errs = e.errors()
    err = next((x for x in errs if not x["type"].endswith("_type")), errs[0])
    # drop union-member names pydantic adds to the location: messages.0.content.str -> messages.0.content
    loc = [p for p in err["loc"] if not (isinstance(p, str) and (p in ("str", "int", "float", "bool", "list") or "[" in p))]
    param = ".".join(str(p) for p in loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


_strict = ConfigDict(strict=True, extra="ignore")
NonNeg = Annotated[float, Field(ge=0.0)]
Prob = Annotated[float, Field(ge=0.0, le=1.0)]


class Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _strict
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Prob = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Prob = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # accepted only at their neutral values: anything else would change the answer
    logprobs: Literal[False, None] = None
    top_logprobs: Literal[0, None] = None
    logit_bias: Annotated[dict, Field(max_length=0)] | None = None
    best_of: Literal[1, None] = None
    echo: Literal[False] = False
    tools: Annotated[list, Field(max_length=0)] | None = None
    functions: Annotated[list, Field(max_length=0)] | None = None
    tool_choice: Literal["none", None] = None

    @model_validator(mode="after")
    def _penalties(self):
        if self.repetition_penalty is not None and (self.frequency_penalty or self.presence_penalty):
            raise ValueError("give repetition_penalty or frequency_penalty/presence_penalty, not both")
        return self

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def to_llm(self, default_max_tokens: int, defaults: dict | None = None) -> dict:
        """Keyword arguments for LLM.complete (docs/SERVER.md, "Parameter mapping"); `defaults`
        (the model's sampling defaults, when it has them) fill the fields the request omits."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.repetition_penalty is not None:
            rp = self.repetition_penalty
        else:
            # OpenAI's additive penalties in [-2, 2] -> a multiplicative one in [0.5, 2]
            rp = 2.0 ** (max(-2.0, min(2.0, (self.frequency_penalty or 0.0) + (self.presence_penalty or 0.0))) / 2)
        kw = dict(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                  top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, repetition_penalty=rp,
                  seed=self.seed, stop=[s for s in stop if s] or None)
        if isinstance(defaults, dict):
            given = self.model_fields_set | ({"repetition_penalty"} if self.frequency_penalty or self.presence_penalty else set())
            kw.update({k: v for k, v in defaults.items() if k in kw and k not in given})
        return kw


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def plain(self) -> dict:
        """{role, content} with content as one string, as chat templates expect."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    suffix: Literal[None, ""] = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
