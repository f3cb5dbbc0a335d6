"""The model manager: which models are resident, and which one a request uses.

It coordinates: it routes names to residents (every name that reaches one file finds the one
resident, which goes by the model's name), keeps the bounded queue of requests waiting for a load,
and runs each load as a transaction (``studio.residency.transaction``), at most one per instance
(``LoadSettings.key``), whose steps ``steps`` carries out. What it asks along the way belongs elsewhere:
where a model goes and what must make room (``placement.decide``, fed by ``placer``), which file a
name means (``lookup``), what a resident is made of (``builder``), the errors' words (``wording``),
the events listeners hear (``events``), unloads and lifetimes (``unloading``), each resident's life
(``resident``).

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from launcher.capabilities import Capabilities
from launcher.devices import Inventory, discover
from launcher.planner import plan
from launcher.sampling import Sampling
from studio.errors import (
    BadRequestError,
    BusyError,
    ModelNotFoundError,
    ModelUnloadedError,
    NotReadyError,
    StudioError,
)
from studio.library.catalog import Catalog, CatalogEntry
from studio.library.downloads import DownloadManager
from studio.residency.builder import Builder, SupervisorFactory, supervisor_factory
from studio.residency.events import AdmissionEvent, Narrator, ResidencyEvent
from studio.residency.lifecycle import COMING_UP, GOING_AWAY, HOLDS_MEMORY, ResidentState
from studio.residency.lookup import Lookup
from studio.residency.placer import Placed, Placer, Planner
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
from studio.residency.steps import NOT_SERVING, LoadSteps
from studio.residency.transaction import Key, Load, LoadStep, _Superseded
from studio.residency.unloading import Unloading
from studio.residency.waits import WaitObserver, Waits, observed
from studio.settings import ModelDefaults, ResidencySettings

log = structlog.get_logger(__name__)

__all__ = ["AdmissionEvent", "ModelManager", "Placed", "ResidencyEvent", "supervisor_factory"]


class ModelManager(LoadSteps, Unloading):
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
        self.lookup = Lookup(catalog, downloads, work_timeout)
        self.binary = binary
        #: which build runs and why (``launcher.backends.running_build``); None: only the binary is known
        self.build = dict(build) if build is not None else None
        self.caps = caps
        self.discover_devices = discover_devices or (lambda: discover(llama_server=binary))
        self.model_defaults = dict(model_defaults or {})  # per model name, from the config file
        self.sampling = sampling or Sampling()  # the studio's answer limits, under each model's own
        self.residency = residency or ResidencySettings()
        self.max_waiting = max_waiting
        self.work_timeout = work_timeout  # seconds a header read, a plan or a device query may take
        self.slot_cache = slot_cache  # saves slots before a stop, restores them for the chat that continues one
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
        self._cores_due, self._once_idle = False, frozenset[str]()  # ``steps.LoadSteps._cores_changed``
        self._rebalancing: asyncio.Task[None] | None = None  # restarts residents with their share of the cores
        self._waiting = 0
        self._last_extra_args: dict[Path, tuple[str, ...]] = {}
        self.counters = {"loads": 0, "evictions": 0, "load_failures": 0}
        self.listeners: list[Callable[[ResidencyEvent], None]] = []  # told of every load, eviction, crash
        # told of every change of a resident's admission; requests paused on a resident wait for it to accept again
        self.admission_listeners: list[Callable[[AdmissionEvent], None]] = [self._on_admission]
        self._events = Narrator(self.listeners, self.admission_listeners)

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

    @property
    def catalog(self) -> Catalog:
        """The models the studio knows (the lookup's: one catalog for every name a request uses)."""
        return self.lookup.catalog

    @catalog.setter
    def catalog(self, catalog: Catalog) -> None:
        self.lookup.catalog = catalog

    @property
    def downloads(self) -> DownloadManager | None:
        """Fetches an uncached owner/repo:VARIANT when its auto_download is on (None: never)."""
        return self.lookup.downloads

    @downloads.setter
    def downloads(self, downloads: DownloadManager | None) -> None:
        self.lookup.downloads = downloads

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
    async def acquire(
        self, model: str | None, *, embeddings: bool = False, waits: Waits | None = None
    ) -> tuple[LoadedModel, Lease]:
        """Return the model a request should use (loading it if needed) and the lease to release.

        An ``embeddings`` request gets an instance that embeds: the model's own when it does, else its
        embedding instance (the module docstring). A name with ``EMBEDDINGS_SUFFIX`` names that instance.
        ``waits`` gives the observer told of each wait (``studio.residency.waits``), asked only if one comes.

        Raises:
            BusyError: too many requests wait already, or busy models hold the memory it needs.
            studio.errors.ModelNotFoundError: ``model`` is unknown (and ``default_for_unknown`` is off, or there
                is no default model).
            DoesNotFitError: the model cannot fit even with every idle model evicted.
        """
        found = self.acquire_now(model, embeddings=embeddings)
        if found is not None:
            return found
        resident = self.find(model) if model is not None else self.default  # a loading one too
        name = model if model is not None else resident.name if resident is not None else self._coming_default
        if resident is not None and not resident.settings.embeddings:  # its file: one the catalog may not list
            name = str(resident.settings.path)
        if name is None:
            raise BadRequestError("no model is loaded and the request names none; pass `model`", param="model")
        seen = waits() if waits is not None else None
        try:
            if embeddings or name.endswith(EMBEDDINGS_SUFFIX):
                return await self._queued(lambda: self._ready_embeddings(name, seen))
            return await self._queued(lambda: self._ready(name, None, seen))
        except ModelNotFoundError:
            fallback = self.default.name if self.default is not None else self._coming_default  # or the one loading
            if model is None or not self.residency.default_for_unknown or fallback is None or fallback == model:
                raise
            log.info("an unknown model goes to the default", asked=model, model=fallback)
            return await self.acquire(fallback, embeddings=embeddings, waits=waits)

    def acquire_now(self, model: str | None, *, embeddings: bool = False) -> tuple[LoadedModel, Lease] | None:
        """The fast path of ``acquire``: the model and its lease when it is ready now, else ``None`` (no wait).

        A streamed request that would wait starts its answer early and sends keep-alives meanwhile
        (``studio.http.clients.load_wait``).
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

    async def _ready_embeddings(self, model: str, seen: WaitObserver | None) -> tuple[LoadedModel, Lease]:
        """Wait for an instance of ``model`` that embeds and enter it: the model's own when it was given
        ``--embeddings`` (running, or configured so), else its embedding instance."""
        base = base_name(model)
        if model == base:
            entry = await self.lookup.entry(base)
            chat = self._residents.get((entry.path, False))
            serving = chat is not None and chat.state not in NOT_SERVING
            own = chat.settings if chat is not None and serving else self._settings(LoadRequest(model=base), entry)
            if own.embeds:
                return await self._ready(base, None, seen)
        name = embedding_name(base)
        return await self._ready(name, LoadRequest(model=name, embeddings=True), seen)

    async def _ready(
        self, model: str, request: LoadRequest | None, seen: WaitObserver | None = None
    ) -> tuple[LoadedModel, Lease]:
        """Wait until ``model`` is resident and ready (with ``request``'s settings, when given) and enter it;
        ``seen`` hears each wait: for its load, or queued while the ready model admits no new request.

        A request without settings takes the resident instance as it is, or joins the load in progress;
        an explicit load with other settings than the running instance's (or the loading one's) begins
        a load that replaces it (or supersedes that load).
        """
        while True:
            self._check_open()
            entry = await self.lookup.entry(model)
            key = (entry.path, request is not None and request.embeddings)
            load = self._loads.get(key)
            resident = self._residents.get(key)
            wanted = self._settings(request, entry) if request is not None else None
            if resident is not None and resident.state in GOING_AWAY and load is None:
                gone = resident.wait_until({ResidentState.UNLOADED})  # evicted or unloading: then load it anew
                await observed(seen, "load", resident.name, gone)
                continue
            serving = resident is not None and resident.state not in NOT_SERVING
            if serving and resident is not None and (wanted is None or wanted == resident.settings):
                if load is None or (wanted is None and resident.state is ResidentState.READY):
                    self._route(model, resident)
                    coming = seen if resident.state is not ResidentState.READY else None  # a load or a restart
                    state = await observed(coming, "load", resident.name, resident.wait_settled())
                    if state is ResidentState.READY:
                        try:
                            return resident.enter()
                        except NotReadyError:  # paused for a load that waits for its memory, or going away
                            await observed(seen, "queued", resident.name, self.changed())  # admission, state
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
                resident = await observed(seen, "load", load.entry.name, load.wait())
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
        self._cores_changed(None)
        self._notify()

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
        entry = await self.lookup.entry(request.model)
        return await self._place(entry, request, replacing=self._residents.get((entry.path, request.embeddings)))

    def _on_admission(self, event: AdmissionEvent) -> None:
        if event.new == "accepting":  # a hold ended: the requests it held look again (a hold itself wakes none)
            self._notify()

    def _on_resident_change(self, resident: ResidentModel) -> None:
        if resident.state is ResidentState.FAILED:
            self.counters["load_failures"] += 1
        if resident.state is ResidentState.UNLOADED:
            if self.slot_cache is not None and resident.loaded is not None:
                self.slot_cache.forget(resident.loaded.url)
            if self._residents.get(resident.settings.key) is resident:
                del self._residents[resident.settings.key]
            for name in [n for n, r in self._routes.items() if r is resident]:
                del self._routes[name]
        self._cores_changed(resident)
        self._notify()

    async def warm(self, loaded: LoadedModel, body: Mapping[str, Any]) -> int:
        """Before a chat runs: restore the saved slot its prompt continues, if any (``studio.residency.slot_cache``);
        return the tokens restored (0: none)."""
        return await self.slot_cache.warm(loaded, body) if self.slot_cache is not None else 0
