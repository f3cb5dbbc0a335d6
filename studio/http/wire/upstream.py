"""A lean HTTP/1.1 client for the studio's own llama-servers on loopback: pooled connections, one write a request.

The proxy's added latency is its CPU time per request: on a small machine
llama-server's threads hold every core, so each millisecond the service spends
is a millisecond a token waits. httpx's own client and transport (httpcore on
anyio, h11 in pure Python) cost about as much per request as the rest of the
service together, and an ``httpx.Request`` alone (URL and header models, body
encoding) ~19 µs; so a request here is its bytes, built once (``_request``)
and written in one piece on a ``studio.http.wire.upstream_wire.Wire``, whose parser
reads the answer. Responses and errors stay ``httpx``'s (``httpx.Response``,
``httpx.HTTPError``), so the code that reads the answers does not change.

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
import functools
import time
from collections.abc import Awaitable, Mapping
from typing import NamedTuple, TypeVar
from urllib.parse import urlsplit

import httpx

from studio import json_codec
from studio.http.wire.upstream_wire import DEFAULT_IDLE, Wire, plainly

#: Seconds after a streamed answer during which a spare connection is kept ready, renewed before the server's
#: keep-alive timeout (5 s in b11434's cpp-httplib) would drop it: a person reading an answer and typing the next.
SPARE_WINDOW = 60.0
#: Seconds after it is made that a spare is replaced by a new one (within the window) or let go.
SPARE_LIFE = DEFAULT_IDLE - 0.5
#: Seconds for which a server's peak of simultaneous answers is remembered (one to two of them): as many spares are
#: renewed, so a fan-out starts on spares again at its next turn while a person chatting afterwards keeps one.
DEMAND_WINDOW = 10.0

T = TypeVar("T")
Origin = tuple[str, int]


class _Target(NamedTuple):
    """Where a URL's requests go: the server, the request target and the ``Host`` header."""

    origin: Origin
    path: bytes
    host: bytes


class Upstream:
    """Requests to llama-server over pooled connections: how the proxy, ``/api/chat`` and ``/metrics`` reach a model.

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
    no connection open. Only as many are renewed as the server's recent peak of
    simultaneous answers (``DEMAND_WINDOW``) asks for, less those running: each
    renewal is a new connection, and the 31 spares a fan-out of 32 left, which a
    person's one stream at a time never takes, cost the studio ~0.5 ms of CPU a
    second for the rest of the window. b11434's HTTP thread pool grows for
    connections beyond its fixed threads, so idle spares take no request's
    place. One the server dropped anyway is retried once on a new connection,
    as for any idle connection.

    Idle connections are kept per server, so models taking turns each keep
    theirs; a request takes only one to its own server.

    Args:
        max_connections: requests in flight at once (more wait for a free one),
            and idle connections kept, all servers together (the oldest goes first).
        connect_timeout: seconds to reach llama-server; an answer may take as long as it takes.
    """

    def __init__(self, *, max_connections: int = 64, connect_timeout: float = 10.0) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._max_idle = max_connections
        self._connect_timeout = connect_timeout
        self._targets: dict[str, _Target] = {}
        self._idle: dict[Origin, list[Wire]] = {}  # per server, oldest first
        self._spares: dict[Origin, list[asyncio.Task[Wire]]] = {}  # per server, oldest first
        self._spare_until: dict[Origin, float] = {}  # per server: when its spares stop being renewed
        self._demand: dict[Origin, _Demand] = {}  # per server: its POSTs running now and their recent peak
        self._renewals: set[asyncio.TimerHandle] = set()
        self._closed = False  # ``aclose`` ran: a response ending after it opens no spare

    async def post(self, url: str, body: object, headers: Mapping[str, str]) -> httpx.Response:
        """Send ``body`` as JSON and return the response once its head is in; the caller closes it.

        Raises:
            httpx.HTTPError: llama-server could not be reached or broke off.
        """
        return await self.send("POST", url, headers, body)

    async def send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: object = None,
        query: str = "",
        content: bytes | None = None,
    ) -> httpx.Response:
        """Send a request (``body`` as JSON, or ``content`` as it is; none) and return the response once its head
        is in. ``query`` is a raw query string passed on as it came. The caller closes the response.

        Raises:
            httpx.HTTPError: llama-server could not be reached, or broke off or garbled its answer's head.
        """
        target = self._target(url)
        request = _request(method, target, query, headers, body, content)
        return await self._exchange(target.origin, request, method == "POST", self._connect_timeout, None)

    async def get(self, url: str, headers: Mapping[str, str], *, timeout: float) -> bytes:
        """The body of a GET (llama-server's own ``/metrics``), each read within ``timeout`` seconds.

        Raises:
            httpx.HTTPError: no answer, a broken one, or one that is not a 200.
        """
        target = self._target(url)
        resp = await self._exchange(
            target.origin, _request("GET", target, "", headers, None, None), False, timeout, timeout
        )
        try:
            content = await resp.aread()
        finally:
            await resp.aclose()
        if resp.status_code != 200:
            raise httpx.HTTPStatusError(
                f"{url} answered {resp.status_code}", request=httpx.Request("GET", url), response=resp
            )
        return content

    async def aclose(self) -> None:
        """Close idle and spare connections; responses still open keep theirs until they are closed."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for wires in idle.values():
            for wire in wires:
                wire.close()
        for renewal in self._renewals:
            renewal.cancel()
        self._renewals.clear()
        self._spare_until.clear()
        self._demand.clear()
        spares = [opening for openings in self._spares.values() for opening in openings]
        self._spares = {}
        for opening in spares:
            opening.cancel()
        for result in await asyncio.gather(*spares, return_exceptions=True):
            if isinstance(result, Wire):
                result.close()

    def _target(self, url: str) -> _Target:
        """``url`` split once: a handful of URLs per model."""
        found = self._targets.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise httpx.UnsupportedProtocol(f"the studio reaches llama-server over plain http, not {url!r}")
            if len(self._targets) >= 64:  # old models' URLs
                self._targets.clear()
            port = parts.port or 80
            found = self._targets[url] = _Target(
                (parts.hostname, port), (parts.path or "/").encode(), f"{parts.hostname}:{port}".encode()
            )
        return found

    async def _exchange(
        self, origin: Origin, request: bytes, spare: bool, connect_timeout: float | None, read_timeout: float | None
    ) -> httpx.Response:
        """Send ``request`` on a connection to ``origin`` and return the response once its head is in.

        ``spare``: a connection this answer closes is replaced by a spare (a ``POST``: a chat, maybe streamed).
        """
        await self._slots.acquire()
        demand = self._demand_of(origin) if spare else None
        if demand is not None:
            demand.started()
        try:
            wire = self._take_idle(origin) or await self._take_spare(origin)
        except BaseException:
            self._unslot(demand)
            raise
        on_end = self._ended_then_spare if spare else self._ended
        try:
            while True:
                if wire is None:
                    wire = await _connect(origin, connect_timeout)
                answer = wire.ask(request, read_timeout=read_timeout, on_end=on_end)
                try:
                    await _timed(answer.head, read_timeout)
                    break
                except httpx.RemoteProtocolError:
                    wire.close()
                    if not wire.reused or answer.arrived:
                        raise
                    wire = None  # the server dropped an idle connection just now: once more, on a new one
        except BaseException as exc:
            if wire is not None:
                wire.close()  # mid-request: closing it is what tells llama-server to stop
            self._unslot(demand)
            if isinstance(exc, TimeoutError):
                raise httpx.ReadTimeout(f"no answer from llama-server within {read_timeout} s") from exc
            raise
        return httpx.Response(
            answer.status,
            headers=answer.headers,
            stream=answer,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": answer.reason},
        )

    def _ended(self, wire: Wire, reusable_for: float | None) -> None:
        """An answer was closed: its connection back to the pool (``reusable_for`` s) or closed; its slot freed."""
        if reusable_for is not None and reusable_for > 0:
            wire.reusable_until = time.monotonic() + reusable_for
            wire.idle()
            self._pool(wire)
        else:
            wire.close()
        self._slots.release()

    def _unslot(self, demand: _Demand | None) -> None:
        """A request that got no answer lets its slot go (and is no longer running, for its server's demand)."""
        if demand is not None:
            demand.ended()
        self._slots.release()

    def _demand_of(self, origin: Origin) -> _Demand:
        found = self._demand.get(origin)
        if found is None:
            found = self._demand[origin] = _Demand()
        return found

    def _ended_then_spare(self, wire: Wire, reusable_for: float | None) -> None:
        """``_ended``, and a closed connection is replaced by a spare (see the class docstring)."""
        demand = self._demand.get(wire.origin)
        if demand is not None:  # none once the upstream closed
            demand.ended()
        self._ended(wire, reusable_for)
        if reusable_for is None or reusable_for <= 0:
            self._spare_until[wire.origin] = time.monotonic() + SPARE_WINDOW
            self._open_spare(wire.origin)

    def _take_idle(self, origin: Origin) -> Wire | None:
        """The newest idle connection to ``origin`` (the likeliest still open); dead or expired ones are closed."""
        if not self._idle:
            return None
        self._prune()
        idle = self._idle.get(origin)
        if not idle:
            return None
        wire = idle.pop()
        if not idle:
            del self._idle[origin]
        wire.reused = True
        return wire

    def _prune(self) -> None:
        """Close the idle connections, any server's, that are dead or past their time: an unloaded model's too."""
        for origin, idle in list(self._idle.items()):
            kept = []
            for wire in idle:
                if wire.alive():
                    kept.append(wire)
                else:
                    wire.close()
            if kept:
                self._idle[origin] = kept
            else:
                del self._idle[origin]

    def _pool(self, wire: Wire) -> None:
        """Keep ``wire`` idle; at ``max_connections`` idle ones the oldest, whichever server's, is closed first."""
        if self._idle_count() >= self._max_idle:
            self._prune()
            if self._idle_count() >= self._max_idle:
                oldest = min(self._idle, key=lambda origin: self._idle[origin][0].reusable_until)
                idle = self._idle[oldest]
                idle.pop(0).close()
                if not idle:
                    del self._idle[oldest]
        self._idle.setdefault(wire.origin, []).append(wire)

    def _idle_count(self) -> int:
        return sum(map(len, self._idle.values()))

    async def _take_spare(self, origin: Origin) -> Wire | None:
        """A spare connection to ``origin`` if there is one and it is still fresh: an open one first.

        One still connecting is waited for: it is nearer done than a new one would be. The newest open one is
        taken, so that those a fan-out left age unused and their renewal lets them go once no longer wanted
        (taking the oldest, one stream every few seconds kept a dozen from ever reaching their renewal).
        """
        spares = self._spares.get(origin)
        if not spares:
            return None
        opening = next((task for task in reversed(spares) if task.done()), spares[0])
        self._forget_spare(origin, opening)
        if opening.done():
            wire = _made(opening)  # no wait: the usual case
        else:
            try:
                wire = await asyncio.shield(opening)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if opening.cancelled() and not (current and current.cancelling()):
                    return None  # the spare was cancelled (the upstream is closing), not this request
                opening.add_done_callback(_close_if_made)  # this request was cancelled: nobody takes the spare
                raise
            except OSError:
                return None  # the request connects itself, and says why if it cannot
        if wire is not None and wire.alive():
            return wire
        if wire is not None:
            wire.close()
        return None

    def _open_spare(self, origin: Origin) -> None:
        """Start opening one more spare connection to ``origin``, up to ``max_connections`` of them.

        One that cannot be made (the server is gone: an unloaded model's) is forgotten at once. None is opened once
        the upstream is closed (the app shutting down): nothing would close it.
        """
        if self._closed:
            return
        spares = self._spares.setdefault(origin, [])
        if len(spares) >= self._max_idle:
            return
        loop = asyncio.get_running_loop()

        async def opened() -> Wire:
            # Its error is nobody's (no request to name); the deadline below bounds it without an asyncio.timeout,
            # whose context costs a spare as much Python as the rest of its making.
            _, wire = await loop.create_connection(functools.partial(Wire, origin), *origin)
            wire.reused = True  # it waits idle: the server may drop it, and then a request retries on a new one
            wire.reusable_until = time.monotonic() + DEFAULT_IDLE
            renewal: asyncio.TimerHandle

            def renew() -> None:
                self._renewals.discard(renewal)
                self._renew_spare(origin, task)

            renewal = loop.call_later(SPARE_LIFE, renew)
            self._renewals.add(renewal)
            return wire

        def ended(done: asyncio.Task[Wire]) -> None:
            deadline.cancel()
            if _made(done) is None:  # no error: the next request connects itself, and says why if it cannot
                self._forget_spare(origin, done)

        task = asyncio.ensure_future(opened())
        deadline = loop.call_later(self._connect_timeout, task.cancel)
        task.add_done_callback(ended)
        spares.append(task)

    def _forget_spare(self, origin: Origin, opening: asyncio.Task[Wire]) -> bool:
        """Drop ``opening`` from ``origin``'s spares; return whether it was one (not yet taken or dropped)."""
        spares = self._spares.get(origin)
        if spares is None or opening not in spares:
            return False
        spares.remove(opening)
        if not spares:
            del self._spares[origin]
        return True

    def _renew_spare(self, origin: Origin, opening: asyncio.Task[Wire]) -> None:
        """An unused spare is near the server's keep-alive timeout: replace it within the window if the server's
        recent demand wants it, else let it go."""
        if not self._forget_spare(origin, opening):
            return  # taken by a request, or dropped
        _close_if_made(opening)
        demand = self._demand_of(origin)
        if time.monotonic() >= self._spare_until.get(origin, 0.0):
            self._spare_until.pop(origin, None)
            if not demand.running:
                del self._demand[origin]
        elif len(self._spares.get(origin, ())) < demand.wanted():
            self._open_spare(origin)


class _Demand:
    """A server's ``POST`` answers running now, and the most that ran at once lately: how many spares it wants."""

    def __init__(self) -> None:
        self.running = 0
        self._peak = 0  # the most at once since ``_since``
        self._peak_before = 0  # the most at once in the window before
        self._since = time.monotonic()

    def started(self) -> None:
        self._turn()
        self.running += 1
        self._peak = max(self._peak, self.running)

    def ended(self) -> None:
        self.running -= 1

    def wanted(self) -> int:
        """Spares worth keeping: the recent peak (at least one) less the answers running, each of which leaves a
        spare when it ends."""
        self._turn()
        return max(self._peak, self._peak_before, 1) - self.running

    def _turn(self) -> None:
        """Start a new window once one has passed: the peak then covers the last one to two windows."""
        now = time.monotonic()
        if now - self._since >= DEMAND_WINDOW:
            self._peak_before = self._peak if now - self._since < 2 * DEMAND_WINDOW else self.running
            self._peak = self.running
            self._since = now


def _request(
    method: str, target: _Target, query: str, headers: Mapping[str, str], body: object, content: bytes | None
) -> bytes:
    """The request line, headers and body, as one write: ``body`` as JSON, or ``content`` as it is, or none.

    Raises:
        httpx.LocalProtocolError: a header with a line break in it (it would forge the next header).
    """
    path = target.path + b"?" + query.encode("latin-1") if query else target.path
    lines = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode("ascii"), path, target.host)]
    for name, value in headers.items():
        line = f"{name}: {value}\r\n"
        if line.count("\r") != 1 or line.count("\n") != 1:
            raise httpx.LocalProtocolError(f"the header {name!r} has a line break in it")
        lines.append(line.encode("latin-1"))
    if body is not None:
        content = json_codec.dumps(body)
        lines.append(b"Content-Type: application/json\r\n")
    if content is not None:
        lines.append(b"Content-Length: %d\r\n\r\n" % len(content))
        lines.append(content)
    else:
        lines.append(b"\r\n")
    return b"".join(lines)


async def _connect(origin: Origin, timeout: float | None) -> Wire:
    """A new connection to ``origin``.

    Raises:
        httpx.ConnectTimeout, httpx.ConnectError: it cannot be made (in time).
    """
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            _, wire = await loop.create_connection(functools.partial(Wire, origin), *origin)
    except TimeoutError as exc:
        raise httpx.ConnectTimeout(f"no connection to {origin[0]}:{origin[1]} within {timeout} s") from exc
    except OSError as exc:
        raise httpx.ConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {plainly(exc)}") from exc
    return wire


async def _timed(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``await awaitable``, within ``timeout`` seconds unless that is ``None``."""
    if timeout is None:
        return await awaitable
    async with asyncio.timeout(timeout):
        return await awaitable


def _made(opening: asyncio.Task[Wire]) -> Wire | None:
    """The connection a finished ``opening`` made; ``None`` if it was cancelled or failed."""
    if opening.cancelled() or opening.exception() is not None:
        return None
    return opening.result()


def _close_if_made(opening: asyncio.Task[Wire]) -> None:
    """Close the connection ``opening`` made, if it made one (a done-callback)."""
    wire = _made(opening)
    if wire is not None:
        wire.close()
