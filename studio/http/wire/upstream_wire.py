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
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Protocol, cast

import httptools
import httpx

from studio.http.wire.chunk_pump import PumpEnd, pump

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
        self.head: asyncio.Future[None] = wire.loop.create_future()
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.arrived = False  # any byte of the answer: an idle connection the server dropped has none (retry)
        self._chunked = False
        self._until_close = False  # neither sized nor chunked: the body ends with the connection
        held: list[bytes] = []  # payload that arrived and was not read yet (always this list: the parser fills it)
        self._held = held
        self._held_size = 0
        #: (a chunked body) whether what arrived so far ends between two chunks, not inside one
        self.between_chunks = True
        self._waiter: asyncio.Future[None] | None = None
        self._flowing: _Flowing | None = None  # the pipe, once started: each arrival goes to it
        self._error: Exception | None = None
        self._began = False  # read, or piped
        self._closed = False
        # llhttp's callbacks for each chunk are C functions, not methods: no Python frame runs per chunk
        self.on_body = held.append
        self.on_chunk_header = partial(setattr, self, "between_chunks", False)
        self.on_chunk_complete = partial(setattr, self, "between_chunks", True)
        self._parser = httptools.HttpResponseParser(self)

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
                self._garbled(exc)
        if self._flowing is not None:
            self._flowing.hand_on()
        elif self._held:  # payload for the reader
            self._held_size += len(data)
            if self._held_size > READ_HIGH and self._wire.transport is not None:
                self._wire.transport.pause_reading()  # until it is read
            self._wake()

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

    def _garbled(self, exc: httptools.HttpParserError) -> None:
        """What arrived is no HTTP answer: the answer fails, and the connection, of no further use, closes."""
        self._fail(httpx.RemoteProtocolError(f"it sent a broken answer ({exc})"))
        self._wire.close()

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
            await self._news()
        data = self._take_held()
        if self._held_size > READ_HIGH and self._wire.transport is not None and not self._wire.lost:
            self._wire.transport.resume_reading()
        self._held_size = 0
        return data

    def begun(self) -> bool:
        """Whether the body has begun: its first bytes are in (up to a chunk's end, where a body is chunked), or it
        ended or broke off; ``first_bytes`` waits until it has."""
        return (
            (bool(self._held) and self.between_chunks)
            or self.complete
            or self._error is not None
            or self._held_size > READ_HIGH  # reading paused: no more comes until they are read
        )

    async def first_bytes(self) -> None:
        """Wait until the body has begun (``begun``), leaving what arrived to whoever reads or pipes the body.

        Raises:
            httpx.ReadTimeout: nothing arrived within the read timeout.
            httpx.RemoteProtocolError: the server broke off, or sent a broken body, first.
        """
        while not self.begun():
            await self._news()
        if self._error is not None:
            raise self._error

    async def begins_within(self, seconds: float) -> bool:
        """Whether the body begins (``begun``) within ``seconds``, what arrived left for the relay: the wait of a
        ready model's stream for its first token, which needs no task of its own. ``False`` at once for an answer
        read within a timeout (``first_bytes`` waits for it)."""
        if self.begun():
            return True
        if self._timeout is not None:
            return False
        loop = self._wire.loop
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            self._wake()

        timer = loop.call_later(seconds, expire)
        try:
            while not self.begun() and not expired:
                self._waiter = loop.create_future()
                await self._waiter
        finally:
            timer.cancel()
            self._waiter = None
        return self.begun()

    async def _news(self) -> None:
        """Wait for the answer's next news (payload, its end, its failure), within the read timeout.

        Raises:
            httpx.ReadTimeout: nothing arrived within the read timeout.
        """
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

    def _take_held(self) -> bytes:
        """The payload that arrived and was not handed on yet, in one piece; none is held after."""
        held = self._held
        data = b"" if not held else held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        return data

    def pipe(self, sink: Sink) -> Piped | None:
        """A ``Piped`` that hands each arrival's payload to ``sink`` from the parser's callback, once started;
        ``None``: this body cannot be piped (it is read within a timeout, or was read or closed already), so
        ``read_some`` it."""
        if self._timeout is not None or self._began or self._closed:
            return None
        self._began = True
        return Piped(self, sink)

    def pipe_framed(self, transport: asyncio.WriteTransport, flow: WriteFlow) -> Framed | None:
        """A ``Framed`` that passes this chunked body on as it arrives, framing and all, on ``transport``, once started;
        ``None``: it cannot be (it is not chunked, it stopped inside a chunk so far, or it cannot be piped), so
        ``pipe`` or ``read_some`` it."""
        if not self._chunked or not self.between_chunks or self._timeout is not None or self._began or self._closed:
            return None
        self._began = True
        return Framed(self, transport, flow)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while data := await self.read_some():
            yield data

    async def aclose(self) -> None:
        """Free the connection: back to its owner's pool after a complete answer that allows it, else closed.

        A chunked answer is never reused: llama-server b11434 closes the connection after it though its
        headers say ``Keep-Alive`` (``studio.http.wire.upstream``'s docstring).
        """
        if self._closed:
            return
        self._closed = True
        reuse = _reuse_for(self.headers) if self.complete and not self._chunked and self._error is None else None
        self._on_end(self._wire, reuse)


#: Takes the bytes handed on; returns what to await before the next while the client is behind, if it is.
Sink = Callable[[bytes], Awaitable[None] | None]


class _Flowing:
    """What the two ways of passing an answer's body on share: ``done``, and the connection not read while the
    client is behind (a write returned what to await), until it has caught up."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.done: asyncio.Future[bytes] = answer._wire.loop.create_future()
        self._pending: asyncio.Future[None] | None = None

    def hand_on(self) -> None:
        """The answer has news (payload, its end, its failure): pass it on, each way as it does."""
        raise NotImplementedError

    def _take_over(self) -> None:
        """Have the answer's arrivals come here from now on (what it holds is the caller's to take): reading
        resumes if a reader had it paused."""
        answer = self._answer
        answer._flowing = self
        if answer._held_size > READ_HIGH:
            self.resume()
        answer._held_size = 0

    def _behind(self, left: Awaitable[None]) -> None:
        """The client is behind: stop reading until ``left`` says it has caught up (``done`` fails if it fails)."""
        self.pause()
        self._pending = pending = asyncio.ensure_future(left)
        pending.add_done_callback(self._caught_up)

    def _caught_up(self, pending: asyncio.Future[None]) -> None:
        if pending.cancelled():  # the relay ended first
            return
        error = pending.exception()
        if error is None:
            self.resume()
        elif not self.done.done():
            self.done.set_exception(error)

    async def caught_up(self) -> None:
        """Return once what the last write left to do is done (a server's ``send`` run up to its first wait: what
        the caller sends next must wait for it)."""
        if self._pending is not None:
            await self._pending

    def pause(self) -> None:
        """Stop reading until ``resume``."""
        transport = self._answer._wire.transport
        if transport is not None and not transport.is_closing():
            transport.pause_reading()

    def resume(self) -> None:
        """Read on."""
        transport = self._answer._wire.transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    def close(self) -> None:
        """Stop: nothing more is handed on, and a wait for the client ends."""
        self.done.cancel()  # a connection lost after this is nobody's error
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()


class Piped(_Flowing):
    """An answer's body once ``start`` has it flow to the sink: each arrival's payload is handed on at once.

    What one read brings goes on in one piece (several of llama-server's chunks that came together are
    one write to the client, not one each), and what arrives with the body's end is not handed on but
    is ``done``'s result, so that the caller can send it with its own end in one piece too.
    ``sink`` must not block: while the client is behind it returns what to await, and reading pauses
    until that is done. ``done`` fails as ``read_some`` does (after the bytes before the failure went to
    the sink), or with what the sink raised.
    """

    def __init__(self, answer: Answer, sink: Sink) -> None:
        super().__init__(answer)
        self._sink = sink

    def start(self) -> None:
        """From now on each arrival goes to the sink: what arrived before goes first."""
        self._take_over()
        self.hand_on()

    def hand_on(self) -> None:
        """Hand what arrived to the sink, or to ``done`` with the body's end (or its failure)."""
        answer, done = self._answer, self.done
        if done.done():
            return
        data = answer._take_held()
        if answer.complete:
            done.set_result(data)
            return
        if data:
            try:
                left = self._sink(data)
            except Exception as exc:  # the sink's own failure, as it is
                done.set_exception(exc)
                answer._wire.close()
                return
            if left is not None:
                self._behind(left)
        if answer._error is not None:
            done.set_exception(answer._error)


class WriteFlow(Protocol):
    """A connection's write flow control (uvicorn's ``FlowControl``): ``write_paused`` while it cannot take more."""

    write_paused: bool

    async def drain(self) -> None:
        """Return once it can take more."""


#: Arrivals a ``Framed`` writes on before it parses them, at most: parsing them together costs less than one by one.
PARSE_EVERY = 64


class Framed(_Flowing):
    """A chunked answer's body passed on as it arrives, its chunked framing and all, on a client's connection
    whose response is chunked too (``transport``, with its ``flow`` control: a client that reads slower than
    the answer comes has reading paused until it has caught up; a client that is gone is written nothing).

    Each arrival is written on as it came, from one Python call: the least a relay can do. It is parsed
    (llhttp) later, several arrivals together, which on a busy machine costs a fraction of parsing each
    (``scripts/bench_proxy.py``'s CPU per chunk); only an arrival that may end the body is parsed before it
    is written on. That one is not written but is ``done``'s result, the body's end in it (its last chunk,
    trailers), for the caller to write when it ends its response. What arrived before ``start`` (payload
    only: its framing is parsed away) goes first, framed again. After a failure ``between_chunks`` says
    whether what was written ended between two chunks, where an error event can follow as a chunk of its
    own, or inside one, where the client's body cannot go on. ``first_at`` is when the first bytes came,
    ``tail`` the last two arrivals.

    Where the C chunk pump was built (``studio.http.wire.chunk_pump``), the arrivals after ``start`` go through it
    instead, the same way (written as they came, the end handed back, a failure between or inside chunks),
    with no Python per arrival.
    """

    def __init__(self, answer: Answer, transport: asyncio.WriteTransport, flow: WriteFlow) -> None:
        super().__init__(answer)
        self._transport = transport
        self._flow = flow
        self.first_at: float | None = None
        self.between_chunks = True
        self._unparsed: list[bytes] = []  # arrivals written on, not parsed yet
        self._recent: Callable[[], tuple[bytes, bytes]] = lambda: (b"", b"")  # the last two arrivals
        self._stop_pump: Callable[[], None] | None = None  # the chunk pump passes the body on: what stops it

    @property
    def tail(self) -> bytes:
        """The last two arrivals (llama-server's ``timings`` and ``usage`` are in them once the body ended)."""
        before, last = self._recent()
        return before + last

    def start(self) -> None:
        """From now on each arrival goes to the writer: what arrived before goes first."""
        answer, done = self._answer, self.done
        self._take_over()
        payload = answer._take_held()
        framed = b"%x\r\n%s\r\n" % (len(payload), payload) if payload else b""
        if payload:
            self.first_at = time.perf_counter()
            self._recent = lambda: (b"", framed)
        if answer.complete:
            done.set_result(framed + b"0\r\n\r\n")
            return
        if framed:
            self._wrote(framed)
        if answer._error is not None:
            done.set_exception(answer._error)
            return
        transport = answer._wire.transport
        assert transport is not None
        self._stop_pump = pump(transport, self._transport, self.first_at, framed, self._pumped)
        if self._stop_pump is None:  # relayed here, arrival by arrival
            transport.set_protocol(_Arrivals(self._arrivals(), self))

    def _pumped(self, end: PumpEnd) -> None:
        """The chunk pump passed the rest of the body on: how it ended, as ``_arrivals`` would have seen it."""
        self._stop_pump = None
        answer, done = self._answer, self.done
        if self.first_at is None and end.first_at:
            self.first_at = end.first_at
        self._recent = lambda: (end.before, end.last)
        self.between_chunks = end.between_chunks
        if done.done():
            return
        if end.how == "complete":
            answer.complete = True
            done.set_result(end.end)
            return
        if end.how == "client gone":  # as uvicorn would on its own write: its disconnect ends the relay
            self._transport.abort()
            return
        if end.how == "garbled":
            answer._garbled(httptools.HttpParserError("invalid chunk framing"))
            self.hand_on()
        else:  # broken: as if the connection had closed under the answer, which says so and hands it on
            answer.connection_lost(OSError(end.error, os.strerror(end.error)) if end.error else None)

    def _arrivals(self) -> Callable[[bytes], None]:
        """The connection's ``data_received`` from ``start`` on (a closure: each attribute it would look up per
        arrival is looked up once)."""
        done, unparsed, parse, flow = self.done, self._unparsed, self._parse, self._flow
        write, gone, held = self._transport.write, self._transport.is_closing, self._answer._held
        before, last = self._recent()

        def arrived(data: bytes) -> None:
            nonlocal before, last
            if done.done() or gone():
                return  # what follows the end or a failure is no part of the answer; a client gone ends the relay
            if self.first_at is None:
                self.first_at = time.perf_counter()
            # a chunked body ends with "\r\n\r\n" (its last chunk, and trailers if any): an arrival that can end it
            # ends so, or is shorter and ends what an earlier one began
            if len(data) < 4 or data.endswith(b"\r\n\r\n") or len(unparsed) >= PARSE_EVERY:
                ended = parse(data)
                carried = bool(held)  # payload: the framing is what goes on
                held.clear()
                if ended:
                    if carried:  # a last chunk alone is none of the tail: /metrics reads the events before it
                        before, last = last, data
                    return
            else:
                unparsed.append(data)
            before, last = last, data
            write(data)
            if flow.write_paused:
                self._behind(flow.drain())

        def recent() -> tuple[bytes, bytes]:
            return before, last

        self._recent = recent
        return arrived

    def _parse(self, data: bytes) -> bool:
        """Parse what was written unparsed, then ``data`` (not written yet; its payload is left held); whether the
        answer ended with it, complete or broken (``done`` then says which)."""
        answer, unparsed, done = self._answer, self._unparsed, self.done
        feed = answer._parser.feed_data
        try:
            for piece in unparsed:
                feed(piece)
            unparsed.clear()
            answer._held.clear()  # their payload, parsed out: what was written is the framing and all
            # what was written so far ends between chunks: after a chunk's end, with not even part of a size line
            # since (which ends with no "\n")
            written = self._recent()[1]
            self.between_chunks = answer.between_chunks and (not written or written.endswith(b"\n"))
            feed(data)
        except httptools.HttpParserError as exc:
            if not answer.complete:
                if unparsed:  # the broken bytes were written
                    self.between_chunks = False
                answer._garbled(exc)
        unparsed.clear()
        if answer.complete:
            done.set_result(data)
        elif answer._error is not None:
            done.set_exception(answer._error)
        else:
            return False
        return True

    def _wrote(self, data: bytes) -> None:
        """Write ``data`` on."""
        if not self._transport.is_closing():
            self._transport.write(data)
            if self._flow.write_paused:
                self._behind(self._flow.drain())

    def close(self) -> None:
        if self._stop_pump is not None:
            self._stop_pump()
            self._stop_pump = None
        super().close()

    def lost(self, exc: Exception | None) -> None:
        """The connection closed: what was written unparsed is parsed first, so the answer knows how it ended."""
        if not self.done.done():
            self._parse(b"")
        self._answer.connection_lost(exc)

    def hand_on(self) -> None:
        """The answer broke off (the connection closed): between chunks or inside one."""
        answer, done = self._answer, self.done
        if not done.done() and answer._error is not None:
            done.set_exception(answer._error)


class _Arrivals(asyncio.BaseProtocol):
    """A connection's protocol while ``Framed`` passes its answer on: its ``data_received`` is ``Framed``'s closure."""

    def __init__(self, arrived: Callable[[bytes], None], framed: Framed) -> None:
        self.data_received = arrived
        self._framed = framed

    def eof_received(self) -> bool:
        return False  # close; connection_lost says the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self._framed.lost(exc)


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


def body_begun(resp: httpx.Response) -> bool:
    """Whether ``resp``'s body has begun (``Answer.begun``): any other stream is read as it comes."""
    stream = resp.stream
    return stream.begun() if isinstance(stream, Answer) else True


async def body_first_bytes(resp: httpx.Response) -> None:
    """Wait until ``resp``'s body has begun (``Answer.first_bytes``), its bytes left for the relay.

    Raises:
        httpx.HTTPError: it broke off (or timed out) first.
    """
    stream = resp.stream
    if isinstance(stream, Answer):
        await stream.first_bytes()


async def body_begins_within(resp: httpx.Response, seconds: float) -> bool:
    """Whether ``resp``'s body begins within ``seconds`` (``Answer.begins_within``); any other stream has begun."""
    stream = resp.stream
    return await stream.begins_within(seconds) if isinstance(stream, Answer) else True


def body_framed(resp: httpx.Response, transport: asyncio.WriteTransport, flow: WriteFlow) -> Framed | None:
    """Pass ``resp``'s chunked body on framed (``Answer.pipe_framed``); ``None``: it cannot be, so ``body_pipe`` it."""
    stream = resp.stream
    return stream.pipe_framed(transport, flow) if isinstance(stream, Answer) else None


def body_pipe(resp: httpx.Response, sink: Sink) -> Piped | None:
    """Pipe ``resp``'s body into ``sink`` (``Answer.pipe``); ``None``: it cannot be, so ``body_reader`` it."""
    stream = resp.stream
    return stream.pipe(sink) if isinstance(stream, Answer) else None
