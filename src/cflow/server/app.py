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
from dataclasses import asdict, is_dataclass, replace
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

from cflow.errors import CflowError, ModelFileChanged
from cflow.generate import Decoder, recompute_for
from cflow.llm import CHATML_TEMPLATE
from cflow.server.batcher import CACHE_RAM_MIB, END, Batcher, Job, QueueFull
from cflow.server.metrics import Metrics
from cflow.server.schemas import (ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                  check_content_type, from_validation, parse_body)

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
    def choice(text, finish, logprobs=None):
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    @staticmethod
    def delta(text, finish, first=False, logprobs=None):
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}

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
    def choice(text, finish, logprobs=None):
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def delta(text, finish, first=False, logprobs=None):
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

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


class Server:
    """State of one app: the model, its batcher and metrics."""

    def __init__(self, llm, *, parallel: int, api_key: str | None, max_body: int, max_queue: int,
                 default_max_tokens: int, cache_ram: int):
        self.llm, self.api_key, self.max_body, self.default_max_tokens = llm, api_key, max_body, default_max_tokens
        self.name = _display_name(llm.name)
        self.batcher = Batcher(llm.engine, parallel, max_queue, cache_bytes=cache_ram << 20)
        self.metrics = Metrics(self.batcher)
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
    async def run(self, request: Request, req, prompt: list[int], fmt):
        sampling = self.sampling(req, prompt)
        t0 = time.perf_counter()
        try:
            decoder = Decoder(self.llm.tokenizer, prompt, recompute=recompute_for(self.llm.engine), **sampling)
            gen = Job(self.batcher, decoder, stream=bool(req.stream))
        except CflowError as e:
            raise _model_error(e) from None
        try:
            self.batcher.submit(gen)
        except QueueFull as e:
            raise _model_error(e) from None
        watch = asyncio.create_task(_disconnected(request))
        handed_off = False
        try:
            item = await _next(gen, watch)
            if isinstance(item, Exception):
                raise _model_error(item)
            if req.stream:
                handed_off = True
                return EventStream(self.events(gen, item, fmt, req, prompt, t0),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            text, last, lps = [], None, []
            while item is not END:
                if isinstance(item, Exception):
                    raise _model_error(item)
                if last is None:
                    text.append(self.echoed(req))
                    lps += self.echoed_logprobs(req, prompt, item.prompt_logprobs)
                text.append(item.text)
                lps += item.logprobs or []
                last = item
                item = await _next(gen, watch)
            self.done(last, t0)
            body = self.head(fmt, fmt.obj)
            logprobs = fmt.logprobs(self.llm.tokenizer, lps, 0)[0] if sampling["logprobs"] is not None else None
            body["choices"] = [fmt.choice("".join(text), last.finish_reason, logprobs)]
            body["usage"] = _usage(last.usage)
            body["timings"] = _plain(last.timings)
            return JSONResponse(body)
        except ClientGone:
            self.metrics.cancelled.inc()
            return Response(status_code=499)  # nobody is left to read it
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            if not handed_off:
                gen.cancel()

    async def events(self, gen: Job, item, fmt, req, prompt: list[int], t0: float):
        head, last, first = self.head(fmt, fmt.chunk_obj), None, True
        want_logprobs = gen.decoder.logprobs is not None
        # logprobs of tokens whose text is held back (an echoed prompt's first); text_offset so far
        carry, offset, echo = self.echoed_logprobs(req, prompt, item.prompt_logprobs), 0, self.echoed(req)
        try:
            while item is not END:
                if isinstance(item, Exception):
                    yield _sse(_model_error(item).body())
                    break
                carry += item.logprobs or []
                if echo:
                    item, echo = replace(item, text=echo + item.text), ""
                if item.text or item.finish_reason or first:
                    logprobs = None
                    if want_logprobs:
                        logprobs, offset = fmt.logprobs(self.llm.tokenizer, carry, offset)
                        carry = []
                    chunk = dict(head, choices=[fmt.delta(item.text, item.finish_reason, first, logprobs)])
                    if item.finish_reason:
                        chunk["timings"] = _plain(item.timings)
                    yield _sse(chunk)
                    first = False
                last = item
                item = await gen.next()
            if last is not None and last.finish_reason:
                self.done(last, t0)
                if req.include_usage():
                    yield _sse(dict(head, choices=[], usage=_usage(last.usage)))
            yield "data: [DONE]\n\n"
        finally:
            if last is None or not last.finish_reason:
                self.metrics.cancelled.inc()
            gen.cancel()

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

    def chat_text(self, messages) -> str:
        """Messages rendered with the model's chat template, the generation prompt added."""
        try:
            return self.llm.render_chat([m.plain() for m in messages], add_generation_prompt=True)
        except (jinja2.TemplateError, CflowError) as e:
            raise ApiError(400, f"messages: the chat template rejected them: {e}", param="messages") from None

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.llm.config.vocab_size
        if ids and max(ids) >= vocab:
            raise ApiError(400, f"{param}: token ids must be below the vocabulary's {vocab}", param=param,
                           code="invalid_value")

    async def chat_completions(self, request: Request):
        req = await self.parsed(request, ChatRequest)
        prompt = self.llm.tokenizer.encode(self.chat_text(req.messages), add_special_tokens=False)
        return await self.run(request, req, prompt, _Chat)

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

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error},
                    middleware=[Middleware(_AnswerBeforeClosing)], lifespan=lifespan)
    app.state.server = srv
    return app
