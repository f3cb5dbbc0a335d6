"""Load and eviction records, built from the manager's ``ResidencyEvent`` stream (no hook in the manager).

The manager tells every listener what changed (``kind``, ``model``, ``seconds``, ``reason``; and, where its
events carry them, the ``old`` and ``new`` states). A load evicts its victims just before it starts its own
llama-server, in the same task, so the evictions made "to make room" (reason ``evicted``) since the last
load began belong to the next load that comes up: that is how a load's record names the evictions it caused
and its steps' durations (each eviction's stop, then the start). At a ``loaded`` event the resident is
ready, so its plan and its memory, predicted and actual, are read then (``studio.views.residency``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from studio.views.residency import resident_json

log = structlog.get_logger(__name__)

#: Load records kept in memory for the requests that waited on them to find theirs.
RECENT_LOADS = 64

_KINDS = {"loaded": "load", "load_failed": "load", "evicted": "eviction", "crashed": "crash", "restarted": "restart"}


class _Event(Protocol):
    kind: str
    model: str
    seconds: float
    reason: str


class _Manager(Protocol):
    def find(self, model: str) -> Any: ...


class LoadTracker:
    """Turns residency events into records (handed to ``emit``) and remembers recent loads for the requests."""

    def __init__(self, manager: _Manager, emit: Callable[[dict[str, Any]], None], new_id: Callable[[], str]) -> None:
        self.manager = manager
        self.emit = emit
        self.new_id = new_id
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_LOADS)
        self._evicted: list[dict[str, Any]] = []  # evictions to make room, not yet claimed by a load

    def on_event(self, event: _Event) -> None:
        """The manager's listener: never raises (a bug here must not break a state change)."""
        try:
            self._record(event)
        except Exception:
            log.exception("an activity record of a residency event failed", kind=event.kind, model=event.model)

    def _record(self, event: _Event) -> None:
        now, wall = time.perf_counter(), time.time()
        kind = _KINDS.get(event.kind, event.kind)
        record: dict[str, Any] = {
            "kind": kind,
            "id": self.new_id(),
            "model": event.model,
            "event": event.kind,
            "reason": event.reason or None,
            "seconds": event.seconds,
            "times": {"began": wall - event.seconds, "ended": wall},
            "old": _state(getattr(event, "old", None)),
            "new": _state(getattr(event, "new", None)),
            "outcome": "finished" if event.kind != "load_failed" else (event.reason or "error"),
        }
        if event.kind == "evicted":
            if event.reason == "evicted":
                self._evicted.append(record)
            self.emit(record)
            return
        if kind == "load":
            began = now - event.seconds
            evictions, self._evicted = self._evicted, []
            steps = [{"step": f"evict {e['model']}", "seconds": e["seconds"]} for e in evictions]
            steps.append({"step": "start", "seconds": event.seconds})
            if evictions:  # the load began with its first eviction
                began -= sum(e["seconds"] for e in evictions)
                record["times"]["began"] = min(e["times"]["began"] for e in evictions)
            record["evicted"] = [e["model"] for e in evictions]
            record["eviction_ids"] = [e["id"] for e in evictions]
            record["steps"] = steps
            if event.kind == "loaded":
                record.update(self._resident_summary(event.model))
            self.recent.append({**record, "began_at": began, "ended_at": now})
        self.emit(record)

    def _resident_summary(self, model: str) -> dict[str, Any]:
        """The plan in brief and the memory, predicted and actual, of the resident just loaded."""
        resident = self.manager.find(model)
        if resident is None:
            return {}
        found = resident_json(resident)
        memory = found.get("memory") or {}

        def total(kind: str) -> dict[str, Any] | None:
            bill = memory.get(kind)
            return None if not bill else {"total": bill.get("total"), "by_device": bill.get("by_device")}

        return {
            "plan": {
                "context": found.get("effective_context"),
                "offload": found.get("offload"),
                "speculative": (found.get("speculative") or {}).get("resolved"),
                "cache_type_kv": found.get("cache_type_kv"),
                "reasons": found.get("reasons", [])[:8],
            },
            "memory": {"predicted": total("predicted"), "actual": total("actual")},
        }

    def load_during(self, model: str, began: float, ended: float | None) -> dict[str, Any] | None:
        """The load of ``model`` that ended (ready or failed) while a request waited for it, from ``began`` to
        ``ended`` (``perf_counter`` times; None: the wait goes on), the latest if several did (a restart)."""
        for load in reversed(self.recent):
            if load["model"] == model and began <= load["ended_at"] <= (
                ended if ended is not None else load["ended_at"]
            ):
                return {
                    "id": load["id"],
                    "model": load["model"],
                    "evicted": load["evicted"],
                    "began_at": load["began_at"],
                }
        return None


def _state(value: Any) -> str | None:
    """A state as text (an enum's value), if the event carries one."""
    if value is None:
        return None
    return str(getattr(value, "value", value))
