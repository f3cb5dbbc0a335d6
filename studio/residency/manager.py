"""The model manager: which models are resident, where a new one goes, and which one a request uses.

It decides only placement and routing; each resident model's life belongs to its
own ``ResidentModel``. A request for a ready model takes the fast path: a name
lookup and an in-flight count, no lock. A request for a model that is not
resident waits (in a bounded queue) while one placement at a time plans it
against memory as it will be (``studio.residency.placement``), evicts what must
go, and starts it; requests that arrive meanwhile for the same model wait for
that one start, so concurrent first requests start exactly one llama-server.

Requests are grouped by model: a load that waits for busy models' memory lets each of them take
``group_size`` more requests (and an idle one waits ``GROUP_LINGER`` s for its group's next request)
before it pauses them, so requests for a model run together instead of a swap each; loads that must
evict take turns in the order they began waiting. With two models sharing the memory, no request
waits behind more than two swaps.

A request never changes a resident model's server settings: only an explicit
load with other settings restarts it, once its requests in flight are done.

An embeddings request for a model whose instance does not embed (it was not given ``--embeddings``)
goes to the model's embedding instance, ``"M (embeddings)"`` (``studio.residency.requests``): a
resident of its own, loaded on demand through the same queue and transaction, planned and billed by
the planner's rules for one (``launcher.planner``), evicted like any other; the chat instance is not
touched. A model file has at most one instance of each kind: residents and loads are keyed by
``LoadSettings.key``. Every name that reaches one file (a link under another name, an alias, a path:
``studio.library.catalog``) resolves to its model's entry, path and name, so a request by any of them
finds the one resident, which goes by the model's name; an unload by any of them unloads it.

Every load is one transaction (``studio.residency.transaction.Load``), at most one
per model file: checked before anything running is touched, its victims reserved
under the placement lock and drained outside it, then committed or undone; an
unload or the shutdown cancels it. The arithmetic of memory (budgets, what fits
where) is ``studio.residency.placement``'s; this module routes and runs the steps.

Header reads, plans and device queries run off the event loop with a time limit
(``studio.blocking``), so a hostile file cannot stall other clients.

Every load, failed load, eviction, crash and restart is told to ``listeners`` as a
``ResidencyEvent`` with its duration (``/metrics`` counts them), read from the
resident models' state changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import structlog

import gguf
from gguf.templates import template_capabilities
from launcher.capabilities import Capabilities
from launcher.command import LaunchCommand, build_command
from launcher.devices import RELEASE_WAIT_S, Inventory, discover, wait_for_memory_release
from launcher.errors import LauncherError
from launcher.planner import MIN_AUTO_CTX, LaunchPlan, ModelInfo, PlanRequest, plan
from launcher.registry import ChildRegistry
from launcher.sampling import Sampling
from launcher.supervisor import Status, Supervisor
from launcher.units import format_mib
from studio.blocking import run_blocking
from studio.errors import (
    BadRequestError,
    BusyError,
    DoesNotFitError,
    ModelNotFoundError,
    ModelNotResidentError,
    ModelUnloadedError,
    NotReadyError,
    StudioError,
)
from studio.library.catalog import Catalog, CatalogEntry
from studio.library.downloads import DownloadManager, is_repo_spec
from studio.residency import placement
from studio.residency.lifecycle import COMING_UP, GOING_AWAY, HOLDS_MEMORY, ResidentState
from studio.residency.placement import Holder, physical
from studio.residency.requests import (
    EMBEDDINGS_SUFFIX,
    LoadRequest,
    LoadSettings,
    base_name,
    embedding_name,
    load_settings,
    model_defaults_for,
)
from studio.residency.resident import Lease, LoadedModel, ResidentModel
from studio.residency.slot_cache import SlotCache
from studio.residency.transaction import Load, LoadStep, _Superseded
from studio.settings import ModelDefaults, ResidencySettings

log = structlog.get_logger(__name__)

#: Makes one model's supervisor; it hands every state change to the callback it is given.
SupervisorFactory = Callable[[Callable[[Status], None]], Supervisor]
Planner = Callable[[ModelInfo, Inventory, Capabilities, PlanRequest], LaunchPlan]
#: Seconds a model whose group is open (a load waits for its memory, and it still admits requests) stays
#: after its last request ended, for the next one: a client that sends its requests one after another sends
#: the next within milliseconds of an answer, and without this pause each of its requests would be a swap.
GROUP_LINGER = 0.25
#: Which instance of which model file: ``LoadSettings.key``.
Key = tuple[Path, bool]
#: States of a resident that serves no request and never will: a new load replaces it.
_NOT_SERVING = frozenset({ResidentState.FAILED, ResidentState.UNLOADED})

__all__ = ["ModelManager", "Placed", "ResidencyEvent", "physical", "supervisor_factory"]


def cpu_sharers(live: Sequence[ResidentModel], *, leaving: Collection[str]) -> int:
    """The models whose threads will share the cores: the one placed, and the residents running layers on the CPU
    that stay (not ``leaving``: evicted by this load or another in flight)."""
    return 1 + sum(1 for r in live if r.plan.layers_on_cpu and r.name not in leaving)


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
        self._seen: dict[ResidentModel, tuple[ResidentState, ResidentState | None, float]] = {}  # state, before, since
        self._why: dict[ResidentModel, str] = {}  # why the manager unloads a model (else it was its TTL)

    # -- state ---------------------------------------------------------------------------------
    @property
    def reserve(self) -> int:
        """Bytes of host memory a memory budget keeps for the studio itself (``placement.studio_reserve``)."""
        return 0 if self.own_memory is None else placement.studio_reserve(self.own_memory())

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
                    raise await self._does_not_fit(load.model, load.entry, placed)
                if time.monotonic() >= deadline:
                    raise BusyError(
                        f"not enough memory for {load.entry.name} now: it needs {placed.need}; held by "
                        f"{', '.join(placed.blocked_by) or 'models that loads waiting before it will evict'};"
                        " retry once they are idle",
                        retry_after=max(1, round(self.residency.busy_wait / 6) or 1),
                    )
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
                    self._why.setdefault(victim, "evicted")
                else:
                    self._why.setdefault(victim, "restart")
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
                raise BusyError(
                    f"{load.entry.name} cannot load now: "
                    + ", ".join(f"{v.name} has {v.in_flight} requests in flight" for v in busy)
                    + "; retry once they are done",
                    retry_after=max(1, round(self.residency.busy_wait / 6) or 1),
                )
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
            self._why.setdefault(resident, "unload")
            await resident.unload(grace=0, reason=load.cancelled or f"the load of {resident.name} was undone")
        if load.step is not LoadStep.UNDONE:
            load.move(LoadStep.UNDONE)

    def launch_command(self, placed: Placed) -> LaunchCommand:
        """The command a load of ``placed`` runs: its private files under ``files_root``, its slot folder.

        ``ggstudio plan`` prints it too, so the command it shows is the one a load runs.
        """
        try:
            return build_command(
                placed.plan,
                self.caps,
                binary=self.binary,
                files_root=self.files_root,
                slot_dir=self.slot_cache.folder(placed.plan)
                if self.slot_cache is not None and not placed.settings.embeddings
                else None,
            )
        except OSError as exc:
            raise StudioError(f"could not prepare llama-server's launch files: {exc}", code="launch_files") from exc

    async def _does_not_fit(self, model: str, entry: CatalogEntry, placed: Placed) -> DoesNotFitError:
        smaller = await self._smaller_variant(model, entry, placed)
        return DoesNotFitError(
            f"{entry.name} does not fit even with every idle model evicted: it needs {placed.need}"
            f" where {placed.room or 'nothing'} could be freed; "
            + (f"{smaller} is the largest variant of its repo that would fit, or " if smaller else "")
            + "load it with a smaller n_ctx (see the plan's largest_safe_context) or raise "
            "memory_budget"
        )

    def _check_open(self) -> None:
        if self._closing:
            raise ModelUnloadedError("the studio is shutting down")

    async def changed(self) -> None:
        """Return at the next change of a resident model's state or of a load (``/models/sse`` waits on it)."""
        await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

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
        """The catalog entry of ``model``; an uncached ``owner/repo:VARIANT`` is downloaded first when allowed.

        Another name of a model (a link to its file, an alias) gives the model's own entry: its instances go
        by the model's name. An embedding instance's name gives its model's entry under the instance's name.
        """
        if model.endswith(EMBEDDINGS_SUFFIX):
            entry = await self._entry(base_name(model))
            return replace(entry, name=embedding_name(entry.name))
        try:
            entry = await run_blocking(self.catalog.resolve, model, timeout=self.work_timeout, what=f"finding {model}")
            return replace(entry, name=entry.model, alias_of=None)
        except ModelNotFoundError:
            if self.downloads is None or not is_repo_spec(model):
                raise
        path = await self.downloads.ensure_available(model)  # a 404 saying how to pull, when not allowed
        entry = await run_blocking(self.catalog.resolve, str(path), timeout=self.work_timeout, what=f"finding {path}")
        return replace(entry, name=model)

    async def _place(
        self,
        entry: CatalogEntry,
        request: LoadRequest,
        *,
        replacing: ResidentModel | None = None,
        load: Load | None = None,
    ) -> Placed:
        """Plan ``entry`` against memory as it will be, and choose the fewest idle models to evict for it.

        Memory as it will be: what resident models hold, less the models other loads in progress have
        reserved to evict (they are going), plus what those loads will hold (their reservations).
        """
        model = await run_blocking(gguf.read, entry.path, timeout=self.work_timeout, what=f"reading {entry.path.name}")
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
        others = [other for other in self._loads.values() if other is not load]
        # Models other loads reserved to evict still hold their memory until they are gone (their load may
        # yet be undone): they count as held and busy, and the memory those loads will take counts too.
        going = {victim for other in others for victim in other.victims}
        going_names = {r.name for r in going}
        live = [r for r in self.residents if r.state in HOLDS_MEMORY and r is not replacing]
        holders = [replace(self._holder(r), busy=True) if r in going else self._holder(r) for r in live]
        loading = self._loading_names()
        # the studio's RSS read once per placement: the budget and the plans' reasons show the same reserve
        reserve = self.reserve if self.residency.memory_budget is not None else 0
        budget = self._budget(inventory, reserve)
        budgeted = budget is not None
        base = placement.base_available(
            budget=budget,
            free=placement.free_memory(inventory),
            holders=[h for h in holders if h.name not in loading],
            loading=[
                *(h for h in holders if h.name in loading),
                *(other.reservation for other in others if other.reservation is not None),
            ],
        )
        plan_request = replace(
            settings.plan_request(base_name(entry.name)),  # an embedding instance answers as its model
            spec_measurements=self.spec_measurements,
            cpu_sharers=cpu_sharers(live, leaving=going_names),
        )
        first = await self._plan(info, inventory, base, plan_request, budgeted, reserve)
        cap = self.residency.max_resident
        crowded = cap is not None and len(holders) >= cap
        if placement.fits(first, base) and not crowded:
            return Placed(first, (), (), True, model, settings)
        # The fewest evictions that let the model fit at its smallest context; the final plan then takes
        # whatever context the freed memory allows.
        everything = placement.with_evicted(base, [h for h in holders if h.evictable], budgeted=budgeted)
        smallest = (
            plan_request
            if plan_request.n_ctx is not None
            else replace(plan_request, n_ctx=min(MIN_AUTO_CTX, max(first.native_ctx, 256)))
        )
        need = physical((await self._plan(info, inventory, everything, smallest, budgeted, reserve)).bill, first)
        evict = placement.choose_evictions(need, base, holders, budgeted=budgeted, max_count=cap)
        if evict is None:
            ready = {r.name for r in live if r.state is ResidentState.READY and r not in going}
            once_idle = [replace(h, busy=False) if h.name in ready else h for h in holders]
            drain = placement.choose_evictions(need, base, once_idle, budgeted=budgeted, max_count=cap) or ()
            return Placed(
                first,
                (),
                placement.holders_in_words(holders),
                False,
                model,
                settings,
                need=placement.in_words(need),
                room=placement.in_words(everything),
                drain=drain,
                shortfall=max(placement.shortfall(need, everything).values(), default=0),
            )
        freed = placement.with_evicted(base, [h for h in holders if h.name in evict], budgeted=budgeted)
        # the models it evicts give their cores back too: a model swapped in planned 1 thread of 2 beside the
        # model it replaced, and ran alone at half speed (scripts/bench_cache.py's swap back, 1.9x its TTFT)
        staying = replace(plan_request, cpu_sharers=cpu_sharers(live, leaving={*going_names, *evict}))
        final = await self._plan(info, inventory, freed, staying, budgeted, reserve)
        return Placed(final, evict, (), placement.fits(final, freed), model, settings)

    async def _plan(
        self,
        info: ModelInfo,
        inventory: Inventory,
        available: Mapping[str, int],
        request: PlanRequest,
        budgeted: bool,
        reserve: int,
    ) -> LaunchPlan:
        shared = placement.inventory_for(inventory, available, budgeted=budgeted)
        launch = await run_blocking(
            self.planner, info, shared, self.caps, request, timeout=self.work_timeout, what=f"planning {info.path.name}"
        )
        if not reserve:
            return launch
        why = f"reserve: the studio's own {format_mib(reserve)} of host memory comes off the memory budget"
        return replace(launch, reasons=(*launch.reasons, why))

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

    def _budget(self, inventory: Inventory, reserve: int) -> dict[str, int] | None:
        budget = self.residency.memory_budget
        if budget is None:
            return None
        return placement.budget_map(budget.total, budget.per_device, inventory, reserve=reserve)

    def _loading_names(self) -> set[str]:
        return {r.name for r in self._residents.values() if r.state in COMING_UP}

    def _holder(self, r: ResidentModel) -> Holder:
        lingering = r.grouping and time.monotonic() - r.last_used < GROUP_LINGER  # its group's next request may come
        return placement.holder(
            r.name,
            r.plan,
            r.actual,
            last_used=r.last_used,
            busy=not r.idle or r.state is not ResidentState.READY or lingering,
            pinned=r.pinned,
        )

    def _new_resident(self, load: Load, placed: Placed, command: LaunchCommand) -> ResidentModel:
        """Create and start the new resident model (its owner takes it from there)."""
        entry, request = load.entry, load.request
        was = load.replacing  # a restart keeps the lifetime a user gave the running instance (pin, TTL)
        own = model_defaults_for(entry, self.model_defaults)
        facts = placed.model.facts
        resident = ResidentModel(
            name=entry.name,
            settings=placed.settings,
            plan=placed.plan,
            command=command,
            spec=replace(command.launch_spec(), after_stop=self._after_stop(placed.plan)),
            facts=facts,
            template=template_capabilities(template)
            if (template := placed.settings.chat_template or facts.chat_template)
            else None,
            make_supervisor=self.make_supervisor,
            ttl=next(t for t in (request.ttl, was.ttl if was else None, own.ttl, self.residency.ttl) if t is not None),
            pinned=next(p for p in (request.pinned, was.pinned if was else None, own.pinned, False) if p is not None),
            on_change=self._on_resident_change,
            # an embedding instance's slots hold no conversation to continue: nothing is saved
            before_stop=None if self.slot_cache is None or placed.settings.embeddings else self.slot_cache.save,
        )
        load.resident = resident
        self._residents[placed.settings.key] = resident
        self.counters["loads"] += 1
        resident.start()
        return resident

    def _after_stop(self, launch: LaunchPlan) -> Callable[[], None] | None:
        """What the supervisor runs once a llama-server on GPUs is reaped: wait until their free memory settles.

        A GPU driver frees a killed process's memory a little after the process is reaped; a plan made
        in between (the next load, an eviction's replacement, a restart) would see too little free memory.
        The resident stays ``unloading`` until this returns, so placement counts the memory as held.
        """
        keys = {d.key for d in launch.gpus}
        if not keys:
            return None  # host memory is back when the process is reaped

        def read_free() -> dict[str, int]:
            return {d.key: d.free_bytes for d in self.discover_devices().devices if d.key in keys}

        def wait() -> None:
            try:
                settled = wait_for_memory_release(read_free, timeout=min(self.work_timeout, RELEASE_WAIT_S))
            except (StudioError, LauncherError, OSError) as exc:  # a failing device query must not block a stop
                log.warning("could not watch GPU memory being released", error=str(exc))
                return
            if not settled:
                log.warning("GPU memory was still being released when the wait ended", gpus=sorted(keys))

        return wait

    def _on_resident_change(self, resident: ResidentModel) -> None:
        self._tell(resident)
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
            self._why.setdefault(r, "unload")
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
        try:
            base = base_name(model)
            entry = await run_blocking(self.catalog.resolve, base, timeout=self.work_timeout, what=f"finding {base}")
        except StudioError:  # no longer in the catalog (or never was): only the names in use are left
            return model
        return embedding_name(entry.model) if model.endswith(EMBEDDINGS_SUFFIX) else entry.model

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
