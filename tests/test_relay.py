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
import gc
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from studio.chat.model_turn import Turn, TurnError, read_turn
from studio.http.app import create_app
from studio.http.clients.ollama_app import create_ollama_app
from studio.http.wire import chunk_pump
from studio.http.wire.client_wire import client_wire
from studio.http.wire.relay import SERVER_SEND, Relay, Reshape, send_now, with_server_send
from studio.http.wire.upstream import Upstream
from tests.helpers import free_port
from tests.standin_manager import StandInManager, StandInModel
from tests.test_upstream import CHUNKED_HEAD, Handler, StandIn

BROKE = b'data: {"error": "broke off"}\n\n'
PIECES = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b'data: {"n":3}\n\ndata: {"n":4}\n\n', b"data: [DONE]\n\n"]


@pytest.fixture(autouse=True, params=["C pump", "Python"])
def chunk_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test both ways a chunked body goes on under uvicorn: through the C chunk pump, and in Python (where the
    pump was not built: no compiler, not Linux)."""
    if request.param == "Python":
        monkeypatch.setattr(chunk_pump, "_pump", None)
    elif chunk_pump._pump is None:
        pytest.skip("the C chunk pump was not built here (no C compiler, or not Linux)")


def _chunk(data: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), extension, data)


@asynccontextmanager
async def relaying(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]],
    reshape: Callable[[], Reshape] | None = None,
    seen: list[tuple[float | None, bytes]] | None = None,
    layer_saw: list[tuple[str, bool]] | None = None,
    client_transport: Callable[[asyncio.Transport], None] | None = None,
) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A stand-in answering with ``handler`` and a uvicorn app relaying it; yields (app URL, upstream closed).

    ``reshape`` makes each request's reshape; ``seen`` gets what ``on_close`` was given; ``layer_saw`` the
    (type, more_body) of each message that passed a middleware-like ``send`` wrapper between server and relay;
    ``client_transport`` is handed the server's transport to the client before the relay writes on it.
    """
    closed = asyncio.Event()
    async with StandIn(handler) as standin:
        upstream = Upstream()

        async def close(resp: httpx.Response, first_at: float | None, tail: bytes) -> None:
            await resp.aclose()
            if seen is not None:
                seen.append((first_at, tail))
            closed.set()

        async def on_break(exc: httpx.HTTPError) -> bytes:
            return BROKE

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            while (await receive())["more_body"]:
                pass
            if client_transport is not None:
                client_transport(scope[SERVER_SEND].__self__.transport)
            resp = await upstream.post(standin.url, {}, {})
            relay = Relay(
                resp,
                on_close=lambda first_at, tail: close(resp, first_at, tail),
                on_break=on_break,
                reshape=reshape() if reshape else None,
                media_type="text/event-stream",
            )

            async def layer(message: Message) -> None:
                if layer_saw is not None:
                    layer_saw.append((message["type"], message.get("more_body", False)))
                await send(message)

            await relay(scope, receive, layer)

        try:
            async with _uvicorn(with_server_send(app)) as url:
                yield url, closed
        finally:
            await upstream.aclose()


@asynccontextmanager
async def _uvicorn(app: ASGIApp) -> AsyncIterator[str]:
    """``app`` served by uvicorn on a free port; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        await serving


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


def test_body_chunks_pass_the_middleware_by_while_the_start_and_the_end_go_through_it():
    """The middleware's ``send`` wrappers look only at the start; the chunks between go to the server's ``send``."""
    saw: list[tuple[str, bool]] = []

    async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + b"".join(_chunk(piece) for piece in PIECES) + b"0\r\n\r\n")
        await writer.drain()
        return False

    async def main() -> None:
        async with relaying(whole, layer_saw=saw) as (url, closed), httpx.AsyncClient() as client:
            resp = await client.post(url, content=b"{}")
            assert resp.content == b"".join(PIECES)
            await asyncio.wait_for(closed.wait(), 5)

    run(main())
    assert saw == [("http.response.start", False), ("http.response.body", False)]


def test_under_uvicorn_a_chunked_body_is_written_on_the_client_connection_and_ended_through_send():
    """Once a response started chunked, ``client_wire`` frames its body chunks itself; ``send`` ends the body. A sized
    response, or a ``send`` some middleware wrapped, has none: the relay sends through ``send`` then."""
    found: dict[str, bool] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive())["more_body"]:
            pass
        sized = scope["path"] == "/sized"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"6")] * sized})

        async def wrapped(message: Message) -> None:
            await send(message)

        wire = client_wire(send)
        found[scope["path"]] = wire is not None and client_wire(wrapped) is None
        if wire is None:
            await send({"type": "http.response.body", "body": b"abcdef"})
            return
        for piece in (b"abc", b"def"):
            assert wire.write_chunk(piece) is None  # a client that keeps up is never waited for
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main() -> None:
        async with _uvicorn(app) as url, httpx.AsyncClient() as client:
            for path in ("chunked", "sized", "chunked"):  # the connection is reused: each body ended cleanly
                resp = await client.post(url + path, content=b"{}")
                assert resp.content == b"abcdef"
                assert ("content-length" in resp.headers) == (path == "sized")

    run(main())
    assert found == {"/chunked": True, "/sized": False}


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


def test_an_upstream_that_breaks_off_inside_a_chunk_breaks_the_client_s_body_off_too():
    """Its framing went on as it came: an error event after part of a chunk would be read as that chunk's bytes, so
    the client's connection closes instead and its body is seen broken off."""

    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(PIECES[0]) + _chunk(PIECES[1])[:9])
        await writer.drain()
        await asyncio.sleep(0.05)
        return False  # the connection closes inside the second chunk

    async def main() -> None:
        async with relaying(dies) as (url, closed), httpx.AsyncClient() as client:
            got = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", url, content=b"{}") as resp:
                    async for data in resp.aiter_raw():
                        got += data
            assert got == PIECES[0] + PIECES[1][:6]
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_the_client_gets_the_upstream_s_chunks_as_they_came_sizes_extensions_and_trailers_included():
    body = _chunk(PIECES[0], b";n=1") + _chunk(PIECES[1]) + _chunk(PIECES[2] + PIECES[3]) + b"0\r\nX-Sum: 4\r\n\r\n"
    # reads that end anywhere: inside sizes, payloads, the last chunk
    paced = _paced(*(body[at : at + 23] for at in range(0, len(body), 23)), pause=0.01)

    async def main() -> None:
        async with relaying(paced) as (url, closed):
            reader, writer = await _raw_post(url)
            answer = await reader.read()
            writer.close()
            head, _, got = answer.partition(b"\r\n\r\n")
            assert b"transfer-encoding: chunked" in head.lower() and got == body
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_a_stream_passed_through_tells_its_close_when_its_first_bytes_came_and_its_last_two_arrivals():
    """For /metrics: llama-server's ``timings`` and ``usage`` come in the last events, here with the body's end."""
    seen: list[tuple[float | None, bytes]] = []
    paced = _paced(*(_chunk(piece) for piece in PIECES[:3]), _chunk(PIECES[3]) + b"0\r\n\r\n", pause=0.02)

    async def main() -> None:
        async with relaying(paced, seen=seen) as (url, closed), httpx.AsyncClient() as client:
            began = time.perf_counter()
            resp = await client.post(url, content=b"{}")
            assert resp.content == b"".join(PIECES)
            await asyncio.wait_for(closed.wait(), 5)
            [(first_at, tail)] = seen
            assert first_at is not None and began < first_at < time.perf_counter()
            assert tail == _chunk(PIECES[2]) + _chunk(PIECES[3]) + b"0\r\n\r\n"

    run(main())


def test_a_last_chunk_arriving_alone_leaves_the_tail_to_the_events_before_it():
    """llama-server may send its last chunk in a read of its own: the tail was then that and one event, and the
    usage event before them went uncounted (``ggstudio_generated_tokens_total`` short by a stream's tokens)."""
    seen: list[tuple[float | None, bytes]] = []
    paced = _paced(*(_chunk(piece) for piece in PIECES), b"0\r\n\r\n", pause=0.02)

    async def main() -> None:
        async with relaying(paced, seen=seen) as (url, closed), httpx.AsyncClient() as client:
            resp = await client.post(url, content=b"{}")
            assert resp.content == b"".join(PIECES)
            await asyncio.wait_for(closed.wait(), 5)
            [(_, tail)] = seen
            assert tail == _chunk(PIECES[2]) + _chunk(PIECES[3])

    run(main())


def test_a_client_that_reads_slowly_gets_every_byte_in_order_while_the_upstream_waits_for_it():
    """Megabytes the client does not read yet fill the sockets: the relay stops reading upstream until it does."""
    events = [b'data: {"n":%d,"pad":"%s"}\n\n' % (i, b"x" * 4000) for i in range(2000)]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD)
        for event in events:
            writer.write(_chunk(event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return False

    async def main() -> None:
        async with relaying(flood) as (url, closed), httpx.AsyncClient() as client:
            async with client.stream("POST", url, content=b"{}") as resp:
                got = bytearray()
                async for data in resp.aiter_raw():
                    if not got:
                        await asyncio.sleep(0.5)  # everything written meanwhile waits in the sockets' buffers
                    got += data
            assert bytes(got) == b"".join(events)
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_a_client_behind_when_the_body_ends_is_waited_for_not_left_to_a_dropped_drain():
    """The last bytes of a passed-through body, written while the client was behind, returned the client's drain;
    dropped unawaited, it warned ("never awaited") and the end did not wait for the client. The client here
    reads slowly through small socket buffers, so the body's end always finds it behind."""
    events = [b'data: {"n":%d,"pad":"%s"}\n\n' % (i, b"x" * 2000) for i in range(40)]

    async def at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + b"".join(_chunk(event) for event in events) + b"0\r\n\r\n")
        await writer.drain()
        return False

    def small_buffers(transport: asyncio.Transport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=1)  # paused while anything waits to be written

    async def main() -> None:
        async with relaying(at_once, client_transport=small_buffers) as (url, closed):
            reader, writer = await _raw_post(url, receive_buffer=4096)
            answer = bytearray()
            while data := await reader.read(1024):
                answer += data
                await asyncio.sleep(0.002)
            writer.close()
            head, _, got = bytes(answer).partition(b"\r\n\r\n")
            assert _payload(got) == b"".join(events)  # however the relay framed what came before it started
            await asyncio.wait_for(closed.wait(), 5)
        gc.collect()  # a drain dropped unawaited warns when it is collected: the suite makes that an error

    run(main())


def _paced(*arrivals: bytes, pause: float) -> Handler:
    """An upstream answer: the chunked head, then each of ``arrivals`` ``pause`` s after the one before (a read
    of the relay's each), then the connection closes."""

    async def paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD)
        await writer.drain()
        for data in arrivals:
            await asyncio.sleep(pause)
            writer.write(data)
            await writer.drain()
        return False

    return paced


async def _raw_post(
    url: str, *, receive_buffer: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A bare socket's request to the relay at ``url``, whose answer is read as it comes on the wire;
    ``receive_buffer`` (bytes) shrinks the socket's receive buffer, and the reader's, so a slow reader is behind."""
    host, port = url.removeprefix("http://").strip("/").split(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=receive_buffer or 2**16)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    return reader, writer


def _payload(chunked: bytes) -> bytes:
    """The payload of a complete chunked body (no extensions, no trailers)."""
    payload, rest = bytearray(), chunked
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n", "the body ends with its last chunk"
            return bytes(payload)
        payload += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


class _HoldsTheLastEvent:
    """A reshape that holds each event back until the next comes (as the tool-call healer holds markup)."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        out, self._held = self._held, data
        return out

    def close(self) -> bytes:
        held, self._held = self._held, b""
        return held

    finish = close


def test_a_reshape_s_held_bytes_reach_the_client_before_the_error_event_when_the_upstream_breaks_off():
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + _chunk(PIECES[0]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(PIECES[1]))
        await writer.drain()
        await asyncio.sleep(0.05)
        return False

    async def main() -> None:
        seen: list[tuple[float | None, bytes]] = []
        async with relaying(dies, _HoldsTheLastEvent, seen) as (url, closed), httpx.AsyncClient() as client:
            resp = await client.post(url, content=b"{}")
            assert resp.content == PIECES[0] + PIECES[1] + BROKE
            await asyncio.wait_for(closed.wait(), 5)
        [(first_at, tail)] = seen  # for /metrics: when the first bytes came, and the last upstream bytes
        assert first_at is not None and tail == PIECES[0] + PIECES[1]

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


GUI_STREAM = (
    b"".join(
        b"data: " + json.dumps(c).encode() + b"\n\n"
        for c in [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
            {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
            {"choices": [{"index": 0, "delta": {"content": 'H\u00e9llo "w"\n'}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f"}}]}}]},
            {
                "choices": [{"index": 0, "finish_reason": "length", "delta": {}}],
                "timings": {"predicted_n": 3, "predicted_per_second": 9.5, "draft_n": 4, "draft_n_accepted": 3},
            },
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}},
        ]
    )
    + b":\n\ndata: [DONE]\n\n"
)


class _Pieces(httpx.AsyncByteStream):
    """A response body that arrives in the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece


def _turn(pieces: list[bytes]) -> list[object]:
    async def main() -> list[object]:
        return [item async for item in read_turn(httpx.Response(200, stream=_Pieces(pieces)), None)]

    return asyncio.run(main())


def test_a_gui_turn_from_a_whole_stream():
    *events, turn = _turn([GUI_STREAM])
    assert events == [
        {"type": "reasoning", "text": "hm"},
        {"type": "content", "text": 'H\u00e9llo "w"\n'},
        {"type": "tool_call", "index": 0, "id": "c1", "function": {"name": "f"}},
    ]
    assert isinstance(turn, Turn) and turn.content == 'H\u00e9llo "w"\n' and turn.finish_reason == "length"
    assert turn.usage == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert turn.timings["draft_n_accepted"] == 3


@pytest.mark.parametrize("cut", range(1, len(GUI_STREAM), 7))
def test_a_gui_turn_is_the_same_however_the_stream_is_split(cut):
    assert _turn([GUI_STREAM[:cut], GUI_STREAM[cut:]]) == _turn([GUI_STREAM])


def test_an_error_chunk_ends_the_turn_with_its_error():
    with pytest.raises(TurnError) as info:
        _turn(
            [
                b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n'
                b'data: {"choices": [{"delta": {"content": "late"}}]}\n\n'
            ]
        )
    assert info.value.status == 500 and info.value.error == {"message": "boom", "type": "server_error"}


STREAMED_CHAT = {"model": "standin", "messages": [{"role": "user", "content": "Hi"}], "stream": True}


@pytest.mark.parametrize(
    ("listener", "path", "body"),
    [
        ("studio", "/v1/chat/completions", STREAMED_CHAT),
        ("studio", "/api/chat", {"model": "standin", "messages": STREAMED_CHAT["messages"]}),
        ("ollama", "/api/chat", STREAMED_CHAT),
    ],
    ids=["OpenAI stream (Relay)", "GUI chat (EventStream)", "Ollama stream (EventStream)"],
)
def test_relay_returns_lease_when_cancelled_at_response_start(listener, path, body):
    """A request cancelled while its response start is sent (the server shutting down, a client gone) still ends.

    The lease was released, and the upstream response closed, only in a ``finally`` entered after the start
    went out: the model's in-flight count never came back to 0 (never idle, never evicted, its TTL never ran
    out) and the upstream connection and its transport slot stayed taken.
    """
    upstream_open = 0

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        nonlocal upstream_open
        upstream_open += 1
        writer.write(CHUNKED_HEAD)
        try:
            while not reader.at_eof():
                writer.write(_chunk(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            pass
        upstream_open -= 1
        return False

    async def main() -> None:
        async with StandIn(endless) as standin:
            manager = StandInManager(StandInModel(name="standin", url=f"http://127.0.0.1:{standin.port}"))
            studio = create_app(manager)
            app = create_ollama_app(studio) if listener == "ollama" else studio
            async with studio.router.lifespan_context(studio):
                starting = asyncio.Event()
                request = asyncio.create_task(_asgi_post(app, path, body, starting))
                await asyncio.wait_for(starting.wait(), 5)
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
                assert manager.in_flight == 0, "the lease was not returned"
                await asyncio.wait_for(_until(lambda: upstream_open == 0), 5)  # the upstream request was closed

    run(main())


async def _asgi_post(app: Callable[..., Awaitable[None]], path: str, body: object, starting: asyncio.Event) -> None:
    """POST ``body`` to ``app`` as a server would, whose ``send`` of the response start never finishes."""
    content = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    messages = [{"type": "http.request", "body": content, "more_body": False}]

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: dict[str, object]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
            starting.set()
            await asyncio.Event().wait()  # cancelled here

    await app(scope, receive, send)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)


class _BareAwaitable:
    """What granian's ``send`` returns: an awaitable whose ``__await__`` is a bare iterator, with no ``send`` or
    ``close`` (``granian._granian.PyEmptyAwaitable``; granian is no dependency, so it is imitated here)."""

    def __init__(self, waits: list[object]) -> None:
        self._waits = waits

    def __await__(self):
        return iter(self._waits)


def test_a_server_whose_send_awaitable_is_a_bare_iterator_is_driven_too():
    """``send_now`` stepped the awaitable with ``.send(None)``: under granian every chunk raised AttributeError."""

    async def main() -> None:
        sent: list[Message] = []

        def writes_at_once(message: Message) -> _BareAwaitable:
            sent.append(message)
            return _BareAwaitable([])

        assert send_now(writes_at_once, {"type": "http.response.body", "body": b"a"}) is None
        client_reads: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def waits_for_the_client(message: Message) -> _BareAwaitable:
            sent.append(message)
            return _BareAwaitable([client_reads])

        left = send_now(waits_for_the_client, {"type": "http.response.body", "body": b"b"})
        assert left is not None
        rest = asyncio.ensure_future(left)
        await asyncio.sleep(0.01)
        assert not rest.done()  # it waits while the client does not read
        client_reads.set_result(None)
        await asyncio.wait_for(rest, 1)
        assert [m["body"] for m in sent] == [b"a", b"b"]

    run(main())
