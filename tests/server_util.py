"""A real uvicorn server on a loopback port, in a thread of the test process, and the helpers
the server tests share. No test outcome depends on a clock: TIMEOUT only bounds a hang."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx

TIMEOUT = 60.0  # seconds: a hung test fails after this; nothing that passes comes near it
# A test that needs a slot held until it lets go holds it with a generation of FOREVER tokens
# in a context of LONG_CTX: the tiny model takes hours for that, so it never ends by itself
# (one of conftest's 4096 tokens takes seconds, and a busy machine could see it end early).
LONG_CTX = 1 << 16
FOREVER = LONG_CTX - 1024
_local = threading.local()


def long_llm(cflow_path):
    """The tiny model (conftest's tiny_cflow) with a context of LONG_CTX tokens; its KV pages are
    committed only as they fill."""
    from cflow.llm import LLM

    return LLM(str(cflow_path), n_ctx=LONG_CTX, quiet=True)


@contextlib.contextmanager
def serving(llm, **kw):
    """Yields the base URL of a server for create_app(llm, **kw); stops it on exit."""
    import uvicorn

    from cflow.server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(llm, **kw), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def http() -> httpx.Client:
    """This thread's HTTP client (kept connections, TIMEOUT): polling the server costs it little."""
    if getattr(_local, "client", None) is None:
        _local.client = httpx.Client(timeout=TIMEOUT)
    return _local.client


def health(url) -> dict:
    return http().get(url + "/health").json()


def metric(url, name, labels: str | None = None) -> float:
    """A value of /metrics: the sample `name` (with exactly `labels`, e.g. 'endpoint="x",status="400"',
    when given); 0 for a labelled sample not yet counted."""
    for line in http().get(url + "/metrics").text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name if labels is None else key == f"{name}{{{labels}}}":
            return float(value)
    if labels is not None:
        return 0.0
    raise KeyError(name)


def wait_for(pred, timeout=TIMEOUT, what="condition"):
    """Wait until pred() (server state, read afresh each time) holds; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
