"""Resident models' state changes as events: what ``/metrics`` counts and listeners hear.

Each change of a resident's state is a transition ``(old, new)`` of ``studio.residency.lifecycle``'s table;
the resident's owner reports each one with how long it was in ``old``, and the kind of event (loaded,
failed, evicted, crashed, restarted) is read from the transition and the unload's cause it carries.
A change of a ready resident's admission (``lifecycle.Admission``) is an ``AdmissionEvent`` of its own,
with the reason the resident was given: listeners hear each change and keep no copy to compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from studio.residency.lifecycle import Admission, ResidentState
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


@dataclass(frozen=True)
class AdmissionEvent:
    """A ready resident stopped or began again to admit new requests (``lifecycle.ADMISSIONS``), and why."""

    model: str
    old: str  # the admission it left (``Admission`` values)
    new: str  # the admission it entered
    reason: str  # e.g. "gemma waits for its memory", "gemma is loaded"


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
    """Turns each resident's transitions into events for ``listeners``, its admission's for ``admission_listeners``."""

    def __init__(
        self,
        listeners: list[Callable[[ResidencyEvent], None]],
        admission_listeners: list[Callable[[AdmissionEvent], None]],
    ) -> None:
        self.listeners = listeners
        self.admission_listeners = admission_listeners

    def admission(self, r: ResidentModel, old: Admission, new: Admission, reason: str) -> None:
        """``r``'s admission went from ``old`` to ``new`` for ``reason``: tell the admission listeners."""
        event = AdmissionEvent(r.name, old.value, new.value, reason)
        for listener in self.admission_listeners:
            listener(event)

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
