"""Resident models' state changes as events: what ``/metrics`` counts and listeners hear.

Each change of a resident's state is a transition ``(old, new)`` of ``studio.residency.lifecycle``'s table;
the kind of event (loaded, failed, evicted, crashed, restarted) is read from the transition and from why
the manager unloaded it, so that listeners never rebuild it themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from studio.residency.lifecycle import ResidentState
from studio.residency.resident import ResidentModel

S = ResidentState
Kind = Literal["loaded", "load_failed", "evicted", "crashed", "restarted"]
#: Why the manager unloads a resident; the one unload a resident starts itself is its TTL's.
Why = Literal["evicted", "unload", "ttl", "restart", "shutdown"]


@dataclass(frozen=True)
class ResidencyEvent:
    """A resident model came, went, crashed or restarted, and how long the change took."""

    kind: Kind
    model: str
    seconds: float = 0.0  # loaded, load_failed: since its start began; evicted: stopping its llama-server
    reason: str = ""  # load_failed: "error" or "cancelled"; evicted: "evicted", "unload", "ttl", "restart", "shutdown"
    old: str | None = None  # the state it left (``ResidentState`` values)
    new: str = ""  # the state it entered


def kind_of(old: ResidentState, new: ResidentState, before: ResidentState | None) -> tuple[Kind, str] | None:
    """The event a transition ``old -> new`` is, and its reason; ``before``: the state ahead of ``old``.

    An unload tells an eviction only of a model that was serving (it drained): a failed or crashed
    one held nothing. The eviction's reason is the manager's, filled in by ``Narrator``.
    """
    if old is S.LOADING and new is S.READY:
        return "loaded", ""
    if old is S.LOADING:
        return "load_failed", "cancelled" if new is S.UNLOADING else "error"
    if new is S.CRASHED:
        return "crashed", ""
    if old is S.CRASHED and new is S.LOADING:
        return "restarted", ""
    if new is S.UNLOADED and before is S.DRAINING:
        return "evicted", ""
    return None


class Narrator:
    """Follows each resident's transitions and tells ``listeners`` the events among them."""

    def __init__(self, listeners: list[Callable[[ResidencyEvent], None]]) -> None:
        self.listeners = listeners
        self._last: dict[ResidentModel, tuple[ResidentState, ResidentState | None, float]] = {}  # state, before, since
        self._why: dict[ResidentModel, Why] = {}

    def unloading(self, resident: ResidentModel, why: Why) -> None:
        """The manager is about to unload ``resident`` for ``why`` (the first reason given stands)."""
        self._why.setdefault(resident, why)

    def changed(self, r: ResidentModel) -> None:
        """``r`` may have changed state: tell the listeners what its transition was."""
        old, before, since = self._last.get(r, (S.LOADING, None, r.created))
        if r.state is old:
            return  # a request left; no change
        now = time.monotonic()
        self._last[r] = (r.state, old, now)
        found = kind_of(old, r.state, before)
        if r.state is S.UNLOADED:
            del self._last[r]
            why: str = self._why.pop(r, "ttl")
        if found is None:
            return
        kind, reason = found
        timed = kind in ("loaded", "load_failed", "evicted")
        event = ResidencyEvent(
            kind,
            r.name,
            now - since if timed else 0.0,
            why if kind == "evicted" else reason,
            old=old.value,
            new=r.state.value,
        )
        for listener in self.listeners:
            listener(event)
