"""The model manager: which models are resident, and which one a request uses.

It coordinates: it routes names to residents (every name that reaches one file finds the one
resident, which goes by the model's name), keeps the bounded queue of requests waiting for a load,
and runs each load as a transaction (``studio.residency.transaction``), at most one per instance
(``LoadSettings.key``). What it asks along the way belongs elsewhere: where a model goes and what
must make room (``placement.decide``, fed by ``placer``), which file a name means (``lookup``), what a
resident is made of (``builder``), the errors' words (``wording``), the events listeners hear
(``events``), each resident's life (``resident``).

A request for a ready model takes the fast path: a name lookup and an in-flight count, no lock.
Requests for a model not resident wait for its one load, so concurrent first requests start one
llama-server. Loads that must wait for busy models' memory let each of them take ``group_size``
more requests, then pause them: requests for a model run together instead of a swap each, and
loads that must evict take turns in the order they began waiting. A request never changes a
resident's settings: only an explicit load with other settings restarts it. An embeddings request
for a model whose instance does not embed goes to its embedding instance, ``"M (embeddings)"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from launcher.capabilities import Capabilities
from launcher.command import LaunchCommand
from launcher.devices import Inventory, discover
from launcher.planner import plan
from launcher.sampling import Sampling
from studio.errors import (
    BadRequestError,
    BusyError,
    ModelNotFoundError,
    ModelNotResidentError,
    ModelUnloadedError,
    NotReadyError,
    StudioError,
)
from studio.library.catalog import Catalog, CatalogEntry
from studio.library.downloads import DownloadManager
from studio.residency import placement, wording
from studio.residency.builder import Builder, SupervisorFactory, supervisor_factory
from studio.residency.events import Narrator, ResidencyEvent
from studio.residency.lifecycle import COMING_UP, GOING_AWAY, HOLDS_MEMORY, ResidentState
from studio.residency.lookup import Lookup
from studio.residency.placement import Holder, physical
from studio.residency.placer import GROUP_LINGER, Placed, Placer, Planner
from studio.residency.requests import (
    EMBEDDINGS_SUFFIX,
    LoadRequest,
    LoadSettings,
    base_name,
    embedding_name,
    load_settings,
)
from studio.residency.resident import Lease, LoadedModel, ResidentModel
from studio.residency.slot_cache import SlotCache
from studio.residency.transaction import Load, LoadStep, _Superseded
from studio.settings import ModelDefaults, ResidencySettings

log = structlog.get_logger(__name__)

#: Which instance of which model file: ``LoadSettings.key``.
Key = tuple[Path, bool]
#: States of a resident that serves no request and never will: a new load replaces it.
_NOT_SERVING = frozenset({ResidentState.FAILED, ResidentState.UNLOADED})

__all__ = ["ModelManager", "Placed", "ResidencyEvent", "physical", "supervisor_factory"]


class ModelManager:
    """The resident models of one studio; see the module docstring."""

    def __init__(
        self,
        *,
        catalog: Catalog,
        binary: Path,
        caps: Capabilities,
        build: Mapping[str, Any] | None = None,
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
        slot_cache: SlotCache | None = None,
        own_memory: Callable[[], int] | None = None,
        sampling: Sampling | None = None,
    ) -> None:
        self.catalog = catalog
        self.binary = binary
        #: which build runs and why (``launcher.backends.running_build``); None: only the binary is known
        self.build = dict(build) if build is not None else None
        self.caps = caps
        self.make_supervisor = make_supervisor
        self.discover_devices = discover_devices or (lambda: discover(llama_server=binary))
        self.files_root = files_root
        self.model_defaults = dict(model_defaults or {})  # per model name, from the config file
        self.sampling = sampling or Sampling()  # the studio's answer limits, under each model's own
        self.residency = residency or ResidencySettings()
        self.max_waiting = max_waiting
        self.work_timeout = work_timeout  # seconds a header read, a plan or a device query may take
        self.planner = planner  # tests pass a slow one to show the event loop stays free
        self.downloads = downloads  # fetches an uncached owner/repo:VARIANT when its auto_download is on
        self.spec_measurements = spec_measurements  # ``bench-spec``'s results, which ``auto`` follows
        self.slot_cache = slot_cache  # saves slots before a stop, restores them for the chat that continues one
        self.own_memory = own_memory  # the studio's RSS now; None: no reserve (a manager inside a test)
        self.lookup = Lookup(catalog, downloads, work_timeout)
        self.builder = Builder(
            caps=caps,
            binary=binary,
            make_supervisor=make_supervisor,
            discover_devices=self.discover_devices,
            residency=self.residency,
            model_defaults=self.model_defaults,
            work_timeout=work_timeout,
            files_root=files_root,
            slot_cache=slot_cache,
        )
        self.placer = Placer(
            caps=caps,
            discover_devices=self.discover_devices,
            residency=self.residency,
            planner=planner,
            work_timeout=work_timeout,
            own_memory=own_memory,
            spec_measurements=spec_measurements,
        )
        self._residents: dict[Key, ResidentModel] = {}
        self._routes: dict[str, ResidentModel] = {}  # every name a request used for a resident model
        self._default: ResidentModel | None = None  # the model a request without ``model`` uses
        self._loads: dict[Key, Load] = {}  # the one load in progress per instance (``LoadSettings.key``)
        self._closing = False
        self._coming_default: str | None = None  # the first preload, until it is resident
        self._preloading: asyncio.Task[None] | None = None  # ``start_preload``'s, until ``aclose`` ends it
        self._placement = asyncio.Lock()
        self._changed = asyncio.Event()  # set whenever a resident model goes idle, changes state or goes
        self._waiting = 0
        self._last_extra_args: dict[Path, tuple[str, ...]] = {}
        self.counters = {"loads": 0, "evictions": 0, "load_failures": 0}
        self.listeners: list[Callable[[ResidencyEvent], None]] = []  # told of every load, eviction, crash
        self._events = Narrator(self.listeners)

    # -- state ---------------------------------------------------------------------------------
    @property
    def reserve(self) -> int:
        """Bytes of host memory a memory budget keeps for the studio itself (``placement.studio_reserve``)."""
        return self.placer.reserve

    @property
    def residents(self) -> list[ResidentModel]:
        """The resident models, oldest first."""
        return sorted(self._residents.values(), key=lambda r: r.created)

    @property
    def default(self) -> ResidentModel | None:
        """The model a request without ``model`` goes to: the last one loaded explicitly, else the latest.

        Never an embedding instance: a request without ``model`` is its default model's chat.
        """
        if self._default is not None and self._default.state is not ResidentState.UNLOADED:
            return self._default
        live = [r for r in self.residents if r.state in HOLDS_MEMORY and not r.settings.embeddings]
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
        """A model being loaded that has no resident instance yet (checking its plan or waiting for memory)."""
        return next((load.entry.name for load in self._loads.values() if load.resident is None), None)

    @property
    def loads(self) -> list[Load]:
        """The loads in progress."""
        return list(self._loads.values())

    def find(self, model: str) -> ResidentModel | None:
        """The resident model a request's ``model`` names, by any name it was used under, or its path.

        A path names the model's chat instance; its embedding instance goes by its own name.
        """
        found = self._routes.get(model)
        if found is not None and found.state is not ResidentState.UNLOADED:
            return found
        for r in self._residents.values():
            if model == r.name or (model == str(r.settings.path) and not r.settings.embeddings):
                return r
        return None

    # -- requests ------------------------------------------------------------------------------
    async def acquire(self, model: str | None, *, embeddings: bool = False) -> tuple[LoadedModel, Lease]:
        """Return the model a request should use (loading it if needed) and the lease to release.

        An ``embeddings`` request gets an instance that embeds: the model's own when it does, else its
        embedding instance (the module docstring). A name with ``EMBEDDINGS_SUFFIX`` names that instance.

        Raises:
            BusyError: too many requests wait already, or busy models hold the memory it needs.
            studio.errors.ModelNotFoundError: ``model`` is unknown (and ``default_for_unknown`` is off, or there
                is no default model).
            DoesNotFitError: the model cannot fit even with every idle model evicted.
        """
        found = self.acquire_now(model, embeddings=embeddings)
        if found is not None:
            return found
        resident = self._routes.get(model) if model is not None else self.default
        name = model if model is not None else resident.name if resident is not None else self._coming_default
        if name is None:
            raise BadRequestError("no model is loaded and the request names none; pass `model`", param="model")
        try:
            if embeddings or name.endswith(EMBEDDINGS_SUFFIX):
                return await self._queued(lambda: self._ready_embeddings(name))
            return await self._queued(lambda: self._ready(name, None))
        except ModelNotFoundError:
            fallback = self.default.name if self.default is not None else self._coming_default  # or the one loading
            if model is None or not self.residency.default_for_unknown or fallback is None or fallback == model:
                raise
            log.info("an unknown model goes to the default", asked=model, model=fallback)
            return await self.acquire(fallback, embeddings=embeddings)

    def acquire_now(self, model: str | None, *, embeddings: bool = False) -> tuple[LoadedModel, Lease] | None:
        """The fast path of ``acquire``: the model and its lease when it is ready now, else ``None`` (no wait).

        A streamed request that would wait starts its answer early and sends keep-alives meanwhile
        (``studio.http.load_wait``).
        """
        resident = self._routes.get(model) if model is not None else self.default
        if embeddings and (resident is None or not resident.settings.embeds):
            base = model if model is not None else resident.name if resident is not None else None
            resident = self._routes.get(embedding_name(base)) if base is not None else None
        if resident is None:
            return None
        try:
            return resident.enter()
        except NotReadyError:
            return None

    def load_progress(self, model: str | None) -> tuple[str, float | None]:
        """The name of the model a waiting request will get, and the share of its weights loaded (``None``: unknown)."""
        resident = self.find(model) if model is not None else self.default
        if resident is None or resident.state not in COMING_UP:
            load = next((load for load in self._loads.values() if model is None or load.names(model)), None)
            return (load.entry.name if load else model or self._coming_default or "the model"), None
        progress = resident.supervisor.status().progress
        if progress is None or progress.bytes_total <= 0:
            return resident.name, None
        return resident.name, min(1.0, progress.bytes_loaded / progress.bytes_total)

    async def load(self, request: LoadRequest) -> LoadedModel:
        """Make ``request``'s model resident (or keep it, if its settings are equal) and the default; return it.

        A refused load (bad settings, a plan that does not fit) changes nothing: the running instance
        keeps serving with its settings. A load of a model that is loading with other settings takes
        that load's place: the later settings win, after at most one restart. A load of an embedding
        instance (``request.embeddings``, or a name with ``EMBEDDINGS_SUFFIX``) never becomes the default.
        """
        if request.embeddings or request.model.endswith(EMBEDDINGS_SUFFIX):
            request = request.replace(model=embedding_name(request.model), embeddings=True)
        loaded, lease = await self._queued(lambda: self._ready(request.model, request))
        await lease()
        resident = self.find(request.model)
        if resident is not None:
            if not request.embeddings:
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

    def start_preload(self, requests: Sequence[LoadRequest]) -> asyncio.Task[None] | None:
        """Begin ``preload`` in the background, on the running loop, and return its task (None: nothing to load);
        ``aclose`` cancels what is left of it first.

        ``serve`` calls it before the web stack is even imported, so that llama-server loads while that happens.
        """
        if requests:
            self._preloading = asyncio.create_task(self.preload(requests))
        return self._preloading

    async def _queued(self, work: Callable[[], Any]) -> Any:
        if self._waiting >= self.max_waiting:
            raise BusyError(f"{self._waiting} requests are already waiting for a model load; retry shortly")
        self._waiting += 1
        try:
            return await work()
        finally:
            self._waiting -= 1

    async def _ready_embeddings(self, model: str) -> tuple[LoadedModel, Lease]:
        """Wait for an instance of ``model`` that embeds and enter it: the model's own when it was given
        ``--embeddings`` (running, or configured so), else its embedding instance."""
        base = base_name(model)
        if model == base:
            entry = await self._entry(base)
            chat = self._residents.get((entry.path, False))
            serving = chat is not None and chat.state not in _NOT_SERVING
            own = chat.settings if chat is not None and serving else self._settings(LoadRequest(model=base), entry)
            if own.embeds:
                return await self._ready(base, None)
        name = embedding_name(base)
        return await self._ready(name, LoadRequest(model=name, embeddings=True))

    async def _ready(self, model: str, request: LoadRequest | None) -> tuple[LoadedModel, Lease]:
        """Wait until ``model`` is resident and ready (with ``request``'s settings, when given) and enter it.

        A request without settings takes the resident instance as it is, or joins the load in progress;
        an explicit load with other settings than the running instance's (or the loading one's) begins
        a load that replaces it (or supersedes that load).
        """
        while True:
            self._check_open()
            entry = await self._entry(model)
            key = (entry.path, request is not None and request.embeddings)
            load = self._loads.get(key)
            resident = self._residents.get(key)
            wanted = self._settings(request, entry) if request is not None else None
            if resident is not None and resident.state in GOING_AWAY and load is None:
                await resident.wait_until({ResidentState.UNLOADED})  # evicted or unloading: then load it anew
                continue
            serving = resident is not None and resident.state not in _NOT_SERVING
            if serving and resident is not None and (wanted is None or wanted == resident.settings):
                if load is None or (wanted is None and resident.state is ResidentState.READY):
                    self._route(model, resident)
                    state = await resident.wait_settled()
                    if state is ResidentState.READY:
                        try:
                            return resident.enter()
                        except NotReadyError:  # paused for a load that waits for its memory, or going away
                            await asyncio.wait(
                                [asyncio.ensure_future(resident.admitted()), asyncio.ensure_future(self.changed())],
                                return_when=asyncio.FIRST_COMPLETED,
                            )
                    elif state is ResidentState.FAILED:
                        raise resident.failure or StudioError(resident.error or f"{resident.name} failed")
                    continue
            if load is None:
                load = self._begin(model, entry, request)
            elif wanted is not None and wanted != load.settings:
                log.info("a later load of the model takes the place of the one in progress", model=entry.name)
                load.cancel(f"a later load of {entry.name} took this one's place", superseded=True)
                load = self._begin(model, entry, request, after=load)
            try:
                resident = await load.wait()
            except _Superseded:
                request = None  # the later load's settings win: follow it, never fight it
                continue
            try:
                return resident.enter()
            except NotReadyError:
                continue  # it crashed or was unloaded just now: look again

    def _begin(
        self, model: str, entry: CatalogEntry, request: LoadRequest | None, *, after: Load | None = None
    ) -> Load:
        """Begin the one load of ``entry``'s model; its task runs the steps, its future tells every waiter."""
        self._check_open()  # the shutdown may have begun while the entry was resolved
        request = request or LoadRequest(model=model)
        load = Load(model, entry, request, self._settings(request, entry), replacing=None, after=after)
        self._loads[load.settings.key] = load
        load.task = asyncio.create_task(self._run_load(load), name=f"load {entry.name}")
        load.task.add_done_callback(lambda _: self._settled(load))
        self._notify()  # a load began: /models/sse says "loading"
        return load

    async def _run_load(self, load: Load) -> None:
        try:
            if load.after is not None:
                await load.after.ended()
            resident = await self._transact(load)
        except asyncio.CancelledError:
            await asyncio.shield(self._undo(load))
            if load.cancelled is None:  # not ours: the loop itself is going away
                raise
            load.outcome.set_exception(load.failure())
        except Exception as exc:
            if not load.outcome.done():  # kept even if an unload cancels the load while it is undone
                load.outcome.set_exception(exc)
            await asyncio.shield(self._undo(load))
        else:
            self._commit(load, resident)

    def _settled(self, load: Load) -> None:
        """The load's task ended, however: every waiter hears once, and the model may be loaded anew.

        A done callback rather than a ``finally``: a load cancelled before its task's first step (superseded
        in the same tick it began, or by the shutdown) runs none of its own code.
        """
        if not load.outcome.done():
            load.outcome.set_exception(load.failure())
        if load.step not in (LoadStep.COMMITTED, LoadStep.UNDONE):
            load.move(LoadStep.UNDONE)  # cancelled before it touched anything
        if self._loads.get(load.settings.key) is load:
            del self._loads[load.settings.key]
        self._notify()

    async def _transact(self, load: Load) -> ResidentModel:
        """Check, reserve, start; return the ready resident. Raises what refused or failed the load."""
        key = load.settings.key
        existing = self._residents.get(key)
        while existing is not None and existing.state in GOING_AWAY:  # evicted or unloading: let it go first
            await existing.wait_until({ResidentState.UNLOADED})
            existing = self._residents.get(key)
        if existing is not None and existing.state not in _NOT_SERVING and existing.settings == load.settings:
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
                    command = self.launch_command(placed)
                    victims = [v for name in placed.evict if (v := self.find(name)) is not None]
                    if load.replacing is not None:
                        victims.append(load.replacing)
                    for victim in victims:
                        if victim not in load.paused:
                            victim.pause()
                            load.paused.append(victim)
                    load.victims = tuple(victims)
                    load.reservation = Holder(
                        name=load.entry.name,
                        held=(held := placement.physical(placed.plan.bill, placed.plan)),
                        reclaim=held,
                        last_used=time.monotonic(),
                        busy=True,
                    )
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
                        if busy not in load.paused:
                            busy.pause(after=self.residency.group_size)
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
                    self._events.unloading(victim, "evicted")
                else:
                    self._events.unloading(victim, "restart")
                await victim.unload(grace=0, reason=f"{victim.name} was evicted to make room for {load.entry.name}")
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
            busy = [v for v in load.victims if not v.idle and v.state is ResidentState.READY]
            if not busy:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise wording.still_serving(load.entry.name, busy, self.residency.busy_wait)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    def _commit(self, load: Load, resident: ResidentModel) -> None:
        """The new resident is ready: route it, remember its extra flags, let the paused models serve on."""
        load.resume_paused()
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
        load.resume_paused()
        load.reservation = None
        resident = load.resident
        if resident is not None and (load.cancelled is not None or resident.state is not ResidentState.FAILED):
            self._events.unloading(resident, "unload")
            await resident.unload(grace=0, reason=load.cancelled or f"the load of {resident.name} was undone")
        if load.step is not LoadStep.UNDONE:
            load.move(LoadStep.UNDONE)

    def launch_command(self, placed: Placed) -> LaunchCommand:
        """The command a load of ``placed`` runs (``ggstudio plan`` prints the same)."""
        return self.builder.launch_command(placed)

    def _check_open(self) -> None:
        if self._closing:
            raise ModelUnloadedError("the studio is shutting down")

    async def changed(self) -> None:
        """Return at the next change of a resident model's state or of a load (``/models/sse`` waits on it)."""
        await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _route(self, model: str, resident: ResidentModel) -> None:
        self._routes[model] = resident
        self._routes.setdefault(resident.name, resident)

    def _settings(self, request: LoadRequest, entry: CatalogEntry) -> LoadSettings:
        return load_settings(
            request,
            entry,
            self.model_defaults,
            last_extra_args=self._last_extra_args.get(entry.path),
            fallback=self.sampling,
        )

    # -- placement -----------------------------------------------------------------------------
    async def preview(self, request: LoadRequest) -> Placed:
        """What a load of ``request`` would get, and which resident models it would evict; loads nothing."""
        entry = await self._entry(request.model)
        return await self._place(entry, request, replacing=self._residents.get((entry.path, request.embeddings)))

    async def _entry(self, model: str) -> CatalogEntry:
        return await self.lookup.entry(model)

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
            lambda: self.residents,
            lambda: [other for other in self._loads.values() if other is not load],
            replacing=replacing,
        )

    def _new_resident(self, load: Load, placed: Placed, command: LaunchCommand) -> ResidentModel:
        """Create and start the new resident model (its owner takes it from there)."""
        resident = self.builder.resident(
            load.entry, load.request, placed, command, was=load.replacing, on_change=self._on_resident_change
        )
        load.resident = resident
        self._residents[placed.settings.key] = resident
        self.counters["loads"] += 1
        resident.start()
        return resident

    def _on_resident_change(self, resident: ResidentModel) -> None:
        self._events.changed(resident)
        if resident.state is ResidentState.FAILED:
            self.counters["load_failures"] += 1
        if resident.state is ResidentState.UNLOADED:
            if self.slot_cache is not None and resident.loaded is not None:
                self.slot_cache.forget(resident.loaded.url)
            if self._residents.get(resident.settings.key) is resident:
                del self._residents[resident.settings.key]
            for name in [n for n, r in self._routes.items() if r is resident]:
                del self._routes[name]
        self._notify()

    async def warm(self, loaded: LoadedModel, body: Mapping[str, Any]) -> int:
        """Before a chat runs: restore the saved slot its prompt continues, if any (``studio.residency.slot_cache``);
        return the tokens restored (0: none)."""
        return await self.slot_cache.warm(loaded, body) if self.slot_cache is not None else 0

    # -- unload, lifetime ----------------------------------------------------------------------
    async def unload(self, model: str | None = None, *, grace: float | None = None) -> None:
        """Unload ``model`` (every model when None): requests in flight get ``grace`` s, then an error.

        A load of the model in progress (or waiting for memory) is cancelled first: its llama-server is
        stopped, its waiters get an error saying it was unloaded, and nothing of it stays resident.

        Raises:
            ModelNotResidentError: ``model`` is neither resident nor loading.
        """
        grace = self.residency.unload_grace if grace is None else grace
        names = None if model is None else self._instance_names(await self._known_as(model))
        loads = [load for load in self._loads.values() if names is None or any(load.names(n) for n in names)]
        targets = list(self._residents.values()) if names is None else [r for n in names if (r := self.find(n))]
        if model is not None and not loads and not targets:
            self._resident_named(model)  # raises: there is nothing to unload
        await self._cancel(loads, "{} was unloaded while it was loading")
        for r in targets:
            self._events.unloading(r, "unload")
        await asyncio.gather(
            *(r.unload(grace=grace, reason=f"{r.name} was unloaded while this request ran") for r in targets)
        )

    def _instance_names(self, model: str) -> tuple[str, ...]:
        """The instances an unload of ``model`` ends: the one it names and, when it names a model, that model's
        embedding instance too (one model is one thing to unload, as in Ollama); an embedding instance's own
        name names it alone."""
        if model.endswith(EMBEDDINGS_SUFFIX):
            return (model,)
        found = self.find(model)
        return (model, embedding_name(found.name if found is not None else model))

    async def _known_as(self, model: str) -> str:
        """The name ``model``'s instance goes by: ``model`` when a resident or a load goes by it, else its
        model's name in the catalog (``model`` names another link to its file, an alias, a path), else ``model``."""
        if self.find(model) is not None or any(load.names(model) for load in self._loads.values()):
            return model
        return await self.lookup.model_name(model)

    async def _cancel(self, loads: Sequence[Load], why: str) -> None:
        for load in loads:
            load.cancel(why.format(load.entry.name))
        await asyncio.gather(*(load.ended() for load in loads))

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
        """Cancel the preload and the loads in progress, then unload every model now (at shutdown no request waits).

        The preload first: still running, it would start its next model again after this stopped the last one.
        """
        if self._preloading is not None:
            self._preloading.cancel()
            await asyncio.gather(self._preloading, return_exceptions=True)
        self._closing = True
        await self._cancel(list(self._loads.values()), "the studio is shutting down while {} was loading")
        for r in self._residents.values():
            self._events.unloading(r, "shutdown")
        await asyncio.gather(
            *(r.unload(grace=0, reason="the studio is shutting down") for r in list(self._residents.values())),
            return_exceptions=True,
        )

    def close_now(self) -> None:
        """Stop every llama-server from any thread, without the event loop (a last resort at exit)."""
        for r in list(self._residents.values()):
            r.supervisor.close()
            r.command.cleanup()
