"""The healing relay of a streamed chat answer: llama-server's SSE bytes in, healed SSE bytes out.

Used only when the request offered ``tools``; other streams pass through as
bytes. Events the healer leaves alone go out as the exact bytes that came in.
"""

from __future__ import annotations

from typing import Any

from studio.chat.sse import DONE, EventSplitter, encode, event_json
from studio.chat.tool_healing import ChunkHealer


class HealingRelay:
    """Feed it upstream bytes as they arrive; send what it returns (see the module docstring)."""

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self._split = EventSplitter()
        self._healer = ChunkHealer(tools)

    def feed(self, data: bytes) -> bytes:
        """Bytes to send now for ``data``: whole events only, held markup kept back."""
        out = []
        for event in self._split.feed(data):
            payload = event_json(event)
            if event.rstrip(b"\n") == DONE or (isinstance(payload, dict) and "error" in payload):
                out += [encode(c) for c in self._healer.finish()]
                out.append(event)
            elif isinstance(payload, dict):
                made = self._healer.feed(payload)
                out += [event] if made is None else [encode(c) for c in made]
            else:
                out.append(event)
        return b"".join(out)

    def close(self) -> bytes:
        """What is still held when the upstream stream ends or breaks off."""
        return b"".join(encode(c) for c in self._healer.finish()) + self._split.rest()

    finish = close  # a whole stream's end holds nothing more than a broken one's
