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
from dataclasses import dataclass, field, replace

from launcher.devices import Inventory
from launcher.memory import DeviceBill, MemoryBill
from launcher.planner import LaunchPlan
from launcher.units import MIB, format_mib

#: The key of a budget on all devices together.
TOTAL = "total"
#: The least a memory budget keeps for the studio's own host memory (Python, FastAPI, uvicorn, the catalog),
#: which no model's bill counts: ``ggstudio serve`` measured 79 MiB RSS once its first model was ready, and
#: as much after five chats and a page (44 MiB when its model manager is made, before the server is up).
RESERVE_FLOOR = 96 * MIB
#: Beyond the studio's RSS at a placement: what it may grow by before the next one (requests, history).
RESERVE_HEADROOM = 16 * MIB
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


def holder(
    name: str,
    plan: LaunchPlan,
    actual: MemoryBill | None,
    *,
    last_used: float,
    busy: bool,
    pinned: bool,
) -> Holder:
    """A resident model as placement sees it: what it allocated plus what it will still grow by, else its bill."""
    if actual is not None:  # what it allocated, plus what it will grow by (drafted logits, MiniMax's masks, cache)
        # the prompt cache included, and the process line, which the log that made ``actual`` never prints
        unlogged = {k: d.growth + d.process for k, d in by_device(plan.bill, plan).items()}
        held = {k: d.total + unlogged.get(k, 0) for k, d in by_device(actual, plan).items()}
    else:
        held = physical(plan.bill, plan)
    # mapped weights on the CPU are page cache: free memory already counts them as available
    cpu_weights = by_device(actual or plan.bill, plan).get("CPU")
    reclaim = {k: n - (cpu_weights.weights if k == "CPU" and cpu_weights else 0) for k, n in held.items()}
    return Holder(name=name, held=held, reclaim=reclaim, last_used=last_used, busy=busy, pinned=pinned)


def studio_reserve(rss: int) -> int:
    """The studio's own share of a memory budget, from its RSS now: that and some headroom, at least the floor."""
    return max(RESERVE_FLOOR, rss + RESERVE_HEADROOM)


def budget_map(
    total: int | None, per_device: Mapping[str, int], inventory: Inventory, *, reserve: int = 0
) -> dict[str, int]:
    """A memory budget per device key: a total budget lets each device take all of it, and the sum is checked.

    ``reserve`` (the studio's own host memory, on no model's bill) comes off the host's share and the total.
    """
    if total is not None:
        out = {TOTAL: total, **{d.key: total for d in inventory.devices}}
    else:
        out = {d.key: per_device.get(d.key, 0) for d in inventory.devices}
    for key in (TOTAL, "CPU"):
        if key in out:
            out[key] = max(0, out[key] - reserve)
    return out


def physical(bill: MemoryBill, launch: LaunchPlan) -> dict[str, int]:
    """``bill``'s bytes per physical device (``CPU``, ``CUDA0``...): its ``GPU<i>`` is the plan's i-th GPU."""
    return {k: d.total for k, d in by_device(bill, launch).items()}


def by_device(bill: MemoryBill, launch: LaunchPlan) -> dict[str, DeviceBill]:
    """``bill``'s parts per physical device."""
    out: dict[str, DeviceBill] = {}
    for d in bill.devices:
        if d.device.startswith("GPU") and d.device[3:].isdigit() and int(d.device[3:]) < len(launch.gpus):
            out[launch.gpus[int(d.device[3:])].key] = d
        else:
            out[d.device] = d
    return out


def fits(launch: LaunchPlan, available: Mapping[str, int]) -> bool:
    """The planner's own verdict, and, under a budget on all devices together, their sum within it."""
    return launch.fits and not shortfall(physical(launch.bill, launch), available)


def free_memory(inventory: Inventory) -> dict[str, int]:
    """Free bytes per device key, as the inventory saw them."""
    return {d.key: d.free_bytes for d in inventory.devices}


def inventory_for(inventory: Inventory, available: Mapping[str, int], *, budgeted: bool) -> Inventory:
    """The inventory a plan sees: under a budget, what it leaves per device; else free memory as it will be."""
    devices = []
    for d in inventory.devices:
        if budgeted:
            room = min(available.get(d.key, 0), available.get(TOTAL, available.get(d.key, 0)))
            devices.append(replace(d, budget_bytes=max(0, room)))
        elif d.key in available:
            devices.append(replace(d, free_bytes=max(0, available[d.key])))
        else:
            devices.append(d)
    return replace(inventory, devices=tuple(devices))


def in_words(bytes_per_device: Mapping[str, int]) -> str:
    """``1.2 GiB on CPU, 3 GiB in all``: memory per device for an error message."""
    return ", ".join(
        f"{format_mib(n)} on {d}" if d != TOTAL else f"{format_mib(n)} in all" for d, n in bytes_per_device.items()
    )
