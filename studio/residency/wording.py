"""What a refused or waiting load tells its client: the errors' words, in one place.

Each says what holds the memory (or the requests in flight), what the model needs and what to do,
so that a client's 503 or 507 reads the same wherever the manager refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

from studio.errors import BusyError, DoesNotFitError
from studio.residency.placer import Placed
from studio.residency.resident import ResidentModel


def retry_after(busy_wait: float) -> int:
    """Seconds a client is told to wait before it retries a load that waited ``busy_wait`` s in vain."""
    return max(1, round(busy_wait / 6) or 1)


def no_memory_now(name: str, placed: Placed, busy_wait: float) -> BusyError:
    """Busy models (or loads waiting before this one) hold the memory past the wait."""
    return BusyError(
        f"not enough memory for {name} now: it needs {placed.need}; held by "
        f"{', '.join(placed.blocked_by) or 'models that loads waiting before it will evict'};"
        " retry once they are idle",
        retry_after=retry_after(busy_wait),
    )


def still_serving(name: str, busy: Sequence[ResidentModel], busy_wait: float) -> BusyError:
    """The models this load evicts still had requests in flight when the wait ended."""
    return BusyError(
        f"{name} cannot load now: "
        + ", ".join(f"{v.name} has {v.in_flight} requests in flight" for v in busy)
        + "; retry once they are done",
        retry_after=retry_after(busy_wait),
    )


def does_not_fit(name: str, placed: Placed, smaller: str | None) -> DoesNotFitError:
    """Not even evicting every idle model makes room: what it needs, what could be freed, what to do."""
    return DoesNotFitError(
        f"{name} does not fit even with every idle model evicted: it needs {placed.need}"
        f" where {placed.room or 'nothing'} could be freed; "
        + (f"{smaller} is the largest variant of its repo that would fit, or " if smaller else "")
        + "load it with a smaller n_ctx (see the plan's largest_safe_context) or raise "
        "memory_budget"
    )
