"""Which transitions of a resident are events, read from the lifecycle's table: every allowed change has a row."""

from __future__ import annotations

import pytest

from launcher.supervisor import State
from studio.residency.events import kind_of
from studio.residency.lifecycle import SUPERVISOR_ANSWERS, SUPERVISOR_MOVES, TRANSITIONS, ResidentState

S = ResidentState
#: (old, new, drained) -> (kind, reason), or None: no event
EVENTS = {
    (S.LOADING, S.READY, False): ("loaded", ""),
    (S.LOADING, S.FAILED, False): ("load_failed", "error"),
    (S.LOADING, S.UNLOADING, False): ("load_failed", "cancelled"),
    (S.READY, S.CRASHED, False): ("crashed", ""),
    (S.CRASHED, S.LOADING, False): ("restarted", ""),
    (S.UNLOADING, S.UNLOADED, True): ("evicted", ""),  # it was serving: its reason is the unload's why
    (S.UNLOADING, S.UNLOADED, False): None,  # a failed or crashed one held nothing
}


@pytest.mark.parametrize(
    "old, new", [(old, new) for old, nexts in TRANSITIONS.items() for new in sorted(nexts, key=str)]
)
def test_every_transition_is_an_event_or_not_by_the_table(old, new):
    for drained in (False, True):
        drain_matters = (old, new) == (S.UNLOADING, S.UNLOADED)
        assert kind_of(old, new, drained=drained) == EVENTS.get((old, new, drained and drain_matters))


def test_every_supervisor_state_moves_the_resident_by_the_table_or_answers_its_own_command():
    """The layering: the supervisor reports, the resident decides; each supervisor state is one or the other."""
    assert set(SUPERVISOR_MOVES).isdisjoint(SUPERVISOR_ANSWERS)
    assert set(SUPERVISOR_MOVES) | SUPERVISOR_ANSWERS == set(State)
    # a move lands where the supervisor's own change could take the resident: from ready, by its table
    assert all(new in TRANSITIONS[S.READY] for new in SUPERVISOR_MOVES.values())
