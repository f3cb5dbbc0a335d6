"""Resident models' state changes as events: what ``/metrics`` counts and listeners hear.

Each change of a resident's state is a transition ``(old, new)`` of ``studio.residency.lifecycle``'s table;
the resident's owner reports each one with how long it was in ``old``, and the kind of event (loaded,
failed, evicted, crashed, restarted) is read from the transition and the unload's cause it carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from studio.residency.lifecycle import ResidentState
from studio.residency.resident import ResidentModel

S = ResidentState
Kind = Literal["loaded", "load_failed", "evicted", "crashed", "restarted"]


@dataclass(frozen=True)
class ResidencyEvent:
    """A resident model came, went, crashed or restarted, and how long the change took."""

    kind: Kind
    model: str
    seconds: float = 0.0  # loaded, load_failed: since its start began; evicted: stopping its llama-server
    reason: str = ""  # load_failed: "error" or "cancelled"; evicted: "evicted", "unload", "ttl", "restart", "shutdown"
    old: str | None = None  # the state it left (``ResidentState`` values)
    new: str = ""  # the state it entered


def kind_of(old: ResidentState, new: ResidentState, *, drained: bool) -> tuple[Kind, str] | None:
    """The event a transition ``old -> new`` is, and its reason; None: no event.

    An unload tells an eviction only of a model that ``drained`` (it was serving): a failed or crashed one
    held nothing. The eviction's reason is the unload's ``why``, filled in by ``Narrator``.
    """
    if old is S.LOADING and new is S.READY:
        return "loaded", ""
    if old is S.LOADING:
        return "load_failed", "cancelled" if new is S.UNLOADING else "error"
    if new is S.CRASHED:
        return "crashed", ""
    if old is S.CRASHED and new is S.LOADING:
        return "restarted", ""
    if new is S.UNLOADED and drained:
        return "evicted", ""
    return None


class Narrator:
    """Turns each resident's transitions into events for ``listeners``."""

    def __init__(self, listeners: list[Callable[[ResidencyEvent], None]]) -> None:
        self.listeners = listeners

    def transition(self, r: ResidentModel, old: ResidentState, new: ResidentState, seconds: float) -> None:
        """``r`` went from ``old`` (after ``seconds`` there) to ``new``: tell the listeners, if it is an event."""
        found = kind_of(old, new, drained=r.drained)
        if found is None:
            return
        kind, reason = found
        event = ResidencyEvent(
            kind,
            r.name,
            seconds if kind in ("loaded", "load_failed", "evicted") else 0.0,
            (r.why or "ttl") if kind == "evicted" else reason,
            old=old.value,
            new=new.value,
        )
        for listener in self.listeners:
            listener(event)
