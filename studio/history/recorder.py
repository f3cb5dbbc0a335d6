"""A chat turn stored as it happens: the user's message before the model runs, the answer while it streams.

``begin_turn`` stores the user's message and an empty answer marked ``cut`` in one write, so
two tabs on one conversation get question-answer pairs in the order the studio received
them. ``recorded`` then passes the chat's events through and saves the answer so far at most
every ``SAVE_EVERY`` seconds (or ``SAVE_CHUNKS`` events): a disconnect, a Stop or a crash of
the studio leaves what was streamed, still ``cut``; only the ``done`` event clears the mark.

Saving never holds the chat up: writes go to the store's writer thread, and a failed one (a
full disk) becomes one ``history`` event for the page, while the answer goes on.
"""

from __future__ import annotations

import binascii
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from studio.error_table import outcome
from studio.errors import HistoryError
from studio.history import store
from studio.history.service import History

log = structlog.get_logger(__name__)

#: Seconds between two saves of a streaming answer, and events between two at the most.
SAVE_EVERY = 0.5
SAVE_CHUNKS = 64
#: Seconds the final save of an answer may hold up its ``done`` event.
FINAL_SAVE_TIMEOUT = 10.0
#: Body fields that are the conversation, not its settings.
_NOT_OPTIONS = frozenset({"model", "messages", "stream", "stream_options", "conversation_id"})
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+);base64,(?P<data>.*)", re.S)


@dataclass(frozen=True)
class Turn:
    """Where one turn is stored: its conversation and the id of its answer's row."""

    conversation_id: str
    answer_id: int


async def begin_turn(
    history: History, conversation_id: str, body: Mapping[str, Any], model: str, load: Mapping[str, Any]
) -> Turn:
    """Store the turn's user message (its images by hash) and an empty, cut answer; record the model and settings.

    Raises:
        ConversationNotFoundError: no conversation has that id.
        HistoryError: the store cannot be used or written (the caller answers anyway).
    """
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    stored: list[dict[str, Any]] = []
    if last.get("role") == "user":
        text, attachments = await _user_content(history, last.get("content"))
        stored.append({"role": "user", "content": text, "attachments": attachments})
    stored.append({"role": "assistant", "cut": True})
    options = {k: v for k, v in body.items() if k not in _NOT_OPTIONS}
    system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
    if isinstance(system, str):
        options["system"] = system
    changes = {"model": model, "load": dict(load), "options": options}
    rows = await history.write(_begin, conversation_id, changes, stored)
    return Turn(conversation_id, rows[-1]["id"])


def _begin(
    conn: sqlite3.Connection, cid: str, changes: dict[str, Any], messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    store.update_conversation(conn, cid, changes)
    return store.append_messages(conn, cid, messages)


async def _user_content(history: History, content: Any) -> tuple[str, list[dict[str, Any]]]:
    """A user message's text, and its inline images stored once each by content hash."""
    if isinstance(content, str):
        return content, []
    texts, attachments = [], []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, Mapping):
            continue
        if part.get("type") == "text":
            texts.append(str(part.get("text") or ""))
        elif part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url") or ""
            found = _DATA_URL.fullmatch(url)
            if found is None:
                continue  # a remote URL: the model fetched it; nothing to keep
            try:
                digest = await history.store_attachment(found["data"], found["type"])
            except (binascii.Error, ValueError):
                continue  # not base64: the media preflight refuses these before this is reached
            attachments.append({"hash": digest, "media_type": found["type"]})
    return "\n".join(texts), attachments


@dataclass
class _Answer:
    """The answer so far, as it will be stored."""

    content: str = ""
    reasoning: str = ""
    tool_calls: dict[Any, dict[str, Any]] = field(default_factory=dict)
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    ended: bool = False

    def add(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind == "content":
            self.content += event.get("text") or ""
        elif kind == "reasoning":
            self.reasoning += event.get("text") or ""
        elif kind == "tool_call":  # a delta of a call the page is to run
            empty = {"id": None, "name": "", "arguments": ""}
            call = self.tool_calls.setdefault(("delta", event.get("index", 0)), empty)
            call["id"] = call["id"] or event.get("id")
            function = event.get("function") or {}
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""
        elif kind == "tool_start":  # a call the studio runs
            key = ("run", len(self.tool_calls))
            self.tool_calls[key] = {k: event.get(k) for k in ("id", "name", "arguments")}
        elif kind == "tool_end":
            self.tool_results.append({k: v for k, v in event.items() if k != "type"})
        elif kind == "done":
            self.usage = event.get("usage")
            self.timings = {
                **(event.get("timings") or {}),
                "tokens_per_second": event.get("tokens_per_second"),
                "finish_reason": event.get("finish_reason"),
            }
            self.ended = True

    def row(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "reasoning": self.reasoning,
            "tool_calls": list(self.tool_calls.values()),
            "tool_results": self.tool_results,
            "usage": self.usage,
            "timings": self.timings,
            "cut": not self.ended,
        }

    @property
    def empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)


async def recorded(
    events: AsyncIterator[dict[str, Any]], history: History | None, turn: Turn | None, problem: HistoryError | None
) -> AsyncIterator[dict[str, Any]]:
    """``events`` as they come, the answer saved along the way; ``history`` events where saving failed.

    Without a ``turn`` (it could not be stored: ``problem`` says why) the events pass as they are, after one
    ``history`` event.
    """
    if history is None or turn is None:
        if problem is not None:
            yield _unsaved(problem)
        async for event in events:
            yield event
        return
    answer, pending = _Answer(), None
    last_save, since = time.monotonic(), 0
    told = False
    try:
        async for event in events:
            answer.add(event)
            since += 1
            failed = _failure(pending)
            if failed is not None and not told:
                told = True
                yield _unsaved(failed)
            if event.get("type") in ("done", "error"):
                final = await _final_save(history, turn, answer)
                if final is not None and not told:
                    told = True
                    yield _unsaved(final)
            elif (since >= SAVE_CHUNKS or time.monotonic() - last_save >= SAVE_EVERY) and (
                pending is None or pending.done()
            ):
                pending = history.submit(store.update_message, turn.answer_id, answer.row())
                last_save, since = time.monotonic(), 0
            yield event
    finally:
        if not answer.ended:  # cut: a disconnect, a Stop, an error; queued even when this task is cancelled
            history.submit(_cut, turn.answer_id, answer.row(), answer.empty)
        await events.aclose()  # type: ignore[attr-defined]


async def _final_save(history: History, turn: Turn, answer: _Answer) -> HistoryError | None:
    """Save the answer as it ended (``done``: no longer cut); the error if that failed."""
    if not answer.ended:
        return None  # an error event: the ``finally`` stores it as cut
    try:
        with anyio.fail_after(FINAL_SAVE_TIMEOUT):
            await history.write(store.update_message, turn.answer_id, answer.row())
    except HistoryError as exc:
        return exc
    except TimeoutError:
        return HistoryError(f"the chat history took more than {FINAL_SAVE_TIMEOUT:g} s to save; the disk may be stuck")
    return None


def _cut(conn: sqlite3.Connection, answer_id: int, row: dict[str, Any], empty: bool) -> None:
    """Store a cut answer as streamed so far; one cut before its first word is not kept (the question is)."""
    if empty:
        store.delete_message(conn, answer_id)
    else:
        store.update_message(conn, answer_id, row)


def _failure(pending: Future[None] | None) -> HistoryError | None:
    if pending is None or not pending.done():
        return None
    exc = pending.exception()
    if exc is not None and not isinstance(exc, HistoryError):
        log.error("history save failed", error=repr(exc))
        return HistoryError(f"the chat history could not be saved: {exc}")
    return exc


def _unsaved(exc: HistoryError) -> dict[str, Any]:
    """The event that tells the page this answer is not (all) stored."""
    return {"type": "history", "saved": False, "message": exc.message, "code": outcome(exc).code}
