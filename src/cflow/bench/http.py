"""The load generator's HTTP/1.1 client: one keep-alive connection per simulated client, h11
(the sans-IO protocol library uvicorn serves with) over asyncio streams.

Why not httpx: `cflow bench load` runs its clients on the server's own machine, so every cycle
a client spends is taken from the engine's threads, and a step of several sequences waits at
its barriers for a thread that lost its core (docs/SERVER.md, "The load generator"). Measured on
a 2-vCPU VM: httpx's AsyncClient took 1.6-2.6 ms of CPU a request (5.5 streamed), this client
0.5-0.6 (2.5), and 3 ms more a request (busy-waited in the client) cut `--parallel 8` throughput
by 13%. A connection here is a socket, an h11 state machine and a read buffer; no pool, no
redirects, no auth flows, no anyio layer.

    conn = Connection("http://127.0.0.1:8000")
    status, body = await conn.post_json("/v1/chat/completions", {...}, headers)
    async with conn.stream("/v1/chat/completions", {...}, headers) as r:   # r.status
        async for line in r.lines(): ...                                    # SSE lines, no EOL
    await conn.close()

A dropped connection, a refused one or a malformed response raises HttpError; the next request
on the Connection opens a new socket. A request on a kept-alive connection that the server closed
while it idled (no byte of an answer) goes once more on a new one. Leaving `stream` before the
end closes the connection (the server sees the client go), as a browser tab closed mid-answer
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from urllib.parse import urlsplit

import h11

READ_BYTES = 1 << 16


async def _within(aw, seconds: float):
    if hasattr(asyncio, "timeout"):  # 3.11+: no task per read
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)


class HttpError(Exception):
    """The connection failed, was dropped, or the response broke the protocol."""


class Connection:
    def __init__(self, url: str, timeout: float = 3600.0):
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"an http:// URL is needed, got {url!r}")
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout
        self._authority = u.netloc.encode()
        self._prefix = u.path.rstrip("/")  # a server behind a path (http://host/llm): its routes below it
        self._reader = self._writer = self._h11 = None
        self._received = 0  # bytes of the response read so far

    async def _open(self) -> None:
        try:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            raise HttpError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        self._h11 = h11.Connection(h11.CLIENT)

    async def close(self) -> None:
        w, self._reader, self._writer, self._h11 = self._writer, None, None, None
        if w is not None:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()

    def _kept(self) -> bool:
        """Whether an open connection is ready for the next request (kept alive)."""
        return self._h11 is not None and self._h11.our_state is h11.IDLE and self._h11.their_state is h11.IDLE

    async def _send(self, path: str, body: bytes, headers: dict) -> None:
        if not self._kept():  # none yet, or one the last exchange left unusable
            await self.close()
            await self._open()
        hs = [(b"host", self._authority), (b"content-type", b"application/json"),
              (b"content-length", str(len(body)).encode())]
        hs += [(k.encode(), v.encode()) for k, v in headers.items()]
        self._received = 0
        try:
            data = self._h11.send(h11.Request(method="POST", target=self._prefix + path, headers=hs))
            data += self._h11.send(h11.Data(data=body)) + self._h11.send(h11.EndOfMessage())
            self._writer.write(data)
            await self._writer.drain()
        except (OSError, h11.ProtocolError) as e:
            await self.close()
            raise HttpError(f"sending the request failed: {e}") from e

    async def _request(self, path: str, obj, headers: dict | None) -> int:
        """POST obj as JSON; the response's status. A kept-alive connection that the server had
        closed while it idled (it answers nothing, not a byte) is opened anew and the request sent
        once more, as browsers do: the server never saw it."""
        body, headers = json.dumps(obj).encode(), headers or {}
        kept = self._kept()
        try:
            await self._send(path, body, headers)
            return await self._head()
        except HttpError:
            if not kept or self._received:
                raise
        await self._send(path, body, headers)
        return await self._head()

    async def _event(self):
        """The next h11 event of the response, reading from the socket as needed."""
        try:
            while True:
                ev = self._h11.next_event()
                if isinstance(ev, h11.ConnectionClosed):  # an OSError: handled below
                    raise ConnectionError("the server closed the connection mid-response")
                if ev is not h11.NEED_DATA:
                    return ev
                data = await _within(self._reader.read(READ_BYTES), self.timeout)
                self._received += len(data)
                self._h11.receive_data(data)  # b"": the peer closed
        except (OSError, asyncio.TimeoutError, h11.ProtocolError) as e:  # 3.10: not TimeoutError
            await self.close()
            raise HttpError(f"reading the response failed: {e!r}") from e

    async def _head(self) -> int:
        ev = await self._event()
        while isinstance(ev, h11.InformationalResponse):
            ev = await self._event()
        return ev.status_code

    def _done(self) -> None:
        """After EndOfMessage: keep the connection for the next request, if both sides may."""
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()

    async def post_json(self, path: str, obj, headers: dict | None = None) -> tuple[int, bytes]:
        """POST obj as JSON; the status and the whole body."""
        status, parts = await self._request(path, obj, headers), []
        while not isinstance(ev := await self._event(), h11.EndOfMessage):
            parts.append(ev.data)
        self._done()
        return status, b"".join(parts)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, obj, headers: dict | None = None):
        """POST obj as JSON and read the response as it comes (`lines()`); leaving early closes
        the connection."""
        r = _Streamed(self, await self._request(path, obj, headers))
        try:
            yield r
        finally:
            if not r.ended:
                await self.close()


class _Streamed:
    def __init__(self, conn: Connection, status: int):
        self.conn, self.status, self.ended = conn, status, False

    async def lines(self):
        """The body's lines as str, without their line ends, as they arrive."""
        buf = b""
        while True:
            ev = await self.conn._event()
            if isinstance(ev, h11.EndOfMessage):
                self.ended = True
                self.conn._done()
                if buf:
                    yield buf.decode()
                return
            buf += ev.data
            *done, buf = buf.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode()
