"""The model manager: which models are resident, where a new one goes, and which one a request uses.

It decides only placement and routing; each resident model's life belongs to its
own ``ResidentModel``. A request for a ready model takes the fast path: a name
lookup and an in-flight count, no lock. A request for a model that is not
resident waits (in a bounded queue) while one placement at a time plans it
against memory as it will be (``studio.residency.placement``), evicts what must
go, and starts it; requests that arrive meanwhile for the same model wait for
that one start, so concurrent first requests start exactly one llama-server.

A request never changes a resident model's server settings: only an explicit
load with other settings restarts it, once its requests in flight are done.

Header reads, plans and device queries run off the event loop with a time limit
(``studio.blocking``), so a hostile file cannot stall other clients.

Every load, failed load, eviction, crash and restart is told to ``listeners`` as a
``ResidencyEvent`` with its duration (``/metrics`` counts them), read from the
resident models' state changes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import structlog

import gguf
from gguf.templates import template_capabilities
from launcher.capabilities import Capabilities
from launcher.command import build_command
from launcher.devices import Inventory, discover
from launcher.memory import DeviceBill, MemoryBill
from launcher.planner import MIN_AUTO_CTX, LaunchPlan, ModelInfo, PlanRequest, plan
from launcher.registry import ChildRegistry
from launcher.supervisor import Status, Supervisor
from launcher.units import format_mib
from studio.blocking import run_blocking
from studio.errors import (
    BadRequestError,
    BusyError,
    DoesNotFitError,
    ModelNotFoundError,
    ModelNotResidentError,
    NotReadyError,
    StudioError,
)
from studio.library.catalog import Catalog, CatalogEntry
from studio.library.downloads import DownloadManager, is_repo_spec
from studio.residency import placement
from studio.residency.lifecycle import COMING_UP, GOING_AWAY, HOLDS_MEMORY, ResidentState
from studio.residency.placement import TOTAL, Holder
from studio.residency.requests import LoadRequest, LoadSettings, load_settings, model_defaults_for
from studio.residency.resident import Lease, LoadedModel, ResidentModel
from studio.settings import ModelDefaults, ResidencySettings

log = structlog.get_logger(__name__)

#: Makes one model's supervisor; it hands every state change to the callback it is given.
SupervisorFactory = Callable[[Callable[[Status], None]], Supervisor]
Planner = Callable[[ModelInfo, Inventory, Capabilities, PlanRequest], LaunchPlan]


def supervisor_factory(logs_dir: Path, registry: ChildRegistry) -> SupervisorFactory:
    """Supervisors that log into ``logs_dir`` and record their children in ``registry``."""
    return lambda on_change: Supervisor(logs_dir=logs_dir, registry=registry, on_change=on_change)


@dataclass(frozen=True)
class ResidencyEvent:
    """A resident model came, went, crashed or restarted, and how long the change took."""

    kind: Literal["loaded", "load_failed", "evicted", "crashed", "restarted"]
    model: str
    seconds: float = 0.0  # loaded, load_failed: since its start began; evicted: stopping its llama-server
    reason: str = ""  # load_failed: "error" or "cancelled"; evicted: "evicted", "unload", "ttl", "restart", "shutdown"


@dataclass(frozen=True)
class Placed:
    """A planned load: the plan, the resident models that must go for it, and whether it then fits."""

    plan: LaunchPlan
    evict: tuple[str, ...]  # idle models to unload first
    blocked_by: tuple[str, ...]  # when it does not fit: busy or pinned models holding the memory, in words
    fits: bool
    model: gguf.GGUFFile
    settings: LoadSettings
    need: str = ""  # when it does not fit: what it needs, and what evicting every idle model would leave
    room: str = ""
    drain: tuple[str, ...] = ()  # busy models that would free enough once their requests are done
    shortfall: int = 0  # bytes missing even with every evictable model gone


class ModelManager:
    """The resident models of one studio; see the module docstring."""

    def __init__(
        self,
        *,
        catalog: Catalog,
        binary: Path,
        caps: Capabilities,
        make_supervisor: SupervisorFactory,
        discover_devices: Callable[[], Inventory] | None = None,
        files_root: Path | None = None,
        model_defaults: Mapping[str, ModelDefaults] | None = None,
        residency: ResidencySettings | None = None,
        max_waiting: int = 64,
        work_timeout: float = 30.0,
        planner: Planner = plan,
        downloads: DownloadManager | None = None,
        spec_measurements: Path | None = None,
    ) -> None:
        self.catalog = catalog
        self.binary = binary
        self.caps = caps
        self.make_supervisor = make_supervisor
        self.discover_devices = discover_devices or (lambda: discover(llama_server=binary))
        self.files_root = files_root
        self.model_defaults = dict(model_defaults or {})  # per model name, from the config file
        self.residency = residency or ResidencySettings()
        self.max_waiting = max_waiting
        self.work_timeout = work_timeout  # seconds a header read, a plan or a device query may take
        self.planner = planner  # tests pass a slow one to show the event loop stays free
        self.downloads = downloads  # fetches an uncached owner/repo:VARIANT when its auto_download is on
        self.spec_measurements = spec_measurements  # ``bench-spec``'s results, which ``auto`` follows
        self._residents: dict[Path, ResidentModel] = {}
        self._routes: dict[str, ResidentModel] = {}  # every name a request used for a resident model
        self._default: ResidentModel | None = None  # the model a request without ``model`` uses
        self._pending: dict[Path, LoadRequest] = {}  # explicit loads waiting for the old instance to go
        self._resolving: str | None = None
        self._coming_default: str | None = None  # the first preload, until it is resident
        self._placement = asyncio.Lock()
        self._changed = asyncio.Event()  # set whenever a resident model goes idle, changes state or goes
        self._waiting = 0
        self._last_extra_args: dict[Path, tuple[str, ...]] = {}
        self.counters = {"loads": 0, "evictions": 0, "load_failures": 0}
        self.listeners: list[Callable[[ResidencyEvent], None]] = []  # told of every load, eviction, crash
        self._seen: dict[ResidentModel, tuple[ResidentState, ResidentState | None, float]] = {}  # state, before, since
        self._why: dict[ResidentModel, str] = {}  # why the manager unloads a model (else it was its TTL)

    # -- state ---------------------------------------------------------------------------------
    @property
    def residents(self) -> list[ResidentModel]:
        """The resident models, oldest first."""
        return sorted(self._residents.values(), key=lambda r: r.created)

    @property
    def default(self) -> ResidentModel | None:
        """The model a request without ``model`` goes to: the last one loaded explicitly, else the latest."""
        if self._default is not None and self._default.state is not ResidentState.UNLOADED:
            return self._default
        live = [r for r in self.residents if r.state in HOLDS_MEMORY]
        return max(live, key=lambda r: r.last_used) if live else None

    @property
    def loaded(self) -> LoadedModel | None:
        """The default model, if it is ready."""
        default = self.default
        return default.loaded if default is not None and default.state is ResidentState.READY else None

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def resolving(self) -> str | None:
        """The model a placement is working on now, if any."""
        return self._resolving

    def find(self, model: str) -> ResidentModel | None:
        """The resident model a request's ``model`` names, by any name it was used under, or its path."""
        found = self._routes.get(model)
        if found is not None and found.state is not ResidentState.UNLOADED:
            return found
        for r in self._residents.values():
            if model in (r.name, str(r.settings.path)):
                return r
        return None

    # -- requests ------------------------------------------------------------------------------
    async def acquire(self, model: str | None) -> tuple[LoadedModel, Lease]:
        """Return the model a request should use (loading it if needed) and the lease to release.

        Raises:
            BusyError: too many requests wait already, or busy models hold the memory it needs.
            studio.errors.ModelNotFoundError: ``model`` is unknown.
            DoesNotFitError: the model cannot fit even with every idle model evicted.
        """
        resident = self._routes.get(model) if model is not None else self.default
        if resident is not None:
            try:
                return resident.enter()
            except NotReadyError:
                pass
        name = model if model is not None else resident.name if resident is not None else self._coming_default
        if name is None:
            raise BadRequestError("no model is loaded and the request names none; pass `model`", param="model")
        return await self._queued(lambda: self._ready(name, None))

    async def load(self, request: LoadRequest) -> LoadedModel:
        """Make ``request``'s model resident (or keep it, if its settings are equal) and the default; return it."""
        loaded, lease = await self._queued(lambda: self._ready(request.model, request))
        await lease()
        resident = self.find(request.model)
        if resident is not None:
            self._default = resident
            if request.ttl is not None:
                resident.set_ttl(request.ttl)
            if request.pinned is not None:
                resident.set_pinned(request.pinned)
        return loaded

    async def preload(self, requests: Sequence[LoadRequest]) -> None:
        """Load ``requests`` in order; the first is the default, and requests without ``model`` that arrive
        meanwhile wait for it rather than being told no model is loaded. A failure is logged, the rest go on."""
        self._coming_default = requests[0].model if requests else None
        try:
            for request in requests:
                try:
                    await self.load(request)
                except Exception as exc:  # shown in /api/status; the service keeps running
                    log.error("preloading a model failed", model=request.model, error=str(exc))
                finally:
                    self._coming_default = None
        finally:
            self._coming_default = None

    async def _queued(self, work: Callable[[], Any]) -> Any:
        if self._waiting >= self.max_waiting:
            raise BusyError(f"{self._waiting} requests are already waiting for a model load; retry shortly")
        self._waiting += 1
        try:
            return await work()
        finally:
            self._waiting -= 1

    async def _ready(self, model: str, request: LoadRequest | None) -> tuple[LoadedModel, Lease]:
        """Wait until ``model`` is resident and ready, placing and starting it when needed, and enter it."""
        while True:
            resident = await self._resident_for(model, request)
            state = await resident.wait_settled()
            if state is ResidentState.READY:
                try:
                    return resident.enter()
                except NotReadyError:
                    await resident.admitted()  # paused for a load that waits for its memory, or going away
                    continue
            if state is ResidentState.FAILED:
                raise resident.failure or StudioError(resident.error or f"{resident.name} failed to load")
            await resident.wait_until({ResidentState.UNLOADED})  # going away: then load it anew

    async def _resident_for(self, model: str, request: LoadRequest | None) -> ResidentModel:
        """The resident model for ``model`` with ``request``'s settings, placed and started when there is none."""
        entry = await self._entry(model)
        request = request or self._pending.get(entry.path)
        deadline = time.monotonic() + self.residency.busy_wait
        paused: list[ResidentModel] = []
        try:
            return await self._place_and_start(model, entry, request, deadline, paused)
        finally:
            self._resume(paused)

    def _resume(self, paused: list[ResidentModel]) -> None:
        for victim in paused:
            victim.resume()
        paused.clear()

    async def _place_and_start(
        self, model: str, entry: CatalogEntry, request: LoadRequest | None, deadline: float, paused: list[ResidentModel]
    ) -> ResidentModel:
        while True:
            existing = self._residents.get(entry.path)
            if existing is not None and existing.state in GOING_AWAY:
                await existing.wait_until({ResidentState.UNLOADED})
                continue
            async with self._placement:
                existing = self._residents.get(entry.path)
                if existing is not None and existing.state in (ResidentState.FAILED, ResidentState.UNLOADED):
                    await existing.unload(grace=0, reason="")  # a failed one is retried; it holds nothing
                    existing = None
                if existing is not None and existing.state not in GOING_AWAY:
                    if request is None or self._settings(request, entry) == existing.settings:
                        self._route(model, existing)
                        return existing
                    self._pending[entry.path] = request
                    log.info("settings changed: restarting once its requests finish", model=existing.name)
                elif existing is None:
                    placed = await self._place(entry, request or LoadRequest(model=model))
                    force = request is not None and request.force
                    if placed.fits or force:
                        resident = await self._start(entry, placed, request)
                        self._route(model, resident)
                        self._pending.pop(entry.path, None)
                        return resident
                    if not placed.blocked_by:
                        smaller = await self._smaller_variant(model, entry, placed)
                        raise DoesNotFitError(
                            f"{entry.name} does not fit even with every idle model evicted: it needs {placed.need}"
                            f" where {placed.room or 'nothing'} could be freed; "
                            + (f"{smaller} is the largest variant of its repo that would fit, or " if smaller else "")
                            + "load it with a smaller n_ctx (see the plan's largest_safe_context) or raise "
                            "memory_budget"
                        )
                    if time.monotonic() >= deadline:
                        self._resume(paused)
                        raise BusyError(
                            f"not enough memory for {entry.name} now: it needs {placed.need}; held by "
                            f"{', '.join(placed.blocked_by)}; retry once they are idle",
                            retry_after=max(1, round(self.residency.busy_wait / 6) or 1),
                        )
                    # New requests would keep the busy models busy for ever: hold them back (in-flight ones
                    # finish) until this load got their memory or gave up.
                    for name in placed.drain:
                        if (victim := self.find(name)) is not None and victim not in paused:
                            victim.pause()
                            paused.append(victim)
                    changed = self._changed
            if existing is not None:  # a restart with new settings: let its requests finish, then place again
                self._why.setdefault(existing, "restart")
                await existing.unload(grace=float("inf"), reason="")
                continue
            try:
                await asyncio.wait_for(changed.wait(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                pass

    async def _smaller_variant(self, model: str, entry: CatalogEntry, placed: Placed) -> str | None:
        """For a Hub model, the largest variant of its repo whose weights are smaller by at least the shortfall."""
        if self.downloads is None or not is_repo_spec(model):
            return None
        largest = placed.model.file_size - placed.shortfall

        def fits(size: int, label: str) -> bool:
            return size <= largest

        try:
            return await run_blocking(
                self.downloads.suggest_variant,
                model,
                fits,
                timeout=self.work_timeout,
                what=f"listing the variants of {model}",
            )
        except (StudioError, OSError):  # offline, or the Hub is unreachable: the advice just goes without it
            return None

    def _route(self, model: str, resident: ResidentModel) -> None:
        self._routes[model] = resident
        self._routes.setdefault(resident.name, resident)

    def _settings(self, request: LoadRequest, entry: CatalogEntry) -> LoadSettings:
        return load_settings(request, entry, self.model_defaults, last_extra_args=self._last_extra_args.get(entry.path))

    # -- placement -----------------------------------------------------------------------------
    async def preview(self, request: LoadRequest) -> Placed:
        """What a load of ``request`` would get, and which resident models it would evict; loads nothing."""
        entry = await self._entry(request.model)
        return await self._place(entry, request, replacing=self._residents.get(entry.path))

    async def _entry(self, model: str) -> CatalogEntry:
        """The catalog entry of ``model``; an uncached ``owner/repo:VARIANT`` is downloaded first when allowed."""
        try:
            return await run_blocking(self.catalog.resolve, model, timeout=self.work_timeout, what=f"finding {model}")
        except ModelNotFoundError:
            if self.downloads is None or not is_repo_spec(model):
                raise
        path = await self.downloads.ensure_available(model)  # a 404 saying how to pull, when not allowed
        entry = await run_blocking(self.catalog.resolve, str(path), timeout=self.work_timeout, what=f"finding {path}")
        return replace(entry, name=model)

    async def _place(
        self, entry: CatalogEntry, request: LoadRequest, *, replacing: ResidentModel | None = None
    ) -> Placed:
        """Plan ``entry`` against memory as it will be, and choose the fewest idle models to evict for it."""
        self._resolving = entry.name
        try:
            model = await run_blocking(
                gguf.read, entry.path, timeout=self.work_timeout, what=f"reading {entry.path.name}"
            )
            settings = self._settings(request, entry)
            inventory = self._without_busy_workers(
                await run_blocking(self.discover_devices, timeout=self.work_timeout, what="listing devices"), replacing
            )
            projector = (
                await run_blocking(
                    gguf.read, settings.mmproj, timeout=self.work_timeout, what=f"reading {settings.mmproj.name}"
                )
                if settings.mmproj
                else None
            )
            info = ModelInfo.from_gguf(model, mmproj=projector)
            holders = [self._holder(r) for r in self.residents if r.state in HOLDS_MEMORY and r is not replacing]
            loading = self._loading_names()
            budget = self._budget(inventory)
            budgeted = budget is not None
            base = placement.base_available(
                budget=budget,
                free=_free(inventory),
                holders=[h for h in holders if h.name not in loading],
                loading=[h for h in holders if h.name in loading],
            )
            plan_request = replace(settings.plan_request(entry.name), spec_measurements=self.spec_measurements)
            first = await self._plan(info, inventory, base, plan_request, budgeted)
            cap = self.residency.max_resident
            crowded = cap is not None and len(holders) >= cap
            if _fits(first, base) and not crowded:
                return Placed(first, (), (), True, model, settings)
            # The fewest evictions that let the model fit at its smallest context; the final plan then takes
            # whatever context the freed memory allows.
            everything = placement.with_evicted(base, [h for h in holders if h.evictable], budgeted=budgeted)
            smallest = (
                plan_request
                if plan_request.n_ctx is not None
                else replace(plan_request, n_ctx=min(MIN_AUTO_CTX, max(first.native_ctx, 256)))
            )
            need = physical((await self._plan(info, inventory, everything, smallest, budgeted)).bill, first)
            evict = placement.choose_evictions(
                need, base, holders, budgeted=budgeted, max_count=self.residency.max_resident
            )
            if evict is None:
                ready = {r.name for r in self.residents if r.state is ResidentState.READY}
                once_idle = [replace(h, busy=False) if h.name in ready else h for h in holders]
                drain = (
                    placement.choose_evictions(
                        need, base, once_idle, budgeted=budgeted, max_count=self.residency.max_resident
                    )
                    or ()
                )
                return Placed(
                    first,
                    (),
                    placement.holders_in_words(holders),
                    False,
                    model,
                    settings,
                    need=_in_words(need),
                    room=_in_words(everything),
                    drain=drain,
                    shortfall=max(placement.shortfall(need, everything).values(), default=0),
                )
            freed = placement.with_evicted(base, [h for h in holders if h.name in evict], budgeted=budgeted)
            final = await self._plan(info, inventory, freed, plan_request, budgeted)
            return Placed(final, evict, (), _fits(final, freed), model, settings)
        finally:
            self._resolving = None

    async def _plan(
        self, info: ModelInfo, inventory: Inventory, available: Mapping[str, int], request: PlanRequest, budgeted: bool
    ) -> LaunchPlan:
        shared = _inventory_for(inventory, available, budgeted=budgeted)
        return await run_blocking(
            self.planner, info, shared, self.caps, request, timeout=self.work_timeout, what=f"planning {info.path.name}"
        )

    def _without_busy_workers(self, inventory: Inventory, replacing: ResidentModel | None) -> Inventory:
        """An RPC worker serves one llama-server at a time: leave out the workers resident models use."""
        taken = {
            w: r.name
            for r in self.residents
            if r.state in HOLDS_MEMORY and r is not replacing
            for w in r.plan.rpc_workers
        }
        if not any(d.endpoint in taken for d in inventory.rpc):
            return inventory
        left_out = sorted({f"{d.endpoint} (serving {taken[d.endpoint]})" for d in inventory.rpc if d.endpoint in taken})
        return replace(
            inventory,
            devices=tuple(d for d in inventory.devices if d.endpoint not in taken),
            warnings=(
                *inventory.warnings,
                "RPC workers busy with another resident model are left out: " + ", ".join(left_out),
            ),
        )

    def _budget(self, inventory: Inventory) -> dict[str, int] | None:
        budget = self.residency.memory_budget
        if budget is None:
            return None
        if budget.total is not None:  # each device alone may take the whole budget; the sum is checked too
            return {TOTAL: budget.total, **{d.key: budget.total for d in inventory.devices}}
        return {d.key: budget.per_device.get(d.key, 0) for d in inventory.devices}

    def _loading_names(self) -> set[str]:
        return {r.name for r in self._residents.values() if r.state in COMING_UP}

    def _holder(self, r: ResidentModel) -> Holder:
        predicted = physical(r.plan.bill, r.plan)
        actual = r.actual
        if actual is not None:  # what it allocated, plus what it will grow by (drafted logits, MiniMax's masks)
            growth = {k: d.output_growth + d.compute_growth for k, d in _by_device(r.plan.bill, r.plan).items()}
            held = {k: d.total + growth.get(k, 0) for k, d in _by_device(actual, r.plan).items()}
        else:
            held = predicted
        # mapped weights on the CPU are page cache: free memory already counts them as available
        cpu_weights = _by_device(actual or r.plan.bill, r.plan).get("CPU")
        reclaim = {k: n - (cpu_weights.weights if k == "CPU" and cpu_weights else 0) for k, n in held.items()}
        return Holder(
            name=r.name,
            held=held,
            reclaim=reclaim,
            last_used=r.last_used,
            busy=not r.idle or r.state is not ResidentState.READY,
            pinned=r.pinned,
        )

    async def _start(self, entry: CatalogEntry, placed: Placed, request: LoadRequest | None) -> ResidentModel:
        """Evict what the placement chose, then start the new resident model (its owner takes it from there)."""
        for name in placed.evict:
            victim = self.find(name)
            if victim is not None:
                log.info("evicting idle model", model=name, for_model=entry.name)
                self.counters["evictions"] += 1
                # No grace limit: a request that slipped in while the plan was made finishes; none is cut.
                self._why.setdefault(victim, "evicted")
                await victim.unload(grace=float("inf"), reason=f"{name} was evicted to make room for {entry.name}")
        try:
            command = build_command(placed.plan, self.caps, binary=self.binary, files_root=self.files_root)
        except OSError as exc:
            raise StudioError(f"could not prepare llama-server's launch files: {exc}", code="launch_files") from exc
        own = model_defaults_for(entry, self.model_defaults)
        facts = placed.model.facts
        resident = ResidentModel(
            name=entry.name,
            settings=placed.settings,
            plan=placed.plan,
            command=command,
            spec=command.launch_spec(),
            facts=facts,
            template=template_capabilities(template)
            if (template := placed.settings.chat_template or facts.chat_template)
            else None,
            make_supervisor=self.make_supervisor,
            ttl=next(t for t in ((request.ttl if request else None), own.ttl, self.residency.ttl) if t is not None),
            pinned=bool(request.pinned if request and request.pinned is not None else own.pinned),
            on_change=self._on_resident_change,
        )
        self._residents[entry.path] = resident
        self._last_extra_args[entry.path] = placed.settings.extra_args
        self.counters["loads"] += 1
        resident.start()
        return resident

    def _on_resident_change(self, resident: ResidentModel) -> None:
        self._tell(resident)
        if resident.state is ResidentState.FAILED:
            self.counters["load_failures"] += 1
        if resident.state is ResidentState.UNLOADED:
            if self._residents.get(resident.settings.path) is resident:
                del self._residents[resident.settings.path]
            for name in [n for n, r in self._routes.items() if r is resident]:
                del self._routes[name]
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _tell(self, r: ResidentModel) -> None:
        """Turn a resident model's state change into a ``ResidencyEvent`` for the listeners."""
        state, before, since = self._seen.get(r, (ResidentState.LOADING, None, r.created))
        if r.state is state:
            return  # a request left; no change
        now = time.monotonic()
        self._seen[r] = (r.state, state, now)
        event = None
        if state is ResidentState.LOADING and r.state is ResidentState.READY:
            event = ResidencyEvent("loaded", r.name, now - since)
        elif state is ResidentState.LOADING:
            event = ResidencyEvent(
                "load_failed", r.name, now - since, "cancelled" if r.state is ResidentState.UNLOADING else "error"
            )
        elif r.state is ResidentState.CRASHED:
            event = ResidencyEvent("crashed", r.name)
        elif state is ResidentState.CRASHED and r.state is ResidentState.LOADING:
            event = ResidencyEvent("restarted", r.name)
        elif r.state is ResidentState.UNLOADED:
            del self._seen[r]
            why = self._why.pop(r, "ttl")  # the one unload a resident model starts itself is its TTL's
            if before is ResidentState.DRAINING:  # it was serving; a failed or crashed one held nothing
                event = ResidencyEvent("evicted", r.name, now - since, why)
        if event is not None:
            for listener in self.listeners:
                listener(event)

    # -- unload, lifetime ----------------------------------------------------------------------
    async def unload(self, model: str | None = None, *, grace: float | None = None) -> None:
        """Unload ``model`` (every model when None): requests in flight get ``grace`` s, then an error.

        Raises:
            ModelNotResidentError: ``model`` is not resident.
        """
        grace = self.residency.unload_grace if grace is None else grace
        targets = list(self._residents.values()) if model is None else [self._resident_named(model)]
        for r in targets:
            self._why.setdefault(r, "unload")
        await asyncio.gather(
            *(r.unload(grace=grace, reason=f"{r.name} was unloaded while this request ran") for r in targets)
        )

    def set_ttl(self, model: str, ttl: float) -> None:
        """Set a resident model's idle TTL in seconds (0: never)."""
        if ttl < 0:
            raise BadRequestError("ttl must be 0 (never) or a number of seconds", param="ttl")
        self._resident_named(model).set_ttl(ttl)

    def set_pinned(self, model: str, pinned: bool) -> None:
        """Pin a resident model (never evicted, no TTL) or unpin it."""
        self._resident_named(model).set_pinned(pinned)

    def _resident_named(self, model: str) -> ResidentModel:
        found = self.find(model)
        if found is None:
            resident = ", ".join(r.name for r in self.residents) or "none"
            raise ModelNotResidentError(f"{model!r} is not resident (resident: {resident})")
        return found

    async def aclose(self) -> None:
        """Unload every model now (at shutdown no request waits)."""
        for r in self._residents.values():
            self._why.setdefault(r, "shutdown")
        await asyncio.gather(
            *(r.unload(grace=0, reason="the studio is shutting down") for r in list(self._residents.values())),
            return_exceptions=True,
        )

    def close_now(self) -> None:
        """Stop every llama-server from any thread, without the event loop (a last resort at exit)."""
        for r in list(self._residents.values()):
            r.supervisor.close()
            r.command.cleanup()


def physical(bill: MemoryBill, launch: LaunchPlan) -> dict[str, int]:
    """``bill``'s bytes per physical device (``CPU``, ``CUDA0``...): its ``GPU<i>`` is the plan's i-th GPU."""
    return {k: d.total for k, d in _by_device(bill, launch).items()}


def _by_device(bill: MemoryBill, launch: LaunchPlan) -> dict[str, DeviceBill]:
    out: dict[str, DeviceBill] = {}
    for d in bill.devices:
        if d.device.startswith("GPU") and d.device[3:].isdigit() and int(d.device[3:]) < len(launch.gpus):
            out[launch.gpus[int(d.device[3:])].key] = d
        else:
            out[d.device] = d
    return out


def _fits(launch: LaunchPlan, available: Mapping[str, int]) -> bool:
    """The planner's own verdict, and, under a budget on all devices together, their sum within it."""
    return launch.fits and not placement.shortfall(physical(launch.bill, launch), available)


def _free(inventory: Inventory) -> dict[str, int]:
    return {d.key: d.free_bytes for d in inventory.devices}


def _inventory_for(inventory: Inventory, available: Mapping[str, int], *, budgeted: bool) -> Inventory:
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


def _in_words(bytes_per_device: Mapping[str, int]) -> str:
    return ", ".join(
        f"{format_mib(n)} on {d}" if d != TOTAL else f"{format_mib(n)} in all" for d, n in bytes_per_device.items()
    )
