"""Relay a streamed llama-server answer to an ASGI client: bytes as they arrive, cancelled when the client leaves.

Every microsecond the relay spends per chunk is one a token waits on a
machine whose cores llama-server keeps busy. Starlette's ``StreamingResponse``
runs each stream in an anyio task group beside a disconnect listener and pulls
bytes through a stack of async generators (ours, httpx's ``aiter_raw``, the
transport's body); measured on the streaming path (``scripts/bench_proxy.py``)
that was most of the studio's CPU per chunk. ``Relay`` sends each arrival with
one ``send`` from the upstream connection's own callback (``Piped``): no task
wakes and no coroutine chain resumes per chunk, and nothing is buffered (bytes
that arrive together go on together, none waits for another). The server's
``send`` runs there up to its first wait (``send_now``); it waits only for a
client that reads slower than the model writes, and then the upstream is not
read until it has caught up. A disconnect is noticed by one watcher task per
request, which cancels the relay; the upstream response is then closed, which
tells llama-server to stop generating.

Body chunks go to the server's own ``send`` (``with_server_send``), past the
middleware between (Starlette's error handler, the metrics, the body limit):
each of those wraps ``send`` only to look at ``http.response.start``, which
still goes through them, and passing a chunk through their wrappers cost a few
µs of the ~20 µs of Python per chunk. Under uvicorn they go further still,
framed and written on the client's connection itself (``studio.http.wire.client_wire``);
the body's end goes through ``send``. A chunked upstream body that is not reshaped
goes further still: on the client's connection as it came, framing and all
(``studio.http.wire.upstream_wire.Framed``), one Python call an arrival; its own last
chunk ends the client's body, and ``send`` only finishes the request. If it breaks
off inside a chunk, the client's connection closes without an error event (which
would be read as that chunk's bytes); between chunks the error event follows.

A ``Reshape`` turns the bytes into something else on the way (a chat stream
with tools, healed); without one they pass through byte for byte.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

import anyio
import httpx
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from studio.http.wire.client_wire import ChunkWriter, ClientWire, client_wire
from studio.http.wire.upstream_wire import (
    Framed,
    body_begins_within,
    body_begun,
    body_first_bytes,
    body_framed,
    body_pipe,
    body_reader,
)

#: The scope key under which ``with_server_send`` keeps the ASGI server's own ``send``.
SERVER_SEND = "gguf_studio.server_send"


def with_server_send(app: ASGIApp) -> ASGIApp:
    """``app``, with the server's ``send`` in each HTTP request's scope for the streams' body chunks."""

    async def serving(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return serving


class Reshape(Protocol):
    """Turns upstream bytes into what the client gets (``studio.chat.tool_stream.HealingRelay``)."""

    def feed(self, data: bytes) -> bytes:
        """Return what the client gets for ``data`` (``b""``: nothing yet)."""

    def finish(self) -> bytes:
        """Return what is still held, and whatever ends the reshaped stream, once the upstream body is complete."""

    def close(self) -> bytes:
        """Return what is still held, once the upstream body broke off (the error event follows)."""


class _Streamed(Response):
    """A ``Response`` that sends its own body until the client leaves, then closes what it owns (once).

    The response start goes out inside the guarded part, so a cancellation while
    it is sent (the server shutting down, a client gone) still closes what the
    response was handed: the lease on the model and the upstream response.
    """

    def __init__(
        self, *, status_code: int = 200, headers: Mapping[str, str] | None = None, media_type: str | None = None
    ) -> None:
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.complete = False  # its last bytes went out: the client did not leave before (the activity's record)
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def respond() -> bytes:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            return await self._body(scope.get(SERVER_SEND, send))  # the start went through every layer

        last = await until_client_leaves(receive, respond, self._close)
        if last is not None:
            await send({"type": "http.response.body", "body": last, "more_body": False})
            self.complete = True

    async def _body(self, send: Send) -> bytes:
        """Send the body on as it comes; return the last bytes, sent with ``more_body`` false."""
        raise NotImplementedError

    def first_byte_at(self) -> float | None:
        """When the answer's first bytes came (``perf_counter``), if they did yet: read by the live activity view."""
        return None

    async def _close(self) -> None:
        """Let go of what the body came from; awaited once, whatever happened, shielded from cancellation."""
        raise NotImplementedError


class Relay(_Streamed):
    """An ASGI response that relays ``upstream``'s body as it arrives.

    Args:
        upstream: llama-server's response, its head read and its body still on the wire.
        on_close: closes ``upstream`` and ends the request (the lease); awaited once, whatever happened,
            with the time the first bytes arrived (``None``: none did) and the last two arrivals
            (llama-server's ``timings`` and ``usage`` are in them, for ``/metrics``).
        on_break: the last bytes for the client when the upstream breaks off (an error event).
        on_early_break: what a break before the body's first bytes raises (``first_bytes``); none: the body is
            relayed as it comes, and a break then is ``on_break``'s too.
        reshape: what to turn the bytes into; ``None`` passes them through untouched.
    """

    def __init__(
        self,
        upstream: httpx.Response,
        *,
        on_close: Callable[[float | None, bytes], Awaitable[None]],
        on_break: Callable[[httpx.HTTPError], Awaitable[bytes]],
        on_early_break: Callable[[httpx.HTTPError], Awaitable[Exception]] | None = None,
        reshape: Reshape | None = None,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(status_code=status_code, headers=headers, media_type=media_type)
        self._upstream = upstream
        self._on_close = on_close
        self._on_break = on_break
        self._on_early_break = on_early_break
        self._reshape = reshape
        self._first_at: float | None = None
        self._before_last = self._last = b""  # the last two arrivals
        self._framed: Framed | None = None

    def first_byte_at(self) -> float | None:
        return self._framed.first_at if self._framed is not None else self._first_at

    def unbegun(self) -> bool:
        """Whether the upstream body has not begun yet and a break before it is ``on_early_break``'s: then
        ``first_bytes`` waits for it before the response goes out."""
        return self._on_early_break is not None and not body_begun(self._upstream)

    async def first_bytes(self) -> None:
        """Wait until the upstream body has begun, its bytes left to be relayed first; when it breaks off before,
        or the wait is cancelled, the upstream response is closed (not the rest of ``on_close``: nothing was
        answered), and a break raises what ``on_early_break`` makes of it.

        A llama-server that dies before the answer's first byte has cost the client nothing: its request may be
        sent again (``studio.http.clients.load_wait``), which once the relay began it may not.
        """
        assert self._on_early_break is not None
        try:
            await body_first_bytes(self._upstream)
        except httpx.HTTPError as exc:
            await self._upstream.aclose()
            raise await self._on_early_break(exc) from exc
        except BaseException:
            await self._upstream.aclose()
            raise

    async def begins_within(self, seconds: float) -> bool:
        """Whether the upstream body begins (or breaks off) within ``seconds``; then ``first_bytes`` returns at once.
        A cancelled wait closes the upstream response, as ``first_bytes``'s does."""
        try:
            return await body_begins_within(self._upstream, seconds)
        except BaseException:
            await self._upstream.aclose()
            raise

    async def _close(self) -> None:
        if self._framed is not None:
            await self._on_close(self._framed.first_at, self._framed.tail)
        else:
            await self._on_close(self._first_at, self._before_last + self._last)

    async def _body(self, send: Send) -> bytes:
        """Send the body on as it comes; return the last bytes (``b""``, what the reshape held, or an error event)."""
        reshape = self._reshape
        wire = client_wire(send)
        if wire is not None and reshape is None:
            framed = body_framed(self._upstream, wire.transport, wire.flow)
            if framed is not None:
                self._framed = framed
                return await self._framed_body(framed, wire)
        try:
            last = await self._relayed(send, None if wire is None else wire.write_chunk)
            out = self._arrived(last) if last else b""  # it goes with the body's end, in one write
            return out if reshape is None else out + reshape.finish()
        except httpx.HTTPError as exc:
            held = b"" if reshape is None else reshape.close()  # held-back text is not lost
            return held + await self._on_break(exc)

    async def _framed_body(self, framed: Framed, wire: ClientWire) -> bytes:
        """Pass the chunked upstream body on as it came, framing and all, its own last chunk ending the client's."""
        try:
            framed.start()
            last = await framed.done
        except httpx.HTTPError as exc:
            if framed.between_chunks:
                return await self._on_break(exc)
            wire.broken_framed()
            return b""
        finally:
            framed.close()
        if (left := wire.write_framed(last)) is not None:
            await left  # the client is behind: its drain is what the end waits for (a dropped one warns)
        wire.ended_framed()
        return b""

    def _arrived(self, data: bytes) -> bytes:
        """What the client gets for ``data``, which arrived just now."""
        if self._first_at is None:
            self._first_at = time.perf_counter()
        self._before_last, self._last = self._last, data
        return data if self._reshape is None else self._reshape.feed(data)

    async def _relayed(self, send: Send, write: ChunkWriter | None) -> bytes:
        """Send each arrival on: from the upstream's callback where the body can be piped, else read by read;
        ``write`` (if any) frames and writes a chunk on the client's connection.

        Returns what arrived with the upstream body's end, not yet sent: the caller sends it as the last bytes.
        """

        def sink(data: bytes) -> Awaitable[None] | None:
            out = self._arrived(data)
            if not out:
                return None
            if write is not None:
                return write(out)
            return send_now(send, {"type": "http.response.body", "body": out, "more_body": True})

        piped = body_pipe(self._upstream, sink)
        if piped is None:
            read = body_reader(self._upstream)
            while data := await read():
                out = self._arrived(data)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            return b""
        try:
            piped.start()
            last = await piped.done
            await piped.caught_up()
            return last
        finally:
            piped.close()


class EventStream(_Streamed):
    """An ASGI response that sends each bytes item of ``events`` as it comes, until the client leaves.

    ``StreamingResponse`` without its anyio task group and disconnect listener per
    request: one watcher task notices a client that leaves and cancels the stream.

    Args:
        events: the body, closed either way.
        on_close: lets go of what ``events`` reads from (the lease, the upstream response); awaited once,
            after ``events`` is closed, whatever happened: also when the stream never began, when closing
            ``events`` runs none of its ``finally``.
    """

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        on_close: Callable[[], Awaitable[None]],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(status_code=status_code, headers=headers, media_type=media_type)
        self._events = events
        self._on_close = on_close

    async def _body(self, send: Send) -> bytes:
        async for data in self._events:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        return b""

    async def _close(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._on_close()


def send_now(send: Send, message: Message) -> Awaitable[None] | None:
    """Run ``send(message)`` up to its first wait, here and now; return what is left of it to await, if anything.

    An ASGI server's ``send`` waits only while the client does not read; else it
    writes and returns, and running it here, in the upstream's callback, spares a
    task waking per chunk. Its awaitable is stepped as an iterator, which every awaitable
    is: a coroutine's also takes ``send``, a server's own may not (granian's does not).
    """
    sending = send(message).__await__()
    try:
        waiting = next(sending)
    except StopIteration:
        return None
    return _send_rest(sending, waiting)


async def _send_rest(sending: Iterator[Any], waiting: object) -> None:
    """Drive ``sending`` on from its first wait (``send_now``), waiting for what it waits for."""
    try:
        while True:
            if isinstance(waiting, asyncio.Future):
                await asyncio.wait((waiting,))
            else:  # a bare yield: one turn of the loop
                await asyncio.sleep(0)
            waiting = next(sending)
    except StopIteration:
        return
    finally:
        close = getattr(sending, "close", None)  # a coroutine's: its ``finally`` runs if it was left half-way
        if close is not None:
            close()


#: Detached answers (``LoadWait``'s ``detach``) still on their way, held until their response is closed.
_DETACHED: set[asyncio.Task[None]] = set()


async def _closed_when_answered(answer: asyncio.Future[Response]) -> None:
    """Wait for a detached answer and close its response; its failure was the left client's (nobody to tell)."""
    await asyncio.gather(answer, return_exceptions=True)
    if not answer.cancelled() and answer.exception() is None and isinstance(response := answer.result(), _Streamed):
        with anyio.CancelScope(shield=True):
            await response._close()


async def until_client_leaves(
    receive: Receive, work: Callable[[], Awaitable[bytes]], cleanup: Callable[[], Awaitable[None]]
) -> bytes | None:
    """Return what ``work`` returns, or ``None`` when the client left first and ``work`` was cancelled.

    ``cleanup`` is awaited either way, after the cancellation (asyncio delivers it once, so nothing
    there is cancelled again). The cancellation is asyncio's own, not an anyio scope: two scopes a
    request were ~5 % of its CPU (``scripts/bench_proxy.py``'s CPU per request). A cancellation from
    elsewhere (``Task.cancelling``) is not taken for the client's and goes on up.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = over = False

    def left(watcher: asyncio.Future[None]) -> None:
        nonlocal gone
        if not over and not watcher.cancelled():  # a callback already scheduled when work ended: too late
            gone = True
            task.cancel()

    watcher = asyncio.ensure_future(client_gone(receive))
    watcher.add_done_callback(left)
    try:
        return await work()
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            return None
        raise
    finally:
        over = True
        watcher.cancel()
        await cleanup()


async def client_gone(receive: Receive) -> None:
    """Return once the client's side of the connection is gone (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class LoadWait(_Streamed):
    """An ASGI stream that begins before its answer exists: keep-alive lines until ``answer`` is done, then its body.

    Args:
        answer: makes the response (waits for the model's load, then asks llama-server); cancelled and its
            response closed when the client leaves.
        beat: the keep-alive line sent every ``every`` seconds until ``answer`` is done.
        ended: the last bytes when ``answer`` fails or returns a response that is not a stream: the error
            (an exception, or a whole error response's body) in the stream's own form.
        detach: a client that leaves during the wait does not cancel ``answer``: it goes on to llama-server,
            which records a stream named by ``X-Conversation-Id`` for a later resume (as llama.cpp's router
            detaches such a request from the client), and its response is closed once it comes.
    """

    def __init__(
        self,
        answer: asyncio.Future[Response],
        *,
        beat: Callable[[], bytes],
        ended: Callable[[BaseException | bytes], bytes],
        every: float,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
        detach: bool = False,
    ) -> None:
        super().__init__(status_code=200, headers=headers, media_type=media_type)
        self._answer = answer
        self._detach = detach
        self._beat = beat
        self._ended = ended
        self._every = every

    async def _body(self, send: Send) -> bytes:
        while not (await asyncio.wait({self._answer}, timeout=self._every))[0]:
            await send({"type": "http.response.body", "body": self._beat(), "more_body": True})
        try:
            response = self._answer.result()
        except Exception as exc:  # the load failed, or llama-server did not answer: said in the stream
            return self._ended(exc)
        if isinstance(response, _Streamed):
            return await self._relayed(response, send)
        return self._ended(bytes(response.body))

    async def _relayed(self, response: _Streamed, send: Send) -> bytes:
        """``response``'s body, with keep-alives until its first bytes: a relay handed over before its upstream body
        began (the forwarded routes' wait for it first, ``Relay.first_bytes``) would otherwise leave the client in
        silence for as long as a long prompt takes on a busy machine: seconds."""
        began = asyncio.Event()

        async def relay(message: Message) -> None:
            began.set()
            await send(message)

        body = asyncio.ensure_future(response._body(relay))
        try:
            while not began.is_set() and not body.done():
                first = asyncio.ensure_future(began.wait())
                await asyncio.wait({body, first}, timeout=self._every, return_when=asyncio.FIRST_COMPLETED)
                first.cancel()
                if not began.is_set() and not body.done():
                    await send({"type": "http.response.body", "body": self._beat(), "more_body": True})
            return await body
        finally:
            if not body.done():
                body.cancel()
                await asyncio.gather(body, return_exceptions=True)

    def first_byte_at(self) -> float | None:
        if not self._answer.done() or self._answer.cancelled() or self._answer.exception() is not None:
            return None
        response = self._answer.result()
        return response.first_byte_at() if isinstance(response, _Streamed) else None

    async def _close(self) -> None:
        if not self._answer.done() and self._detach:
            task = asyncio.ensure_future(_closed_when_answered(self._answer))
            _DETACHED.add(task)
            task.add_done_callback(_DETACHED.discard)
            return
        if not self._answer.done():
            self._answer.cancel()
            await asyncio.gather(self._answer, return_exceptions=True)
        if self._answer.cancelled() or self._answer.exception() is not None:
            return
        response = self._answer.result()
        if isinstance(response, _Streamed):
            await response._close()
