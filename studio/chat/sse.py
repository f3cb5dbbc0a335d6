"""Server-sent events as llama-server writes them: ``data: <json>`` lines, each event ended by a blank line.

b11434 writes every event as ``data: ...\\n\\n`` (``format_oai_sse`` in
``tools/server/server-common.cpp``), keep-alive pings as ``:\\n\\n`` and the end as
``data: [DONE]\\n\\n``; the splitter keeps each event's bytes exactly as they came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from studio import json_codec

DONE = b"data: [DONE]"


class EventSplitter:
    """Cuts a byte stream into whole events, however the bytes arrive."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The events completed by ``data``, each with its terminating blank line."""
        self._buf += data
        events = []
        while (end := self._buf.find(b"\n\n")) != -1:
            events.append(self._buf[: end + 2])
            self._buf = self._buf[end + 2 :]
        return events

    def holding(self) -> bool:
        """Whether bytes of an event that has not ended yet are held."""
        return bool(self._buf)

    def rest(self) -> bytes:
        """Bytes of an event that never ended (the stream broke off)."""
        rest, self._buf = self._buf, b""
        return rest


class EventReshape:
    """A ``studio.http.wire.relay.Reshape`` that sends each whole event through ``rewrite``: an event cut across
    arrivals waits for its end, and the bytes of one that never ends go on as they came."""

    def __init__(self) -> None:
        self._split = EventSplitter()

    def feed(self, data: bytes) -> bytes:
        """The whole events ``data`` completes, each as ``rewrite`` gives it."""
        return b"".join(self.rewrite(event) for event in self._split.feed(data))

    def close(self) -> bytes:
        """Bytes of an event that never ended (the upstream broke off): as they came."""
        return self._split.rest()

    def finish(self) -> bytes:
        """What is held at a whole stream's end: no more than at a broken one's."""
        return self.close()

    def rewrite(self, event: bytes) -> bytes:
        """What the client gets for one whole event."""
        raise NotImplementedError


def rewrite_data(event: bytes, change: Callable[[Any], bool]) -> bytes:
    """``event`` with its ``data:`` JSON written anew once ``change`` changed it in place (it says whether it did);
    as it came otherwise, and when it has no data line or the data is not JSON."""
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:"):
            try:
                payload = json_codec.loads(line[5:])
            except ValueError:
                return event
            if not change(payload):
                return event
            lines[i] = b"data: " + json_codec.dumps(payload)
            return b"\n".join(lines)
    return event


def event_json(event: bytes) -> Any:
    """The JSON payload of a one-line ``data:`` event, or ``None`` (a ping, ``[DONE]``, anything else)."""
    line = event.rstrip(b"\n")
    if not line.startswith(b"data:") or b"\n" in line or line == DONE:
        return None
    try:
        return json_codec.loads(line[5:])
    except ValueError:
        return None


def encode(payload: Any) -> bytes:
    """One ``data:`` event, compact as llama-server writes them."""
    return b"data: " + json_codec.dumps(payload) + b"\n\n"
