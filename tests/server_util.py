"""A real uvicorn server on a loopback port, in a thread of the test process."""

from __future__ import annotations

import contextlib
import threading
import time


@contextlib.contextmanager
def serving(llm, **kw):
    """Yields the base URL of a server for create_app(llm, **kw); stops it on exit."""
    import uvicorn

    from cflow.server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(llm, **kw), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
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


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
