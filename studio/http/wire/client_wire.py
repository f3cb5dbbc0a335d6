"""A stream's body written straight to the client's connection, past uvicorn's ``send``.

uvicorn's ``send`` for each chunk of a chunked response checks the response's state, frames the
chunk and writes it; driving that coroutine from the upstream's callback (``studio.http.wire.relay``)
cost several µs of the ~20 µs of Python a relayed chunk took (``scripts/bench_proxy.py``'s CPU per
chunk). Once the response has started with chunked framing, the body's chunks are nothing but
``<size>\\r\\n<bytes>\\r\\n`` on the connection, so the relay writes them itself, with uvicorn's own
flow control (a client that reads slower than the model writes is waited for), and ends the body
through ``send`` as before, which writes the last chunk and lets uvicorn finish the request.
A chunked upstream body can go on as it came, framing and all (``write_framed``): then its own
last chunk ends it, and ``send`` only finishes the request.

This is the one module that knows uvicorn's objects (its httptools protocol's per-request
``RequestResponseCycle``, whose bound ``send`` the server hands the app); under any other server,
protocol or framing ``client_wire`` finds none and the relay sends through ``send``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

#: Writes body bytes; returns what to await before the next while the client is behind, if it is.
ChunkWriter = Callable[[bytes], Awaitable[None] | None]


class ClientWire:
    """The client's connection under a response that started chunked: its body written on it directly.

    ``write_chunk`` frames a payload as one chunk; ``write_framed`` writes bytes that are chunked already.
    Each is a closure over the connection's transport and flow control: it runs once per relayed chunk,
    where every attribute looked up is paid again. A client that is gone is written nothing: its
    disconnect ends the stream (``studio.http.wire.relay.until_client_leaves``).
    """

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        #: the connection, and its write flow control, for a relay that writes on it itself (``Framed``)
        self.transport, self.flow = cycle.transport, cycle.flow
        write, flow = cycle.transport.write, cycle.flow

        def write_chunk(data: bytes) -> Awaitable[None] | None:
            if cycle.disconnected:
                return None
            write(b"%x\r\n%s\r\n" % (len(data), data))
            return flow.drain() if flow.write_paused else None

        def write_framed(data: bytes) -> Awaitable[None] | None:
            if cycle.disconnected:
                return None
            write(data)
            return flow.drain() if flow.write_paused else None

        self.write_chunk: ChunkWriter = write_chunk
        self.write_framed: ChunkWriter = write_framed

    def ended_framed(self) -> None:
        """What ``write_framed`` wrote ended the body (its last chunk): the ``send`` ending the response adds none."""
        self._cycle.chunked_encoding = False  # a body of no bytes left to write: uvicorn only finishes the request

    def broken_framed(self) -> None:
        """What ``write_framed`` wrote stopped inside a chunk: the ``send`` that ends the response adds nothing and
        closes the connection, so the client sees the body broken off (anything more would be read as that chunk's)."""
        self._cycle.chunked_encoding = False
        self._cycle.keep_alive = False


def client_wire(send: Send) -> ClientWire | None:
    """The client's connection under the server's own ``send``, once its response started chunked; ``None``: send
    through ``send``."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle:
        return None
    if not cycle.response_started or cycle.response_complete or not cycle.chunked_encoding:
        return None
    if cycle.scope["method"] == "HEAD":
        return None
    return ClientWire(cycle)
