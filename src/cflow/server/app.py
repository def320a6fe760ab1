"""The OpenAI-compatible HTTP API and the chat page, as a Starlette app around one cflow.LLM.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics, GET / (the chat page). Every error is an OpenAI-style error object; input a
client controls never causes a 500. docs/SERVER.md documents fields, mapping and limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, is_dataclass
from functools import partial
from pathlib import Path

import anyio
import jinja2
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from cflow._native import core
from cflow.errors import CflowError, ModelFileChanged
from cflow.generate import Decoder, recompute_for
from cflow.llm import CHATML_TEMPLATE
from cflow.server.batcher import CACHE_RAM_MIB, END, Batcher, Job, QueueFull
from cflow.server.metrics import Metrics
from cflow.server.schemas import (ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                  check_content_type, from_validation, parse_body)
from cflow.tools import AnswerStream, ToolCalling, native

STATIC = Path(__file__).parent / "static"
MAX_BODY = 1 << 20  # bytes; a full context of text is far below this
DEFAULT_MAX_TOKENS = 512  # when a request gives none (and the context has room)


class ClientGone(Exception):
    pass


class EventStream(StreamingResponse):
    """Server-sent events that stop (and so cancel the generation) when the client leaves.

    Starlette only listens for the disconnect under ASGI spec < 2.4 and otherwise waits for a
    failed send; a request still waiting for its slot sends nothing, so we always listen."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as tg:
            async def run_then_stop(fn):
                with contextlib.suppress(OSError):
                    await fn()
                tg.cancel_scope.cancel()

            tg.start_soon(run_then_stop, partial(self.stream_response, send))
            await run_then_stop(partial(self.listen_for_disconnect, receive))


DRAIN_BYTES = 64 << 20  # of a body left unread by an early answer, read and dropped before closing
DRAIN_SECONDS = 30.0


class _AnswerBeforeClosing:
    """ASGI middleware: an answer given before the request's body was read to its end (a 413, a
    401, a 404 with a body) says `Connection: close`, and the rest of the body is read and dropped
    before the answer ends and the connection closes. Closing a socket that still holds unread
    data makes the kernel reset the connection, and a client that is still sending (urllib,
    which always asks to close) then loses the answer. At most DRAIN_BYTES or DRAIN_SECONDS are
    spent on it; a client that asked `Expect: 100-continue` has not sent the body, so it is
    left unread."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        size = headers.get(b"content-length", b"")
        has_body = b"transfer-encoding" in headers or (size.isdigit() and int(size) > 0)
        state = {"ended": not has_body, "asked": False, "close": False}

        async def receive_():
            state["asked"] = True
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                state["ended"] = True
            return msg

        async def drain():
            if b"100-continue" in headers.get(b"expect", b"").lower() and not state["asked"]:
                return
            if size.isdigit() and int(size) > DRAIN_BYTES:
                return  # cannot reach its end: close at once
            n = 0
            with anyio.move_on_after(DRAIN_SECONDS):
                while not state["ended"] and n <= DRAIN_BYTES:
                    n += len((await receive_()).get("body", b""))

        async def send_(msg):
            if msg["type"] == "http.response.start" and not state["ended"]:
                state["close"] = True
                msg = dict(msg, headers=[*msg.get("headers", []), (b"connection", b"close")])
            elif msg["type"] == "http.response.body" and state["close"] and not msg.get("more_body", False):
                await send(dict(msg, more_body=True))  # the whole answer is out: a client reading it has it now
                await drain()
                msg = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(msg)

        await self.app(scope, receive_, send_)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(u) -> dict | None:
    """OpenAI's usage object; the prompt tokens served from the prompt cache as
    prompt_tokens_details.cached_tokens."""
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _plain(obj) -> dict | None:
    if obj is None:
        return None
    if is_dataclass(obj):
        return asdict(obj)
    return obj._asdict() if hasattr(obj, "_asdict") else dict(vars(obj))


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(gen: Job, watch: asyncio.Task):
    """The generation's next item, or ClientGone as soon as the client leaves."""
    if not gen.queue.empty():
        return gen.queue.get_nowait()
    if watch.done():
        raise ClientGone
    get = asyncio.ensure_future(gen.next())
    done, _ = await asyncio.wait((get, watch), return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone


def _display_name(name: str) -> str:
    """A model id for clients: the name itself, or a path's file name without .cflow/.gguf."""
    p = Path(name)
    if len(p.parts) == 1:
        return name
    return p.name.removesuffix(".cflow").removesuffix(".gguf") or name


def _unusable(reason: str) -> ApiError:
    """The model file changed on disk under the mapping (ModelFileChanged): a 503, as for a server
    that cannot serve until its operator restarts it; not the client's fault (4xx) nor a bug (500)."""
    return ApiError(503, reason, type="server_error", code="model_file_changed")


def _model_error(e: Exception) -> ApiError:
    if isinstance(e, QueueFull):
        return ApiError(503, "server busy: the request queue is full, retry later", type="server_error", code="queue_full")
    if isinstance(e, ModelFileChanged):
        return _unusable(str(e))
    if isinstance(e, CflowError):
        return ApiError(400, str(e), code="invalid_value")
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


def _spelt(tok, i: int) -> tuple[str, bytes]:
    """A token as logprobs name it: its text (a part of a character as U+FFFD) and its bytes."""
    b = tok.token_bytes(i)
    return b.decode("utf-8", "replace"), b


class _Chat:
    """Response shapes of /v1/chat/completions."""

    prefix, obj, chunk_obj = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text, finish, logprobs=None, index=0, calls=None):
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def delta(text, finish, first=False, logprobs=None, index=0, calls=None):
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if calls:  # the calls' deltas (cflow.tools.AnswerStream; OpenAI's clients gather them by index)
            d["tool_calls"] = calls
        return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(tok, lps, offset: int) -> tuple[dict, int]:
        """OpenAI's chat logprobs of tokens lps (sampling.TokenLogprob): per token its text, bytes
        and logprob, and the most likely tokens of its step alike."""
        def one(i, lp):
            text, b = _spelt(tok, i)
            return {"token": text, "logprob": lp, "bytes": list(b)}

        return {"content": [dict(one(x.id, x.logprob), top_logprobs=[one(i, v) for i, v in x.top]) for x in lps],
                "refusal": None}, offset


class _Text:
    """Response shapes of /v1/completions."""

    prefix, obj, chunk_obj = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(text, finish, logprobs=None, index=0, calls=None):
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def delta(text, finish, first=False, logprobs=None, index=0, calls=None):
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(tok, lps, offset: int) -> tuple[dict, int]:
        """The completions API's logprobs: parallel lists of tokens, their logprobs, {token:
        logprob} of each step's most likely tokens, and each token's character offset in the
        text (its first at 0); and the offset after them. An entry that is a bare token id (an
        echoed prompt's first token, which nothing predicts) has null for its logprob and top."""
        tokens, offsets, values, tops = [], [], [], []
        for x in lps:
            scored = not isinstance(x, int)
            offsets.append(offset)
            tokens.append(_spelt(tok, x.id if scored else x)[0])
            offset += len(tokens[-1])
            values.append(x.logprob if scored else None)
            if not scored:
                tops.append(None)
                continue
            tops.append({})  # two tokens that read alike (parts of characters: U+FFFD) keep the likelier
            for i, v in x.top:
                tops[-1].setdefault(_spelt(tok, i)[0], v)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


class _Choice:
    """One choice of an answer as its chunks come: its text, its logprobs (those of tokens whose
    text is still held back carried to the next piece), an echoed prompt before its first text
    (echo_logprobs: its entries from the first chunk's prompt_logprobs). With tools, its content
    and calls as cflow.tools.AnswerStream lets them go (constrained: whether a grammar keeps
    every call one of a given tool, so that calls stream as they are written)."""

    def __init__(self, index: int, gen: Job, echo: str, echo_logprobs, calling: ToolCalling | None = None,
                 constrained: bool = False):
        self.index, self.gen, self.echo, self.echo_logprobs, self.calling = index, gen, echo, echo_logprobs, calling
        self.constrained = constrained
        self.reader = AnswerStream(calling, constrained) if calling is not None and gen.stream else None
        self.text: list[str] = []
        self.carry: list = []
        self.offset, self.first, self.ended = 0, True, False
        self.last = None  # the last Chunk (finish_reason, usage, timings once it ends)

    def _take(self, item) -> str:
        """item's text, after the echoed prompt for the first; its logprobs to the carry."""
        if self.last is None:
            self.carry += self.echo_logprobs(item.prompt_logprobs)
        self.carry += item.logprobs or []
        text, self.echo, self.last = self.echo + item.text, "", item
        return text

    def add(self, item) -> None:
        """An unstreamed answer: keep the chunk."""
        self.text.append(self._take(item))

    def answer(self, text: str, finish: str | None) -> tuple[str | None, str | None, list | None]:
        """(content, finish_reason, tool calls): with tools, the calls read from the answer
        (cflow.tools: what its stream adds up to), and finish_reason "tool_calls" when it made some."""
        if self.calling is None or finish is None:
            return text, finish, None
        reader = AnswerStream(self.calling, self.constrained)
        content = reader.feed(text)[0]
        rest, finish, _, calls = reader.end(finish)
        return (content + rest) or None, finish, calls

    def whole(self, fmt, tok, want_logprobs: bool) -> dict:
        logprobs = fmt.logprobs(tok, self.carry, 0)[0] if want_logprobs else None
        text, finish, calls = self.answer("".join(self.text), self.last.finish_reason)
        return fmt.choice(text, finish, logprobs, self.index, calls)

    def piece(self, item, fmt, tok, want_logprobs: bool) -> dict | None:
        """A streamed chunk's choice for item, or None when it has nothing to send yet."""
        text, finish, calls = self._take(item), item.finish_reason, None
        if self.reader is not None:
            text, calls = self.reader.feed(text)
            if finish is not None:
                rest, finish, more, _ = self.reader.end(finish)
                text, calls = text + rest, calls + more
        if not (text or finish or self.first or calls):
            return None
        logprobs = None
        if want_logprobs:
            logprobs, self.offset = fmt.logprobs(tok, self.carry, self.offset)
            self.carry = []
        out = fmt.delta(text, finish, self.first, logprobs, self.index, calls)
        self.first = False
        return out


def _usage_of(lasts: list) -> dict | None:
    """The usage of n choices of one prompt: the prompt once (its cached part as the first
    choice found it), the choices' tokens summed."""
    if any(last.usage is None for last in lasts):
        return None
    u = _usage(lasts[0].usage)
    u["completion_tokens"] = sum(last.usage.completion_tokens for last in lasts)
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


class Server:
    """State of one app: the model, its batcher and metrics."""

    def __init__(self, llm, *, parallel: int, api_key: str | None, max_body: int, max_queue: int,
                 default_max_tokens: int, cache_ram: int):
        self.llm, self.api_key, self.max_body, self.default_max_tokens = llm, api_key, max_body, default_max_tokens
        self.name = _display_name(llm.name)
        self.batcher = Batcher(llm.engine, parallel, max_queue, cache_bytes=cache_ram << 20)
        self.metrics = Metrics(self.batcher)
        # one thread builds the grammars and matchers of structured outputs and tools, off the event
        # loop (the default executor ran up to six, each with a malloc arena of its own)
        self.grammars = ThreadPoolExecutor(1, thread_name_prefix="cflow-grammar",
                                           initializer=partial(core.set_thread_name, "cflow-grammar"))
        self.created = int(time.time())

    # ---- request checks
    def auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           type="authentication_error", code="invalid_api_key")

    async def body(self, request: Request) -> dict:
        """The JSON object of the body (schemas.parse_body); 413 past max_body (what is left of
        the body is then read and dropped, _AnswerBeforeClosing); 415 for a type that is not JSON."""
        check_content_type(request.headers.get("content-type"))
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body:
            raise ApiError(413, f"request body of {size} bytes exceeds the limit of {self.max_body}", code="body_too_large")
        buf = bytearray()
        try:
            async for part in request.stream():
                buf += part
                if len(buf) > self.max_body:
                    raise ApiError(413, f"request body exceeds the limit of {self.max_body} bytes", code="body_too_large")
        except ClientDisconnect:
            raise ApiError(499, "the client left before sending the whole body") from None
        return parse_body(bytes(buf))

    def sampling(self, req, prompt: list[int]) -> dict:
        n_ctx, n = self.llm.n_ctx, len(prompt)
        self.check_ids([int(k) for k in req.logit_bias or {}], "logit_bias")
        if req.max_tokens == 0 and not self.echoed(req):
            raise ApiError(400, "max_tokens: 0 only with echo (to score the prompt)", param="max_tokens",
                           code="invalid_value")
        if req.max_tokens is not None and n + req.max_tokens > n_ctx:
            raise ApiError(400, f"prompt of {n} tokens plus max_tokens {req.max_tokens} exceeds the context "
                           f"of {n_ctx} tokens", param="max_tokens", code="context_length_exceeded")
        if n >= n_ctx:
            raise ApiError(400, f"prompt of {n} tokens leaves no room in the context of {n_ctx} tokens",
                           param="messages" if isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded")
        return req.to_llm(min(self.default_max_tokens, n_ctx - n), getattr(self.llm, "generation_defaults", None))

    # ---- generation
    async def run(self, request: Request, req, prompt: list[int], fmt, calling: ToolCalling | None = None):
        """Generate the request's n choices: n jobs, which the batcher decodes side by side (the
        later ones copy the prompt's KV from the first while it runs); choice i draws with seed
        + i when a seed is given. A client that leaves cancels them all. calling: the chat's
        tools (cflow.tools): their grammar constrains the answer; streamed, its content and calls
        come as they are written (cflow.tools.AnswerStream)."""
        sampling = self.sampling(req, prompt)
        t0 = time.perf_counter()

        def decoders() -> list[Decoder]:
            tok = self.llm.tokenizer
            grammar = sampling["grammar"] if calling is None else calling.grammar(tok)
            block = None if calling is None else calling.block_grammar(tok)
            return [Decoder(tok, prompt, recompute=recompute_for(self.llm.engine), block_grammar=block,
                            **dict(sampling, grammar=grammar,
                                   seed=None if sampling["seed"] is None else (sampling["seed"] + i) % 2**64))
                    for i in range(req.n)]

        try:
            # a structured output's first request builds the tokenizer's matcher view (seconds
            # for a large vocabulary), and a large schema's matcher takes a while: off the loop
            slow = sampling["grammar"] is not None or calling is not None
            made = await asyncio.get_running_loop().run_in_executor(self.grammars, decoders) if slow else decoders()
        except CflowError as e:
            raise _model_error(e) from None
        gens = [Job(self.batcher, decoder, stream=bool(req.stream)) for decoder in made]
        constrained = calling is not None and calling.calls_constrained(self.llm.tokenizer)
        submitted = 0
        watch = None
        handed_off = False
        try:
            for gen in gens:
                self.batcher.submit(gen)
                submitted += 1
            watch = asyncio.create_task(_disconnected(request))
            # a streamed answer starts with its first choice's first token (choices past
            # --parallel wait for a slot); an unstreamed one's errors are the request's status
            firsts = []
            for gen in gens[:1] if req.stream else gens:
                firsts.append(await _next(gen, watch))
                if isinstance(firsts[-1], Exception):
                    raise _model_error(firsts[-1])
            choices = [_Choice(i, g, self.echoed(req), partial(self.echoed_logprobs, req, prompt), calling,
                               constrained) for i, g in enumerate(gens)]
            if req.stream:
                handed_off = True
                return EventStream(self.events(choices, firsts[0], fmt, req, t0),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            body = self.head(fmt, fmt.obj)
            body["choices"], lasts = [], []
            for choice, item in zip(choices, firsts):  # the others' chunks wait in their queues
                while item is not END:
                    if isinstance(item, Exception):
                        raise _model_error(item)
                    choice.add(item)
                    item = await _next(choice.gen, watch)
                body["choices"].append(choice.whole(fmt, self.llm.tokenizer, sampling["logprobs"] is not None))
                lasts.append(choice.last)
            for last in lasts:
                self.done(last, t0)
            body["usage"] = _usage_of(lasts)
            body["timings"] = _plain(lasts[0].timings)
            return JSONResponse(body)
        except QueueFull as e:
            raise _model_error(e) from None
        except ClientGone:
            self.metrics.cancelled.inc()
            return Response(status_code=499)  # nobody is left to read it
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            if not handed_off:
                for gen in gens[:submitted]:
                    gen.cancel()

    async def events(self, choices: list[_Choice], first, fmt, req, t0: float):
        """The server-sent events of n choices, each chunk one choice's, in the order they come
        (`first`: the first choice's first item)."""
        head = self.head(fmt, fmt.chunk_obj)
        want_logprobs = choices[0].gen.decoder.logprobs is not None
        reads: dict[_Choice, asyncio.Future] = {}  # a pending gen.next() per choice, with n > 1
        try:
            ready, failed = [(choices[0], first)], False
            while ready and not failed:
                for choice, item in ready:
                    if isinstance(item, Exception):
                        yield _sse(_model_error(item).body())
                        failed = True
                        break
                    if item is END:
                        choice.ended = True
                        continue
                    out = choice.piece(item, fmt, self.llm.tokenizer, want_logprobs)
                    if out is not None:
                        chunk = dict(head, choices=[out])
                        if item.finish_reason:
                            chunk["timings"] = _plain(item.timings)
                        yield _sse(chunk)
                live = [c for c in choices if not c.ended]
                if failed or not live:
                    break
                if len(live) == 1 and not reads:  # one choice: no task a token
                    ready = [(live[0], await live[0].gen.next())]
                    continue
                for c in live:
                    if c not in reads:
                        reads[c] = asyncio.ensure_future(c.gen.next())
                done, _ = await asyncio.wait(reads.values(), return_when=asyncio.FIRST_COMPLETED)
                ready = [(c, f.result()) for c, f in list(reads.items()) if f in done]
                for c, _ in ready:
                    del reads[c]
            lasts = [c.last for c in choices]
            if not failed and all(last is not None and last.finish_reason for last in lasts):
                for last in lasts:
                    self.done(last, t0)
                if req.include_usage():
                    yield _sse(dict(head, choices=[], usage=_usage_of(lasts)))
            yield "data: [DONE]\n\n"
        finally:
            for c in choices:
                if c.last is None or not c.last.finish_reason:
                    self.metrics.cancelled.inc()
                c.gen.cancel()
            for f in reads.values():
                f.cancel()

    def echoed(self, req) -> str:
        """The text an answer starts with: the prompt, when a completion asks for its echo."""
        return req.text(self.llm.tokenizer) if getattr(req, "echo", False) else ""

    def echoed_logprobs(self, req, prompt: list[int], scored) -> list:
        """The logprobs entries of an echoed prompt (Decoder's prompt_logprobs, None when not
        asked for): its tokens but for a BOS the tokenizer put before a text; the first token,
        which nothing predicts, as its bare id. A prompt of token ids keeps them all."""
        if scored is None:
            return []
        tok = self.llm.tokenizer
        added = req.ids() is None and tok.add_bos and tok.bos_token_id is not None
        skip = int(added and prompt[0] == tok.bos_token_id)
        return [prompt[j] if scored[j] is None else scored[j] for j in range(skip, len(prompt))]

    def head(self, fmt, obj: str) -> dict:
        return {"id": f"{fmt.prefix}-{uuid.uuid4().hex[:24]}", "object": obj, "created": int(time.time()),
                "model": self.name}

    def done(self, last, t0: float) -> None:
        self.metrics.finished(last.usage, last.timings)
        self.metrics.latency.observe(time.perf_counter() - t0)

    # ---- endpoints
    async def parsed(self, request: Request, model):
        """The request's body as `model` (a schemas class), after the API key check."""
        self.auth(request)
        try:
            return model.model_validate(await self.body(request))
        except ValidationError as e:
            raise from_validation(e) from None

    def chat_text(self, messages, calling: ToolCalling | None = None) -> str:
        """Messages rendered with the model's chat template, the generation prompt added (with
        tools: as cflow.tools shapes them for it)."""
        plain = [m.plain() for m in messages]
        try:
            if calling is not None:
                plain = calling.messages(plain)
            tools = None if calling is None else calling.template_tools()
            return self.llm.render_chat(plain, add_generation_prompt=True, tools=tools)
        except (jinja2.TemplateError, CflowError) as e:
            raise ApiError(400, f"messages: the chat template rejected them: {e}", param="messages") from None

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.llm.config.vocab_size
        if ids and max(ids) >= vocab:
            raise ApiError(400, f"{param}: token ids must be below the vocabulary's {vocab}", param=param,
                           code="invalid_value")

    async def chat_completions(self, request: Request):
        req = await self.parsed(request, ChatRequest)
        spec = req.calling()
        calling = None if spec is None else ToolCalling(*spec, native=native(self.llm.chat_template))
        prompt = self.llm.tokenizer.encode(self.chat_text(req.messages, calling), add_special_tokens=False)
        return await self.run(request, req, prompt, _Chat, calling)

    async def completions(self, request: Request):
        req = await self.parsed(request, CompletionRequest)
        prompt = req.ids()
        if prompt is None:
            prompt = self.llm.tokenizer.encode(req.text(), add_special_tokens=True)  # BOS as the model wants it
        self.check_ids(prompt, "prompt")
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        return await self.run(request, req, prompt, _Text)

    # ---- the tokenizer (vLLM's /tokenize, /detokenize and /tokenizer_info, which lm-evaluation-
    # harness's remote tokenizer reads; llama-server's field names too)
    async def tokenize(self, request: Request):
        req = await self.parsed(request, TokenizeRequest)
        if req.messages is not None:
            text, special = self.chat_text(req.messages), False  # the template writes the special tokens
        else:
            text = req.prompt if req.prompt is not None else req.content
            special = req.add_special_tokens if req.add_special_tokens is not None else bool(req.add_special)
        ids = self.llm.tokenizer.encode(text, add_special_tokens=special)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.llm.n_ctx})

    async def detokenize(self, request: Request):
        req = await self.parsed(request, DetokenizeRequest)
        self.check_ids(req.tokens, "tokens")
        text = self.llm.tokenizer.decode(req.tokens)
        return JSONResponse({"prompt": text, "content": text})

    async def tokenizer_info(self, request: Request):
        self.auth(request)
        tok = self.llm.tokenizer

        def text(i):
            return None if i is None else tok.token_text(i)

        eos = min(tok.eos_token_ids) if tok.eos_token_ids else None
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tok.bos_token_id),
                             "eos_token": text(eos), "pad_token": None, "add_bos_token": tok.add_bos,
                             "chat_template": getattr(self.llm, "chat_template", None) or CHATML_TEMPLATE, "model_max_length": self.llm.n_ctx,
                             "vocab_size": self.llm.config.vocab_size})

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "cflow",
                "n_ctx": self.llm.n_ctx}

    async def models(self, request: Request):
        self.auth(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request):
        self.auth(request)
        if request.path_params["model"] != self.name:
            raise ApiError(404, f"model {request.path_params['model']!r} not found; this server runs {self.name!r}",
                           param="model", code="model_not_found")
        return JSONResponse(self.model_card())

    def unusable(self) -> str | None:
        """Why the model cannot serve (its file changed on disk: Engine.weights_error), or None."""
        check = getattr(getattr(self.llm, "engine", None), "weights_error", None)
        return check() if check is not None else None

    async def health(self, request: Request):
        s = self.batcher
        body = {"status": "ok", "model": self.name, "slots": s.n, "active": s.active, "queued": s.queued}
        reason = self.unusable()
        if reason is None:
            return JSONResponse(body)
        return JSONResponse(dict(body, status="error", **_unusable(reason).body()), status_code=503)

    async def slots(self, request: Request):
        """llama-server's /slots: per slot, what it does now (Batcher.slot_states), and the queue."""
        self.auth(request)
        n_ctx = self.llm.n_ctx
        return JSONResponse({"slots": [dict(s, n_ctx=n_ctx) for s in self.batcher.slot_states()],
                             "queued": self.batcher.queued})

    async def prometheus(self, request: Request):
        self.auth(request)
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def page(self, request: Request):
        return FileResponse(STATIC / "index.html")


def create_app(llm, *, parallel: int | None = None, max_concurrency: int | None = None, api_key: str | None = None,
               max_body: int = MAX_BODY, max_queue: int = 256, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               cache_ram: int = CACHE_RAM_MIB) -> Starlette:
    """The ASGI app serving `llm` (a cflow.LLM, or anything with its interface).

    parallel (max_concurrency: its former name): sequences decoded together, one engine step for
    all of them (server/batcher.py); their KV caches are made now, and a CflowError says so when
    they would not fit in memory. Later requests wait (at most max_queue of them, then 503), in
    arrival order but for those whose prompts are cached (server/batcher.py). cache_ram: MiB of
    KV memory for the histories that leave the slots (the prompt cache; 0: none). api_key: if
    set, /v1/*, the tokenizer endpoints and /metrics need `Authorization: Bearer KEY`.
    """
    n = parallel if parallel is not None else max_concurrency if max_concurrency is not None else 1
    srv = Server(llm, parallel=n, api_key=api_key, max_body=max_body, max_queue=max_queue,
                 default_max_tokens=default_max_tokens, cache_ram=cache_ram)

    def endpoint(name, fn):
        async def handle(request: Request):
            try:
                resp = await fn(request)
            except ApiError as e:
                resp = JSONResponse(e.body(), status_code=e.status,
                                    headers={"WWW-Authenticate": "Bearer"} if e.status == 401 else None)
            srv.metrics.requests.labels(name, str(resp.status_code)).inc()
            return resp
        return handle

    routes = [
        Route("/v1/chat/completions", endpoint("chat_completions", srv.chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", srv.completions), methods=["POST"]),
        Route("/v1/models", endpoint("models", srv.models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint("models", srv.model), methods=["GET"]),
        Route("/tokenize", endpoint("tokenize", srv.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint("detokenize", srv.detokenize), methods=["POST"]),
        Route("/tokenizer_info", endpoint("tokenizer_info", srv.tokenizer_info), methods=["GET"]),
        Route("/health", endpoint("health", srv.health), methods=["GET"]),
        Route("/metrics", endpoint("metrics", srv.prometheus), methods=["GET"]),
        Route("/slots", endpoint("slots", srv.slots), methods=["GET"]),
        Route("/", srv.page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    async def http_error(request, exc: HTTPException):
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def server_error(request, exc: Exception):
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.batcher.stop)
            srv.grammars.shutdown(wait=False)

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error},
                    middleware=[Middleware(_AnswerBeforeClosing)], lifespan=lifespan)
    app.state.server = srv
    return app
