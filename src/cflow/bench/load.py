"""`cflow bench load`: many concurrent clients against `cflow serve` on loopback.

Starts a server (unless --url is given), warms it with one request, then runs --clients
concurrent clients that each send --requests chat completions one after another. Reports server
errors, p50/p95 latency, total completion tokens/s, and the server's resident memory before and
after the run (growth should stay small: requests must not leak)."""

from __future__ import annotations

import asyncio
import socket
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


def add_arguments(p):
    p.add_argument("-m", "--model", default=None, help="model to serve (default: the built-in default model)")
    p.add_argument("--url", default=None, help="load an already running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its memory")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default %(default)s)")
    p.add_argument("--requests", type=int, default=50, help="requests per client (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default %(default)s)")
    p.add_argument("--stream", action="store_true", help="streamed requests (server-sent events)")
    p.add_argument("--max-concurrency", type=int, default=1, help="slots of the started server (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="engine threads of the started server")
    p.add_argument("--api-key", default=None, help="API key to send (and to start the server with)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    import psutil

    return psutil.Process(pid).memory_info().rss


def _start_server(args):
    from cflow.errors import CflowError

    port = _free_port()
    cmd = [sys.executable, "-m", "cflow", "serve", "--port", str(port), "--log-level", "warning",
           "--max-concurrency", str(args.max_concurrency), "--max-queue", str(max(256, args.clients))]
    for flag, value in (("-m", args.model), ("--threads", args.threads), ("--api-key", args.api_key)):
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


async def _client(http, url, headers, args, k, results, bar):
    import httpx

    for i in range(args.requests):
        body = {"messages": [{"role": "user", "content": QUESTIONS[(k + i) % len(QUESTIONS)]}],
                "max_tokens": args.max_tokens, "temperature": 0.7, "seed": k * 1000 + i, "stream": args.stream}
        if args.stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        status, tokens = 0, 0
        try:
            if args.stream:
                async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                    status = r.status_code
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"usage"' in line:
                            tokens = _usage_tokens(line[6:])
            else:
                r = await http.post(url + "/v1/chat/completions", json=body, headers=headers)
                status = r.status_code
                if status == 200:
                    tokens = r.json()["usage"]["completion_tokens"]
        except httpx.HTTPError:
            status = -1  # connection failed or dropped: counted with the server errors
        results.append((time.perf_counter() - t0, status, tokens))
        bar.update(1)


def _usage_tokens(data: str) -> int:
    import json

    usage = json.loads(data).get("usage") or {}
    return int(usage.get("completion_tokens", 0))


async def _load(url, args) -> tuple[list, float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: list = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    from tqdm import tqdm

    with tqdm(total=args.clients * args.requests, desc="requests", unit="req", file=sys.stderr,
              mininterval=1.0) as bar:
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600.0)) as http:
            t0 = time.perf_counter()
            await asyncio.gather(*(_client(http, url, headers, args, k, results, bar) for k in range(args.clients)))
            return results, time.perf_counter() - t0


def _pct(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def main(args) -> int:
    import httpx

    proc, url, pid = None, args.url, args.pid
    if url is None:
        proc, url = _start_server(args)
        pid = proc.pid
    try:
        url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        warm = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=600, json={
            "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": args.max_tokens})
        warm.raise_for_status()
        rss0 = _rss(pid)
        results, wall = asyncio.run(_load(url, args))
        rss1 = _rss(pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    lat = sorted(r[0] for r in results)
    server_err = sum(1 for r in results if r[1] >= 500 or r[1] == -1)
    other_err = sum(1 for r in results if 0 <= r[1] < 500 and r[1] != 200)
    tokens = sum(r[2] for r in results)
    print(f"load: {model} at {url}, {args.clients} clients x {args.requests} requests = {len(results)}, "
          f"max_tokens {args.max_tokens}{', streamed' if args.stream else ''}")
    print(f"  errors      {server_err} server (5xx or dropped), {other_err} other")
    print(f"  latency     p50 {_pct(lat, 0.50):.3f} s   p95 {_pct(lat, 0.95):.3f} s   max {lat[-1]:.3f} s")
    print(f"  throughput  {tokens} completion tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s, "
          f"{len(results) / wall:.2f} requests/s")
    if rss0 is not None and rss1 is not None:
        print(f"  server RSS  before {rss0 / 2**20:.1f} MiB, after {rss1 / 2**20:.1f} MiB "
              f"({100 * (rss1 - rss0) / rss0:+.2f}%)")
    return 0 if server_err == 0 else 1
