"""One connection to a llama-server, and each answer on it parsed by httptools as the bytes arrive.

A ``Wire`` is the connection's own ``asyncio.Protocol``: the request goes out in one write, and
every arrival is fed to one httptools (llhttp, C) parser per answer, which reads the status line,
the headers and the body (chunked framing, ``Content-Length``, trailers) alike. Payload bytes
pass on as soon as they arrive: to whoever reads the body (``Answer.read_some``), or, once piped
(``Answer.pipe``), straight from the parser's callback to a sink, with no task waking and no
coroutine resuming per chunk. asyncio's ``StreamReader``/``StreamWriter`` pair this replaces cost
a connection, a request and a chunk several times more Python (``scripts/bench_proxy.py``'s CPU
per request), and its hand-written head reader and chunked decoder are now llhttp's.

Requests, responses and errors stay ``httpx``'s (``httpx.Response`` carries an ``Answer`` as its
stream, failures are ``httpx.HTTPError``), so the code that reads the answers does not change.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

import httptools
import httpx

#: Bytes of body held for a reader before reading from the connection pauses.
READ_HIGH = 256 * 1024

_NO_BODY_STATUS = frozenset({204, 304})

#: What an ended answer tells its connection's owner: the connection, and the seconds it may be reused for
#: (``None``: close it).
OnEnd = Callable[["Wire", "float | None"], None]


class Wire(asyncio.Protocol):
    """One TCP connection to ``origin``, one exchange at a time (``ask``); reusable until ``reusable_until``."""

    def __init__(self, origin: tuple[str, int]) -> None:
        self.origin = origin
        self.loop = asyncio.get_running_loop()  # once: each answer makes futures on it
        self.transport: asyncio.Transport | None = None
        self.reused = False  # it waited idle: the server may have dropped it, so a request retries on a new one
        self.reusable_until = 0.0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.close()  # bytes that answer no request (an answer reads its own): not a connection to trust further

    def eof_received(self) -> bool:
        return False  # close; connection_lost says the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def alive(self) -> bool:
        """Whether it may carry another request now: open, and within the time the server keeps it."""
        return not self.lost and time.monotonic() < self.reusable_until

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def ask(self, request: bytes, *, read_timeout: float | None, on_end: OnEnd) -> Answer:
        """Send ``request`` (its head and body, whole) and return its answer, its head still to come.

        The answer is the connection's protocol until it is closed: each arrival goes straight to its parser,
        one Python call less per chunk than through this object.
        """
        transport = self.transport
        assert transport is not None
        answer = Answer(self, read_timeout, on_end)
        transport.set_protocol(answer)
        transport.write(request)
        return answer

    def idle(self) -> None:
        """Its answer is over and it is kept for another: it is the connection's protocol again."""
        if self.transport is not None:
            self.transport.set_protocol(self)


class Answer(httpx.AsyncByteStream, asyncio.Protocol):
    """One answer on a ``Wire``: ``head`` is done once its status and headers are in; its body comes after.

    The body is read with ``read_some`` (what has arrived, at least one byte; also what iterating it and
    ``httpx.Response.aread`` do) or piped into a sink (``pipe``), never both. Closing it gives the connection
    back to its owner, to be reused after a complete answer that allows it, else closed (which tells
    llama-server to stop generating).
    """

    def __init__(self, wire: Wire, read_timeout: float | None, on_end: OnEnd) -> None:
        self._wire = wire
        self._timeout = read_timeout
        self._on_end = on_end
        self._parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[None] = wire.loop.create_future()
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.arrived = False  # any byte of the answer: an idle connection the server dropped has none (retry)
        self._chunked = False
        self._until_close = False  # neither sized nor chunked: the body ends with the connection
        self._held: list[bytes] = []  # payload that arrived and was not read yet
        self._held_size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._flowing: Piped | None = None  # the pipe, once started: each arrival's payload goes to it
        self._error: Exception | None = None
        self._began = False  # read, or piped
        self._closed = False

    # -- httptools' callbacks ------------------------------------------------------------------
    def on_status(self, reason: bytes) -> None:
        self.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real head follows
            self.headers = []
            return
        self.status = status
        sized = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif lowered == b"content-length":
                sized = True
        self._until_close = not self._chunked and not sized and status not in _NO_BODY_STATUS
        self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._held.append(body)
        if self._flowing is not None:
            return  # handed on once the arrival is parsed
        self._held_size += len(body)
        if self._held_size > READ_HIGH and self._wire.transport is not None:
            self._wire.transport.pause_reading()  # until it is read
        self._wake()

    def on_message_complete(self) -> None:
        if self.status == 0:
            return  # the end of an interim answer
        self.complete = True
        self._wake()

    # -- the connection's protocol, while the exchange is under way ----------------------------
    def data_received(self, data: bytes) -> None:
        """Parse what just arrived; a broken answer ends the answer with that error."""
        if self.complete or self._error is not None:
            return  # what follows a complete answer is no part of it
        self.arrived = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.complete:  # else it is what follows the answer
                self._fail(httpx.RemoteProtocolError(f"it sent a broken answer ({exc})"))
                self._wire.close()
        if self._flowing is not None:
            self._flowing.hand_on()

    def eof_received(self) -> bool:
        return False  # close; connection_lost says the rest

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection closed: the end of a body that runs to the close, else an answer broken off."""
        self._wire.lost = True
        if self.complete or self._error is not None:
            return
        if self.head.done() and self._until_close and exc is None:
            self.on_message_complete()
        elif not self.arrived:
            self._fail(httpx.RemoteProtocolError("it closed the connection without an answer"))
        else:
            self._fail(httpx.RemoteProtocolError(f"it broke off its answer ({plainly(exc)})"))
        if self._flowing is not None:
            self._flowing.hand_on()

    def _fail(self, error: Exception) -> None:
        self._error = error
        if not self.head.done():
            self.head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side ---------------------------------------------------------------------
    async def read_some(self) -> bytes:
        """Return the body bytes that have arrived (waiting for at least one); ``b""`` once the body is complete.

        Raises:
            httpx.StreamClosed: the response was closed.
            httpx.ReadTimeout: nothing arrived within the read timeout.
            httpx.RemoteProtocolError: the server broke off or sent a broken body.
        """
        if self._closed:
            raise httpx.StreamClosed()
        self._began = True
        while not self._held:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._wire.loop.create_future()
            try:
                if self._timeout is None:
                    await self._waiter
                else:
                    async with asyncio.timeout(self._timeout):
                        await self._waiter
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"no data from llama-server for {self._timeout} s") from exc
            finally:
                self._waiter = None
        held, self._held = self._held, []
        if self._held_size > READ_HIGH and self._wire.transport is not None and not self._wire.lost:
            self._wire.transport.resume_reading()
        self._held_size = 0
        return held[0] if len(held) == 1 else b"".join(held)

    def pipe(self, sink: Callable[[bytes], None]) -> Piped | None:
        """A ``Piped`` that hands each arrival's payload to ``sink`` from the parser's callback, once started;
        ``None``: this body cannot be piped (it is read within a timeout, or was read or closed already), so
        ``read_some`` it."""
        if self._timeout is not None or self._began or self._closed:
            return None
        self._began = True
        return Piped(self, sink)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while data := await self.read_some():
            yield data

    async def aclose(self) -> None:
        """Free the connection: back to its owner's pool after a complete answer that allows it, else closed.

        A chunked answer is never reused: llama-server b11434 closes the connection after it though its
        headers say ``Keep-Alive`` (``studio.http.upstream``'s docstring).
        """
        if self._closed:
            return
        self._closed = True
        reuse = _reuse_for(self.headers) if self.complete and not self._chunked and self._error is None else None
        self._on_end(self._wire, reuse)


class Piped:
    """An answer's body once ``start`` has it flow to the sink: each arrival's payload is handed on at once.

    What one read brings goes on in one piece (several of llama-server's chunks that came together are
    one write to the client, not one each), and what arrives with the body's end is not handed on but
    is ``done``'s result, so that the caller can send it with its own end in one piece too.
    ``sink`` must not block: while it cannot take more it has reading paused until it resumes it.
    ``done`` fails as ``read_some`` does (after the bytes before the failure went to the sink), or with
    what the sink raised.
    """

    def __init__(self, answer: Answer, sink: Callable[[bytes], None]) -> None:
        self._answer = answer
        self._sink = sink
        self.done: asyncio.Future[bytes] = answer._wire.loop.create_future()

    def start(self) -> None:
        """From now on each arrival goes to the sink: what arrived before goes first."""
        answer = self._answer
        answer._flowing = self
        if answer._held_size > READ_HIGH:
            self.resume()
        answer._held_size = 0
        self.hand_on()

    def hand_on(self) -> None:
        """Hand what arrived to the sink, or to ``done`` with the body's end (or its failure)."""
        answer, done = self._answer, self.done
        if done.done():
            return
        held = answer._held
        data = b"" if not held else held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        if answer.complete:
            done.set_result(data)
            return
        if data:
            try:
                self._sink(data)
            except Exception as exc:  # the sink's own failure, as it is
                done.set_exception(exc)
                answer._wire.close()
                return
        if answer._error is not None:
            done.set_exception(answer._error)

    def pause(self) -> None:
        """Stop reading until ``resume``: the sink cannot take more yet."""
        transport = self._answer._wire.transport
        if transport is not None and not transport.is_closing():
            transport.pause_reading()

    def resume(self) -> None:
        """Read on."""
        transport = self._answer._wire.transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()


#: Seconds an idle connection is kept when the server announces no keep-alive timeout.
DEFAULT_IDLE = 4.0
#: Seconds of margin below the server's announced keep-alive timeout.
IDLE_MARGIN = 1.0


def _reuse_for(headers: list[tuple[bytes, bytes]]) -> float | None:
    """Seconds a connection may idle after an answer with these headers, from ``Connection`` and ``Keep-Alive``."""
    lowered = {name.lower(): value.lower() for name, value in headers}
    if b"close" in lowered.get(b"connection", b""):
        return None
    idle = DEFAULT_IDLE
    for param in lowered.get(b"keep-alive", b"").split(b","):
        name, _, value = param.strip().partition(b"=")
        if name == b"timeout" and value.isdigit():
            idle = float(value) - IDLE_MARGIN
        elif name == b"max" and value.isdigit() and int(value) <= 1:
            return None
    return idle


def plainly(exc: BaseException | None) -> str:
    """What went wrong, in words a client can read: never an internal class name."""
    if exc is None:
        return "the answer ended early"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or "the connection failed"
    return str(exc) or "the connection failed"


def body_reader(resp: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """Return a function giving ``resp``'s next body bytes as they arrive (``b""`` at the end).

    On an ``Answer`` it is its own ``read_some``; on any other stream it steps ``aiter_raw``.
    """
    stream = resp.stream
    if isinstance(stream, Answer):
        return stream.read_some
    chunks = resp.aiter_raw()

    async def read() -> bytes:
        async for chunk in chunks:
            if chunk:
                return chunk
        return b""

    return read


def body_pipe(resp: httpx.Response, sink: Callable[[bytes], None]) -> Piped | None:
    """Pipe ``resp``'s body into ``sink`` (``Answer.pipe``); ``None``: it cannot be, so ``body_reader`` it."""
    stream = resp.stream
    return stream.pipe(sink) if isinstance(stream, Answer) else None
