"""The activity of one studio: the requests in flight, the recent records, the live subscribers, the writes.

A request's trace is kept once it ends (``end``), in a few steps on the event loop: in the recent records in
memory (what ``/api/activity`` answers first and ``ggstudio top`` shows), for the live subscribers
(``/api/activity/events``) and in the pending batch. What is derived from it (its client, llama-server's
timings, its phases for ``/metrics``, its database row) is worked out per batch, at most once a
``FLUSH_EVERY`` (a timer on the loop, no task per request), or sooner when a reader wants it (``select``,
``/metrics``): code run for a hundred traces in a row stays in the caches, and the request's path does not
run it. The batch then goes to the history store's writer thread, with the retention applied in the same
transaction: the request never waits for the disk. A studio without a history keeps its records in memory
only. One that makes none (``recording`` off: the config's ``activity_days = 0``) still reads and deletes
what was kept before.

Nothing of a request's body is kept unless a capture is on (``captures``): then its request and its
answer's bytes are, bounded by the retention's ``capture_bytes``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from studio.activity import store
from studio.activity.captures import CaptureSwitch
from studio.activity.loads import LoadTracker
from studio.activity.store import Capture, Retention
from studio.activity.trace import CURRENT, RequestTrace

if TYPE_CHECKING:
    from contextvars import Token

    from studio.history.service import History

log = structlog.get_logger(__name__)

#: Seconds between two batches handed to the database's writer (a read of the records hands it the batch first):
#: each commit writes the pages it touched again, so fewer, larger batches cost less.
FLUSH_EVERY = 5.0
#: Records kept in memory for the live views and the first page of ``/api/activity``.
RECENT = 1000
#: Events a live subscriber may fall behind by before it is dropped (it reconnects and reads again).
SUBSCRIBER_BACKLOG = 1000

#: Told of every finished request, with its trace, once its batch is settled (``/metrics`` observes the phases).
RequestListener = Callable[[RequestTrace], None]
#: What the recent records and the batch hold: a finished request's trace, or a load's (eviction's...) record.
Kept = RequestTrace | dict[str, Any]


class Activity:
    """See the module docstring; the app makes one (``app.state.activity``) around its manager and history."""

    def __init__(
        self,
        manager: Any,
        history: History | None = None,
        *,
        retention: Retention | None = None,
        flush_every: float = FLUSH_EVERY,
        recording: bool = True,
    ) -> None:
        self.manager = manager
        self.history = history
        self.retention = retention or Retention()
        self.flush_every = flush_every
        self.recording = recording
        self.captures = CaptureSwitch()
        self.in_flight: dict[str, RequestTrace] = {}
        self.recent: deque[Kept] = deque(maxlen=RECENT)
        self.listeners: list[RequestListener] = []
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._prefix = os.urandom(3).hex()
        self._ids = itertools.count(1)
        self._pending: list[Kept] = []
        self._pending_captures: list[Capture] = []
        self._flush: asyncio.TimerHandle | None = None
        self.tracker = LoadTracker(manager, self._add, self.new_id)
        if recording:
            manager.listeners.append(self.tracker.on_event)

    def new_id(self) -> str:
        """A record id: unique in this studio's lifetime, and across restarts by its random prefix."""
        return f"{self._prefix}-{next(self._ids)}"

    # -- a request ---------------------------------------------------------------------------------

    def begin(
        self, headers: Mapping[bytes, bytes] | list[tuple[bytes, bytes]], route: str, dialect: str, *, generates: bool
    ) -> tuple[RequestTrace, Token[RequestTrace]]:
        """Start the trace of a request that just arrived, and make it the current one (``CURRENT``)."""
        trace = RequestTrace(
            self.new_id(), route, dialect, None, None, None, generates, time.perf_counter(), time.time()
        )
        trace.headers = headers
        self.in_flight[trace.id] = trace
        if self._subscribers:
            self._publish({"type": "begin", "request": self.live(trace)})
        return trace, CURRENT.set(trace)

    def end(self, trace: RequestTrace, token: Token[RequestTrace] | None = None) -> None:
        """The request is over: keep its trace (memory, the next batch) and tell the subscribers.

        Nothing is derived from it here (see the module docstring): the listeners hear of it with its batch.
        """
        if token is not None:
            CURRENT.reset(token)
        self.in_flight.pop(trace.id, None)
        if trace.ended is None:
            trace.ended = time.perf_counter()
        trace.probe = None  # the probe holds the response: kept, it kept the whole exchange alive
        for wait in trace.waits or ():  # each load it waited for: the one of its model that ended meanwhile
            if wait[0] == "load":
                found = self.tracker.load_during(wait[3], wait[1], wait[2] if wait[2] is not None else trace.ended)
                if found is not None:
                    wait[4], trace.load = found["id"], found
        if trace.request_body is not None:
            captured = self.captures.take(trace)
            if captured is not None:
                self._pending_captures.append(captured)
        self._add(trace)

    def live(self, trace: RequestTrace) -> dict[str, Any]:
        """A request in flight as the live views show it: its phase now and since when."""
        now = time.perf_counter()
        first = trace.first_byte_now()
        waiting = trace.waits[-1] if trace.waits and trace.waits[-1][2] is None else None
        if trace.acquired is None:
            phase = "loading" if waiting and waiting[0] == "load" else "queued"
        elif trace.sent is None:
            phase = "queued"
        elif first is None:
            phase = "prefill"
        else:
            phase = "decode"
        return {
            "id": trace.id,
            "route": trace.route,
            "model": trace.model or trace.asked,
            "client": trace.client(),
            "phase": phase,
            "arrived": trace.wall0,
            "seconds": now - trace.arrived,
            "times": {
                "acquired": trace.wall(trace.acquired),
                "sent": trace.wall(trace.sent),
                "first_byte": trace.wall(first),
            },
            "retries": len(trace.retried_after),
            "outcome": "in_flight",
        }

    # -- records, subscribers, batches -------------------------------------------------------------

    def _add(self, record: Kept) -> None:
        self.recent.append(record)
        if self._subscribers:
            self._publish({"type": "record", "record": as_record(record)})
        self._pending.append(record)
        if self._flush is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a residency event from outside the loop (a supervisor's thread): next time
                return
            self._flush = loop.call_later(self.flush_every, self.flush)

    def flush(self) -> None:
        """Settle the pending batch (each request's trace finished, the listeners told) and hand it to the
        database's writer (it runs it on its thread; nothing waits here)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        records, self._pending = self._pending, []
        listeners = self.listeners
        for kept in records:
            if isinstance(kept, RequestTrace):
                kept.finish()
                for listener in listeners:
                    listener(kept)
        if self.history is None or not (records or self._pending_captures):
            self._pending_captures.clear()
            return
        captures, self._pending_captures = self._pending_captures, []
        future = self.history.submit(store.write_batch, records, captures, self.retention, time.time())
        future.add_done_callback(_log_failure)

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        """A queue of live events (``begin``, ``record``); ``unsubscribe`` it when done."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SUBSCRIBER_BACKLOG)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(queue)

    def _publish(self, event: dict[str, Any]) -> None:
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:  # a reader that stopped reading: it is dropped, not waited for
                self._subscribers.discard(queue)

    # -- reading -----------------------------------------------------------------------------------

    async def select(self, query: store.Query) -> list[dict[str, Any]]:
        """The records matching ``query``: from the database (with what is not written yet), else from memory."""
        if self.history is None or self.history.problem is not None:
            found = (as_record(r) for r in reversed(self.recent))
            return [r for r in found if matches(r, query)][: query.limit]
        self.flush()
        await self.history.write(lambda _c: None)  # the writer has run the batch just handed to it
        return await self.history.read(store.select, query)

    async def delete(self, before: float | None) -> int:
        """Delete the records (and captures) begun before ``before`` (all: ``None``); return how many were stored."""
        self.flush()  # the batch is written (and its listeners told) before the delete, on the same writer
        if before is None:
            self.recent.clear()
        else:
            kept = [r for r in self.recent if _started(r) >= before]
            self.recent.clear()
            self.recent.extend(kept)
        if self.history is None:
            return 0
        return await self.history.write(store.delete_all, before)


def as_record(kept: Kept) -> dict[str, Any]:
    """A kept item as ``/api/activity`` shows it (a request's trace becomes its record here)."""
    if isinstance(kept, RequestTrace):
        record = kept.record()
        record["captured"] = kept.captured
        return record
    return kept


def matches(record: dict[str, Any], query: store.Query) -> bool:
    """Whether ``record`` passes ``query``'s filters (the in-memory twin of ``store.select``)."""
    if query.model is not None and record.get("model") != query.model:
        return False
    if query.route is not None and record.get("route") != query.route:
        return False
    if query.kind is not None and record.get("kind") != query.kind:
        return False
    filed = "retried" if record.get("retries") and record.get("outcome") != "error" else record.get("outcome")
    if query.outcome is not None and filed != query.outcome:
        return False
    started = _started(record)
    ended = (record.get("times") or {}).get("ended") or started
    if query.since is not None and ended < query.since:
        return False
    return query.until is None or started <= query.until


def _started(record: Kept) -> float:
    if isinstance(record, RequestTrace):
        return record.wall0
    times = record.get("times") or {}
    return float(times.get("arrived") or times.get("began") or 0.0)


def _log_failure(future: Any) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("activity records could not be written", error=str(exc))
