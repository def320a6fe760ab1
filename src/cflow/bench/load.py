"""`cflow bench load`: many concurrent clients against `cflow serve` on loopback.

Starts a server (unless --url is given), warms it with one request per slot or client, then runs
--clients concurrent clients that each send --requests chat completions one after another (or,
with --duration, until that time is up). Reports server errors, p50/p95 latency, total
completion tokens/s, time to first token and inter-token latency (streamed requests), the CPU the
server and the load clients took (in cores: on a small host they share them), and the
server's resident memory before and after the run, and every --rss-every seconds during it: its
growth from the first reading under load to the end is a soak's figure (requests must not leak;
the reading before the run precedes what the first requests build and keep, such as the
grammars' thread and the prompt cache's histories). --parallel 1,2,4,8 runs one phase per value,
a server each, and plots throughput and latency against parallelism; --rounds R runs that list R
times, alternating its order (1,8 then 8,1 ...), and reports each value's ratio to the first
round by round, with the median and range (the host's drift over minutes is as large as many
changes: a ratio of phases run side by side, repeated, is the figure to read). --disconnect makes
clients abandon streams mid-way (a soak)."""

from __future__ import annotations

import asyncio
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in one sentence.",
    "List three fruits.",
    "Tell me a short story about a fox.",
    "What is 12 times 7?",
    "Why is the sky blue?",
    "Give me a name for a cat.",
]
# offered with --tools' share of the requests (tool_choice auto)
BENCH_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                      "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                     "required": ["tz"]}}},
]


def add_arguments(p):
    p.add_argument("-m", "--model", default=None, help="model to serve (default: the built-in default model)")
    p.add_argument("--url", default=None,
                   help="load an already running server (http://HOST:PORT, as `cflow serve` speaks) instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its memory and CPU")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default %(default)s)")
    p.add_argument("--requests", type=int, default=50, help="requests per client (default %(default)s)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds: each client sends requests until this time is up (a soak; instead of --requests)")
    p.add_argument("--disconnect", type=float, default=0.0,
                   help="fraction of streamed requests a client abandons mid-stream, at a random token (default 0)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default %(default)s)")
    p.add_argument("--turns", type=int, default=1,
                   help="turns of each client's conversations: a request carries the earlier turns' questions "
                        "and answers, as a chat does (default %(default)s: single questions)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="the requests' prompts instead of the built-in questions: JSON lines, each a string (a "
                        "user message) or a list of chat messages (a conversation to answer, a system prompt or a "
                        "long document in it); request i of client k takes line k + i x clients, round the file")
    p.add_argument("--stream", action="store_true", help="streamed requests (server-sent events): also "
                   "time to first token and inter-token latency")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="frequency_penalty of each request (-2..2; default: not sent, no penalty)")
    p.add_argument("--n", type=int, default=1, help="choices of each request (1..16; default %(default)s)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="ask for each token's logprob and its step's K most likely (0..20; default: not asked)")
    p.add_argument("--json", type=float, default=0.0, metavar="SHARE",
                   help="the share of requests (0..1) in JSON mode (response_format json_object); their answers "
                        "are checked: a closed object must parse (default %(default)s)")
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="with --json: those requests give this JSON schema (a file, or the schema's text; "
                        "response_format json_schema) instead of asking for any object; a closed answer must parse")
    p.add_argument("--tools", type=float, default=0.0, metavar="SHARE",
                   help="the share of requests (0..1, beside --json's) offered two tools (get_weather, get_time; "
                        "tool_choice auto); their calls are checked: arguments must parse as a JSON object "
                        "(default %(default)s)")
    p.add_argument("--parallel", "--max-concurrency", dest="parallel", default="1",
                   help="sequences the started server decodes together; a list (1,2,4,8) runs one phase per "
                        "value, a server each, and plots them (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the --parallel list this many times, in alternating order, and report each "
                        "value's ratio to the first per round: median and range (default %(default)s)")
    p.add_argument("--plot", default=None,
                   help="PNG of throughput and latency against parallelism (default with several --parallel "
                        "values: bench-load.png; needs matplotlib)")
    p.add_argument("--threads", type=int, default=None, help="engine threads of the started server")
    p.add_argument("--n-ctx", type=int, default=None, help="context of the started server")
    p.add_argument("--activations", choices=("int8x2", "int8", "fp32"), default=None,
                   help="activations of the started server (default: its own, int8x2)")
    from cflow.engine import KV_CACHE_TYPES

    for short, which in (("-ctk", "keys"), ("-ctv", "values")):
        p.add_argument(f"--cache-type-{which[0]}", short, choices=KV_CACHE_TYPES, default=None,
                       help=f"the started server's KV cache type of {which} (default: its own, f16)")
    p.add_argument("--cache-ram", type=int, default=None,
                   help="MiB of prompt cache of the started server (default: its own; 0: none)")
    p.add_argument("--api-key", default=None, help="API key to send (and to start the server with)")
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (disconnects)")
    p.add_argument("--rss-every", type=float, default=30.0, metavar="SECONDS",
                   help="read the server's resident memory this often during the run, and report its growth "
                        "from the first reading under load to the end (default %(default)s; 0: only before and "
                        "after)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    import psutil

    return psutil.Process(pid).memory_info().rss


# The server's threads by what they do, from their OS names (core.set_thread_name): the engine
# (the batcher thread that runs each step and the pool's workers) and the event loop (the main
# thread: HTTP, JSON, the hand-out to clients); the rest (the grammar thread, libuv's workers, any
# thread that ended) is the total's remainder.
ENGINE_THREADS = ("cflow-batcher", "cflow-pool", "cflow-io")


def _cpu(pid: int | None, by_thread: bool = False, total_last: bool = False) -> dict | None:
    """CPU seconds of a process so far: "total" (user + system, every thread, ended ones too) and,
    by_thread where Linux shows the threads' names, "engine" and "event loop" (ENGINE_THREADS).
    The total is read before the threads, or after them with total_last: a run's first reading
    takes it first and its last reading last, so that the threads' window lies within the
    total's even when this process is preempted between the reads. Linux counts each thread's
    time and the total in 10 ms ticks, cut short: over a run of a fraction of a second the parts
    and the total may differ by a few ticks."""
    if pid is None:
        return None
    import psutil

    proc = psutil.Process(pid)
    out = {}
    if not total_last:
        t = proc.cpu_times()
        out["total"] = t.user + t.system
    if by_thread and os.path.isdir(f"/proc/{pid}/task"):
        out.update({"engine": 0.0, "event loop": 0.0})
        for th in proc.threads():
            try:
                with open(f"/proc/{pid}/task/{th.id}/comm") as f:
                    name = f.read().strip()
            except OSError:  # the thread ended meanwhile: its time stays in the total
                continue
            group = "event loop" if th.id == pid else "engine" if name in ENGINE_THREADS else None
            if group:
                out[group] += th.user_time + th.system_time
    if total_last:
        t = proc.cpu_times()
        out["total"] = t.user + t.system
    return out


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _start_server(args, parallel: int):
    from cflow.errors import CflowError

    port = _free_port()
    cmd = [sys.executable, "-m", "cflow", "serve", "--port", str(port), "--log-level", "warning",
           "--parallel", str(parallel), "--max-queue", str(max(256, args.clients))]
    for flag, value in (("-m", args.model), ("--threads", args.threads), ("--n-ctx", args.n_ctx),
                        ("--activations", args.activations), ("--cache-type-k", args.cache_type_k),
                        ("--cache-type-v", args.cache_type_v), ("--cache-ram", args.cache_ram),
                        ("--api-key", args.api_key)):
        if value is not None:
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 600  # first use may convert the model
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CflowError(f"the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise CflowError("the server did not answer /health within 600 s")


class Result:
    """One request: status (-1: connection failed or dropped), completion tokens, seconds to the
    end, to the first token and between tokens (streamed), whether the client left mid-stream."""

    def __init__(self):
        self.status, self.tokens, self.latency, self.ttft = 0, 0, 0.0, None
        self.prompt_tokens = self.cached_tokens = 0  # from usage: the prompt, and what of it was reused
        self.gaps: list[float] = []
        self.abandoned = self.stream_error = False
        self.text = ""  # the answer (for the next turn of a conversation)
        self.finish: str | None = None  # the first choice's finish_reason
        self.json = False  # asked for JSON mode
        self.tools = False  # offered tools
        self.calls: list[dict] = []  # the first choice's tool calls

    @property
    def server_error(self) -> bool:
        return self.status >= 500 or self.status == -1 or self.stream_error


def _usage(res: Result, usage: dict) -> None:
    res.tokens = int(usage.get("completion_tokens", 0))
    res.prompt_tokens = int(usage.get("prompt_tokens", 0))
    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def _stream(conn, body, headers, res: Result, cut: int | None, t0: float) -> None:
    import json

    async with conn.stream("/v1/chat/completions", body, headers) as r:
        res.status, last, seen = r.status, None, 0
        async for line in r.lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                res.stream_error = True
            elif event.get("choices"):
                choice = event["choices"][0]
                if choice.get("index", 0) == 0:  # the conversation goes on with the first choice
                    res.text += choice.get("delta", {}).get("content") or ""
                    _gather_calls(res.calls, choice.get("delta", {}).get("tool_calls"))
                    res.finish = choice.get("finish_reason") or res.finish
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.gaps.append(now - last)
                last, seen = now, seen + 1
                if cut is not None and seen >= cut:
                    res.abandoned = True  # leave mid-stream: the server must cancel and carry on
                    return
            if event.get("usage"):
                _usage(res, event["usage"])


async def _client(url, headers, args, k, results, bar, deadline):
    """Client k: its requests one after another on one keep-alive connection (bench/http.py)."""
    import json

    from cflow.bench.http import Connection, HttpError

    rng = random.Random(args.seed * 7919 + k)
    conn, i, chat = Connection(url), 0, []
    try:
        while (time.perf_counter() < deadline) if deadline is not None else (i < args.requests):
            if len(chat) >= 2 * args.turns:  # the conversation is over: the client starts another
                chat = []
            if args.prompts is None:
                chat.append({"role": "user", "content": QUESTIONS[(k + i) % len(QUESTIONS)]})
            else:
                item = args.prompts[(k + i * args.clients) % len(args.prompts)]
                chat = chat + [{"role": "user", "content": item}] if isinstance(item, str) else list(item)
            body = {"messages": list(chat),
                    "max_tokens": args.max_tokens, "temperature": 0.7, "seed": k * 1000 + i, "stream": args.stream}
            if args.frequency_penalty is not None:
                body["frequency_penalty"] = args.frequency_penalty
            if args.n > 1:
                body["n"] = args.n
            if args.logprobs is not None:
                body.update(logprobs=True, top_logprobs=args.logprobs)
            i += 1
            res, t0 = Result(), time.perf_counter()
            draw = rng.random()
            if draw < args.json:
                body["response_format"], res.json = args.response_format, True
            elif draw < args.json + args.tools:
                body["tools"], res.tools = BENCH_TOOLS, True
            try:
                if args.stream:
                    body["stream_options"] = {"include_usage": True}
                    cut = rng.randint(1, max(1, args.max_tokens - 1)) if rng.random() < args.disconnect else None
                    await _stream(conn, body, headers, res, cut, t0)
                else:
                    res.status, raw = await conn.post_json("/v1/chat/completions", body, headers)
                    if res.status == 200:
                        answer = json.loads(raw)
                        _usage(res, answer["usage"])
                        res.text = answer["choices"][0]["message"]["content"] or ""
                        res.calls = answer["choices"][0]["message"].get("tool_calls") or []
                        res.finish = answer["choices"][0]["finish_reason"]
            except HttpError:
                res.status = -1
            res.latency = time.perf_counter() - t0
            if res.status == 200 and not res.abandoned and not res.stream_error and not res.calls:
                chat.append({"role": "assistant", "content": res.text})
            else:  # an answer cut short or failed: the client starts a new conversation
                chat = []
            results.append(res)
            bar.update(1)
    finally:
        await conn.close()


async def _load(url, args, pid: int | None = None) -> tuple[list[Result], float, list[tuple[float, int]]]:
    """The clients' run: its results, its wall time and, with the server's pid, its resident
    memory every --rss-every seconds (seconds into the run, bytes)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: list[Result] = []
    readings: list[tuple[float, int]] = []
    from tqdm import tqdm

    async def watch(t0: float) -> None:
        import psutil

        while True:
            await asyncio.sleep(args.rss_every)
            try:
                readings.append((time.perf_counter() - t0, _rss(pid)))
            except psutil.Error:  # the server is gone: the clients' errors say so
                return

    total = None if args.duration else args.clients * args.requests
    with tqdm(total=total, desc="requests", unit="req", file=sys.stderr, mininterval=1.0) as bar:
        t0 = time.perf_counter()
        deadline = t0 + args.duration if args.duration else None
        watcher = asyncio.create_task(watch(t0)) if pid is not None and args.rss_every > 0 else None
        try:
            await asyncio.gather(*(_client(url, headers, args, k, results, bar, deadline) for k in range(args.clients)))
        finally:
            if watcher is not None:
                watcher.cancel()
        return results, time.perf_counter() - t0, readings


async def _warm(url, headers, n: int, max_tokens: int, fmt: dict | None = None, tools: bool = False) -> None:
    """n requests at once (a slot's worth and a client's worth), twice, the second time each
    asking the next question: every sequence slot and as many connections as the load will hold
    have run, and the first answers' histories have moved to the server's prompt cache, which then
    holds what the load will keep there, before memory is measured. fmt: a third of them ask that
    response_format (whose first request builds the matcher's view of the tokenizer); tools: a
    third are offered the bench's tools (their grammar, and histories with tools in the cache)."""
    import httpx

    def body(i: int, shift: int) -> dict:
        b = {"messages": [{"role": "user", "content": QUESTIONS[(i + shift) % len(QUESTIONS)]}], "max_tokens": max_tokens}
        if fmt is not None and i % 3 == 0:
            b["response_format"] = fmt
        elif tools and i % 3 == 1:
            b["tools"] = BENCH_TOOLS
        return b

    async with httpx.AsyncClient(timeout=600) as http:
        for shift in (0, 1):
            rs = await asyncio.gather(*(http.post(url + "/v1/chat/completions", headers=headers, json=body(i, shift))
                                        for i in range(n)))
            for r in rs:
                r.raise_for_status()


def _pct(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))] if sorted_xs else float("nan")


BATCHER_GAUGES = ("cflow_batcher_steps", "cflow_batcher_forward_seconds", "cflow_batcher_step_seconds",
                  "cflow_batcher_decode_rows", "cflow_batcher_prompt_rows")
CACHE_GAUGES = ("cflow_prompt_cache_entries", "cflow_prompt_cache_bytes", "cflow_prompt_cache_hits")


def _batcher(url: str, headers: dict) -> dict[str, float] | None:
    """The batcher's counters from the server's /metrics (None: a server without them)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    except (httpx.HTTPError, ValueError):
        return None
    if not all(k in got for k in BATCHER_GAUGES):
        return None
    return {k: got[k] for k in BATCHER_GAUGES + CACHE_GAUGES if k in got}


def _phase(args, parallel: int | None) -> dict:
    """One run against one server (started here with `parallel` slots, or args.url)."""
    import httpx

    proc, url, pid = None, args.url, args.pid
    if url is None:
        proc, url = _start_server(args, parallel)
        pid = proc.pid
    try:
        url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        slots = httpx.get(url + "/health", timeout=10).json().get("slots", 1)
        asyncio.run(_warm(url, headers, max(slots, args.clients), args.max_tokens,
                          args.response_format if args.json > 0 else None, args.tools > 0))
        rss0, b0 = _rss(pid), _batcher(url, headers)
        # the CPU the server and this process's clients took, over the same span: on a small host
        # the load clients share the cores with the server, and a ratio of phases reads with it
        me = os.getpid()
        server = pid if pid != me else None  # a server in this process is counted with the clients
        c0, m0, t0 = _cpu(server, by_thread=True), _cpu(me), time.perf_counter()
        results, wall, readings = asyncio.run(_load(url, args, pid))
        c1, m1, span = _cpu(server, by_thread=True, total_last=True), _cpu(me), time.perf_counter() - t0
        cpu = ({k: (c1[k] - c0[k]) / span for k in c0} if c0 else None, (m1["total"] - m0["total"]) / span)
        rss1, b1 = _rss(pid), _batcher(url, headers)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    steps = {k: b1[k] - b0[k] for k in BATCHER_GAUGES} if b0 and b1 else None
    cache = (b0, b1) if b0 and b1 and all(k in b0 and k in b1 for k in CACHE_GAUGES) else None
    return _report(args, model, url, slots, results, wall, rss0, rss1, steps, cache, readings, cpu)


def _report(args, model, url, slots, results, wall, rss0, rss1, steps=None, cache=None, readings=(),
            cpu=(None, None)) -> dict:
    lat = sorted(r.latency for r in results)
    ttft = sorted(r.ttft for r in results if r.ttft is not None)
    gaps = sorted(g for r in results for g in r.gaps)
    server_err = sum(1 for r in results if r.server_error)
    other_err = sum(1 for r in results if not r.server_error and r.status != 200)
    abandoned = sum(1 for r in results if r.abandoned)
    tokens = sum(r.tokens for r in results)
    asked = [r for r in results if r.json and r.status == 200 and not r.abandoned and not r.stream_error]
    closed = [r for r in asked if r.finish == "stop"]
    unparsed = sum(1 for r in closed if not _parses(r.text, objects_only=args.json_schema is None))
    server_err += unparsed  # a closed answer that is not JSON (not one object in JSON mode): the server broke its word
    offered = [r for r in results if r.tools and r.status == 200 and not r.abandoned and not r.stream_error]
    called = [r for r in offered if r.calls]
    cut_calls = [r for r in called if r.finish == "length"]  # the last call's arguments as far as they came
    bad_calls = sum(1 for r in called if not _calls_parse(r.calls, cut=r.finish == "length")
                    or r.finish not in ("tool_calls", "length"))
    server_err += bad_calls  # a call of no offered tool, or arguments that are not a JSON object
    runs = f"for {args.duration:.0f} s" if args.duration else f"x {args.requests} requests"
    fmt = args.response_format["type"]
    from cflow.kernels import kernels_name

    print(f"load: {model} at {url}, parallel {slots}, {args.clients} clients {runs} = {len(results)}, "
          f"max_tokens {args.max_tokens}{f', conversations of {args.turns} turns' if args.turns > 1 else ''}"
          f"{', streamed' if args.stream else ''}"
          f"{'' if args.frequency_penalty is None else f', frequency_penalty {args.frequency_penalty:g}'}"
          f"{f', n {args.n}' if args.n > 1 else ''}{'' if args.logprobs is None else f', logprobs {args.logprobs}'}"
          f"{f', JSON {fmt} {args.json:g} of them' if args.json else ''}"
          f"{f', tools {args.tools:g} of them' if args.tools else ''}, {kernels_name()} kernels")
    print(f"  errors      {server_err} server (5xx or dropped{', or JSON that does not parse' if args.json else ''}"
          f"{', or calls that do not' if args.tools else ''}), "
          f"{other_err} other"
          + (f"; {abandoned} abandoned mid-stream by their client" if abandoned else ""))
    if args.json:
        what = ("json schema", "ended", "parse") if args.json_schema else ("json mode", "closed their object", "parse as one")
        print(f"  {what[0]:<11} {len(asked)} answers: {len(closed)} {what[1]} ({len(closed) - unparsed} "
              f"{what[2]}, {unparsed} do not), {len(asked) - len(closed)} cut by max_tokens or a stop string")
    if args.tools:
        print(f"  tools       {len(offered)} answers: {len(called)} called tools ({len(called) - bad_calls} "
              f"with calls that parse, {bad_calls} not; {len(cut_calls)} of them cut by max_tokens, their last "
              f"call's arguments as far as they came), {len(offered) - len(called)} answered in text")
    print(f"  latency     p50 {_pct(lat, 0.50):.3f} s   p95 {_pct(lat, 0.95):.3f} s   max {lat[-1]:.3f} s")
    if ttft:
        print(f"  first token p50 {_pct(ttft, 0.50):.3f} s   p95 {_pct(ttft, 0.95):.3f} s")
        print(f"  inter-token p50 {1e3 * _pct(gaps, 0.50):.1f} ms   p95 {1e3 * _pct(gaps, 0.95):.1f} ms   "
              f"max {1e3 * gaps[-1]:.1f} ms")
    prompt, cached = sum(r.prompt_tokens for r in results), sum(r.cached_tokens for r in results)
    if prompt:
        print(f"  prompts     {prompt} tokens, {cached} of them reused from KV caches "
              f"({100 * cached / prompt:.0f}%), {(prompt - cached) / max(1, len(results)):.1f} computed a request")
    print(f"  throughput  {tokens} completion tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s, "
          f"{len(results) / wall:.2f} requests/s"
          + ("" if not abandoned else " (abandoned requests' tokens not counted)"))
    if steps and steps["cflow_batcher_steps"] > 0:
        n = steps["cflow_batcher_steps"]
        fwd, whole = steps["cflow_batcher_forward_seconds"], steps["cflow_batcher_step_seconds"]
        print(f"  steps       {n:.0f}, {steps['cflow_batcher_decode_rows'] / n:.2f} decode + "
              f"{steps['cflow_batcher_prompt_rows'] / n:.2f} prompt rows a step; {1e3 * fwd / n:.2f} ms forward + "
              f"{1e3 * (whole - fwd) / n:.2f} ms sampling and hand-out a step; engine busy {100 * fwd / wall:.0f}% "
              f"of the wall time, batcher {100 * whole / wall:.0f}%")
    server, clients_cpu = cpu  # in cores: CPU seconds over the run's wall time
    server_cpu = server["total"] if server else None
    split = {k: server[k] for k in ("engine", "event loop")} if server and "engine" in server else None
    if clients_cpu is not None:
        n = _cores()
        if args.pid == os.getpid():
            print(f"  cpu         server and load clients (one process) {clients_cpu:.2f} cores (of {n})")
        elif server_cpu is None:
            print(f"  cpu         load clients {clients_cpu:.2f} cores (of {n}; the server's unknown without --pid)")
        else:
            parts = "" if not split else (f" (engine {split['engine']:.2f}, event loop {split['event loop']:.2f}, "
                                          f"other {max(0.0, server_cpu - sum(split.values())):.2f})")
            print(f"  cpu         server {server_cpu:.2f} cores{parts}, load clients {clients_cpu:.2f} (of {n}: "
                  f"{100 * (server_cpu + clients_cpu) / n:.0f}% of the host's cores)")
    if cache:
        c0, c1 = cache
        print(f"  prompt cache {c1['cflow_prompt_cache_hits'] - c0['cflow_prompt_cache_hits']:.0f} hits; "
              f"{c0['cflow_prompt_cache_entries']:.0f} histories, {c0['cflow_prompt_cache_bytes'] / 2**20:.1f} MiB "
              f"before, {c1['cflow_prompt_cache_entries']:.0f}, {c1['cflow_prompt_cache_bytes'] / 2**20:.1f} MiB after")
    growth = None
    if rss0 is not None and rss1 is not None:
        growth = 100 * (rss1 - rss0) / rss0
        print(f"  server RSS  before {rss0 / 2**20:.1f} MiB, after {rss1 / 2**20:.1f} MiB ({growth:+.2f}%)")
    under_load = None
    if readings and rss1 is not None:  # from the first reading under load to the end: a soak's figure
        (t1, first), (tm, mid) = readings[0], readings[len(readings) // 2]  # mid: a leak grows on, warm-up stops
        under_load = 100 * (rss1 - first) / first
        print(f"  under load  {first / 2**20:.1f} MiB at the first reading ({t1:.1f} s in), {mid / 2**20:.1f} at "
              f"{tm:.1f} s, {rss1 / 2**20:.1f} at the end ({under_load:+.2f}%; {len(readings)} readings every "
              f"{args.rss_every:g} s, the largest {max(v for _, v in readings) / 2**20:.1f})")
    sys.stdout.flush()
    return dict(parallel=slots, tok_s=tokens / wall, server_errors=server_err, other_errors=other_err,
                lat50=_pct(lat, 0.50), lat95=_pct(lat, 0.95), ttft50=_pct(ttft, 0.50), ttft95=_pct(ttft, 0.95),
                itl50=_pct(gaps, 0.50), itl95=_pct(gaps, 0.95),
                rss_growth=growth, rss_growth_under_load=under_load, cpu_server=server_cpu, cpu_clients=clients_cpu,
                cpu_server_threads=split)


def read_prompts(path: str) -> list:
    """--prompts: the file's JSON lines (blank lines skipped), each a string or a list of chat
    messages ({"role", "content": str}); CflowError naming the first bad line."""
    import json

    from cflow.errors import CflowError

    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise CflowError(f"--prompts: cannot read {path}: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise CflowError(f"--prompts {path}:{n}: not JSON: {e}") from None
        ok = isinstance(item, str) or (isinstance(item, list) and item and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in item))
        if not ok:
            raise CflowError(f"--prompts {path}:{n}: a string or a list of {{\"role\", \"content\"}} messages is needed")
        out.append(item)
    if not out:
        raise CflowError(f"--prompts {path}: no prompts in it")
    return out


def _gather_calls(calls: list[dict], deltas: list[dict] | None) -> None:
    """A stream's tool call deltas into calls, as OpenAI's clients join them: by index, a call's
    first entry its id and name, the arguments' pieces in order."""
    for d in deltas or []:
        i = d.get("index", len(calls))
        while len(calls) <= i:
            calls.append({"function": {"name": None, "arguments": ""}})
        f = calls[i]["function"]
        f["name"] = f["name"] or d.get("function", {}).get("name")
        f["arguments"] += d.get("function", {}).get("arguments") or ""


def _calls_parse(calls: list[dict], cut: bool = False) -> bool:
    """Whether every tool call names a bench tool and its arguments are a JSON object (cut: the
    answer was cut by max_tokens, so the last call's arguments are as far as they came)."""
    import json

    names = {t["function"]["name"] for t in BENCH_TOOLS}
    for i, c in enumerate(calls):
        whole = not (cut and i == len(calls) - 1)
        try:
            ok = c["function"]["name"] in names and (not whole or isinstance(json.loads(c["function"]["arguments"]), dict))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            return False
    return True


def _parses(text: str, objects_only: bool) -> bool:
    """Whether text is JSON (one JSON object, objects_only)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) or not objects_only


def _median_row(runs: list[dict]) -> dict:
    """One value's phases over the rounds as one row: the median of each figure, errors summed."""
    if len(runs) == 1:
        return runs[0]
    row = {k: statistics.median(r[k] for r in runs) for k in ("tok_s", "lat50", "lat95", "ttft50", "ttft95",
                                                             "itl50", "itl95")}
    return dict(row, parallel=runs[0]["parallel"], server_errors=sum(r["server_errors"] for r in runs),
                other_errors=sum(r["other_errors"] for r in runs), rss_growth=max(
                    (r["rss_growth"] for r in runs if r["rss_growth"] is not None), default=None))


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["parallel"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["tok_s"] for r in rows], "o-")
    a.set(xlabel="--parallel", ylabel="aggregate completion tokens/s", title="throughput", xscale="log", xticks=xs)
    a.set_ylim(bottom=0)
    # request latency always; first-token and inter-token latency only where streamed (else nan)
    for key, label in (("lat50", "request p50"), ("lat95", "request p95"), ("ttft50", "first token p50"),
                       ("ttft95", "first token p95"), ("itl50", "inter-token p50"), ("itl95", "inter-token p95")):
        if all(math.isfinite(r[key]) and r[key] > 0 for r in rows):
            b.plot(xs, [1e3 * r[key] for r in rows], "o-" if "50" in key else "o--", label=label)
    b.set(xlabel="--parallel", ylabel="ms", title="latency", xscale="log", yscale="log", xticks=xs)
    b.legend()
    for ax in (a, b):
        ax.minorticks_off()
        ax.set_xticks(xs, [str(x) for x in xs])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    from cflow.errors import CflowError

    try:
        values = [int(v) for v in str(args.parallel).split(",") if v.strip()]
    except ValueError:
        raise CflowError(f"--parallel takes a number or a list such as 1,2,4,8, got {args.parallel!r}") from None
    if not values or min(values) < 1:
        raise CflowError("--parallel values must be >= 1")
    if args.url is not None and not args.url.startswith("http://"):
        raise CflowError(f"--url takes http://HOST:PORT (cflow serve speaks plain HTTP), got {args.url!r}")
    if args.url is not None and len(values) > 1:
        raise CflowError("several --parallel values start a server each: leave out --url")
    if not 0.0 <= args.json <= 1.0:
        raise CflowError(f"--json is a share of the requests, in 0..1, got {args.json:g}")
    if not 0.0 <= args.tools <= 1.0 - args.json:
        raise CflowError(f"--tools is a share of the requests, in 0..1 less --json's, got {args.tools:g}")
    args.response_format = {"type": "json_object"}
    if args.json_schema is not None:
        if not args.json:
            raise CflowError("--json-schema is the schema of the --json share of the requests: add --json SHARE")
        import json

        from cflow.commands.generate import schema_arg

        try:
            schema = json.loads(schema_arg(args.json_schema))
        except ValueError as e:
            raise CflowError(f"--json-schema: not JSON: {e}") from None
        args.response_format = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    if args.prompts is not None:
        args.prompts = read_prompts(args.prompts)
    if args.disconnect and not args.stream:
        raise CflowError("--disconnect abandons streams: add --stream")
    if args.turns < 1:
        raise CflowError("--turns must be >= 1")
    if not args.rss_every >= 0:
        raise CflowError(f"--rss-every must be >= 0 seconds, got {args.rss_every:g}")
    if not 1 <= args.n <= 16:
        raise CflowError(f"--n must be in 1..16 (the server's range), got {args.n}")
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        raise CflowError(f"--logprobs must be in 0..20 (top_logprobs' range), got {args.logprobs}")
    if args.frequency_penalty is not None and not -2.0 <= args.frequency_penalty <= 2.0:
        raise CflowError(f"--frequency-penalty must be in -2..2 (the API's range), got {args.frequency_penalty:g}")
    plot = args.plot or ("bench-load.png" if len(values) > 1 else None)
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CflowError("the plot needs matplotlib: pip install 'cflow[train]' (or matplotlib)") from None
    if args.rounds < 1:
        raise CflowError("--rounds must be >= 1")
    if args.rounds > 1 and len(values) < 2:
        raise CflowError("--rounds compares --parallel values: give two or more (1,8)")
    rounds = []  # per round, its rows in the order of `values`
    for r in range(args.rounds):
        order = list(range(len(values)))[::1 if r % 2 == 0 else -1]  # alternate: a drift hits both ends alike
        if args.rounds > 1:
            print(f"\nround {r + 1} of {args.rounds}: --parallel {','.join(str(values[i]) for i in order)}")
        got = {i: _phase(args, None if args.url else values[i]) for i in order}
        rounds.append([got[i] for i in range(len(values))])
    rows = [_median_row([rnd[i] for rnd in rounds]) for i in range(len(values))]
    if len(rows) > 1:
        base = rows[0]["tok_s"]
        median = " (medians over the rounds)" if len(rounds) > 1 else ""
        print(f"\nparallel   tok/s  x first  latency p50/p95 s  first token p50/p95 s   inter-token p50/p95 ms   "
              f"errors{median}")
        for r in rows:
            ttft = f"{r['ttft50']:10.3f} {r['ttft95']:7.3f}" if math.isfinite(r["ttft50"]) else f"{'-':>10} {'-':>7}"
            itl = f"{1e3 * r['itl50']:13.1f} {1e3 * r['itl95']:7.1f}" if math.isfinite(r["itl50"]) else f"{'-':>13} {'-':>7}"
            print(f"{r['parallel']:>8} {r['tok_s']:7.1f} {r['tok_s'] / base:8.2f}  {r['lat50']:8.3f} {r['lat95']:7.3f}"
                  f"   {ttft}   {itl}   {r['server_errors']:6d}")
    if len(rounds) > 1:
        print(f"\ntok/s against --parallel {values[0]}, round by round (median, range):")
        for i, p in enumerate(values[1:], 1):
            ratios = [rnd[i]["tok_s"] / rnd[0]["tok_s"] for rnd in rounds]
            print(f"{p:>8}  " + " ".join(f"{x:.2f}" for x in ratios)
                  + f"   median {statistics.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}")
    if plot:
        _plot(rows, plot, f"cflow bench load: {args.model or 'default model'}, {args.clients} clients, "
                          f"max_tokens {args.max_tokens}" + (f", medians of {len(rounds)} rounds" if len(rounds) > 1 else ""))
        print(f"plot: {plot}")
    return 0 if all(r["server_errors"] == 0 for rnd in rounds for r in rnd) else 1
