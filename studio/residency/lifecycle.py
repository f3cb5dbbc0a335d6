"""The states of one resident model and the only changes between them.

One task per resident model (``studio.residency.resident``) alone moves it through
this table; every caller sends it a command and waits for a state, so no caller
ever checks a state and then acts on it.
"""

from __future__ import annotations

import enum
from types import MappingProxyType


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

#: States in which the model holds (or is about to hold) memory.
HOLDS_MEMORY = frozenset(
    {ResidentState.LOADING, ResidentState.READY, ResidentState.DRAINING, ResidentState.UNLOADING, ResidentState.CRASHED}
)
#: States a request may wait through for the model to become ready.
COMING_UP = frozenset({ResidentState.LOADING, ResidentState.CRASHED})
#: States of a model on its way out: a request for it waits until it is gone, then loads it anew.
GOING_AWAY = frozenset({ResidentState.DRAINING, ResidentState.UNLOADING})
