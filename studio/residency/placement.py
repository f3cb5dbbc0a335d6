"""Where a new model fits among the resident ones: what memory it can count on, and what to evict.

Pure functions over numbers, so every rule is a row in a table-driven test. Memory
is counted per physical device (``CPU``, ``CUDA0``...): each resident model holds
its actual allocations once llama-server reported them (the predicted bill
before), and would give back what it holds when unloaded. A load first plans
against memory as it is; only when the model does not fit are idle, unpinned
models evicted: the fewest that free enough, least recently used first. Models
with requests in flight, models still loading and pinned models are never chosen.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from launcher.units import format_mib

#: The key of a budget on all devices together.
TOTAL = "total"
#: Past this many candidates the exact fewest-first search gives way to least-recently-used order.
_EXACT_SEARCH_LIMIT = 12


@dataclass(frozen=True)
class Holder:
    """A resident model as placement sees it."""

    name: str
    held: Mapping[str, int]  # bytes per device it occupies
    reclaim: Mapping[str, int]  # bytes per device its unload would give back to free memory
    last_used: float  # monotonic seconds
    busy: bool = False  # requests in flight, or still loading: never evicted
    pinned: bool = False

    @property
    def evictable(self) -> bool:
        return not self.busy and not self.pinned


@dataclass(frozen=True)
class Decision:
    """What a load may use per device, and which models must go first for it."""

    evict: tuple[str, ...]
    available: Mapping[str, int]  # bytes per device (and ``TOTAL`` under a total budget) once they are gone
    holders: tuple[str, ...] = field(default=())  # when it cannot fit: what holds the memory, in words


def base_available(
    *,
    budget: Mapping[str, int] | None,
    free: Mapping[str, int],
    holders: Sequence[Holder],
    loading: Sequence[Holder] = (),
) -> dict[str, int]:
    """Memory a new model can count on without evicting anything.

    With a budget (per device, or ``TOTAL``): the budget less what every resident model holds.
    Without one: what is free now (already net of running models), less what models still
    loading will take and have not taken yet.
    """
    if budget is not None:
        out = dict(budget)
        for h in (*holders, *loading):
            for device, n in h.held.items():
                for key in (device, TOTAL):
                    if key in out:
                        out[key] -= n
        return out
    out = dict(free)
    for h in loading:
        for device, n in h.held.items():
            if device in out:
                out[device] -= n
    return out


def with_evicted(available: Mapping[str, int], evicted: Iterable[Holder], *, budgeted: bool) -> dict[str, int]:
    """``available`` once ``evicted`` are gone: under a budget what they held, else what they give back."""
    out = dict(available)
    for h in evicted:
        for device, n in (h.held if budgeted else h.reclaim).items():
            for key in (device, TOTAL):
                if key in out and (key != TOTAL or budgeted):
                    out[key] += n
    return out


def shortfall(need: Mapping[str, int], available: Mapping[str, int]) -> dict[str, int]:
    """Bytes missing per device (and in ``TOTAL``) for ``need``; empty when it fits."""
    short = {d: n - available[d] for d, n in need.items() if d in available and n > available[d]}
    if TOTAL in available:
        total = sum(need.values())
        if total > available[TOTAL]:
            short[TOTAL] = total - available[TOTAL]
    return short


def choose_evictions(
    need: Mapping[str, int],
    available: Mapping[str, int],
    holders: Sequence[Holder],
    *,
    budgeted: bool,
    max_count: int | None = None,
) -> tuple[str, ...] | None:
    """The fewest evictable holders whose going makes ``need`` fit; among as few, the least recently used.

    ``max_count`` (a cap on resident models) forces at least ``len(holders) - max_count + 1`` to go.
    Returns ``()`` when nothing needs to go, ``None`` when no choice of evictable holders is enough.
    """
    at_least = max(0, len(holders) - max_count + 1) if max_count is not None else 0
    if at_least == 0 and not shortfall(need, available):
        return ()
    candidates = sorted((h for h in holders if h.evictable), key=lambda h: h.last_used)
    if len(candidates) > _EXACT_SEARCH_LIMIT:  # least recently used first until it fits
        for k in range(max(at_least, 1), len(candidates) + 1):
            chosen = candidates[:k]
            if not shortfall(need, with_evicted(available, chosen, budgeted=budgeted)):
                return tuple(h.name for h in chosen)
        return None
    for k in range(max(at_least, 1), len(candidates) + 1):
        fitting = [
            combo
            for combo in itertools.combinations(candidates, k)
            if not shortfall(need, with_evicted(available, combo, budgeted=budgeted))
        ]
        if fitting:
            # the set whose most recent use is oldest; then the one holding least (fewer bytes disturbed)
            best = min(fitting, key=lambda c: (max(h.last_used for h in c), sum(sum(h.held.values()) for h in c)))
            return tuple(h.name for h in best)
    return None


def holders_in_words(holders: Sequence[Holder]) -> tuple[str, ...]:
    """What keeps memory that cannot be evicted now, for the 503's message."""
    words = []
    for h in holders:
        if h.evictable:
            continue
        why = "pinned" if h.pinned else "busy"
        words.append(f"{h.name} ({why}, {format_mib(sum(h.held.values()))})")
    return tuple(words)
