"""The stream relay behind real uvicorn, fed by a stand-in upstream on a real socket.

The stand-in (``tests.test_upstream.StandIn``) frames and paces its bytes in
ways llama-server cannot be made to on demand: one event split over two
chunks and two writes, several events in one chunk, chunk extensions; it
breaks off mid-stream, or streams until its client leaves. What a client of
the studio sees is checked on the wire: bytes unchanged, each piece sent on
before the next exists, an error event when the upstream dies, the upstream
connection closed when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from studio.http.relay import Relay
from studio.http.upstream import Upstream
from tests.helpers import free_port
from tests.test_upstream import CHUNKED_HEAD, StandIn

BROKE = b"data: {\"error\": \"broke off\"}\n\n"
PIECES = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b'data: {"n":3}\n\ndata: {"n":4}\n\n', b"data: [DONE]\n\n"]


def _chunk(data: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), extension, data)


@asynccontextmanager
async def relaying(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]],
                   ) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A stand-in answering with ``handler`` and a uvicorn app relaying it; yields (app URL, upstream closed)."""
    closed = asyncio.Event()
    async with StandIn(handler) as standin:
        upstream = Upstream()

        async def close(resp: httpx.Response) -> None:
            await resp.aclose()
            closed.set()

        async def on_break(exc: httpx.HTTPError) -> bytes:
            return BROKE

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            while (await receive())["more_body"]:
                pass
            resp = await upstream.post(standin.url, {}, {})
            relay = Relay(resp, on_close=lambda first_at, tail: close(resp), on_break=on_break,
                          media_type="text/event-stream")
            await relay(scope, receive, send)

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}/", closed
        finally:
            server.should_exit = True
            await serving
            await upstream.aclose()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def test_bytes_pass_through_unchanged_and_each_piece_goes_on_before_the_next_exists():
    client_has = [asyncio.Event() for _ in PIECES]

    async def paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        first, second, third, done = PIECES
        writer.write(CHUNKED_HEAD + _chunk(first[:7]))  # one event split over two chunks and two writes
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(first[7:], b";ext=1"))
        await writer.drain()
        await asyncio.wait_for(client_has[0].wait(), 5)  # nothing more exists until the client has the first
        writer.write(_chunk(second))
        await writer.drain()
        await asyncio.wait_for(client_has[1].wait(), 5)
        writer.write(_chunk(third) + _chunk(done) + b"0\r\n\r\n")  # two events in one chunk, then the end
        await writer.drain()
        return False

    async def main() -> None:
        async with relaying(paced) as (url, closed), httpx.AsyncClient() as client:
            async with client.stream("POST", url, content=b"{}") as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                got = b""
                async for data in resp.aiter_raw():
                    got += data
                    for i, piece_end in enumerate((len(PIECES[0]), len(PIECES[0]) + len(PIECES[1]))):
                        if len(got) >= piece_end:
                            client_has[i].set()
            assert got == b"".join(PIECES)
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_an_upstream_that_breaks_off_mid_stream_ends_the_stream_with_the_error_event():
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + _chunk(PIECES[0]))
        await writer.drain()
        await asyncio.sleep(0.05)
        return False  # the connection closes mid-body

    async def main() -> None:
        async with relaying(dies) as (url, closed), httpx.AsyncClient() as client:
            resp = await client.post(url, content=b"{}")
            assert resp.status_code == 200 and resp.content == PIECES[0] + BROKE
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_a_client_that_leaves_mid_stream_closes_the_upstream_connection():
    """Closing the upstream connection is what stops llama-server's generation."""
    upstream_saw_close = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD)
        try:
            while not reader.at_eof():
                writer.write(_chunk(PIECES[0]))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            pass
        upstream_saw_close.set()
        return False

    async def main() -> None:
        async with relaying(endless) as (url, closed), httpx.AsyncClient() as client:
            async with client.stream("POST", url, content=b"{}") as resp:
                async for data in resp.aiter_raw():
                    assert data.startswith(b"data: ")
                    break
            await asyncio.wait_for(upstream_saw_close.wait(), 5)
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_a_client_that_leaves_while_no_token_comes_still_closes_the_upstream():
    """A long prompt sends nothing for a while: the relay must notice the client leave without a chunk to send."""
    upstream_saw_close = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + _chunk(PIECES[0]))
        await writer.drain()
        await reader.read()  # nothing more until the connection closes
        upstream_saw_close.set()
        return False

    async def main() -> None:
        async with relaying(silent) as (url, closed), httpx.AsyncClient() as client:
            async with client.stream("POST", url, content=b"{}") as resp:
                async for _ in resp.aiter_raw():
                    break
            await asyncio.wait_for(upstream_saw_close.wait(), 5)
            await asyncio.wait_for(closed.wait(), 5)

    run(main())
