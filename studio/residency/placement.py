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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from launcher.devices import Inventory
from launcher.memory import DeviceBill, MemoryBill
from launcher.planner import MIN_AUTO_CTX, LaunchPlan, PlanRequest
from launcher.units import MIB, format_mib
from studio.settings import MemoryBudget

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


def reservation(name: str, launch: LaunchPlan, now: float) -> Holder:
    """What a load in flight will hold once its model starts: its plan's bill, busy until it is resident."""
    held = physical(launch.bill, launch)
    return Holder(name=name, held=held, reclaim=held, last_used=now, busy=True)


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


def inventory_for(inventory: Inventory, room: Room) -> Inventory:
    """The inventory a plan sees: under a budget, each device's share of the room; else free memory as it will be."""
    devices = []
    available = room.available
    for d in inventory.devices:
        if room.budgeted:
            share = min(available.get(d.key, 0), available.get(TOTAL, available.get(d.key, 0)))
            devices.append(replace(d, budget_bytes=max(0, share)))
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


@dataclass(frozen=True)
class Resident:
    """A resident model as one placement sees it: what it holds, and what it is doing."""

    holder: Holder
    loading: bool = False  # starting (or restarting): free memory does not show what it will take yet
    ready: bool = False  # serving: once its requests are done it could be evicted
    going: bool = False  # another load in flight reserved it to evict: it holds its memory until it is gone
    on_cpu: bool = False  # runs layers on the CPU, so its threads share the cores
    threads: int | None = None  # its --threads; None: every core
    restartable: bool = False  # ready, threads not asked for, and no instance of the model placed: may get its share


@dataclass(frozen=True)
class Room:
    """What a new model may take per device, and why: computed once per placement, handed to the planner."""

    available: Mapping[str, int]  # bytes per device (and ``TOTAL`` under a total budget)
    budgeted: bool  # a memory budget set it, rather than free memory
    reasons: tuple[str, ...] = ()  # said in the plan's reasons

    def without(self, evicted: Iterable[Holder]) -> Room:
        """The room once ``evicted`` are gone."""
        return replace(self, available=with_evicted(self.available, evicted, budgeted=self.budgeted))


@dataclass(frozen=True)
class Snapshot:
    """Everything one placement decides on, frozen: the decision reads nothing else."""

    inventory: Inventory  # the devices (RPC workers other residents use left out)
    residents: tuple[Resident, ...] = ()  # every model holding memory, less the instance a load replaces
    reservations: tuple[Holder, ...] = ()  # what loads in flight will hold once their models start
    budget: MemoryBudget | None = None  # None: the planner's share of free memory
    reserve: int = 0  # the studio's own host memory, off a budget
    max_resident: int | None = None
    loads: int = 0  # loads in flight, reserved or not: their decisions own the cores (``rebalance``)

    def room(self) -> Room:
        """The one room a model may take: the budget (less the studio's reserve) or free memory, less what the
        residents hold and what loads in flight will take."""
        holders = [r.holder for r in self.residents]
        budget = None
        reasons: tuple[str, ...] = ()
        if self.budget is not None:
            budget = budget_map(self.budget.total, self.budget.per_device, self.inventory, reserve=self.reserve)
            if self.reserve:
                reasons = (
                    f"reserve: the studio's own {format_mib(self.reserve)} of host memory comes off the memory budget",
                )
        available = base_available(
            budget=budget,
            free=free_memory(self.inventory),
            holders=[h for r, h in zip(self.residents, holders, strict=True) if not r.loading],
            loading=[*(r.holder for r in self.residents if r.loading), *self.reservations],
        )
        return Room(available, budgeted=budget is not None, reasons=reasons)


@dataclass(frozen=True)
class Decision:
    """What a load gets: the plan, the models to evict first, or why it cannot fit now."""

    plan: LaunchPlan
    evict: tuple[str, ...] = ()  # idle models to unload first
    blocked_by: tuple[str, ...] = ()  # when it does not fit: busy or pinned models holding the memory, in words
    fits: bool = True
    need: str = ""  # when it does not fit: what it needs, and what evicting every idle model would leave
    room: str = ""
    drain: tuple[str, ...] = ()  # busy models that would free enough once their requests are done
    shortfall: int = 0  # bytes missing even with every evictable model gone
    restart: tuple[tuple[str, int], ...] = ()  # idle CPU residents to restart first with these --threads


#: Plans a model on an inventory whose devices carry the room (``inventory_for``); the planner, bound to a model.
PlanFn = Callable[[Inventory, PlanRequest], LaunchPlan]


@dataclass(frozen=True)
class Cores:
    """The CPU's cores as room: how many models share them, and what the ones that stay leave."""

    count: int | None  # usable physical cores; None: not counted (or no max_resident): the planner's share
    sharers: int  # models running layers on the CPU, this one included, or as many as the division plans for
    left: int  # cores the staying CPU residents' threads leave
    holders: tuple[Resident, ...]  # the staying residents that run layers on the CPU

    @classmethod
    def of(cls, snapshot: Snapshot, away: Collection[str]) -> Cores:
        """The cores once ``away`` are gone.

        With ``max_resident`` set, the division is planned before the first load: every model on the CPU
        takes its share of that many from the start, at most what the staying ones leave, and when they
        leave none an idle one is evicted for it, so that residents busy at once never run more threads
        than there are cores. Without it a lone model takes every core, and each later one its share.
        """
        count = snapshot.inventory.cpu.cores if snapshot.max_resident is not None else None
        staying = tuple(r for r in snapshot.residents if r.on_cpu and r.holder.name not in away)
        planned = min(snapshot.max_resident or 1, count or 1)
        held = sum(r.threads if r.threads is not None else (count or 0) for r in staying)
        return cls(count, max(1 + len(staying), planned), (count or 0) - held, staying)

    def threads(self, asked: PlanRequest) -> int | None:
        """The threads to ask for: the cores left when they are fewer than the share; None: the planner's share."""
        if self.count is None or asked.threads is not None or self.left >= self.count // self.sharers:
            return None
        return max(1, self.left)

    @property
    def short(self) -> bool:
        """No core is left for another model on the CPU."""
        return self.count is not None and self.left < 1

    def restarts(self, launch: LaunchPlan, cores: int | None) -> tuple[tuple[str, int], ...]:
        """Without ``max_resident``: the idle CPU residents that, restarted with their share, keep the threads of
        residents busy at once within ``cores`` (a lone model kept every core); each with its share."""
        if self.count is not None or not cores or not launch.layers_on_cpu or not self.holders:
            return ()
        if sum(r.threads or cores for r in self.holders) + (launch.threads or cores) <= cores:
            return ()
        share = max(1, cores // self.sharers)
        return tuple(
            (r.holder.name, share)
            for r in self.holders
            if r.restartable and not r.holder.busy and (r.threads or cores) > share
        )

    def overcommit(self, launch: LaunchPlan, cores: int | None, restart: Mapping[str, int]) -> str | None:
        """The warning for a model that, busy at once with the staying CPU residents (those in ``restart`` with
        their new threads), runs more threads than ``cores``; None: they fit."""
        if self.count is not None or not cores or not launch.layers_on_cpu or not self.holders:
            return None
        held = [restart.get(r.holder.name, r.threads or cores) for r in self.holders]
        total = sum(held) + (launch.threads or cores)
        if total <= cores:
            return None
        names = ", ".join(r.holder.name for r in self.holders)
        said = f"{total} threads on {cores} physical cores while {names} and this model are busy at once"
        later = [
            r.holder.name for r in self.holders if r.restartable and r.holder.busy and r.holder.name not in restart
        ]
        if later:  # ``rebalance`` restarts them once idle
            return f"{said}, until {', '.join(later)} restart(s) with a share of the cores once their requests are done"
        return (
            f"{said} (a model loaded alone keeps every core until a load restarts it idle); max_resident divides "
            "them from the first load"
        )


@dataclass(frozen=True)
class Rebalance:
    """What the cores' division asks once the residents changed without a load: restarts now, and later."""

    restart: tuple[tuple[str, int], ...] = ()  # idle CPU residents to restart now with these --threads
    once_idle: tuple[str, ...] = ()  # busy ones whose threads should change too: once their requests are done


def rebalance(snapshot: Snapshot) -> Rebalance:
    """Each CPU resident's share of the cores once a model left or a load ended, when no load is in flight.

    Without ``max_resident`` the division follows the models on the CPU: a model left alone with its share
    of the cores gets every core back (what a user expects of a lone model), and one that kept more than
    its share beside a model loaded while it was busy gets its share once its requests are done, so that
    residents busy at once never run more threads than there are cores. Only ready residents whose threads
    were not asked for move; a load in flight, or a resident starting, going or restarting, decides
    nothing here (that load's decision owns the cores; the division is looked at again once it ends).
    """
    cores = snapshot.inventory.cpu.cores
    on_cpu = [r for r in snapshot.residents if r.on_cpu]
    if snapshot.max_resident is not None or not cores or not on_cpu or snapshot.loads or snapshot.reservations:
        return Rebalance()
    if any(r.loading or r.going for r in on_cpu):  # a resident starting, going or restarting decides nothing
        return Rebalance()
    share = max(1, cores // len(on_cpu))
    held = {r.holder.name: r.threads or cores for r in on_cpu}
    movable = [r for r in on_cpu if r.restartable]
    # more threads than cores: those above their share come down to it
    over = [r for r in movable if held[r.holder.name] > share] if sum(held.values()) > cores else []
    after = {**held, **{r.holder.name: share for r in over}}
    under = [r for r in movable if held[r.holder.name] < share]
    if under:  # the cores the rest hold now (a busy one above its share still runs its threads) are left
        rest = sum(held[r.holder.name] if r.holder.busy else after[r.holder.name] for r in on_cpu if r not in under)
        each = min(share, (cores - rest) // len(under))
        after.update({r.holder.name: each for r in under if each > held[r.holder.name]})
    moves = [(r, after[r.holder.name]) for r in movable if after[r.holder.name] != held[r.holder.name]]
    return Rebalance(
        restart=tuple((r.holder.name, n) for r, n in moves if not r.holder.busy),
        once_idle=tuple(r.holder.name for r, _ in moves if r.holder.busy),
    )


def decide(snapshot: Snapshot, request: PlanRequest, plan: PlanFn) -> Decision:
    """Plan a model against memory and cores as they will be, and choose the fewest idle models to evict for it.

    Memory as it will be: what residents hold, less nothing for the models other loads reserved to evict
    (they hold their memory until they are gone, and count as busy), plus what those loads will take.
    Cores likewise: a model on the CPU gets its share, at most the cores the staying CPU residents leave;
    when none is left, idle CPU residents are evicted for it as for memory. Without ``max_resident`` a lone
    model kept every core: idle residents that would run more threads than their share beside it are named
    to restart with their share first, so that residents busy at once never run more threads than cores.
    """
    room = snapshot.room()
    going = {r.holder.name for r in snapshot.residents if r.going}
    holders = [replace(r.holder, busy=True) if r.going else r.holder for r in snapshot.residents]

    def placed(
        at: Room, asked: PlanRequest, leaving: Iterable[str] = ()
    ) -> tuple[LaunchPlan, tuple[tuple[str, int], ...]]:
        cores = Cores.of(snapshot, {*going, *leaving})
        threads = cores.threads(asked)
        asked = replace(asked, cpu_sharers=cores.sharers, threads=threads or asked.threads)
        launch = plan(inventory_for(snapshot.inventory, at), asked)
        reasons = launch.reasons
        if threads is not None:
            why = f"threads: {threads}, the cores the other residents on the CPU leave of {cores.count}"
            reasons = tuple(why if r == f"threads: {threads}, as requested" else r for r in reasons)
        restart = cores.restarts(launch, snapshot.inventory.cpu.cores) if asked.threads is None else ()
        if restart:
            names = ", ".join(f"{name} with {n}" for name, n in restart)
            reasons = (*reasons, f"restart: {names} thread(s) first, so that busy at once they share the cores")
        overcommit = cores.overcommit(launch, snapshot.inventory.cpu.cores, dict(restart))
        warnings = (*launch.warnings, overcommit) if overcommit else launch.warnings
        return replace(launch, reasons=(*reasons, *at.reasons), warnings=warnings), restart

    def planned(at: Room, asked: PlanRequest, leaving: Iterable[str] = ()) -> LaunchPlan:
        return placed(at, asked, leaving)[0]

    first, restart = placed(room, request)
    cap = snapshot.max_resident
    on_cpu = first.layers_on_cpu and request.threads is None
    if fits(first, room.available) and not (cap is not None and len(holders) >= cap):
        if not (on_cpu and Cores.of(snapshot, going).short):
            return Decision(first, restart=restart)
    # The fewest evictions that let the model fit at its smallest context; the final plan then takes
    # whatever context the freed memory allows.
    everything = room.without(h for h in holders if h.evictable)
    smallest = (
        request if request.n_ctx is not None else replace(request, n_ctx=min(MIN_AUTO_CTX, max(first.native_ctx, 256)))
    )
    need = physical(planned(everything, smallest).bill, first)
    evict = choose_evictions(need, room.available, holders, budgeted=room.budgeted, max_count=cap)
    if evict is None:
        ready = {r.holder.name for r in snapshot.residents if r.ready and not r.going}
        once_idle = [replace(h, busy=False) if h.name in ready else h for h in holders]
        drain = choose_evictions(need, room.available, once_idle, budgeted=room.budgeted, max_count=cap)
        return Decision(
            first,
            blocked_by=holders_in_words(holders),
            fits=False,
            need=in_words(need),
            room=in_words(everything.available),
            drain=drain or (),
            shortfall=max(shortfall(need, everything.available).values(), default=0),
        )
    cores = Cores.of(snapshot, {*going, *evict})
    if on_cpu and cores.short:  # every core is held: the least recently used idle CPU residents give theirs
        idle = sorted((r for r in cores.holders if r.holder.evictable), key=lambda r: r.holder.last_used)
        if not idle:
            busy = [r for r in cores.holders if not r.holder.evictable]
            return Decision(
                first,
                blocked_by=holders_in_words([r.holder for r in busy]),
                fits=False,
                need=f"a core of the {cores.count} that residents on the CPU hold",
                room="no core",
                drain=tuple(r.holder.name for r in busy if r.ready and not r.holder.pinned)[:1],
            )
        evict = (*evict, idle[0].holder.name)
    freed = room.without(h for h in holders if h.name in evict)
    # the models it evicts give their cores back too: a model swapped in that planned its share beside the
    # model it replaced would run alone on part of the cores
    final, restart = placed(freed, request, leaving=evict)
    return Decision(final, evict=evict, fits=fits(final, freed.available), restart=restart)
