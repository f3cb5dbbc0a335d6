"""Which transitions of a resident are events, read from the lifecycle's table: every allowed change has a row."""

from __future__ import annotations

import pytest

from studio.residency.events import kind_of
from studio.residency.lifecycle import TRANSITIONS, ResidentState

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
