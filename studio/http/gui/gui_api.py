"""The studio GUI's API under ``/api``: models, load, unload, pin, TTL, status, progress and logs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, create_model

import gguf
from launcher.sampling import Sampling
from studio.chat.media import file_capabilities
from studio.errors import ModelNotResidentError
from studio.http.guards.model_paths import check_extra_args, check_model_path, check_projector_path
from studio.http.gui.bodies import ApiBody
from studio.http.gui.gui_hub import is_remote, remote_plan
from studio.http.gui.library_removal import remove_from_library
from studio.library.catalog import CatalogEntry, names_by_model
from studio.load_options import OPTIONS, Option, api_options, describe, options_model
from studio.residency.manager import ModelManager, Placed
from studio.residency.requests import LoadRequest, model_defaults_for, sampling_for
from studio.settings import RESIDENCY_LIMITS
from studio.views.model import summary
from studio.views.plan import plan_json
from studio.views.residency import status_json, template_source

router = APIRouter(prefix="/api")

#: Seconds between two looks at the state for the event streams.
POLL = 0.2


class _LoadBody(ApiBody):
    """A load (or plan preview) request: a model, ``force``, and the load options (``load_body``)."""

    model: str = Field(description="A registered model name or a path to a .gguf file.")
    force: bool = Field(default=False, description="Load even when the plan says it does not fit.")

    def request(self) -> LoadRequest:
        options = self.model_dump(exclude={"model", "force"}, exclude_none=True)
        return LoadRequest.asking(self.model, options, force=self.force)


def load_body(options: Sequence[Option] = OPTIONS) -> type[_LoadBody]:
    """The load API's body: a model, ``force``, and each load option the API takes, as ``studio.load_options``
    defines it (type, bounds, help)."""
    fields = options_model(api_options(options), name="LoadOptions").model_fields
    made: type[_LoadBody] = create_model(  # type: ignore[call-overload]
        "LoadBody", __base__=_LoadBody, **{name: (f.annotation, f) for name, f in fields.items()}
    )
    return made


#: The body of ``/api/load`` and ``/api/plan``.
LoadBody = load_body()


class UnloadBody(ApiBody):
    """Which model to unload; none: every model."""

    model: str | None = Field(default=None, description="A resident model's name; omit to unload all.")
    grace: float | None = Field(
        default=None,
        ge=0,
        le=RESIDENCY_LIMITS["unload_grace"][1],
        description="Seconds requests in flight may finish; default: the config's.",
    )


class PinBody(ApiBody):
    model: str = Field(description="A resident model's name.")
    pinned: bool = True


class TtlBody(ApiBody):
    model: str = Field(description="A resident model's name.")
    ttl: float = Field(
        ge=RESIDENCY_LIMITS["ttl"][0],
        le=RESIDENCY_LIMITS["ttl"][1],
        description="Seconds idle before the model is unloaded; 0: never.",
    )


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager


@router.get("/models")
async def models(request: Request) -> list[dict[str, Any]]:
    """Every servable model with its facts, once, with ``aliases``: every name a request may use for it, its own
    included (another link to its file, an ``[aliases]`` name)."""
    out = []
    manager = _manager(request)
    entries = manager.catalog.entries()
    names = names_by_model(entries)
    for entry in entries:
        if entry.name not in names:  # another name of a model, listed in its aliases
            continue
        try:
            info = summary(await asyncio.to_thread(gguf.read, entry.path), _sampling(manager, entry))
        except gguf.GGUFError as exc:
            info = {"error": str(exc)}
        # ``name`` is what a load takes; the file's own general.name is ``general_name`` (it overwrote ``name``)
        out.append(
            {
                **info,
                "name": entry.name,
                "aliases": names[entry.name],
                "general_name": info.get("name"),
                "path": str(entry.path),
                **_template_source(request, entry, info),
                **await _media(entry),
            }
        )
    return out


def _sampling(manager: ModelManager, entry: CatalogEntry) -> Sampling:
    return sampling_for(entry, manager.model_defaults, manager.sampling)


def _template_source(request: Request, entry: CatalogEntry, info: dict[str, Any]) -> dict[str, bool]:
    """Whether a chat with the model goes through llama-server's fallback template (ChatML): neither the file
    nor the model's config table gives one, as with a base model. The page warns before the first message."""
    configured = model_defaults_for(entry, _manager(request).model_defaults).chat_template
    own = info.get("chat_template")
    return {"fallback_template": info.get("kind") == "model" and template_source(configured, own) == "fallback"}


async def _media(entry: CatalogEntry) -> dict[str, Any]:
    """The paired projector and what the model takes with it: vision, audio, or a TTS model's codec."""
    caps = await asyncio.to_thread(file_capabilities, entry.path, entry.mmproj)
    return {"mmproj": str(entry.mmproj) if entry.mmproj else None, **caps.to_json()}


@router.get("/models/{name:path}")  # a Hugging Face cache model's name has a slash: owner/repo:VARIANT
async def inspect_model(request: Request, name: str) -> dict[str, Any]:
    """One model's facts (the same as ``ggstudio inspect --json``)."""
    await check_model_path(request, name)
    manager = _manager(request)
    entry = manager.catalog.resolve(name)
    info = summary(await asyncio.to_thread(gguf.read, entry.path), _sampling(manager, entry))
    return {
        **info,
        "name": entry.name,
        "general_name": info.get("name"),
        **_template_source(request, entry, info),
        **await _media(entry),
    }


@router.delete("/models/{name:path}")
async def remove_model(request: Request, name: str, force: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """Remove a model from the library (``studio.http.gui.library_removal``); what was removed, or with ``dry_run``
    what would be. A resident or loading model is a 409 unless ``force`` unloads it first."""
    return await remove_from_library(_manager(request), name, force=force, dry_run=dry_run)


def load_routes(options: Sequence[Option] = OPTIONS) -> APIRouter:
    """``/api/load``, ``/api/plan`` and ``/api/load-options``, taking ``options`` (``studio.load_options``)."""
    routes = APIRouter()
    body_type = LoadBody if tuple(options) == OPTIONS else load_body(options)

    async def load(request: Request, body: Any) -> dict[str, Any]:
        """Make a model resident (evicting idle ones as needed) and the default; the status once it is ready."""
        manager = _manager(request)
        await check_model_path(request, body.model)
        await check_projector_path(request, body.mmproj)
        check_extra_args(request, body.extra_args)
        await manager.load(body.request())
        return status_json(manager)

    async def plan_preview(request: Request, body: Any) -> dict[str, Any]:
        """What a load would get (context, GPUs, speculative mode, memory per device, reasons) and what it would
        evict, loading nothing."""
        await check_model_path(request, body.model)
        await check_projector_path(request, body.mmproj)
        check_extra_args(request, body.extra_args)
        hub_part: dict[str, Any] = {}
        if await is_remote(request, body.model):  # not downloaded: planned on its header, read from the Hub
            placed, hub_part = await remote_plan(request, body.request())
            argv: list[str] = []  # a file that is not here yet has no command to show
        else:
            placed = await _manager(request).preview(body.request())
            argv = await asyncio.to_thread(_shown_argv, _manager(request), placed)
        info = plan_json(placed.plan, argv)
        if hub_part:
            info["model"]["path"] = f"{hub_part['model']} (not downloaded)"
        return {
            **info,
            "fits": placed.fits or body.force,
            "evicts": list(placed.evict),
            "blocked_by": list(placed.blocked_by),
            **({"hub": hub_part} if hub_part else {}),
        }

    async def load_options() -> dict[str, Any]:
        """What the load dialog may offer: each load option with its kind, bounds, values and help; also by
        kind (cache types, speculative modes, flash attention, built-in chat templates, the bounds)."""
        return load_options_json(options)

    for route in (load, plan_preview):  # the body's model is this table's, which annotations cannot name
        route.__annotations__ = {"request": Request, "body": body_type, "return": dict[str, Any]}
    routes.post("/load")(load)
    routes.post("/plan")(plan_preview)
    routes.get("/load-options")(load_options)
    return routes


def load_options_json(options: Sequence[Option] = OPTIONS) -> dict[str, Any]:
    """``/api/load-options``: the options (``studio.load_options.describe``), and the lists the page reads."""
    from launcher.chat_templates import BUILTIN_CHAT_TEMPLATES

    rows = {o.name: o for o in options}
    return {
        "options": describe(options),
        "cache_types": list(rows["cache_type_kv"].allowed()),
        "spec_modes": list(rows["spec"].allowed()),
        "flash_attn": list(rows["flash_attn"].allowed()),
        "chat_templates": sorted(BUILTIN_CHAT_TEMPLATES),
        "limits": {o.name: [o.least, o.most] for o in api_options(options) if o.least is not None},
    }


def _shown_argv(manager: ModelManager, placed: Placed) -> list[str]:
    """The command a load of ``placed`` would run (``ggstudio plan`` shows the same)."""
    with manager.launch_command(placed) as command:
        return command.shown_argv()


@router.post("/unload")
async def unload(request: Request, body: UnloadBody | None = None) -> dict[str, Any]:
    """Unload one model, or every model; requests in flight get a grace, then an error. Cancels a load."""
    manager = _manager(request)
    body = body or UnloadBody()
    await manager.unload(body.model, grace=body.grace)
    return status_json(manager)


@router.post("/pin")
async def pin(request: Request, body: PinBody) -> dict[str, Any]:
    """Pin a resident model (never evicted, no idle TTL) or unpin it."""
    manager = _manager(request)
    manager.set_pinned(body.model, body.pinned)
    return status_json(manager)


@router.post("/ttl")
async def ttl(request: Request, body: TtlBody) -> dict[str, Any]:
    """Set a resident model's idle TTL."""
    manager = _manager(request)
    manager.set_ttl(body.model, body.ttl)
    return status_json(manager)


@router.get("/status")
async def status(request: Request) -> dict[str, Any]:
    """The models (``studio.views.residency``) and, under ``history``, whether the chat history can be used."""
    history = getattr(request.app.state, "history", None)
    return {**status_json(_manager(request)), "history": None if history is None else history.status()}


#: States after which a load's progress stream ends.
_SETTLED = frozenset({"ready", "failed", "unloaded", "crashed"})


@router.get("/progress")
async def progress(request: Request, model: str | None = None) -> StreamingResponse:
    """Server-sent events with the status (of ``model``, or the default one) whenever it changes, until it settles."""
    manager = _manager(request)

    def now() -> dict[str, Any]:
        whole = status_json(manager)
        if model is None:
            return whole
        mine = next((m for m in whole["models"] if model in (m["model"], m["path"])), None)
        return mine or {"state": "resolving" if manager.resolving else "unloaded", "model": model}

    async def events() -> AsyncIterator[bytes]:
        last = None
        while True:
            current = now()
            if current != last:
                yield _sse(current)
                last = current
            if current["state"] in _SETTLED:
                return
            await asyncio.sleep(POLL)

    return StreamingResponse(events(), media_type="text/event-stream")


@router.get("/logs")
async def logs(request: Request, follow: bool = True, model: str | None = None) -> StreamingResponse:
    """Server-sent events with a model's llama-server log lines (the last 100, then new ones)."""
    manager = _manager(request)
    resident = manager.find(model) if model is not None else manager.default
    if resident is None and model is not None:
        raise ModelNotResidentError(f"{model!r} is not resident")

    async def events() -> AsyncIterator[bytes]:
        path: Path | None = resident.supervisor.status().log_path if resident is not None else None
        if path is None or not path.exists():
            return
        with path.open("rb") as fh:
            lines = fh.read().decode("utf-8", "replace").splitlines()[-100:]
            for line in lines:
                yield _sse({"line": line})
            while follow and not await request.is_disconnected():
                chunk = fh.readline()
                if chunk:
                    yield _sse({"line": chunk.decode("utf-8", "replace").rstrip("\n")})
                else:
                    await asyncio.sleep(POLL)

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


router.include_router(load_routes())
