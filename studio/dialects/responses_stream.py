"""OpenAI Responses streams as llama-server b11434 writes them, with the indexes OpenAI's clients read.

b11434's Responses events (``to_json_oaicompat_resp_stream`` and its final counterpart in
``tools/server/server-task.cpp``) name the item an event belongs to by ``item_id`` (or the ``item``
itself) only. OpenAI's also carry ``output_index`` (the item's place in the response's output),
``content_index`` (the part's place in its item) and ``sequence_number`` (the event's place in the
stream), and clients that build the response from its events read them: the OpenAI Python SDK's
``responses.stream()`` fails at the first text delta without ``content_index``. So each ``response.*``
event gets those it lacks, counted as OpenAI counts them: items in the order they are added, parts in
the order their ``content_part.added`` come, events from 0. A field llama-server sends is left as it
is, and so is everything else in the event: its ``event:`` line, other events (keep-alive comments,
an error), and bytes that are not JSON.
"""

from __future__ import annotations

from typing import Any

from studio.chat.sse import EventReshape, rewrite_data

#: The events about one part of an item's content: they take the part's ``content_index``.
_PART_EVENTS = ("response.content_part.", "response.output_text.", "response.reasoning_text.", "response.refusal.")


class ResponsesIndexes(EventReshape):
    """A ``studio.http.wire.relay.Reshape`` for a Responses stream: feed it upstream bytes, send what it returns."""

    def __init__(self) -> None:
        super().__init__()
        self._outputs: dict[object, int] = {}  # item id -> output_index
        self._parts: dict[object, int] = {}  # item id -> content parts added so far
        self._sequence = 0

    def rewrite(self, event: bytes) -> bytes:
        """A ``response.*`` event with the indexes it lacked; any other as it came."""
        return rewrite_data(event, self._indexed)

    def _indexed(self, payload: Any) -> bool:
        if not isinstance(payload, dict) or not str(payload.get("type", "")).startswith("response."):
            return False
        self._index(payload)
        return True

    def _index(self, payload: dict[str, Any]) -> None:
        """Add the ``sequence_number``, ``output_index`` and ``content_index`` that ``payload`` lacks."""
        kind: str = payload["type"]
        payload.setdefault("sequence_number", self._sequence)
        self._sequence += 1
        item = payload.get("item")
        item_id = item.get("id") if isinstance(item, dict) else payload.get("item_id")
        if item_id is None:
            return  # about the whole response
        if item_id not in self._outputs:
            self._outputs[item_id] = len(self._outputs)
        payload.setdefault("output_index", self._outputs[item_id])
        if kind.startswith(_PART_EVENTS):
            if kind == "response.content_part.added":
                self._parts[item_id] = self._parts.get(item_id, 0) + 1
            payload.setdefault("content_index", max(self._parts.get(item_id, 0) - 1, 0))
