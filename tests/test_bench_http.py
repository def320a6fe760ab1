"""The load generator's HTTP client (cflow.bench.http) against a real server over loopback: the
tiny model behind `cflow serve`'s app (server_util.serving), and raw sockets for a server that
breaks the protocol. Waits are on server state; TIMEOUT only bounds a hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from server_util import FOREVER, TIMEOUT, health, long_llm, serving, wait_for

from cflow.bench.http import Connection, HttpError

HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url(tiny_llm):
    with serving(tiny_llm) as u:
        yield u


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@contextlib.asynccontextmanager
async def raw_server(answer):
    """A plain asyncio TCP server on a loopback port, answer(reader, writer) per connection:
    yields its http:// base URL."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader) -> bytes:
    """One whole request from the socket (content-length bodies): its head and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    n = next(int(x.split(b":")[1]) for x in head.lower().split(b"\r\n") if x.startswith(b"content-length:"))
    return head + await reader.readexactly(n)


def local_port(conn: Connection) -> int:
    return conn._writer.get_extra_info("sockname")[1]


def test_json_requests_share_one_kept_connection(url):
    async def go():
        conn = Connection(url)
        try:
            out = []
            for n in (3, 5):
                status, body = await conn.post_json("/v1/chat/completions", {"messages": HI, "max_tokens": n,
                                                                             "temperature": 0, "ignore_eos": True})
                out.append((status, json.loads(body), local_port(conn)))
            return out
        finally:
            await conn.close()

    (s1, b1, p1), (s2, b2, p2) = run(go())
    assert (s1, s2) == (200, 200)
    assert b1["usage"]["completion_tokens"] == 3 and b2["usage"]["completion_tokens"] == 5
    assert p1 == p2  # keep-alive: the second request went over the first one's socket


def test_an_error_status_is_returned_not_raised(url):
    async def go():
        conn = Connection(url)
        try:
            bad = await conn.post_json("/v1/chat/completions", {"messages": "not a list"})
            missing = await conn.post_json("/v1/nowhere", {})
            good = await conn.post_json("/v1/chat/completions", {"messages": HI, "max_tokens": 2})
            return bad, missing, good
        finally:
            await conn.close()

    (sb, bb), (sm, _), (sg, _) = run(go())
    assert sb == 400 and "error" in json.loads(bb)
    assert sm == 404 and sg == 200


def test_a_stream_yields_its_sse_lines_and_keeps_the_connection(url):
    async def go():
        conn = Connection(url)
        try:
            body = {"messages": HI, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with conn.stream("/v1/chat/completions", body) as r:
                lines = [line async for line in r.lines()]
                status, port = r.status, local_port(conn)
            again, whole = await conn.post_json("/v1/chat/completions", {**body, "stream": False})
            return status, lines, port, local_port(conn), again, json.loads(whole)
        finally:
            await conn.close()

    status, lines, p1, p2, again, whole = run(go())
    data = [x for x in lines if x.startswith("data: ")]
    assert status == 200 and data[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in data[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == whole["choices"][0]["message"]["content"] and text  # the same greedy tokens
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert again == 200 and p1 == p2


def test_leaving_a_stream_closes_it_and_the_server_frees_the_slot(tiny_cflow):
    llm = long_llm(tiny_cflow)
    with serving(llm, parallel=1) as u:
        async def go():
            conn = Connection(u)
            try:
                body = {"messages": HI, "max_tokens": FOREVER, "ignore_eos": True, "stream": True}
                async with conn.stream("/v1/chat/completions", body) as r:
                    async for line in r.lines():
                        if line.startswith("data: {"):
                            break  # the first token: leave
                first = local_port(conn) if conn._writer else None
                status, _ = await conn.post_json("/v1/chat/completions", {"messages": HI, "max_tokens": 1})
                return first, status, local_port(conn)
            finally:
                await conn.close()

        first, status, port = run(go())
        assert first is None  # leaving early closed the socket ...
        assert status == 200 and port  # ... and the next request opened another
        wait_for(lambda: health(u)["active"] == 0, what="the abandoned slot to free")


def test_a_refused_connection_raises_and_a_bad_url_is_refused():
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

        async def go():
            await Connection(f"http://127.0.0.1:{port}").post_json("/", {})

        with pytest.raises(HttpError, match="cannot connect"):
            run(go())
    with pytest.raises(ValueError, match="http://"):
        Connection("https://example.org")


@pytest.mark.parametrize("reply", [
    b"",  # closed before any byte
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial\"",  # closed mid-body
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:",  # closed mid-chunk
    b"NOT HTTP AT ALL\r\n\r\n",  # not a status line
])
def test_a_server_that_breaks_the_protocol_raises_http_error(reply):
    async def go():
        async def answer(reader, writer):
            await read_request(reader)
            writer.write(reply)
            await writer.drain()
            writer.close()

        async with raw_server(answer) as url:
            conn = Connection(url)
            try:
                with pytest.raises(HttpError):
                    await conn.post_json("/", {"a": 1})
                assert conn._writer is None  # the broken connection is dropped, not reused
                with pytest.raises(HttpError):
                    async with conn.stream("/", {"a": 1}) as r:
                        [x async for x in r.lines()]
            finally:
                await conn.close()

    run(go())


def test_the_request_carries_the_urls_path_host_and_json_body():
    async def go():
        seen = {}

        async def answer(reader, writer):
            head, body = (await read_request(reader)).split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            headers = {k.lower(): v for k, v in (x.split(": ", 1) for x in lines[1:])}
            seen.update(line=lines[0], headers=headers, body=body)
            writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()

        async with raw_server(answer) as url:
            conn = Connection(url + "/llm/")
            try:
                got = await conn.post_json("/v1/chat/completions", {"a": [1, "é"]}, {"Authorization": "Bearer k"})
            finally:
                await conn.close()
        return seen, got, url.rsplit(":", 1)[1]

    seen, got, port = run(go())
    assert got == (201, b"ok")
    assert seen["line"] == "POST /llm/v1/chat/completions HTTP/1.1"
    assert seen["headers"]["host"] == f"127.0.0.1:{port}" and seen["headers"]["authorization"] == "Bearer k"
    assert seen["headers"]["content-type"] == "application/json"
    assert json.loads(seen["body"]) == {"a": [1, "é"]}


def test_a_kept_connection_the_server_closed_while_idle_is_retried_once():
    async def go():
        conns, closed = [], asyncio.Event()

        async def answer(reader, writer):
            conns.append(0)
            k = len(conns)
            await read_request(reader)
            conns[k - 1] += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n" + str(k).encode())
            await writer.drain()
            if k == 1:  # the first connection: kept alive by the answer, then closed while idle
                writer.close()
                await writer.wait_closed()
                closed.set()
            else:
                await reader.read()  # until the client goes

        async with raw_server(answer) as url:
            conn = Connection(url)
            try:
                first = await conn.post_json("/", {})
                await closed.wait()
                second = await conn.post_json("/", {})
            finally:
                await conn.close()
        return first, second, conns

    first, second, conns = run(go())
    assert first == (200, b"1") and second == (200, b"2")
    assert conns == [1, 1]  # each connection saw one request: the second was sent again, on a new one


def test_a_response_cut_off_on_a_kept_connection_is_not_sent_again():
    async def go():
        requests = []

        async def answer(reader, writer):
            await read_request(reader)
            requests.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx")
            await read_request(reader)
            requests.append(2)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")  # a part of the answer's head, then gone
            await writer.drain()
            writer.close()

        async with raw_server(answer) as url:
            conn = Connection(url)
            try:
                assert await conn.post_json("/", {}) == (200, b"x")
                with pytest.raises(HttpError):
                    await conn.post_json("/", {})
            finally:
                await conn.close()
        return requests

    assert run(go()) == [1, 2]  # no second copy of the cut-off request
