"""A lean HTTP/1.1 transport for ``httpx`` to the studio's own llama-server on loopback.

The proxy's added latency is its CPU time per request: on a small machine
llama-server's threads hold every core, so each millisecond the service spends
is a millisecond a token waits. httpx's default transport (httpcore on anyio,
h11 in pure Python) cost about as much per request as the rest of the service
together, and writes each request in two pieces (head, then body), so
llama-server wakes twice. This transport speaks just the HTTP/1.1 that
llama-server speaks, on plain asyncio streams, and writes a request in one
piece. Requests, responses and errors stay ``httpx``'s (``httpx.HTTPError``),
so the code that reads the answers does not change.

What it does not do, because llama-server on loopback does not need it: TLS,
proxies, HTTP/2, ``Expect: 100-continue``, request bodies that stream.

Connection reuse follows what llama-server b11434 really does, not what it
announces: its cpp-httplib returns failure from a finished chunked (streamed)
response and so closes the connection, though the headers say ``Keep-Alive``
(``tools/server/server-http.cpp`` ``process_handler_response``, whose provider
returns ``has_next`` after ``sink.done()``). A chunked response therefore never
goes back to the pool; reusing it would race the server's close and fail the
next request. Idle connections are also dropped before the server's announced
``Keep-Alive: timeout`` runs out, and a reused connection that closes before
any byte of the answer is retried once on a new one (as curl does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import httptools
import httpx

#: Bytes a single read of a body asks for.
READ_SIZE = 64 * 1024
#: Seconds an idle connection is kept when the server announces no keep-alive timeout.
DEFAULT_IDLE = 4.0
#: Seconds of margin below the server's announced keep-alive timeout.
IDLE_MARGIN = 1.0
#: Seconds after a streamed answer during which a spare connection is kept ready, renewed before the server's
#: keep-alive timeout (5 s in b11434's cpp-httplib) would drop it: a person reading an answer and typing the next.
SPARE_WINDOW = 60.0
#: Seconds after it is made that a spare is replaced by a new one (within the window) or let go.
SPARE_LIFE = DEFAULT_IDLE - 0.5

_NO_BODY_STATUS = frozenset({204, 304})

T = TypeVar("T")


@dataclass(eq=False)
class _Connection:
    """One TCP connection to ``origin``; reusable while ``reusable_until`` lies ahead."""

    origin: tuple[str, int]
    reader: _Reader
    writer: asyncio.StreamWriter
    reused: bool = False
    reusable_until: float = field(default=0.0)

    def alive(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof() and time.monotonic() < self.reusable_until

    def close(self) -> None:
        self.writer.close()


class LoopbackTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport for plain-HTTP/1.1 servers on this machine; see the module docstring.

    Since llama-server closes the connection after every streamed answer, each
    chat request would open a new one on its way to the first token (about
    0.8 ms of wall time on the 2-core test machine). So each ``POST``'s
    connection that is closed rather than pooled is replaced by a spare
    connection to the same server, opened in the background, and the next
    request starts on one: after a fan-out of N streams the next N start at
    once (with one spare, all but one of 8 simultaneous starts connected on
    the way to their first token). Before the server's keep-alive timeout would
    drop it, an unused spare is replaced by a new one for ``SPARE_WINDOW``
    seconds after the last such answer, then let go, so an idle studio keeps
    no connection open. b11434's HTTP thread pool grows for connections beyond
    its fixed threads, so idle spares take no request's place. One the server
    dropped anyway is retried once on a new connection, as for any idle
    connection.

    Idle connections are kept per server, so models taking turns each keep
    theirs; a request takes only one to its own server.

    Args:
        max_connections: requests in flight at once (more wait for a free one),
            and idle connections kept, all servers together (the oldest goes first).
    """

    def __init__(self, *, max_connections: int = 64) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._max_idle = max_connections
        self._idle: dict[tuple[str, int], list[_Connection]] = {}  # per server, oldest first
        self._spares: dict[tuple[str, int], list[asyncio.Task[_Connection]]] = {}  # per server, oldest first
        self._spare_until: dict[tuple[str, int], float] = {}  # per server: when its spares stop being renewed
        self._renewals: set[asyncio.TimerHandle] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Return the response with its head read and its body still on the wire.

        Raises:
            httpx.UnsupportedProtocol: not ``http://``.
            httpx.ConnectError, httpx.ConnectTimeout: the server cannot be reached.
            httpx.RemoteProtocolError: the server closed or sent something that is not HTTP/1.1.
            httpx.ReadTimeout: no answer within the read timeout.
        """
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"LoopbackTransport speaks plain http, not {request.url.scheme!r}", request=request
            )
        timeouts = request.extensions.get("timeout", {})
        read_timeout = timeouts.get("read")
        head = _request_head(request, await request.aread())
        origin = (request.url.host, request.url.port or 80)
        await self._slots.acquire()
        try:
            conn = self._take_idle(origin) or await self._take_spare(origin)
        except BaseException:
            self._slots.release()
            raise
        try:
            while True:
                if conn is None:
                    conn = await _connect(request, origin, timeouts.get("connect"))
                try:
                    conn.writer.write(head)
                    await conn.writer.drain()
                    status, headers, reason = await _timed(_read_head(conn.reader), read_timeout)
                    stream = _Body(self, conn, request, status, headers, read_timeout)
                    break
                except TimeoutError:  # an OSError too, but no sign of a dropped connection
                    raise
                except (OSError, _ClosedBeforeAnswer) as exc:
                    conn.close()
                    if not conn.reused:
                        raise httpx.RemoteProtocolError(_plainly(exc), request=request) from exc
                    conn = None  # the server dropped an idle connection just now: once more, on a new one
        except BaseException as exc:
            if conn is not None:
                conn.close()  # mid-request: closing it is what tells llama-server to stop
            self._slots.release()
            if isinstance(exc, (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)):
                raise httpx.RemoteProtocolError(f"it sent a broken answer ({_plainly(exc)})", request=request) from exc
            if isinstance(exc, TimeoutError):
                raise httpx.ReadTimeout(
                    f"no answer from llama-server within {read_timeout} s", request=request
                ) from exc
            raise
        return httpx.Response(
            status,
            headers=headers,
            stream=stream,
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
        )

    def _take_idle(self, origin: tuple[str, int]) -> _Connection | None:
        """The newest idle connection to ``origin`` (the likeliest still open); dead or expired ones are closed."""
        self._prune()
        idle = self._idle.get(origin)
        if not idle:
            return None
        conn = idle.pop()
        if not idle:
            del self._idle[origin]
        conn.reused = True
        return conn

    def _prune(self) -> None:
        """Close the idle connections, any server's, that are dead or past their time: an unloaded model's too."""
        for origin, idle in list(self._idle.items()):
            kept = []
            for conn in idle:
                if conn.alive():
                    kept.append(conn)
                else:
                    conn.close()
            if kept:
                self._idle[origin] = kept
            else:
                del self._idle[origin]

    def _pool(self, conn: _Connection) -> None:
        """Keep ``conn`` idle; at ``max_connections`` idle ones the oldest, whichever server's, is closed first."""
        if self._idle_count() >= self._max_idle:
            self._prune()
            if self._idle_count() >= self._max_idle:
                oldest = min(self._idle, key=lambda origin: self._idle[origin][0].reusable_until)
                idle = self._idle[oldest]
                idle.pop(0).close()
                if not idle:
                    del self._idle[oldest]
        self._idle.setdefault(conn.origin, []).append(conn)

    def _idle_count(self) -> int:
        return sum(map(len, self._idle.values()))

    async def _take_spare(self, origin: tuple[str, int]) -> _Connection | None:
        """A spare connection to ``origin`` if there is one and it is still fresh: an open one first.

        One still connecting is waited for: it is nearer done than a new one would be.
        """
        spares = self._spares.get(origin)
        if not spares:
            return None
        opening = next((task for task in spares if task.done()), spares[0])
        self._forget_spare(origin, opening)
        try:
            conn = await asyncio.shield(opening)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if opening.cancelled() and not (current and current.cancelling()):
                return None  # the spare was cancelled (the upstream is closing), not this request
            opening.add_done_callback(_close_if_made)  # this request was cancelled: nobody takes the spare
            raise
        except httpx.HTTPError:
            return None  # the request connects itself, and says why if it cannot
        if conn.alive():
            return conn
        conn.close()
        return None

    def _open_spare(self, origin: tuple[str, int], connect_timeout: float | None) -> None:
        """Start opening one more spare connection to ``origin``, up to ``max_connections`` of them.

        One that cannot be made (the server is gone: an unloaded model's) is forgotten at once.
        """
        spares = self._spares.setdefault(origin, [])
        if len(spares) >= self._max_idle:
            return
        loop = asyncio.get_running_loop()

        async def opened() -> _Connection:
            conn = await _connect(None, origin, connect_timeout)  # its error is nobody's: no request to name
            conn.reused = True  # it waits idle: the server may drop it, and then a request retries on a new one
            conn.reusable_until = time.monotonic() + DEFAULT_IDLE
            renewal: asyncio.TimerHandle

            def renew() -> None:
                self._renewals.discard(renewal)
                self._renew_spare(origin, task, connect_timeout)

            renewal = loop.call_later(SPARE_LIFE, renew)
            self._renewals.add(renewal)
            return conn

        def failed(done: asyncio.Task[_Connection]) -> None:
            # No error: the next request connects itself, and says why if it cannot.
            if _made(done) is None:
                self._forget_spare(origin, done)

        task = asyncio.ensure_future(opened())
        task.add_done_callback(failed)
        spares.append(task)

    def _forget_spare(self, origin: tuple[str, int], opening: asyncio.Task[_Connection]) -> bool:
        """Drop ``opening`` from ``origin``'s spares; return whether it was one (not yet taken or dropped)."""
        spares = self._spares.get(origin)
        if spares is None or opening not in spares:
            return False
        spares.remove(opening)
        if not spares:
            del self._spares[origin]
        return True

    def _renew_spare(
        self, origin: tuple[str, int], opening: asyncio.Task[_Connection], connect_timeout: float | None
    ) -> None:
        """An unused spare is near the server's keep-alive timeout: replace it within the window, else let it go."""
        if not self._forget_spare(origin, opening):
            return  # taken by a request, or dropped
        _close_if_made(opening)
        if time.monotonic() < self._spare_until.get(origin, 0.0):
            self._open_spare(origin, connect_timeout)
        else:
            self._spare_until.pop(origin, None)

    def _finish(self, conn: _Connection, reusable_for: float | None, request: httpx.Request) -> None:
        """Give ``conn`` back to the pool (``reusable_for`` seconds) or close it; free its slot.

        A ``POST``'s connection that is closed is replaced by a spare (see the class docstring).
        """
        if reusable_for is not None and reusable_for > 0:
            conn.reusable_until = time.monotonic() + reusable_for
            self._pool(conn)
        else:
            conn.close()
            if request.method == "POST":
                self._spare_until[conn.origin] = time.monotonic() + SPARE_WINDOW
                self._open_spare(conn.origin, request.extensions.get("timeout", {}).get("connect"))
        self._slots.release()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        for renewal in self._renewals:
            renewal.cancel()
        self._renewals.clear()
        self._spare_until.clear()
        spares = [opening for openings in self._spares.values() for opening in openings]
        self._spares = {}
        for opening in spares:
            opening.cancel()
        for result in await asyncio.gather(*spares, return_exceptions=True):
            if isinstance(result, _Connection):
                result.close()


def _made(opening: asyncio.Task[_Connection]) -> _Connection | None:
    """The connection a finished ``opening`` made; ``None`` if it was cancelled or failed."""
    if opening.cancelled() or opening.exception() is not None:
        return None
    return opening.result()


def _close_if_made(opening: asyncio.Task[_Connection]) -> None:
    """Close the connection ``opening`` made, if it made one (a done-callback)."""
    conn = _made(opening)
    if conn is not None:
        conn.close()


def _plainly(exc: BaseException) -> str:
    """What went wrong, in words a client can read: never an internal class name."""
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the answer ended early"
    if isinstance(exc, asyncio.LimitOverrunError):
        return "a line of the answer was too long"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or "the connection failed"
    return str(exc) or "the connection failed"


class _ClosedBeforeAnswer(Exception):
    """The server closed the connection before sending a byte of its answer."""


def _request_head(request: httpx.Request, body: bytes) -> bytes:
    """The request line, headers and body, as one write."""
    target = request.url.raw_path
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in request.headers.raw]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def _connect(request: httpx.Request | None, origin: tuple[str, int], timeout: float | None) -> _Connection:
    """A new connection to ``origin``; its errors name ``request`` (``None``: a spare's, which no request sees)."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await _open(*origin)
    except TimeoutError as exc:
        raise httpx.ConnectTimeout(
            f"no connection to {origin[0]}:{origin[1]} within {timeout} s", request=request
        ) from exc
    except OSError as exc:
        raise httpx.ConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {exc}", request=request) from exc
    return _Connection(origin, reader, writer)


async def _open(host: str, port: int) -> tuple[_Reader, asyncio.StreamWriter]:
    """``asyncio.open_connection``, with a reader that can hand over what it holds (``_Body.pipe``)."""
    loop = asyncio.get_running_loop()
    reader = _Reader(limit=READ_SIZE, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, host, port)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class _Reader(asyncio.StreamReader):
    """A ``StreamReader`` whose buffered bytes can be taken, when a protocol takes the connection over."""

    _buffer: bytearray  # the base class's, undeclared in its stubs

    def take_buffered(self) -> bytes:
        """Return the bytes read off the connection and not yet asked for, and forget them."""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


async def _timed(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``await awaitable``, within ``timeout`` seconds unless that is ``None``."""
    if timeout is None:
        return await awaitable
    async with asyncio.timeout(timeout):
        return await awaitable


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, raw headers and reason phrase of the next response (1xx answers skipped)."""
    while True:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise _ClosedBeforeAnswer("it closed the connection without an answer") from None
            raise
        lines = raw[:-4].split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200:
            continue
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ValueError(f"not a header line: {line[:80]!r}")
            headers.append((name.strip(), value.strip()))
        return status, headers, reason


class _Body(httpx.AsyncByteStream):
    """The body of one response, read off its connection as the caller asks.

    ``pipe`` is the relay's way in: each arrival handed on from the connection's
    callback. ``read_some`` is one await per arrival, the chunked framing
    stripped by the same decoder; iterating (``aiter_raw``, ``aread``) goes
    through it.
    """

    def __init__(
        self,
        transport: LoopbackTransport,
        conn: _Connection,
        request: httpx.Request,
        status: int,
        headers: list[tuple[bytes, bytes]],
        timeout: float | None,
    ) -> None:
        self._transport = transport
        self._conn: _Connection | None = conn
        self._reader = conn.reader
        self._request = request
        self._timeout = timeout
        self._complete = False
        self._began = False  # read_some has read, or pipe took the connection
        lowered = {name.lower(): value.lower() for name, value in headers}
        chunked = b"chunked" in lowered.get(b"transfer-encoding", b"")
        self._chunked = _ChunkedDecoder() if chunked else None
        length = lowered.get(b"content-length")
        if request.method == "HEAD" or status in _NO_BODY_STATUS:
            self._left: int | None = 0
        else:
            self._left = int(length) if length is not None and not chunked else None
        self._reuse_for = _reuse_for(lowered) if (self._left is not None or chunked) else None

    async def read_some(self) -> bytes:
        """Return the body bytes that have arrived (waiting for at least one); ``b""`` once the body is complete.

        Raises:
            httpx.StreamClosed: the response was closed.
            httpx.ReadTimeout: nothing arrived within the read timeout.
            httpx.RemoteProtocolError: the server broke off or sent a broken body.
        """
        if self._complete:
            return b""
        if self._conn is None:
            raise httpx.StreamClosed()
        self._began = True
        try:
            decoder = self._chunked
            while True:
                if self._left == 0:
                    self._complete = True
                    return b""
                want = READ_SIZE if self._left is None else min(self._left, READ_SIZE)
                if self._timeout is None:
                    data = await self._reader.read(want)
                else:
                    async with asyncio.timeout(self._timeout):
                        data = await self._reader.read(want)
                if decoder is not None:
                    if not data:
                        raise asyncio.IncompleteReadError(b"", None)
                    payload = decoder.feed(data)
                    if decoder.done:
                        self._complete = True
                        return payload
                    if payload:
                        return payload
                    continue  # only framing arrived
                if not data:
                    if self._left is not None:
                        raise asyncio.IncompleteReadError(b"", self._left)
                    self._complete = True  # the body ends with the connection
                    return b""
                if self._left is not None:
                    self._left -= len(data)
                return data
        except TimeoutError as exc:  # before OSError, its base
            raise httpx.ReadTimeout(f"no data from llama-server for {self._timeout} s", request=self._request) from exc
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise httpx.RemoteProtocolError(
                f"it broke off its answer ({_plainly(exc)})", request=self._request
            ) from exc

    def pipe(self, sink: Callable[[bytes], None]) -> Piped | None:
        """A ``Piped`` that hands each arrival's payload to ``sink`` from the event loop's callback, once
        started; ``None``: this body cannot be piped (not chunked, read within a timeout, begun or closed),
        so ``read_some`` it.

        No task wakes and no coroutine resumes per chunk: that was most of the relay's CPU per chunk
        (``scripts/bench_proxy.py --stand-in``).
        """
        conn, decoder = self._conn, self._chunked
        if conn is None or decoder is None or self._timeout is not None or self._complete or self._began:
            return None
        self._began = True
        return Piped(self, conn, decoder, sink)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while data := await self.read_some():
            yield data

    async def aclose(self) -> None:
        """Free the connection: back to the pool after a complete body, else closed (which cancels the work)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            # A chunked answer is never reused: llama-server closes the connection after it (module docstring).
            reuse = self._reuse_for if self._complete and self._chunked is None else None
            self._transport._finish(conn, reuse, self._request)


class Piped(asyncio.Protocol):
    """A chunked body's connection once ``start`` took it over: payloads go to the sink as they arrive.

    ``sink`` must not block: while it cannot take more it has reading paused
    until it resumes it. ``done`` is done once the body is complete; it fails
    as ``read_some`` does, or with what the sink raised.
    """

    def __init__(self, body: _Body, conn: _Connection, decoder: _ChunkedDecoder, sink: Callable[[bytes], None]) -> None:
        self._body = body
        self._conn = conn
        self._decoder = decoder
        self._sink = sink
        self._transport = cast(asyncio.Transport, conn.writer.transport)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def start(self) -> None:
        """Take the connection over from its reader: what the reader holds goes to the sink first."""
        reader = self._conn.reader
        buffered, ended, broken = reader.take_buffered(), reader.at_eof(), reader.exception()
        self._transport.set_protocol(self)
        if not self._transport.is_reading() and not self._transport.is_closing():  # the reader paused it (full)
            self._transport.resume_reading()
        if buffered:
            self.data_received(buffered)
        if ended or broken is not None:
            self.connection_lost(broken)

    def pause(self) -> None:
        """Stop reading until ``resume``: the sink cannot take more yet."""
        if not self._transport.is_closing():
            self._transport.pause_reading()

    def resume(self) -> None:
        """Read on."""
        if not self._transport.is_closing():
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        try:
            payload = self._decoder.feed(data)
        except ValueError as exc:
            self._broke(exc)
            return
        if payload:
            try:
                self._sink(payload)
            except Exception as exc:  # the sink's own failure, as it is
                self.done.set_exception(exc)
                return
        if self._decoder.done:
            self._body._complete = True
            self.done.set_result(None)

    def eof_received(self) -> bool:
        self._broke(asyncio.IncompleteReadError(b"", None))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._broke(exc if exc is not None else asyncio.IncompleteReadError(b"", None))

    def _broke(self, exc: BaseException) -> None:
        if not self.done.done():
            error = httpx.RemoteProtocolError(f"it broke off its answer ({_plainly(exc)})", request=self._body._request)
            error.__cause__ = exc
            self.done.set_exception(error)


def _reuse_for(headers: dict[bytes, bytes]) -> float | None:
    """Seconds a connection may idle after this response, from ``Connection`` and ``Keep-Alive``."""
    if b"close" in headers.get(b"connection", b""):
        return None
    idle = DEFAULT_IDLE
    for param in headers.get(b"keep-alive", b"").split(b","):
        name, _, value = param.strip().partition(b"=")
        if name == b"timeout" and value.isdigit():
            idle = float(value) - IDLE_MARGIN
        elif name == b"max" and value.isdigit() and int(value) <= 1:
            return None
    return idle


def body_reader(resp: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """Return a function giving ``resp``'s next body bytes as they arrive (``b""`` at the end).

    On this transport it is the body's own ``read_some``; on any other (tests
    may pass ``httpx.MockTransport``) it steps ``aiter_raw``.
    """
    stream = resp.stream
    if isinstance(stream, _Body):
        return stream.read_some
    chunks = resp.aiter_raw()

    async def read() -> bytes:
        async for chunk in chunks:
            if chunk:
                return chunk
        return b""

    return read


def body_pipe(resp: httpx.Response, sink: Callable[[bytes], None]) -> Piped | None:
    """Pipe ``resp``'s body into ``sink`` (``_Body.pipe``); ``None``: it cannot be, so ``body_reader`` it."""
    stream = resp.stream
    return stream.pipe(sink) if isinstance(stream, _Body) else None


#: What primes a ``_ChunkedDecoder``'s parser: the head of a chunked response (the real one was read already).
_CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class _ChunkedDecoder:
    """Strips HTTP/1.1 chunked framing off bytes as they come; payload bytes pass on as soon as they arrive.

    Nothing waits for a whole chunk: a chunk split over two reads yields its
    first part at once. ``done`` turns true after the last chunk and its trailer.
    The framing is httptools' C parser's work: about a sixth of the CPU a chunk
    took to decode in Python.
    """

    __slots__ = ("_parser", "_out", "done")

    def __init__(self) -> None:
        self._out: list[bytes] = []
        self.done = False
        self._parser = httptools.HttpResponseParser(self)
        self._parser.feed_data(_CHUNKED_HEAD)

    def on_body(self, body: bytes) -> None:
        self._out.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    def feed(self, data: bytes) -> bytes:
        """Return the payload in ``data``. Raises ``ValueError`` on broken framing."""
        if self.done:
            return b""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.done:  # else it is what follows the body, which is no part of it
                raise ValueError(f"broken chunked framing ({exc})") from None
        out, self._out = self._out, []
        return out[0] if len(out) == 1 else b"".join(out)


class Upstream:
    """POSTs to llama-server over one pooled transport: how the proxy and /api/chat reach the model.

    It calls the transport itself rather than going through ``httpx.AsyncClient``,
    whose per-request work (URL merging, cookie extraction, auth and redirect
    handling) costs about 0.2 ms of CPU here and buys nothing against our own
    child. The requests and responses are still ``httpx`` objects, and so are
    the errors.

    Args:
        transport: what carries the requests; default a ``LoopbackTransport``.
            Tests may pass ``httpx.MockTransport`` or ``httpx.ASGITransport``.
        max_connections: requests in flight at once, for the default transport.
        connect_timeout: seconds to reach llama-server; an answer may take as long as it takes.
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        max_connections: int = 64,
        connect_timeout: float = 10.0,
    ) -> None:
        self.transport = transport or LoopbackTransport(max_connections=max_connections)
        self._timeout = {"connect": connect_timeout, "read": None, "write": None, "pool": None}
        self._urls: dict[str, httpx.URL] = {}

    async def post(self, url: str, body: object, headers: dict[str, str]) -> httpx.Response:
        """Send ``body`` as JSON and return the response once its head is in; the caller closes it.

        Raises:
            httpx.HTTPError: llama-server could not be reached or broke off.
        """
        return await self.send("POST", url, headers, body)

    async def send(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        body: object = None,
        query: str = "",
        content: bytes | None = None,
    ) -> httpx.Response:
        """Send a request (``body`` as JSON, or ``content`` as it is; none) and return the response once its head is in.

        ``query`` is a raw query string passed on as it came. The caller closes the response.

        Raises:
            httpx.HTTPError: llama-server could not be reached or broke off.
        """
        parsed = self._urls.get(url)
        if parsed is None:  # a handful of URLs per model: parse each once
            if len(self._urls) >= 64:  # old models' URLs
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        if query:
            parsed = parsed.copy_with(query=query.encode())
        request = httpx.Request(
            method, parsed, json=body, content=content, headers=headers, extensions={"timeout": self._timeout}
        )
        return await self.transport.handle_async_request(request)

    async def get(self, url: str, headers: dict[str, str], *, timeout: float) -> bytes:
        """The body of a GET (llama-server's own ``/metrics``), each read within ``timeout`` seconds.

        Raises:
            httpx.HTTPError: no answer, a broken one, or one that is not a 200.
        """
        timeouts = {**self._timeout, "connect": timeout, "read": timeout}
        request = httpx.Request("GET", url, headers=headers, extensions={"timeout": timeouts})
        resp = await self.transport.handle_async_request(request)
        try:
            content = await resp.aread()
        finally:
            await resp.aclose()
        if resp.status_code != 200:
            raise httpx.HTTPStatusError(f"{url} answered {resp.status_code}", request=request, response=resp)
        return content

    async def aclose(self) -> None:
        """Close idle connections; responses still open keep theirs until they are closed."""
        await self.transport.aclose()
