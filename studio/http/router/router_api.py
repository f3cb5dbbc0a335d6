"""llama.cpp router's model API: ``GET /models`` with each model's ``status``, load, unload, and status events.

Clients written for llama-server's router (Open WebUI, PocketPal, Letta, llama.cpp's web UI) read
``GET /models`` (or ``/v1/models``) to show which models are loaded, and drive ``POST /models/load``,
``POST /models/unload`` and ``GET /models/sse``. The shapes are the router's (b11434
``tools/server/server-models.cpp``, ``get_router_models``): each model carries
``status: {"value": "loaded" | "loading" | "unloaded", "args": [...]}``, and a model whose last start
failed is ``unloaded`` with ``"failed": true`` and its ``exit_code``. The studio's own fields (``meta``
with the live context and the resident state) stay beside them, as ``/v1/models`` answered before.

How the studio's resident states read as the router's: a model starting, or restarting after a crash,
is ``loading``; one serving, or draining and stopping (it still answers until it is gone), is
``loaded`` (the router too says ``loaded`` until its child exits); a failed start is ``unloaded`` and
``failed``. A load that is still checking its plan or waiting for memory is ``loading`` too.

As the router's, ``POST /models/load`` answers at once and the model loads in the background (its
status says how it goes; a load refused before anything started, a plan that does not fit, shows as
``failed`` with the reason in ``status.message``); ``POST /models/unload`` answers once the model is
gone. ``GET /models/sse`` sends ``{"model", "event": "status_change", "data": {"status": ...}}``
events as the router does, found by looking at the states every ``POLL`` seconds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from studio.errors import BadRequestError, ModelNotFoundError
from studio.http.guards.model_paths import check_model_path
from studio.http.gui.bodies import ApiBody
from studio.library.catalog import names_by_model
from studio.residency.lifecycle import ResidentState
from studio.residency.manager import ModelManager
from studio.residency.requests import LoadRequest, model_defaults_for
from studio.residency.resident import ResidentModel

log = structlog.get_logger(__name__)

router = APIRouter()

#: ``/models/sse`` looks at the states at every change the manager tells, and at least this often
#: (for what it does not tell: a model file added to a models dir).
POLL = 2.0

#: The router's word for each resident state (module docstring).
_STATUS: dict[ResidentState, str] = {
    ResidentState.LOADING: "loading",
    ResidentState.CRASHED: "loading",
    ResidentState.READY: "loaded",
    ResidentState.DRAINING: "loaded",
    ResidentState.UNLOADING: "loaded",
    ResidentState.FAILED: "unloaded",
    ResidentState.UNLOADED: "unloaded",
}
#: A model no instance or load of stands for, under a name.
_UNLOADED: dict[str, Any] = {"value": "unloaded", "args": []}


class ModelBody(ApiBody):
    """A router client's ``{"model": ...}``."""

    model: str = Field(description="A model name as ``GET /models`` lists it, or a path to a .gguf file.")


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager


class RouterLoads:
    """The loads router clients began, held until done, and why each model's last one failed (by name)."""

    def __init__(self) -> None:
        self.failures: dict[str, str] = {}
        self.pending: set[str] = set()  # begun here: ``loading`` from the answer on, before the manager has it
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        """Return once a load begun here starts or ends (``/models/sse`` waits on it)."""
        await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def begin(self, manager: ModelManager, model: str) -> None:
        """Load ``model`` in the background; a failure before any resident instance is kept in ``failures``."""
        self.failures.pop(model, None)
        self.pending.add(model)
        self._notify()

        async def load() -> None:
            try:
                await manager.load(LoadRequest(model=model))
            except Exception as exc:  # shown as the model's failed status
                self.failures[model] = getattr(exc, "message", None) or str(exc)
                log.warning("a router client's load failed", model=model, error=self.failures[model])
            finally:
                self.pending.discard(model)
                self._notify()

        task = asyncio.create_task(load(), name=f"router load {model}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _loads(request: Request) -> RouterLoads:
    loads: RouterLoads = request.app.state.router_loads
    return loads


def model_status(manager: ModelManager, name: str, loads: RouterLoads) -> dict[str, Any]:
    """The router's ``status`` object of the catalog model ``name``."""
    resident = manager.find(name)
    if resident is not None and resident.state is not ResidentState.UNLOADED:
        status: dict[str, Any] = {"value": _STATUS[resident.state], "args": _args(resident)}
        if resident.state is ResidentState.FAILED:
            exit_code = getattr(resident.failure, "exit_code", None)
            status.update(failed=True, exit_code=exit_code if exit_code is not None else 1, message=resident.error)
        return status
    if name in loads.pending or any(load.names(name) for load in manager.loads):
        return {"value": "loading", "args": []}
    if name in loads.failures:
        return {"value": "unloaded", "args": [], "failed": True, "exit_code": 1, "message": loads.failures[name]}
    return {"value": "unloaded", "args": []}


def status_by_names(manager: ModelManager, names: list[str], loads: RouterLoads) -> dict[str, Any]:
    """The router ``status`` of the model going by ``names``: under the first of them it is not unloaded (a
    router load that failed under an alias is kept under that name)."""
    statuses = [model_status(manager, name, loads) for name in names]
    return next((s for s in statuses if s != _UNLOADED), statuses[0])


def _args(resident: ResidentModel) -> list[str]:
    """The resident's llama-server arguments, its key redacted, as the router lists its children's."""
    port = urlsplit(resident.loaded.url).port if resident.loaded is not None else None
    return resident.command.redacted_argv(port or 0)[1:]


@router.get("/models")
@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """Every servable model with its router ``status``; resident ones carry their state and live context in ``meta``.

    As llama-server's, each model is listed once, with ``aliases`` (every name a client may send for it, its
    own included: the config's ``[aliases]`` of it) and ``tags`` (its ``[models.NAME]`` table's).
    """
    manager = _manager(request)
    loads = _loads(request)
    resident = {r.settings.key: r for r in manager.residents}
    entries = manager.catalog.entries()
    names = names_by_model(entries)
    data = []
    for entry in entries:
        if entry.name not in names:  # an alias, listed in its model's aliases
            continue
        tags = list(model_defaults_for(entry, manager.model_defaults).tags or ())
        item: dict[str, Any] = {"id": entry.name, "aliases": names[entry.name], "tags": tags, "object": "model"}
        item.update(created=0, owned_by="gguf-studio")
        r = resident.get((entry.path, False))
        if r is not None:
            item["meta"] = _meta(r)
        item["status"] = status_by_names(manager, names[entry.name], loads)
        data.append(item)
        embedding = resident.get((entry.path, True))
        if embedding is not None:  # the model's embedding instance, listed while it is resident
            data.append(
                {
                    "id": embedding.name,
                    "aliases": [embedding.name],
                    "tags": tags,
                    "object": "model",
                    "created": 0,
                    "owned_by": "gguf-studio",
                    "instance": "embeddings",
                    "meta": _meta(embedding),
                    "status": model_status(manager, embedding.name, loads),
                }
            )
    return {"object": "list", "data": data}


@router.get("/v1/models/{model:path}")  # a Hugging Face cache model's name has a slash: owner/repo:VARIANT
async def retrieve_model(request: Request, model: str) -> dict[str, Any]:
    """One model as ``/v1/models`` lists it, found by its name or one of its aliases (OpenAI's ``models.retrieve``).

    Raises:
        ModelNotFoundError: no listed model goes by that name (a file path is not looked up here).
    """
    listed = (await list_models(request))["data"]
    found = next((item for item in listed if model in item["aliases"]), None)  # a model's own name is one of them
    if found is None:
        known = ", ".join(item["id"] for item in listed) or "none"
        raise ModelNotFoundError(
            f"model {model!r} not found: not one of the known models ({known})", param="model", code="model_not_found"
        )
    return found


def _meta(r: ResidentModel) -> dict[str, Any]:
    """A resident instance's live context and state."""
    return {
        "n_ctx": r.loaded.n_ctx if r.loaded else None,
        "n_ctx_train": r.facts.context_length,
        "loaded": r.loaded is not None,
        "state": r.state.value,
    }


@router.post("/models/load")
async def load_model(request: Request, body: ModelBody) -> dict[str, Any]:
    """Begin loading a model, as the router does: the answer comes at once, ``GET /models`` shows the load.

    Raises:
        BadRequestError: the model is loaded or loading already (the router's answer too).
    """
    manager = _manager(request)
    await check_model_path(request, body.model)
    entry = manager.catalog.resolve(body.model)  # an unknown model is a 404 now, not a failed load later
    if model_status(manager, entry.model, _loads(request))["value"] != "unloaded":  # by any of its names
        raise BadRequestError(f"{body.model} is already running", param="model")
    _loads(request).begin(manager, body.model)
    return {"success": True}


@router.post("/models/unload")
async def unload_model(request: Request, body: ModelBody) -> dict[str, Any]:
    """Unload a model (a load in progress is cancelled); the answer comes once it is gone.

    Raises:
        studio.errors.ModelNotResidentError: the model is neither resident nor loading.
    """
    await _manager(request).unload(body.model)
    return {"success": True}


@router.get("/models/sse")
async def model_events(request: Request) -> StreamingResponse:
    """Server-sent events, one per status change of a model (as ``/models`` lists it), in the router's shape."""
    manager = _manager(request)
    loads = _loads(request)

    def now() -> dict[str, dict[str, Any]]:
        by_model = names_by_model(manager.catalog.entries())
        return {model: status_by_names(manager, names, loads) for model, names in by_model.items()}

    async def events() -> AsyncIterator[bytes]:
        seen = now()
        while True:  # until the client leaves: the response is cancelled then
            # woken by each change, not a timer: a state shorter than a timer's period (a model loaded and
            # unloaded at once) was never sent
            waits = {asyncio.ensure_future(manager.changed()), asyncio.ensure_future(loads.changed())}
            _, idle = await asyncio.wait(waits, timeout=POLL, return_when=asyncio.FIRST_COMPLETED)
            for wait in idle:
                wait.cancel()
            current = now()
            for name, status in current.items():
                before = seen.get(name, {})
                if (status["value"], status.get("failed")) != (before.get("value"), before.get("failed")):
                    yield _event(name, status)
            seen = current

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(name: str, status: dict[str, Any]) -> bytes:
    data: dict[str, Any] = {"status": status["value"]}
    if status["value"] == "unloaded":
        data["exit_code"] = status.get("exit_code", 0)
    return f"data: {json.dumps({'model': name, 'event': 'status_change', 'data': data})}\n\n".encode()
