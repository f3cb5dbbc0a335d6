"""A chunked body handed to the C chunk pump (``studio/http/wire/_pump.c``), where it was built: no Python per chunk.

``Framed`` costs the event loop a wake and a Python callback for each relayed chunk; on a busy
machine that is most of what a stream costs the studio (``scripts/bench_proxy.py``'s CPU per chunk,
which the C floor beside it puts at two thirds of the Python floor's). Once the head and the first
bytes went on in Python, ``pump`` hands the two connections to the pump's thread, which writes each
arrival on as it came, checks its framing, waits for a client that is behind, and reports here,
on the loop's own thread, how the body ended (``PumpEnd``).

This is the one module that knows the extension. Without it (no C compiler at install, not Linux)
or where a connection is no socket, ``pump`` declines and ``Framed`` relays in Python, as before.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import NamedTuple

try:
    from studio.http.wire import _pump  # type: ignore[attr-defined]
except ImportError:  # not built: no compiler at install, or not Linux
    _pump = None


class PumpEnd(NamedTuple):
    """How a pumped body ended.

    ``how`` is ``"complete"`` (``end`` is the arrival that ended it, not written: the caller writes it with its
    own end), ``"broken"`` (the upstream closed or failed first: ``error``, an errno, 0 for a plain close),
    ``"garbled"`` (its framing was broken: that arrival was not written) or ``"client gone"`` (a write to the
    client failed: ``error``). ``between_chunks``: what was written ended between two chunks. ``first_at``: when
    the first bytes came (``time.perf_counter``'s clock), 0 if none did. ``before`` and ``last``: the last two
    arrivals written (or the end, when it carried payload).
    """

    how: str
    error: int
    between_chunks: bool
    first_at: float
    end: bytes
    before: bytes
    last: bytes


class _Channel:
    """One event loop's way to the pump: its results arrive on an eventfd the loop reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        assert _pump is not None
        self.pump = _pump.Pump()
        self.waiting: dict[int, Callable[[PumpEnd], None]] = {}
        loop.add_reader(self.pump.fileno(), self._drain)

    def _drain(self) -> None:
        for stream, how, error, between, first_at, end, before, last in self.pump.results():
            on_end = self.waiting.pop(stream, None)
            if on_end is not None:
                on_end(PumpEnd(how, error, bool(between), first_at, end, before, last))


_channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Channel] = weakref.WeakKeyDictionary()


def pump(
    upstream: asyncio.Transport,
    client: asyncio.WriteTransport,
    first_at: float | None,
    last: bytes,
    on_end: Callable[[PumpEnd], None],
) -> Callable[[], None] | None:
    """Pump the rest of ``upstream``'s chunked body, from a chunk boundary, onto ``client``; ``on_end`` is called
    on the loop once it ended. Returns what stops it (the relay cancelled); ``None``: it cannot be pumped (no
    pump, a connection that is no socket or is TLS, bytes still buffered for the client), so relay it in Python.

    ``first_at`` and ``last`` are what ``Framed`` has so far: when the first bytes came, and the last arrival
    written (the tail goes on from it).
    """
    if _pump is None:
        return None
    up_socket, client_socket = upstream.get_extra_info("socket"), client.get_extra_info("socket")
    if up_socket is None or client_socket is None or client.is_closing() or upstream.is_closing():
        return None
    if client.get_extra_info("ssl_object") is not None or upstream.get_extra_info("ssl_object") is not None:
        return None  # TLS: what goes over the socket is not the body's bytes
    if client.get_write_buffer_size():  # the pump's writes would overtake them
        return None
    loop = asyncio.get_running_loop()
    channel = _channels.get(loop)
    if channel is None:
        channel = _channels[loop] = _Channel(loop)
    upstream.pause_reading()  # the pump reads it from now on
    try:
        stream = channel.pump.add(up_socket.fileno(), client_socket.fileno(), first_at or 0.0, last)
    except OSError:
        upstream.resume_reading()
        return None
    channel.waiting[stream] = on_end

    def stop() -> None:
        if channel.waiting.pop(stream, None) is not None:
            channel.pump.cancel(stream)

    return stop
