"""A stream's body chunks written straight to the client's connection, past uvicorn's ``send``.

uvicorn's ``send`` for each chunk of a chunked response checks the response's state, frames the
chunk and writes it; driving that coroutine from the upstream's callback (``studio.http.relay``)
cost several µs of the ~20 µs of Python a relayed chunk took (``scripts/bench_proxy.py``'s CPU per
chunk). Once the response has started with chunked framing, the body's chunks are nothing but
``<size>\\r\\n<bytes>\\r\\n`` on the connection, so the relay writes them itself, with uvicorn's own
flow control (a client that reads slower than the model writes is waited for), and ends the body
through ``send`` as before, which writes the last chunk and lets uvicorn finish the request.

This is the one module that knows uvicorn's objects (its httptools protocol's per-request
``RequestResponseCycle``, whose bound ``send`` the server hands the app); under any other server,
protocol or framing ``chunk_writer`` finds none and the relay sends through ``send``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

#: Writes one body chunk; returns what to await before the next while the client is behind, if it is.
ChunkWriter = Callable[[bytes], Awaitable[None] | None]


def chunk_writer(send: Send) -> ChunkWriter | None:
    """A writer of body chunks on the connection under the server's own ``send``, once its response started
    chunked; ``None``: send through ``send``.

    A closure over the connection's transport and flow control: it runs once per relayed chunk, where
    every attribute looked up is paid again. A client that is gone is written nothing: its disconnect
    ends the stream (``studio.http.relay.until_client_leaves``).
    """
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle:
        return None
    if not cycle.response_started or cycle.response_complete or not cycle.chunked_encoding:
        return None
    if cycle.scope["method"] == "HEAD":
        return None
    write, flow = cycle.transport.write, cycle.flow

    def write_chunk(data: bytes) -> Awaitable[None] | None:
        if cycle.disconnected:
            return None
        write(b"%x\r\n%s\r\n" % (len(data), data))
        return flow.drain() if flow.write_paused else None

    return write_chunk
