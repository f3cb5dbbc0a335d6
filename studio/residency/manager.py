"""The model manager: the one process-wide owner of the llama-server supervisor.

Loads are serialised by one lock. A request for the loaded model takes the
fast path (no lock) and counts as in flight; a request for another model waits
its turn in a bounded queue, and the swap itself waits until every in-flight
request on the current model has finished: a model is never killed
mid-request by a swap. An explicit unload is the user's decision and cancels a
load in progress at once.

Blocking supervisor calls run in worker threads; the supervisor's own owner
thread is the only one that touches the process.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import structlog

import gguf
from gguf.facts import ModelFacts
from gguf.templates import TemplateCapabilities, template_capabilities
from launcher.capabilities import Capabilities
from launcher.command import LaunchCommand, build_command
from launcher.devices import Inventory, discover, free_memory_of, wait_for_memory_release
from launcher.errors import StartAbortedError
from launcher.memory import MemoryBill
from launcher.planner import LaunchPlan, ModelInfo, PlanRequest, plan
from launcher.supervisor import State, Status, Supervisor
from studio.library.catalog import Catalog, CatalogEntry, model_name
from studio.errors import BadRequestError, BusyError
from studio.settings import ModelDefaults

log = structlog.get_logger(__name__)


class ModelState(enum.Enum):
    """What the studio is doing with its model, as the GUI shows it."""

    UNLOADED = "unloaded"  # nothing loaded
    RESOLVING = "resolving"  # finding the file and reading its header
    LOADING = "loading"  # llama-server is starting
    READY = "ready"  # serving requests
    UNLOADING = "unloading"  # stopping llama-server
    FAILED = "failed"  # the last load failed; ``error`` says why
    CRASHED = "crashed"  # llama-server died after it was ready


@dataclass(frozen=True)
class LoadRequest:
    """What to load. ``None`` takes the model's config default; ``extra_args=None`` first reuses the last ones."""

    model: str
    n_ctx: int | None = None  # None, and none configured: the planner's largest safe context (up to the native one)
    n_parallel: int | None = None  # None, and none configured: 1 slot
    extra_args: tuple[str, ...] | None = None
    spec: str | None = None  # None, and none configured: "auto"
    spec_n_max: int | None = None  # None, and none configured: the speculative policy's
    cache_type: str | None = None  # None, and none configured: "f16"


@dataclass(frozen=True)
class LoadSettings:
    """The settings a model runs with; equal settings mean no restart is needed."""

    path: Path
    n_ctx: int | None
    n_parallel: int | None
    extra_args: tuple[str, ...]
    spec: str = "auto"
    spec_n_max: int | None = None
    cache_type: str = "f16"

    def plan_request(self, alias: str) -> PlanRequest:
        """What the planner is asked for these settings, serving the model as ``alias``."""
        return PlanRequest(
            n_ctx=self.n_ctx, n_parallel=self.n_parallel or 1, cache_type_k=self.cache_type,
            cache_type_v=self.cache_type, spec=self.spec, spec_n_max=self.spec_n_max,
            extra_args=self.extra_args, alias=alias,
        )


def load_settings(request: LoadRequest, entry: CatalogEntry, defaults: Mapping[str, ModelDefaults], *,
                  last_extra_args: tuple[str, ...] | None = None) -> LoadSettings:
    """``request``'s settings for ``entry``: what it leaves out comes from the model's config table
    (by name, then by file name), extra flags first from the last load, then the built-in defaults."""
    own = defaults.get(entry.name) or defaults.get(model_name(entry.path)) or ModelDefaults()
    extra = next(e for e in (request.extra_args, last_extra_args, own.extra_args, ()) if e is not None)
    return LoadSettings(
        entry.path,
        n_ctx=request.n_ctx if request.n_ctx is not None else own.n_ctx,
        n_parallel=request.n_parallel if request.n_parallel is not None else own.n_parallel,
        extra_args=tuple(extra),
        spec=request.spec if request.spec is not None else own.spec or "auto",
        spec_n_max=request.spec_n_max if request.spec_n_max is not None else own.spec_n_max,
        cache_type=request.cache_type if request.cache_type is not None else own.cache_type_kv or "f16",
    )


@dataclass(frozen=True)
class LoadedModel:
    """The live model: where to reach it and what it can do."""

    name: str
    settings: LoadSettings
    url: str
    api_key: str = field(repr=False)
    n_ctx: int  # the effective context per request (llama-server's slot size)
    facts: ModelFacts
    template: TemplateCapabilities | None
    plan: LaunchPlan  # what was decided and why; its bill is shown beside the actual allocations
    command: LaunchCommand = field(repr=False)

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


class ModelManager:
    """Loads, swaps and unloads the studio's model; see the module docstring."""

    def __init__(
        self,
        *,
        catalog: Catalog,
        binary: Path,
        caps: Capabilities,
        supervisor: Supervisor,
        discover_devices: Callable[[], Inventory] | None = None,
        files_root: Path | None = None,
        model_defaults: Mapping[str, ModelDefaults] | None = None,
        max_waiting: int = 64,
    ) -> None:
        self.catalog = catalog
        self.binary = binary
        self.caps = caps
        self.supervisor = supervisor
        self.discover_devices = discover_devices or (lambda: discover(llama_server=binary))
        self.files_root = files_root
        self.model_defaults = dict(model_defaults or {})  # per model name, from the config file
        self.max_waiting = max_waiting
        self._lock = asyncio.Lock()
        self._idle = asyncio.Condition()
        self._in_flight = 0
        self._waiting = 0
        self._state = ModelState.UNLOADED
        self._target: str | None = None  # the model being resolved or loaded
        self._loaded: LoadedModel | None = None
        self._error: str | None = None
        self._last_extra_args: dict[Path, tuple[str, ...]] = {}

    # -- state for the GUI ---------------------------------------------------
    @property
    def loaded(self) -> LoadedModel | None:
        """The model serving requests right now, if any."""
        return self._loaded if self.state == ModelState.READY else None

    @property
    def state(self) -> ModelState:
        if self._state == ModelState.READY and self.supervisor.state == State.CRASHED:
            return ModelState.CRASHED
        return self._state

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``/api/status``."""
        sup = self.supervisor.status()
        loaded = self._loaded
        progress = sup.progress
        state = self.state
        return {
            "state": state.value,
            "model": loaded.name if loaded else self._target,
            "path": str(loaded.settings.path) if loaded else None,
            "native_context": loaded.facts.context_length if loaded else None,
            "effective_context": loaded.n_ctx if loaded else None,
            "largest_safe_context": loaded.plan.max_safe_ctx if loaded else None,
            "speculative": {
                "requested": loaded.plan.spec.requested, "resolved": loaded.plan.spec.resolved,
                "flags": list(loaded.plan.spec.argv),
            } if loaded else None,
            "cache_type_kv": loaded.settings.cache_type if loaded else None,
            "offload": {
                "gpus": [d.name for d in loaded.plan.gpus], "n_gpu_layers": loaded.plan.n_gpu_layers,
                "mode": loaded.plan.offload,
                "active_on": sorted(d.device for d in sup.allocations.devices if d.weights) if sup.allocations
                else None,
            } if loaded else None,
            "reasons": list(loaded.plan.reasons) if loaded else None,
            "capabilities": _capabilities(loaded) if loaded else None,
            "progress": {
                "phase": progress.phase, "bytes_loaded": progress.bytes_loaded, "bytes_total": progress.bytes_total,
                "phases_seen": list(progress.phases_seen),
            } if progress else None,
            "memory": {
                "predicted": _bill(loaded.plan.bill),
                "actual": _bill(sup.allocations) if sup.allocations else None,
            } if loaded else None,
            "error": self._error if state == ModelState.FAILED else (sup.cause if state == ModelState.CRASHED else None),
            "pid": sup.pid,
            "in_flight": self._in_flight,
            "waiting": self._waiting,
        }

    # -- load / unload -------------------------------------------------------
    async def load(self, request: LoadRequest) -> LoadedModel:
        """Load ``request`` (or keep the live model when its settings are equal) and return it."""
        self._check_queue()
        self._waiting += 1
        try:
            async with self._lock:
                return await self._load_locked(request)
        finally:
            self._waiting -= 1

    async def _load_locked(self, request: LoadRequest) -> LoadedModel:
        self._state, self._target = ModelState.RESOLVING, request.model
        try:
            # A bad file or a request the planner refuses fails here, before anything is stopped.
            entry, model, settings = await self._resolve(request)
            live = self._loaded
            if live is not None and live.settings == settings and self.supervisor.state == State.READY:
                self._state = ModelState.READY
                return live
            launch_plan = await self.plan(entry.name, model, settings)
        except Exception:
            self._state = ModelState.READY if self._loaded else ModelState.UNLOADED  # the live model keeps serving
            self._target = self._loaded.name if self._loaded else None
            raise
        await self._drain()
        self._drop_loaded()
        self._state = ModelState.LOADING
        command = build_command(launch_plan, self.caps, binary=self.binary, files_root=self.files_root)
        spec = command.launch_spec()
        uuids = [d.uuid for d in launch_plan.gpus if d.uuid]
        if uuids:  # the next plan must not read VRAM the driver has not released yet
            read = free_memory_of(uuids, llama_server=self.binary)
            spec = replace(spec, after_stop=lambda: wait_for_memory_release(read))
        try:
            status = await asyncio.to_thread(self.supervisor.start, spec)
            n_ctx = await self._effective_context(status, command.api_key)
        except StartAbortedError:
            command.cleanup()
            self._state = ModelState.UNLOADED
            raise
        except Exception as exc:
            command.cleanup()
            self._state, self._error = ModelState.FAILED, str(exc)
            raise
        self._last_extra_args[entry.path] = settings.extra_args
        facts = model.facts
        self._loaded = LoadedModel(
            name=entry.name, settings=settings, url=status.url or "", api_key=command.api_key, n_ctx=n_ctx,
            facts=facts, template=template_capabilities(facts.chat_template) if facts.chat_template else None,
            plan=launch_plan, command=command,
        )
        self._state, self._error = ModelState.READY, None
        log.info("model ready", model=entry.name, n_ctx=n_ctx)
        return self._loaded

    async def plan(self, name: str, model: gguf.GGUFFile, settings: LoadSettings) -> LaunchPlan:
        """The launch plan for ``model`` on this machine now (no process is started)."""
        inventory = await asyncio.to_thread(self.discover_devices)
        return plan(ModelInfo.from_gguf(model), inventory, self.caps, settings.plan_request(name))

    async def preview(self, request: LoadRequest) -> LaunchPlan:
        """What a load of ``request`` would get, without loading anything."""
        entry, model, settings = await self._resolve(request)
        return await self.plan(entry.name, model, settings)

    async def _resolve(self, request: LoadRequest) -> tuple[CatalogEntry, gguf.GGUFFile, LoadSettings]:
        """The catalog entry, parsed header and full settings of ``request``, gaps filled from the config."""
        entry = self.catalog.resolve(request.model)
        model = await asyncio.to_thread(gguf.read, entry.path)
        return entry, model, load_settings(request, entry, self.model_defaults,
                                           last_extra_args=self._last_extra_args.get(entry.path))

    def _drop_loaded(self) -> None:
        if self._loaded is not None:
            self._loaded.command.cleanup()  # the key file: only once its server is stopped or replaced
        self._loaded = None

    async def _effective_context(self, status: Status, api_key: str) -> int:
        async with httpx.AsyncClient(timeout=10) as client:
            props = (await client.get(f"{status.url}/props", headers={"Authorization": f"Bearer {api_key}"})).json()
        return int(props["default_generation_settings"]["n_ctx"])

    async def unload(self) -> None:
        """Stop the model now, cancelling a load in progress."""
        self._state = ModelState.UNLOADING
        await asyncio.to_thread(self.supervisor.stop)  # aborts a start in progress at once
        async with self._lock:
            await asyncio.to_thread(self.supervisor.stop)
            self._drop_loaded()
            self._target, self._error = None, None
            self._state = ModelState.UNLOADED

    async def _drain(self) -> None:
        async with self._idle:
            await self._idle.wait_for(lambda: self._in_flight == 0)

    # -- requests --------------------------------------------------------------
    async def acquire(self, model: str | None) -> tuple[LoadedModel, Callable[[], Awaitable[None]]]:
        """Return the model a request should use (loading it if needed) and its release function.

        Raises:
            BusyError: too many requests are already waiting for a load.
            studio.errors.ModelNotFoundError: ``model`` is unknown.
        """
        live = self.loaded
        if live is not None and not self._lock.locked() and (model is None or self._matches(live, model)):
            return live, self._enter()
        self._check_queue()
        self._waiting += 1
        try:
            async with self._lock:
                live = self.loaded
                if live is None or (model is not None and not self._matches(live, model)):
                    if model is None and live is None:
                        raise _no_model_error()
                    live = await self._load_locked(LoadRequest(model=model or live.name))
                return live, self._enter()
        finally:
            self._waiting -= 1

    def _matches(self, live: LoadedModel, model: str) -> bool:
        return model in (live.name, str(live.settings.path))

    def _enter(self) -> Callable[[], Awaitable[None]]:
        self._in_flight += 1
        released = False

        async def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            async with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

        return release

    def _check_queue(self) -> None:
        if self._waiting >= self.max_waiting:
            raise BusyError(f"{self._waiting} requests are already waiting for a model load; retry shortly")

    async def aclose(self) -> None:
        """Stop llama-server and the supervisor."""
        await asyncio.to_thread(self.supervisor.close)
        self._drop_loaded()


def _no_model_error() -> BadRequestError:
    return BadRequestError("no model is loaded and the request names none; pass `model`", param="model")


def _capabilities(loaded: LoadedModel) -> dict[str, Any]:
    t = loaded.template
    return {
        "reasoning": bool(t and t.supports_reasoning),
        "reasoning_style": t.reasoning_style if t else "none",
        "tools": bool(t and t.supports_tools),
        "has_mtp": loaded.facts.has_mtp,
    }


def _bill(bill: MemoryBill) -> dict[str, Any]:
    """Bytes per device and part, for the GUI."""
    return {
        "devices": {d.device: {"weights": d.weights, "kv": d.kv, "recurrent": d.recurrent, "compute": d.compute,
                               "output": d.output, "output_growth": d.output_growth,
                               "compute_growth": d.compute_growth, "total": d.total}
                    for d in bill.devices},
        "total": bill.total,
        # what llama-server holds once it listens: the figure to set beside the actual total
        "startup_total": bill.startup_total,
        "approximate": bill.approximate,
        "reasons": list(bill.reasons),
    }


