"""What a request waits for before it has its model, told to whoever asked to hear it (the request's trace).

The manager knows why a request waits; the activity timeline wants to know it, and the residency package
imports nothing of the activity's: ``ModelManager.acquire`` takes a ``Waits`` getter and tells the observer
each wait's beginning and end. A request waits either ``queued`` (its model is resident but takes no new
request now: admission paused for another model's load, or its group is full) or for a ``load`` (its model
is loading, restarting, going away to be loaded anew, or its load waits for memory). A ready model's request
waits for nothing, and the getter is never called on that path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal, Protocol, TypeVar

#: What a request waits for (the module docstring).
WaitKind = Literal["queued", "load"]

T = TypeVar("T")


class WaitObserver(Protocol):
    """Hears when a request begins and ends a wait (``studio.activity.trace.RequestTrace`` is one)."""

    def waiting(self, what: WaitKind, model: str) -> None:
        """The request begins to wait for ``what``, on ``model`` (the resident's, or the load's name)."""

    def waited(self) -> None:
        """The wait begun last ended, however (the model came, the load failed, the request left)."""


#: Returns the observer of the request the calling code runs for; called only once the request waits.
Waits = Callable[[], WaitObserver]


async def observed(observer: WaitObserver | None, what: WaitKind, model: str, waited: Awaitable[T]) -> T:
    """``waited``'s result, its wait told to ``observer`` (None: nobody listens)."""
    if observer is None:
        return await waited
    observer.waiting(what, model)
    try:
        return await waited
    finally:
        observer.waited()
