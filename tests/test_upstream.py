"""The loopback transport against a stand-in HTTP server on a real socket.

The stand-in imitates what llama-server's cpp-httplib does on the wire and
cannot be made to do on demand: close a connection right after a chunked
(streamed) answer though its headers say ``Keep-Alive``, drop an idle
connection just as the next request arrives, hang, or answer garbage.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from studio.http.wire import upstream as upstream_module
from studio.http.wire.upstream import Upstream
from studio.http.wire.upstream_wire import Answer, Framed, Wire
from tests.helpers import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]

SIZED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n"
    b'Keep-Alive: timeout=5, max=100\r\n\r\n{"ok":true}'
)
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Keep-Alive: timeout=5, max=100\r\n\r\n"
)


class StandIn:
    """A one-port HTTP/1.1 server whose ``handler`` answers each request.

    ``connections`` counts the connections made and ``ended`` those over;
    ``served`` holds, per request, the number of the connection it came on. With
    ``idle_timeout`` a connection that waits that long for a request is dropped,
    as llama-server drops one after its keep-alive timeout.
    """

    def __init__(self, handler: Handler, idle_timeout: float | None = None) -> None:
        self.handler = handler
        self.idle_timeout = idle_timeout
        self.connections = 0
        self.ended = 0
        self.served: list[int] = []
        self.port = free_port()

    async def __aenter__(self) -> StandIn:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def open(self) -> int:
        """The connections made and not yet over."""
        return self.connections - self.ended

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        connection = self.connections
        n = 0
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout)
                except (asyncio.IncompleteReadError, TimeoutError):
                    return
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                self.served.append(connection)
                n += 1
                if not await self.handler(reader, writer, n):
                    return
        except asyncio.CancelledError:  # the test is over
            pass
        finally:
            self.ended += 1
            writer.close()


async def _sized(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    writer.write(SIZED)
    await writer.drain()
    return True


@asynccontextmanager
async def serving(
    handler: Handler, *, idle_timeout: float | None = None, **upstream_options: Any
) -> AsyncIterator[tuple[StandIn, Upstream]]:
    """A stand-in answering with ``handler`` and an ``Upstream`` to reach it, closed afterwards."""
    async with StandIn(handler, idle_timeout) as server:
        upstream = Upstream(**upstream_options)
        try:
            yield server, upstream
        finally:
            await upstream.aclose()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


async def _post(upstream: Upstream, url: str) -> tuple[int, bytes]:
    resp = await upstream.post(url, {"messages": []}, {"Authorization": "Bearer k"})
    try:
        return resp.status_code, await resp.aread()
    finally:
        await resp.aclose()


async def _once_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    if n > 1:
        return False  # dropped without an answer, as on a keep-alive timeout
    return await _sized(reader, writer, n)


@pytest.mark.parametrize(
    ("handler", "connections"),
    [(_sized, 1), (_once_per_connection, 2)],
    ids=[
        "a sized answer leaves its connection for the next request",
        "an idle connection the server drops is retried once on a new one",
    ],
)
def test_two_requests_both_answered(handler, connections):
    async def main() -> None:
        async with serving(handler) as (server, upstream):
            assert await _post(upstream, server.url) == (200, b'{"ok":true}')
            assert await _post(upstream, server.url) == (200, b'{"ok":true}')
            assert server.connections == connections

    run(main())


def test_pool_keeps_idle_connections_of_other_models():
    """Two models taking turns (A, B, A, B) each reuse their connection: taking one closed every other server's."""

    async def main() -> None:
        async with StandIn(_sized) as a, StandIn(_sized) as b:
            upstream = Upstream()
            try:
                for _ in range(3):
                    for server in (a, b):
                        assert await _post(upstream, server.url) == (200, b'{"ok":true}')
            finally:
                await upstream.aclose()
            assert (a.connections, b.connections) == (1, 1)
            assert a.served == b.served == [1, 1, 1]

    run(main())


def test_idle_connections_stay_within_max_connections():
    """Idle connections kept for several models together number no more than ``max_connections``; the oldest goes."""

    async def main() -> None:
        async with StandIn(_sized) as a, StandIn(_sized) as b, StandIn(_sized) as c:
            upstream = Upstream(max_connections=2)
            try:
                for server in (a, b, c):
                    assert await _post(upstream, server.url) == (200, b'{"ok":true}')
                await asyncio.wait_for(_until(lambda: a.ended == 1), 2)  # the oldest idle one, closed
                assert (b.ended, c.ended) == (0, 0)
                for server in (b, c):
                    assert await _post(upstream, server.url) == (200, b'{"ok":true}')
                assert (b.connections, c.connections) == (1, 1)
            finally:
                await upstream.aclose()

    run(main())


def test_a_request_right_after_a_stream_does_not_reuse_the_connection_llama_server_closes():
    """b11434 closes after every chunked answer despite ``Keep-Alive``; reusing it failed the next request (502)."""

    async def streamed_then_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        closing = await _streamed_then_closed(reader, writer, n)
        await asyncio.sleep(0.05)  # the server's close lands a moment later: the race window
        return closing

    async def main() -> None:
        async with serving(streamed_then_closed) as (server, upstream):
            for _ in range(3):
                assert await _post(upstream, server.url) == (200, b"data: \n\n")
            assert server.served == [1, 2, 3]

    run(main())


async def _streamed_then_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    """As llama-server b11434 answers a streamed chat: chunked, then the connection is closed."""
    writer.write(CHUNKED_HEAD + b"6\r\ndata: \r\n2\r\n\n\n\r\n0\r\n\r\n")
    await writer.drain()
    return False


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)


def test_the_request_after_a_stream_goes_out_on_a_connection_opened_before_it():
    """llama-server closes after each stream; the next chat request does not wait for a new connection."""

    async def main() -> None:
        async with serving(_streamed_then_closed) as (server, upstream):
            assert await _post(upstream, server.url) == (200, b"data: \n\n")
            await _until(lambda: server.connections == 2)  # opened with no request on it yet
            assert server.served == [1]
            assert await _post(upstream, server.url) == (200, b"data: \n\n")
            assert server.served == [1, 2]

    run(main())


def test_after_a_fan_out_of_streams_as_many_requests_start_on_spare_connections():
    """One spare made all but one of 8 simultaneous starts connect on the way to their first token."""

    async def main() -> None:
        async with serving(_streamed_then_closed) as (server, upstream):
            for _ in range(2):
                answers = await asyncio.gather(*(_post(upstream, server.url) for _ in range(3)))
                assert answers == [(200, b"data: \n\n")] * 3
                await asyncio.wait_for(_until(lambda: server.connections == len(server.served) + 3), 2)  # a spare each
            assert sorted(server.served) == [1, 2, 3, 4, 5, 6]  # the second three came on the spares

    run(main())


def test_a_spare_connection_the_server_dropped_is_retried_on_a_new_one():
    async def main() -> None:
        async with serving(_streamed_then_closed, idle_timeout=0.05) as (server, upstream):
            assert await _post(upstream, server.url) == (200, b"data: \n\n")
            await _until(lambda: server.ended == 2)  # the spare, dropped unused
            assert await _post(upstream, server.url) == (200, b"data: \n\n")
            assert server.served == [1, 3]

    run(main())


def test_a_spare_is_renewed_for_a_while_after_a_stream_then_no_connection_is_left_open(monkeypatch):
    """Renewed before llama-server's keep-alive timeout drops it, within a window; an idle studio holds none."""
    monkeypatch.setattr(upstream_module, "SPARE_LIFE", 0.05)
    monkeypatch.setattr(upstream_module, "SPARE_WINDOW", 0.3)

    async def main() -> None:
        async with serving(_streamed_then_closed) as (server, upstream):
            assert await _post(upstream, server.url) == (200, b"data: \n\n")
            await asyncio.wait_for(_until(lambda: server.connections >= 4), 2)  # the spare, renewed twice
            await asyncio.sleep(0.4)  # past the window
            await asyncio.wait_for(_until(lambda: server.ended == server.connections), 2)
            opened = server.connections
            await asyncio.sleep(0.2)
            assert server.connections == opened  # no more spares
            assert await _post(upstream, server.url) == (200, b"data: \n\n")  # the next request connects itself
            assert server.served == [1, opened + 1]

    run(main())


def test_spares_left_by_a_fan_out_were_renewed_for_the_whole_window_though_one_stream_at_a_time_followed(monkeypatch):
    """After 8 simultaneous streams their 8 spares were kept for a minute while a person's one stream at a time
    followed: each renewed every few seconds (a new connection), or, taken oldest first, passed round so that none
    ever reached its renewal. Past the demand window as many are kept as streams lately ran at once."""
    monkeypatch.setattr(upstream_module, "SPARE_LIFE", 0.3)
    monkeypatch.setattr(upstream_module, "DEMAND_WINDOW", 0.2)

    async def main() -> None:
        async with serving(_streamed_then_closed) as (server, upstream):
            await asyncio.gather(*(_post(upstream, server.url) for _ in range(8)))
            await asyncio.wait_for(_until(lambda: server.open == 8), 2)  # a spare for each
            loop = asyncio.get_running_loop()
            began = loop.time()
            while loop.time() - began < 1.5:  # one stream at a time, past two windows and several lives
                assert await _post(upstream, server.url) == (200, b"data: \n\n")
                await asyncio.sleep(0.02)
            # the last stream's spare (and its connection, maybe not yet closed by the server)
            await asyncio.wait_for(_until(lambda: server.open <= 2), 0.1)
            await asyncio.sleep(0.7)
            assert server.open == 1  # one is still renewed: the next stream starts on it

    run(main())


def test_within_the_demand_window_a_fan_out_s_spares_are_all_renewed(monkeypatch):
    """An agent's next fan-out, seconds after the last, starts on spares again."""
    monkeypatch.setattr(upstream_module, "SPARE_LIFE", 0.05)
    monkeypatch.setattr(upstream_module, "DEMAND_WINDOW", 10.0)

    async def main() -> None:
        async with serving(_streamed_then_closed) as (server, upstream):
            await asyncio.gather(*(_post(upstream, server.url) for _ in range(8)))
            await asyncio.wait_for(_until(lambda: server.connections >= 8 + 8 * 3), 2)  # each renewed twice
            assert server.open == 8
            served, opened = len(server.served), server.connections
            await asyncio.gather(*(_post(upstream, server.url) for _ in range(8)))
            assert sorted(server.served[served:]) == list(range(opened - 7, opened + 1))  # the 8 spares, none new

    run(main())


def test_requests_that_failed_are_not_counted_as_running_when_spares_are_renewed(monkeypatch):
    """Answers running are subtracted from the spares a server wants: a failed request still counted would leave the
    next stream's spare unrenewed, and the stream after it connecting on its way."""
    monkeypatch.setattr(upstream_module, "SPARE_LIFE", 0.05)
    monkeypatch.setattr(upstream_module, "DEMAND_WINDOW", 0.1)
    failures = 3

    async def fails_then_streams(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        nonlocal failures
        if failures:
            failures -= 1
            return False  # closed without an answer
        return await _streamed_then_closed(reader, writer, n)

    async def main() -> None:
        async with serving(fails_then_streams) as (server, upstream):
            for _ in range(3):
                with pytest.raises(httpx.RemoteProtocolError):
                    await _post(upstream, server.url)
            assert await _post(upstream, server.url) == (200, b"data: \n\n")
            await asyncio.sleep(0.4)  # past two windows: the peak is what runs now, none
            opened = server.connections
            await asyncio.wait_for(_until(lambda: server.connections >= opened + 2), 2)  # still renewed
            assert server.open == 1

    run(main())


def test_closing_the_upstream_closes_its_spare_connection():
    async def main() -> None:
        async with serving(_streamed_then_closed) as (server, upstream):
            assert await _post(upstream, server.url) == (200, b"data: \n\n")
            await _until(lambda: server.connections == 2)
            await upstream.aclose()
            await asyncio.wait_for(_until(lambda: server.ended == 2), 2)

    run(main())


def test_a_stream_ended_after_the_upstream_closed_opened_a_spare_that_nothing_closed():
    """At shutdown the app closes the upstream while streams still end: each one's end opened a spare connection
    to a server being stopped, with nobody left to close it."""

    async def main() -> None:
        async with serving(_streamed_then_closed) as (server, upstream):
            resp = await upstream.post(server.url, {"messages": []}, {"Authorization": "Bearer k"})
            await upstream.aclose()
            assert await resp.aread() == b"data: \n\n"
            await resp.aclose()
            await asyncio.sleep(0.1)  # a spare connects in well under this
            assert server.connections == 1

    run(main())


def test_a_new_connection_closed_without_an_answer_is_an_error_not_a_retry():
    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        return False

    async def main() -> None:
        async with serving(never_answers) as (server, upstream):
            with pytest.raises(httpx.RemoteProtocolError):
                await _post(upstream, server.url)
            assert server.connections == 1

    run(main())


def test_chunk_extensions_and_trailers_are_read_past():
    async def with_trailer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + b"5;name=value\r\nhello\r\n0\r\nX-Checksum: 1\r\n\r\n")
        await writer.drain()
        return True

    async def main() -> None:
        async with serving(with_trailer) as (server, upstream):
            assert await _post(upstream, server.url) == (200, b"hello")

    run(main())


def test_closing_a_response_mid_stream_closes_the_connection():
    """This is how a client that goes away stops llama-server's generation."""
    client_left = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD)
        try:
            while not reader.at_eof():
                writer.write(b"6\r\ndata: \r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            pass
        client_left.set()
        return False

    async def main() -> None:
        async with serving(endless) as (server, upstream):
            resp = await upstream.post(server.url, {}, {})
            async for chunk in resp.aiter_raw():
                assert chunk == b"data: "
                break
            await resp.aclose()
            await asyncio.wait_for(client_left.wait(), 2)

    run(main())


def test_an_unreachable_server_is_a_connect_error():
    async def main() -> None:
        upstream = Upstream()
        with pytest.raises(httpx.ConnectError):
            await _post(upstream, f"http://127.0.0.1:{free_port()}/v1/chat/completions")

    run(main())


def test_an_answer_that_is_not_http_is_a_protocol_error():
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HELLO THERE\r\n\r\n")
        await writer.drain()
        return True

    async def main() -> None:
        async with serving(garbage) as (server, upstream):
            with pytest.raises(httpx.RemoteProtocolError):
                await _post(upstream, server.url)

    run(main())


def test_a_read_timeout_is_httpx_read_timeout():
    async def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await reader.read()  # until the client gives up
        return False

    async def main() -> None:
        async with serving(hangs) as (server, upstream):
            with pytest.raises(httpx.ReadTimeout):
                await upstream.get(server.url, {}, timeout=0.1)

    run(main())


def test_requests_beyond_max_connections_wait_for_a_free_one():
    async def main() -> None:
        async with serving(_sized, max_connections=1) as (server, upstream):
            first = await upstream.post(server.url, {}, {})
            second = asyncio.create_task(_post(upstream, server.url))
            await asyncio.sleep(0.1)
            assert not second.done()
            await first.aread()
            await first.aclose()
            assert await second == (200, b'{"ok":true}')

    run(main())


def _fed(pieces: list[bytes]) -> tuple[list[bytes], Exception | None]:
    """What a piped answer handed on from ``pieces`` arriving one by one after ``CHUNKED_HEAD`` (the sink's, then
    ``done``'s last bytes), and how it ended (``None``: complete; an exception: its error). An ``AssertionError``:
    it did neither."""

    async def main() -> tuple[list[bytes], Exception | None]:
        answer = Answer(Wire(("127.0.0.1", 0)), None, lambda _wire, _reuse: None)  # the bytes go to it, as its
        answer.data_received(CHUNKED_HEAD)  # connection's protocol
        got: list[bytes] = []
        piped = answer.pipe(got.append)
        assert piped is not None
        piped.start()
        for piece in pieces:
            answer.data_received(piece)
        assert piped.done.done(), "neither complete nor failed"
        error = piped.done.exception()
        return (got if error is not None else [*got, piped.done.result()]), error

    return asyncio.run(main())


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    extension=st.sampled_from([b"", b";name=value"]),
    trailer=st.sampled_from([b"", b"X-Checksum: 1\r\n"]),
)
def test_chunked_framing_comes_off_byte_for_byte_however_the_reads_split_it(chunks, cuts, extension, trailer):
    """Together the payloads are exactly the body's bytes, and the answer ends complete."""
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks) + b"0\r\n" + trailer + b"\r\n"
    bounds = [0, *sorted({min(c, len(wire)) for c in cuts}), len(wire)]
    got, error = _fed([wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    assert error is None and b"".join(got) == b"".join(chunks)


def test_a_chunk_split_over_two_reads_passes_its_first_part_on_at_once():
    """Nothing waits for a whole chunk: a token's bytes go on as they arrive."""

    async def main() -> None:
        answer = Answer(Wire(("127.0.0.1", 0)), None, lambda _wire, _reuse: None)
        answer.data_received(CHUNKED_HEAD + b"a\r\n01234")
        assert await answer.read_some() == b"01234"
        answer.data_received(b"56789\r\n0\r\n\r\n")
        assert await answer.read_some() == b"56789"
        assert await answer.read_some() == b""

    run(main())


@pytest.mark.parametrize(
    "wire",
    [b"zz\r\nhello\r\n", b"5\r\nhelloXX", b"-5\r\nhello\r\n", b"1" * 9000],
    ids=["size not hex", "no CRLF after the data", "negative size", "endless size line"],
)
def test_broken_chunked_framing_is_an_error(wire):
    _, error = _fed([wire])
    assert isinstance(error, httpx.RemoteProtocolError)


class _Connection:
    """The upstream connection's transport as ``Framed`` uses it: it takes the protocol, and pauses and reads on."""

    def __init__(self) -> None:
        self.protocol: Any = None
        self.reading = True

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: ``Framed`` relays in Python (the chunk pump's own tests: test_chunk_pump.py)


class _Client:
    """The client's connection as ``Framed`` writes on it: what was written, and a flow control that never pauses."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.write_paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: ``Framed`` relays in Python

    async def drain(self) -> None:
        pass


def _framed(before: bytes, pieces: list[bytes], *, lost: bool = False) -> tuple[bytes, Framed]:
    """What a ``Framed`` wrote from ``before`` (arrived with the head) and ``pieces`` (arriving one by one after it
    started), ``done``'s last bytes after them; ``lost``: the connection then closes."""

    async def main() -> tuple[bytes, Framed]:
        wire = Wire(("127.0.0.1", 0))
        wire.transport = connection = _Connection()  # type: ignore[assignment]
        answer = Answer(wire, None, lambda _wire, _reuse: None)
        answer.data_received(CHUNKED_HEAD + before)
        client = _Client()
        framed = answer.pipe_framed(client, client)  # type: ignore[arg-type]
        assert framed is not None
        framed.start()
        for piece in pieces:
            connection.protocol.data_received(piece)
        if lost:
            connection.protocol.connection_lost(None)
        assert framed.done.done(), "neither complete nor failed"
        last = framed.done.result() if framed.done.exception() is None else b""
        return b"".join(client.written) + last, framed

    return asyncio.run(main())


_CHUNKS = st.lists(st.binary(min_size=1, max_size=40), max_size=8)
_CUTS = st.lists(st.integers(0, 400), max_size=6)


def _cut(wire: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({min(c, len(wire)) for c in cuts}), len(wire)]
    return [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@settings(max_examples=300, deadline=None)
@given(
    chunks=_CHUNKS,
    cuts=_CUTS,
    extension=st.sampled_from([b"", b";name=value"]),
    trailer=st.sampled_from([b"", b"X-Checksum: 1\r\n"]),
)
def test_a_framed_body_goes_on_byte_for_byte_framing_and_all_however_the_reads_split_it(
    chunks, cuts, extension, trailer
):
    """What the client's connection gets is the upstream body exactly, its chunk sizes, extensions, last chunk and
    trailers included, whatever arrives together; it ends complete."""
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks) + b"0\r\n" + trailer + b"\r\n"
    got, framed = _framed(b"", _cut(wire, cuts))
    assert framed.done.exception() is None and got == wire


def test_payload_that_came_with_the_head_goes_first_framed_again_then_the_rest_as_it_came():
    got, framed = _framed(b"3\r\nabc\r\n", [b"2;x=y\r\nde\r\n", b"0\r\n\r\n"])
    assert got == b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"


def test_a_body_that_ended_with_the_head_is_framed_whole_with_its_end():
    got, _ = _framed(b"3\r\nabc\r\n0\r\n\r\n", [])
    assert got == b"3\r\nabc\r\n0\r\n\r\n"


def test_a_body_cut_mid_chunk_before_the_relay_starts_is_not_framed_through():
    """Payload of a chunk only partly there cannot be framed again: the answer is piped or read instead."""

    async def main() -> None:
        answer = Answer(Wire(("127.0.0.1", 0)), None, lambda _wire, _reuse: None)
        answer.data_received(CHUNKED_HEAD + b"a\r\n01234")
        assert answer.pipe_framed(_Client(), _Client()) is None  # type: ignore[arg-type]
        assert answer.pipe(lambda data: None) is not None

    asyncio.run(main())


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=6), cuts=_CUTS, at=st.integers(0, 300))
def test_a_framed_body_that_breaks_off_says_whether_what_was_written_ended_between_chunks(chunks, cuts, at):
    """Between two chunks an error event can follow as a chunk of its own; inside one the client's body cannot go on.
    Nothing after the break is written."""
    framing = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]
    wire = b"".join(framing)
    at = min(at, len(wire))
    boundaries = {sum(len(f) for f in framing[:i]) for i in range(len(framing) + 1)}
    got, framed = _framed(b"", _cut(wire[:at], cuts), lost=True)
    assert isinstance(framed.done.exception(), httpx.RemoteProtocolError)
    assert got == wire[:at]
    assert framed.between_chunks == (at in boundaries)


def test_broken_framing_in_a_framed_body_is_an_error_and_is_not_written_on():
    got, framed = _framed(b"", [b"3\r\nabc\r\n", b"zz\r\nhello\r\n\r\n"])
    assert isinstance(framed.done.exception(), httpx.RemoteProtocolError)
    assert got == b"3\r\nabc\r\n" and framed.between_chunks


def test_what_arrives_together_goes_on_in_one_piece_and_what_comes_with_the_end_is_the_last_bytes():
    """Several chunks in one read are one hand-on (one write to the client); the last ones are ``done``'s result,
    so the relay sends them with the body's end (one write with the terminator)."""
    got, error = _fed([b"3\r\nabc\r\n2\r\nde\r\n", b"1\r\nf\r\n", b"2\r\ngh\r\n0\r\n\r\n"])
    assert error is None and got == [b"abcde", b"f", b"gh"]
