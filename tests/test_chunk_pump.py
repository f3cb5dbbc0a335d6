"""The C chunk pump (``studio/http/wire/_pump.c``) under ``Framed``, on real sockets: what it writes, how bodies end.

``tests/test_relay.py`` runs the relay under uvicorn both through the pump and in Python; these pin what
only the pump does: its own framing check over any split of the reads, its handling of broken framing,
a stop while it pumps, a client gone under it, and the connections it lets go.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from studio.http.wire import chunk_pump
from studio.http.wire.upstream_wire import Answer, Framed, Wire

pytestmark = pytest.mark.skipif(
    chunk_pump._pump is None, reason="the C chunk pump was not built here (no C compiler, or not Linux)"
)

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Flow:
    """uvicorn's write flow control as ``Framed`` reads it: the pump does its own, so it never pauses here."""

    write_paused = False

    async def drain(self) -> None:
        pass


class _Pair:
    """A pumped ``Framed`` between two real connections: the test plays llama-server on ``server`` and reads what
    the client gets on ``client``."""

    framed: Framed
    answer: Answer
    client_transport: asyncio.Transport
    wire: Wire

    def __init__(self) -> None:
        self.server, up = socket.socketpair()
        self.client, down = socket.socketpair()
        self._up, self._down = up, down
        self.client.setblocking(False)

    async def start(self, before: bytes = b"") -> None:
        loop = asyncio.get_running_loop()
        self.wire = Wire(("127.0.0.1", 0))
        await loop.create_connection(lambda: self.wire, sock=self._up)
        self.client_transport, _ = await loop.create_connection(asyncio.Protocol, sock=self._down)
        self.answer = self.wire.ask(b"POST / HTTP/1.1\r\n\r\n", read_timeout=None, on_end=lambda _w, _r: None)
        self.server.sendall(CHUNKED_HEAD + before)
        await asyncio.wait_for(self.answer.head, 5)
        await asyncio.sleep(0.01)  # ``before`` came with the head
        framed = self.answer.pipe_framed(self.client_transport, _Flow())
        assert framed is not None
        framed.start()
        assert framed._stop_pump is not None, "not handed to the pump"
        self.framed = framed

    async def received(self, at_least: int = 0, quiet: float = 0.05) -> bytes:
        """What the client got: at least ``at_least`` bytes, then until nothing came for ``quiet`` seconds."""
        got = b""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.client, 65536), quiet if len(got) >= at_least else 5)
            except TimeoutError:
                return got
            if not data:
                return got
            got += data

    async def passes(self, data: bytes) -> None:
        """Send ``data`` as llama-server and see the client get exactly it."""
        self.server.sendall(data)
        assert await self.received(len(data)) == data

    async def ended(self) -> None:
        await asyncio.wait({self.framed.done}, timeout=5)
        assert self.framed.done.done(), "the pump never said how the body ended"

    def close(self) -> None:
        self.framed.close()
        self.client_transport.close()
        self.wire.close()
        self.server.close()
        self.client.close()


def _pumped(test: Callable[[_Pair], Awaitable[None]]) -> None:
    async def main() -> None:
        pair = _Pair()
        try:
            await test(pair)
        finally:
            pair.close()

    asyncio.run(asyncio.wait_for(main(), 20))


def _cut(wire: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({min(c, len(wire)) for c in cuts}), len(wire)]
    return [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    extension=st.sampled_from([b"", b";name=value", b" ; a=b"]),
    trailer=st.sampled_from([b"", b"X-Checksum: 1\r\n"]),
)
def test_the_pump_passes_a_body_on_byte_for_byte_however_the_reads_split_its_framing(chunks, cuts, extension, trailer):
    """Sizes, extensions, the last chunk and trailers as they came, each read split anywhere; the end is handed
    back, not written, and only up to the body's end."""
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks) + b"0\r\n" + trailer + b"\r\n"

    async def test(pair: _Pair) -> None:
        await pair.start()
        for piece in _cut(wire, cuts):
            pair.server.sendall(piece)
            await asyncio.sleep(0.001)
        await pair.ended()
        assert pair.framed.done.exception() is None
        assert pair.answer.complete
        assert await pair.received() + pair.framed.done.result() == wire

    _pumped(test)


def test_what_came_with_the_head_goes_first_and_the_tail_and_first_bytes_are_known_after_the_pump():
    async def test(pair: _Pair) -> None:
        await pair.start(b"3\r\nabc\r\n")
        pair.server.sendall(b"2\r\nde\r\n")
        assert await pair.received(15) == b"3\r\nabc\r\n2\r\nde\r\n"
        pair.server.sendall(b"1\r\nf\r\n0\r\n\r\n")
        await pair.ended()
        assert pair.framed.done.result() == b"1\r\nf\r\n0\r\n\r\n"
        assert pair.framed.tail == b"2\r\nde\r\n1\r\nf\r\n0\r\n\r\n"  # /metrics reads llama-server's usage there
        assert pair.framed.first_at is not None

    _pumped(test)


@pytest.mark.parametrize(
    ("sent", "between"), [(b"3\r\nabc\r\n", True), (b"a\r\n01234", False), (b"3\r\nabc\r\n1", False)]
)
def test_an_upstream_that_closes_early_fails_the_body_saying_whether_the_client_s_ended_between_chunks(sent, between):
    async def test(pair: _Pair) -> None:
        await pair.start()
        await pair.passes(sent)
        pair.server.close()
        await pair.ended()
        error = pair.framed.done.exception()
        assert isinstance(error, httpx.RemoteProtocolError) and "broke off its answer" in str(error)
        assert pair.framed.between_chunks is between

    _pumped(test)


def test_broken_framing_fails_the_body_and_none_of_the_broken_read_reaches_the_client():
    async def test(pair: _Pair) -> None:
        await pair.start()
        await pair.passes(b"3\r\nabc\r\n")
        pair.server.sendall(b"zz\r\nnot a chunk\r\n")
        await pair.ended()
        error = pair.framed.done.exception()
        assert isinstance(error, httpx.RemoteProtocolError) and "broken answer" in str(error)
        assert pair.framed.between_chunks
        assert await pair.received() == b""

    _pumped(test)


def test_a_stopped_pump_writes_nothing_more_and_lets_both_connections_go():
    """A relay cancelled (its client left, the studio stopping) stops the pump at once; the pump's own hold on the
    connections goes with it, so closing the loop's closes them for good (llama-server sees it and stops)."""

    async def test(pair: _Pair) -> None:
        await pair.start()
        await pair.passes(b"3\r\nabc\r\n")
        pair.framed.close()
        pair.server.sendall(b"3\r\ndef\r\n")
        assert await pair.received(quiet=0.2) == b""
        pair.client_transport.close()
        pair.wire.close()
        await asyncio.sleep(0.05)
        assert await pair.received() == b""  # the end of the connection, not a wait
        pair.server.settimeout(5)
        assert pair.server.recv(100) == b"POST / HTTP/1.1\r\n\r\n"
        try:  # held open, it would time out
            closed = pair.server.recv(100) == b""
        except ConnectionResetError:  # closed with the chunk sent after the stop unread
            closed = True
        assert closed

    _pumped(test)


def test_a_client_gone_under_the_pump_has_its_connection_closed_so_the_relay_ends():
    async def test(pair: _Pair) -> None:
        await pair.start()
        await pair.passes(b"3\r\nabc\r\n")
        pair.client.close()
        for _ in range(50):
            pair.server.sendall(b"3\r\ndef\r\n")
            await asyncio.sleep(0.02)
            if pair.client_transport.is_closing():
                break
        assert pair.client_transport.is_closing()
        assert not pair.framed.done.done()  # the relay's own watcher of the client ends it, as for any disconnect

    _pumped(test)


def test_a_pumped_stream_leaves_no_connection_open_behind_it():
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def test(pair: _Pair) -> None:
        await pair.start()
        before = open_fds()
        pair.server.sendall(b"3\r\nabc\r\n0\r\n\r\n")
        await pair.ended()
        assert open_fds() == before - 2  # the pump's copies of the two connections

    _pumped(test)


class _Transport:
    """A socket transport as ``pump`` asks it, with TLS on it or not."""

    def __init__(self, tls: bool) -> None:
        self.socket, self.peer = socket.socketpair()
        self.tls = tls

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"socket": self.socket, "ssl_object": object() if self.tls else None}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.socket.close()
        self.peer.close()


@pytest.mark.parametrize("tls", ["client", "upstream"])
def test_a_connection_under_tls_is_never_pumped_its_socket_s_bytes_are_not_the_body_s(tls):
    async def main() -> None:
        transports = [_Transport(tls == "client"), _Transport(tls == "upstream"), _Transport(False), _Transport(False)]
        client, upstream, plain_client, plain_upstream = transports
        try:
            assert chunk_pump.pump(upstream, client, None, b"", lambda end: None) is None  # type: ignore[arg-type]
            plain = chunk_pump.pump(plain_upstream, plain_client, None, b"", lambda end: None)  # type: ignore[arg-type]
            assert plain is not None
            plain()
        finally:
            for transport in transports:
                transport.close()

    asyncio.run(main())
