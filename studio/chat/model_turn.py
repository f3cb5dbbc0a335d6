"""One model turn for ``/api/chat``: llama-server's chat stream as GUI events, then the whole turn.

``read_turn`` yields ``content``, ``reasoning`` and ``tool_call`` events as the
deltas arrive (healed first when the request offered tools, so markup never
reaches the GUI as text), and last a ``Turn``: the full text, the whole tool calls,
``finish_reason``, ``usage`` and ``timings``. An error answer, an error event or a
broken stream raise ``TurnError`` in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from studio.chat.sse import EventSplitter, event_json
from studio.chat.think_split import ThinkSplitter
from studio.chat.tool_healing import ChunkHealer
from studio.errors import AnsweredError, error_body, error_in
from studio.http.wire.upstream_wire import body_reader


@dataclass
class Turn:
    """What the model said in one call."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's whole calls: id, type, function
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None

    def as_message(self) -> dict[str, Any]:
        """The turn as the assistant message that goes back into the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class TurnError(AnsweredError):
    """llama-server answered with an error (``error`` in OpenAI's shape) or went away."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(
            str(error.get("message") or "the model call failed"),
            status=status,
            type=error.get("type"),
            param=error.get("param"),
            code=error.get("code"),
        )
        self.error = error


async def read_turn(
    resp: httpx.Response, tools: dict[str, dict[str, Any]] | None, *, split_think: bool = False
) -> AsyncIterator[dict[str, Any] | Turn]:
    """GUI events for ``resp`` (a streamed chat completion), then its ``Turn``; healed when ``tools``.

    ``split_think``: the template always thinks but llama-server cannot tell where
    (``studio.chat.think_split``); a ``<think>`` block opening the content is reasoning.

    Raises:
        TurnError: an error answer, an error event, or the stream broke off.
    """
    if resp.status_code != 200:
        try:
            error = error_in(await resp.aread())
        except httpx.HTTPError:
            error = None
        raise TurnError(resp.status_code, error or {"message": f"llama-server answered {resp.status_code}"})
    turn = Turn()
    calls: dict[int, dict[str, Any]] = {}
    healer = ChunkHealer(tools) if tools else None
    splitter = ThinkSplitter() if split_think else None
    events, read = EventSplitter(), body_reader(resp)
    try:
        while data := await read():  # each event parsed once, as soon as it is whole (no line decoder)
            for raw in events.feed(data):
                chunk = event_json(raw)
                if not isinstance(chunk, dict):
                    continue  # a ping, [DONE]
                if "error" in chunk:
                    raise TurnError(
                        500, chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                    )
                if splitter is not None:
                    chunk = _split(chunk, splitter)
                made = healer.feed(chunk) if healer else None
                for part in [chunk] if made is None else made:  # [] when everything in it is held back
                    for event in _take(part, turn, calls):
                        yield event
        for part in healer.finish() if healer else ():
            for event in _take(part, turn, calls):
                yield event
    except httpx.HTTPError as exc:
        raise TurnError(
            502, error_body(f"llama-server went away mid-stream: {exc}", "upstream_error")["error"]
        ) from exc
    turn.tool_calls = [calls[i] for i in sorted(calls)]
    yield turn


def _split(chunk: dict[str, Any], splitter: ThinkSplitter) -> dict[str, Any]:
    """``chunk`` with an opening think block's text moved from ``content`` to ``reasoning_content``."""
    choices = []
    for choice in chunk.get("choices") or ():
        delta = dict(choice.get("delta") or {})
        reasoning, content = splitter.feed(delta["content"]) if isinstance(delta.get("content"), str) else ("", None)
        if choice.get("finish_reason") is not None:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, (content or "") + more_content
        if content is not None:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = (delta.get("reasoning_content") or "") + reasoning
        choices.append({**choice, "delta": delta})
    return {**chunk, "choices": choices} if choices else chunk


def _take(chunk: dict[str, Any], turn: Turn, calls: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold one chunk into ``turn``; return its GUI events."""
    turn.usage = chunk.get("usage") or turn.usage
    turn.timings = chunk.get("timings") or turn.timings
    events = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            turn.reasoning += delta["reasoning_content"]
            events.append({"type": "reasoning", "text": delta["reasoning_content"]})
        if delta.get("content"):
            turn.content += delta["content"]
            events.append({"type": "content", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            events.append({**call, "type": "tool_call"})  # the delta's own "type" is "function"
            whole = calls.setdefault(
                call.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            whole["id"] = call.get("id") or whole["id"]
            function = call.get("function") or {}
            whole["function"]["name"] += function.get("name") or ""
            whole["function"]["arguments"] += function.get("arguments") or ""
        turn.finish_reason = choice.get("finish_reason") or turn.finish_reason
    return events
