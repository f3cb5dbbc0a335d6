"""The states of one resident model and the only changes between them.

One task per resident model (``studio.residency.resident``) alone moves it through
this table; every caller sends it a command and waits for a state, so no caller
ever checks a state and then acts on it. Admission (whether a ready model takes new
requests while a load waits for its memory) is a sub-state of ``ready`` with a table
of its own, moved only through the resident's methods.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from types import MappingProxyType

from launcher.supervisor import State


class ResidentState(enum.Enum):
    """Where a resident model is in its life, as ``/api/status`` shows it."""

    LOADING = "loading"  # llama-server is starting: the first start, or a restart after a crash
    READY = "ready"  # serving requests
    DRAINING = "draining"  # turning new requests away, waiting (a bounded grace) for those in flight
    UNLOADING = "unloading"  # stopping llama-server
    CRASHED = "crashed"  # llama-server died after it was ready; a restart waits out its back-off
    FAILED = "failed"  # a start failed, or restarts ran out: nothing runs; ``error`` says why
    UNLOADED = "unloaded"  # stopped and gone from the resident set (final)


#: Every allowed change; anything else is a bug and raises.
TRANSITIONS: MappingProxyType[ResidentState, frozenset[ResidentState]] = MappingProxyType(
    {
        ResidentState.LOADING: frozenset({ResidentState.READY, ResidentState.FAILED, ResidentState.UNLOADING}),
        ResidentState.READY: frozenset({ResidentState.DRAINING, ResidentState.CRASHED}),
        ResidentState.DRAINING: frozenset({ResidentState.UNLOADING}),
        ResidentState.CRASHED: frozenset({ResidentState.LOADING, ResidentState.FAILED, ResidentState.UNLOADING}),
        ResidentState.FAILED: frozenset({ResidentState.UNLOADING}),
        ResidentState.UNLOADING: frozenset({ResidentState.UNLOADED}),
        ResidentState.UNLOADED: frozenset(),
    }
)

#: The layering under this table: which of the supervisor's states (``launcher.supervisor.TRANSITIONS``, what its
#: llama-server did) move a resident, and to where. The supervisor only reports; what a state means for the model
#: (restart it, or give up: ``failed``) is decided here, once. A supervisor state not listed is the answer to a
#: command of the resident's own (start, stop), which the resident awaits: a failed start raises, and the
#: resident moves to ``failed`` itself.
SUPERVISOR_MOVES: MappingProxyType[State, ResidentState] = MappingProxyType(
    {State.CRASHED: ResidentState.CRASHED}  # it died or hung once ready: the owner restarts it or gives up
)
#: The supervisor's states that answer the resident's own start and stop.
SUPERVISOR_ANSWERS = frozenset({State.IDLE, State.STARTING, State.READY, State.STOPPING, State.FAILED})

#: States in which the model holds (or is about to hold) memory.
HOLDS_MEMORY = frozenset(
    {ResidentState.LOADING, ResidentState.READY, ResidentState.DRAINING, ResidentState.UNLOADING, ResidentState.CRASHED}
)
#: States a request may wait through for the model to become ready.
COMING_UP = frozenset({ResidentState.LOADING, ResidentState.CRASHED})
#: States of a model on its way out: a request for it waits until it is gone, then loads it anew.
GOING_AWAY = frozenset({ResidentState.DRAINING, ResidentState.UNLOADING})


class Admission(enum.Enum):
    """Whether a ready resident takes new requests: a sub-state of ``ready`` that a load waiting for its memory
    moves (new requests would keep it busy for ever), and that the load's end, or leaving ``ready``, moves back."""

    ACCEPTING = "accepting"  # new requests enter
    GROUPING = "grouping"  # a load waits for its memory: a group of a few more requests enters, to run before it
    PAUSED_FOR_LOAD = "paused_for_load"  # a load waits for (or reserved) its memory: new requests wait


#: Every allowed change of admission; anything else is a bug and raises.
ADMISSIONS: MappingProxyType[Admission, frozenset[Admission]] = MappingProxyType(
    {
        Admission.ACCEPTING: frozenset({Admission.GROUPING, Admission.PAUSED_FOR_LOAD}),
        Admission.GROUPING: frozenset({Admission.PAUSED_FOR_LOAD, Admission.ACCEPTING}),
        Admission.PAUSED_FOR_LOAD: frozenset({Admission.ACCEPTING}),
    }
)


class AdmissionGate:
    """One resident's admission, moved only through ``ADMISSIONS``; each move is told as ``(old, new, reason)``.

    The resident owns it and is the only caller (``ResidentModel.pause``/``resume``/``enter``), so no caller
    outside keeps a copy of it or changes it.
    """

    __slots__ = ("_on_move", "group_left", "state")

    def __init__(self, on_move: Callable[[Admission, Admission, str], None]) -> None:
        self.state = Admission.ACCEPTING
        self.group_left = 0  # requests the open group still admits (``GROUPING`` only)
        self._on_move = on_move

    def move(self, new: Admission, reason: str) -> None:
        """Change to ``new`` by the table; raise ``RuntimeError`` for a change it does not allow."""
        old = self.state
        if new not in ADMISSIONS[old]:
            raise RuntimeError(f"illegal admission change {old.value} -> {new.value} ({reason})")
        self.state = new
        if new is not Admission.GROUPING:
            self.group_left = 0
        self._on_move(old, new, reason)

    def pause(self, after: int, reason: str) -> None:
        """Admit no new request once ``after`` more came in; a group already open is never extended."""
        if after <= 0:
            if self.state is not Admission.PAUSED_FOR_LOAD:
                self.move(Admission.PAUSED_FOR_LOAD, reason)
        elif self.state is Admission.ACCEPTING:
            self.group_left = after
            self.move(Admission.GROUPING, reason)

    def resume(self, reason: str) -> None:
        """Admit new requests again."""
        if self.state is not Admission.ACCEPTING:
            self.move(Admission.ACCEPTING, reason)

    def admit(self) -> bool:
        """Whether one more request may enter; it counts against an open group, and the group's last closes it."""
        if self.state is Admission.PAUSED_FOR_LOAD:
            return False
        if self.state is Admission.GROUPING:
            self.group_left -= 1
            if self.group_left <= 0:
                self.move(Admission.PAUSED_FOR_LOAD, "its group before the load is complete")
        return True
