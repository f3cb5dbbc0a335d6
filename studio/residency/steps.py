"""The steps of one load, over the manager's state: check and reserve, drain, start, commit or undo; and
between loads, the restarts that give CPU residents their share of the cores (``placement.rebalance``).

``studio.residency.transaction`` says what a load is and which steps it may take; this is what each
step does. One placement at a time decides (``placement.decide``, under the placement lock), nothing
running is touched until the load fits, victims' requests in flight finish outside the lock within
``busy_wait``, and a failed or cancelled load leaves everything as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from launcher.command import LaunchCommand
from studio.errors import BusyError, StudioError
from studio.library.catalog import CatalogEntry
from studio.residency import placement, wording
from studio.residency.builder import Builder
from studio.residency.events import Narrator
from studio.residency.lifecycle import GOING_AWAY, Admission, ResidentState
from studio.residency.lookup import Lookup
from studio.residency.placer import GROUP_LINGER, Placed, Placer
from studio.residency.requests import LoadRequest, LoadSettings
from studio.residency.resident import ResidentModel
from studio.residency.transaction import Key, Load, LoadStep
from studio.settings import ResidencySettings

log = structlog.get_logger(__name__)

#: States of a resident that serves no request and never will: a new load replaces it.
NOT_SERVING = frozenset({ResidentState.FAILED, ResidentState.UNLOADED})


class LoadSteps:
    """What each step of a load does; ``ModelManager`` runs them and owns the state they read."""

    residency: ResidencySettings
    counters: dict[str, int]
    lookup: Lookup
    builder: Builder
    placer: Placer
    _residents: dict[Key, ResidentModel]
    _routes: dict[str, ResidentModel]
    _loads: dict[Key, Load]
    _placement: asyncio.Lock
    _changed: asyncio.Event
    _last_extra_args: dict[Path, tuple[str, ...]]
    find: Callable[[str], ResidentModel | None]
    _route: Callable[[str, ResidentModel], None]
    _settings: Callable[[LoadRequest, CatalogEntry], LoadSettings]
    _on_resident_change: Callable[[ResidentModel], None]
    _events: Narrator
    _closing: bool
    _cores_due: bool  # a CPU resident left, a load ended, or one waiting for its share turned idle
    _once_idle: frozenset[str]  # busy residents whose threads change once their requests are done
    _rebalancing: asyncio.Task[None] | None

    async def _transact(self, load: Load) -> ResidentModel:
        """Check, reserve, start; return the ready resident. Raises what refused or failed the load."""
        key = load.settings.key
        existing = self._residents.get(key)
        while existing is not None and existing.state in GOING_AWAY:  # evicted or unloading: let it go first
            await existing.wait_until({ResidentState.UNLOADED})
            existing = self._residents.get(key)
        if existing is not None and existing.state not in NOT_SERVING and existing.settings == load.settings:
            return existing  # superseded back to what runs: nothing to do
        load.replacing = existing
        deadline = time.monotonic() + self.residency.busy_wait
        # check, and reserve: one placement at a time decides; nothing running is touched until it fits
        while True:
            async with self._placement:
                if load.step is LoadStep.WAITING:
                    load.move(LoadStep.CHECKING)
                placed = await self._place(load.entry, load.request, replacing=load.replacing, load=load)
                behind = bool(placed.evict) and self._waits_behind(load)  # loads that must evict take turns
                if (placed.fits or load.request.force) and not behind:
                    victims = [v for name in placed.evict if (v := self.find(name)) is not None]
                    if any(v.pinned for v in victims):
                        continue  # pinned while the decision was made (off the loop): decide again
                    command = self.launch_command(placed)
                    if load.replacing is not None:
                        victims.append(load.replacing)
                    for victim in victims:
                        if victim.admission is Admission.ACCEPTING:  # a group already open runs to its end
                            victim.pause(reason=f"its memory is reserved for {load.entry.name}")
                        if victim not in load.paused:
                            load.paused.append(victim)
                    load.victims = tuple(victims)
                    load.restarts = self._reserve_restarts(load, placed, victims)
                    load.reservation = placement.reservation(load.entry.name, placed.plan, time.monotonic())
                    load.move(LoadStep.RESERVED)
                    break
                if not placed.blocked_by and not behind:
                    smaller = await self.lookup.smaller_variant(load.model, placed.model.file_size - placed.shortfall)
                    raise wording.does_not_fit(load.entry.name, placed, smaller)
                if time.monotonic() >= deadline:
                    raise wording.no_memory_now(load.entry.name, placed, self.residency.busy_wait)
                # New requests would keep the busy models busy for ever: once ``group_size`` more came in
                # (they run before the swap, together), hold them back until this load got the memory or
                # gave up. Requests in flight finish.
                grouping = False
                for name in placed.drain:
                    if (busy := self.find(name)) is not None:
                        # a pause a restart ended (admission is a sub-state of ready) begins again here
                        busy.pause(after=self.residency.group_size, reason=f"{load.entry.name} waits for its memory")
                        if busy not in load.paused:
                            load.paused.append(busy)
                        grouping = grouping or busy.grouping
                if load.step is LoadStep.CHECKING:
                    load.move(LoadStep.WAITING)
                    load.waiting_since = load.waiting_since or time.monotonic()
                changed = self._changed
            wait = deadline - time.monotonic()
            if grouping:  # an idle model's group ends when no request came for GROUP_LINGER s: look again then
                wait = min(wait, GROUP_LINGER)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(0.01, wait))
        try:
            await self._drained(load, deadline)
            load.move(LoadStep.STARTING)
            for victim in load.victims:
                if victim is not load.replacing:
                    log.info("evicting idle model", model=victim.name, for_model=load.entry.name)
                    self.counters["evictions"] += 1
                await victim.unload(
                    grace=0,
                    reason=f"{victim.name} was evicted to make room for {load.entry.name}",
                    why="evicted" if victim is not load.replacing else "restart",
                )
            for old, threads in load.restarts:
                await self._restart_with(old, threads, why=f"once {load.entry.name} loaded beside it on the CPU")
            resident = self._new_resident(load, placed, command)
        except BaseException:
            command.cleanup()
            raise
        load.reservation = None
        state = await resident.wait_settled()
        if state is not ResidentState.READY:
            raise resident.failure or StudioError(
                resident.error or f"{resident.name} failed to load", code="load_failed"
            )
        return resident

    def _waits_behind(self, load: Load) -> bool:
        """Whether another load began waiting for memory before ``load`` and still waits: it evicts first."""
        since = load.waiting_since or math.inf
        return any(
            other.step is LoadStep.WAITING and (other.waiting_since or math.inf) < since
            for other in self._loads.values()
            if other is not load
        )

    async def _drained(self, load: Load, deadline: float) -> None:
        """Wait, outside the placement lock, until the paused victims' requests in flight are done.

        Raises:
            BusyError: ``busy_wait`` ran out first; the load is undone and the victims serve on.
        """
        while True:
            changed = self._changed
            paused = (*load.victims, *(r for r, _ in load.restarts))
            busy = [v for v in paused if not v.idle and v.state is ResidentState.READY]
            if not busy:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise wording.still_serving(load.entry.name, busy, self.residency.busy_wait)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    def _reserve_restarts(
        self, load: Load, placed: Placed, victims: list[ResidentModel]
    ) -> tuple[tuple[ResidentModel, int], ...]:
        """Pause the idle CPU residents the decision restarts with their share of the cores (as a victim is paused:
        new requests wait), under the placement lock; one another load pauses already is left to that load."""
        out = []
        for name, threads in placed.restart:
            r = self.find(name)
            if (
                r is None
                or r in victims
                or r.state is not ResidentState.READY
                or r.admission is not Admission.ACCEPTING
            ):
                continue
            r.pause(reason=f"it restarts with {threads} thread(s) so that {load.entry.name} shares the cores")
            load.paused.append(r)
            out.append((r, threads))
        return tuple(out)

    async def _restart_with(self, old: ResidentModel, threads: int, *, why: str) -> None:
        """Restart the idle ``old`` with ``threads``, its share of the cores ``why``: its slots are saved as it stops
        and restored when its conversation continues; requests for it wait for the new instance. A failed restart
        fails only it."""
        log.info("restarting idle model with its share of the cores", model=old.name, threads=threads, why=why)
        new = self.builder.restarted(old, threads, why=why)
        new.before_restart = functools.partial(self._room_to_restart, new)
        self._residents[old.settings.key] = new  # requests waiting for the old instance find this one
        for name in [n for n, r in self._routes.items() if r is old]:
            self._routes[name] = new
        stopping = asyncio.ensure_future(
            old.unload(grace=0, reason=f"{old.name} restarts with its share of the cores", why="restart")
        )
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:  # an unload or the shutdown: the old llama-server is stopped before it goes on
            await stopping
            raise
        finally:  # the load cancelled meanwhile: the model still comes back (requests wait for this instance)
            new.start()
        state = await new.wait_settled()
        if state in GOING_AWAY or state is ResidentState.UNLOADED:
            log.info("a model restarting with its share of the cores was unloaded meanwhile", model=old.name)
        elif state is not ResidentState.READY:
            log.warning("the restart with a share of the cores failed", model=old.name, error=new.error)

    def _cores_changed(self, resident: ResidentModel | None) -> None:
        """Divide the cores again (``_rebalance``) once a CPU resident left, a load ended (``resident`` None), or a
        resident waiting for its share turned idle; never while a load is in flight (its decision owns them)."""
        if resident is None or (resident.state in NOT_SERVING and resident.plan.layers_on_cpu):
            self._cores_due = True
        elif resident.name in self._once_idle and resident.idle and resident.state is ResidentState.READY:
            self._cores_due = True
        self._rebalance_soon()

    def _rebalance_soon(self, *_: object) -> None:
        if self._cores_due and not self._loads and not self._closing and not self.dividing_cores:
            self._cores_due = False
            self._rebalancing = asyncio.create_task(self._rebalance(), name="divide the cores")
            self._rebalancing.add_done_callback(self._rebalance_soon)  # what changed meanwhile

    @property
    def dividing_cores(self) -> bool:
        """Whether residents are being restarted with their share of the cores, between loads (``_rebalance``)."""
        return self._rebalancing is not None and not self._rebalancing.done()

    async def _rebalance(self) -> None:
        """Restart the idle CPU residents ``placement.rebalance`` names with their share of the cores, under the
        placement lock: a load that comes meanwhile decides once they are back. Busy ones it names are looked at
        again when they turn idle."""
        async with self._placement:
            residents = sorted(self._residents.values(), key=lambda r: r.created)
            snapshot = self.placer.now(residents, loads=len(self._loads))
            change = placement.rebalance(snapshot) if snapshot is not None else placement.Rebalance()
            self._once_idle = frozenset(change.once_idle)
            restarts = [
                (r, threads)
                for name, threads in change.restart
                if (r := self.find(name)) is not None
                and r.state is ResidentState.READY
                and r.idle
                and r.admission is Admission.ACCEPTING
            ]
            for r, threads in restarts:  # paused at once: no request enters between the snapshot and its restart
                r.pause(reason=f"it restarts with {threads} thread(s), its share of the cores")
            for r, threads in restarts:
                try:
                    await self._restart_with(r, threads, why="once the models beside it on the CPU changed")
                except StudioError as exc:  # its launch files could not be written: it serves on as it is
                    log.warning("could not restart a model with its share of the cores", model=r.name, error=str(exc))
                    r.resume(f"its restart with {threads} thread(s) could not begin")

    def _commit(self, load: Load, resident: ResidentModel) -> None:
        """The new resident is ready: route it, remember its extra flags, let the paused models serve on."""
        load.resume_paused(f"{load.entry.name} is loaded")
        if not resident.settings.embeddings:  # an embedding instance takes no extra flags
            self._last_extra_args[load.entry.path] = resident.settings.extra_args
        self._route(load.model, resident)
        load.move(LoadStep.COMMITTED)
        load.outcome.set_result(resident)

    async def _undo(self, load: Load) -> None:
        """Leave things as they were: paused models serve on; a cancelled load's llama-server is stopped.

        A failed start stays visible as ``failed`` (it holds nothing) so ``/api/status`` says why; the next
        request retries it with the remembered settings, never the failed ones.
        """
        load.resume_paused(f"the load of {load.entry.name} was undone")
        load.reservation = None
        resident = load.resident
        if resident is not None and (load.cancelled is not None or resident.state is not ResidentState.FAILED):
            await resident.unload(grace=0, reason=load.cancelled or f"the load of {resident.name} was undone")
        if load.step is not LoadStep.UNDONE:
            load.move(LoadStep.UNDONE)

    def launch_command(self, placed: Placed) -> LaunchCommand:
        """The command a load of ``placed`` runs (``ggstudio plan`` prints the same)."""
        return self.builder.launch_command(placed)

    async def _place(
        self,
        entry: CatalogEntry,
        request: LoadRequest,
        *,
        replacing: ResidentModel | None = None,
        load: Load | None = None,
    ) -> Placed:
        """Where ``entry`` goes beside the residents as they will be, once other loads in flight are done."""
        return await self.placer.place(
            entry.name,
            self._settings(request, entry),
            lambda: sorted(self._residents.values(), key=lambda r: r.created),
            lambda: [other for other in self._loads.values() if other is not load],
            replacing=replacing,
        )

    def _new_resident(self, load: Load, placed: Placed, command: LaunchCommand) -> ResidentModel:
        """Create and start the new resident model (its owner takes it from there)."""
        resident = self.builder.resident(
            load.entry,
            load.request,
            placed,
            command,
            was=load.replacing,
            on_change=self._on_resident_change,
            on_transition=self._events.transition,
            on_admission=self._events.admission,
        )
        resident.before_restart = functools.partial(self._room_to_restart, resident)
        load.resident = resident
        self._residents[placed.settings.key] = resident
        self.counters["loads"] += 1
        resident.start()
        return resident

    async def _room_to_restart(self, resident: ResidentModel) -> BusyError | None:
        """A crashed model's restart planned again against the memory free now: None when it fits there as it is;
        else the 503 its waiting requests get instead of a restart into the same death (the out-of-memory killer
        takes a model when another program took the room). The next request loads it anew, as any load."""
        async with self._placement:
            placed = await self.placer.place(
                resident.name,
                resident.settings,
                lambda: sorted(self._residents.values(), key=lambda r: r.created),
                lambda: list(self._loads.values()),
                replacing=resident,
            )
        if placed.fits and not placed.evict:
            return None
        need = placement.in_words(placement.physical(placed.plan.bill, placed.plan))
        held = [f"held by {', '.join(placed.blocked_by)}"] if placed.blocked_by else []
        if placed.evict:
            held.append(f"it fits only once {', '.join(placed.evict)} are evicted")
        elif placed.room:
            held.append(f"{placed.room} is left even with every idle model evicted")
        if self.residency.memory_budget is None:
            held.append("other programs hold the rest of the memory")
        return BusyError(f"not enough memory to restart {resident.name} now: it needs {need}; " + "; ".join(held))
