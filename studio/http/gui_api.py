"""The studio GUI's API under ``/api``: models, load, unload, pin, TTL, status, progress and logs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

import gguf
from launcher.memory import CacheType, FlashAttn
from launcher.sampling import Sampling
from launcher.speculative import MODES
from studio.chat.media import file_capabilities
from studio.errors import ModelNotResidentError
from studio.http.bodies import ApiBody
from studio.http.gui_hub import is_remote, remote_plan
from studio.http.library_removal import remove_from_library
from studio.http.model_paths import check_extra_args, check_model_path, check_projector_path
from studio.library.catalog import CatalogEntry, names_by_model
from studio.residency.manager import ModelManager, Placed
from studio.residency.requests import LoadRequest, model_defaults_for, sampling_for
from studio.settings import LOAD_LIMITS, RESIDENCY_LIMITS
from studio.views.model import summary
from studio.views.plan import plan_json
from studio.views.residency import status_json, template_source

router = APIRouter(prefix="/api")

#: Seconds between two looks at the state for the event streams.
POLL = 0.2


class LoadBody(ApiBody):
    """A load (or plan preview) request from the GUI."""

    model: str = Field(description="A registered model name or a path to a .gguf file.")
    n_ctx: int | None = Field(
        default=None,
        ge=LOAD_LIMITS["n_ctx"][0],
        le=LOAD_LIMITS["n_ctx"][1],
        description="Context size; default: the config's, or the largest that fits.",
    )
    n_parallel: int | None = Field(
        default=None,
        ge=LOAD_LIMITS["n_parallel"][0],
        le=LOAD_LIMITS["n_parallel"][1],
        description="Server slots; default: the config's, else 4 on a unified KV cache on GPUs, 1 on the CPU.",
    )
    cache_type_kv: CacheType | None = Field(
        default=None, description="KV cache type (quantized types need flash attention); default: the config's, or f16."
    )
    spec: str | None = Field(
        default=None, description=f"Speculative mode: {', '.join(MODES)}; default: the config's, or auto."
    )
    spec_n_max: int | None = Field(
        default=None,
        ge=LOAD_LIMITS["spec_n_max"][0],
        le=LOAD_LIMITS["spec_n_max"][1],
        description="Drafted tokens per step; default: the config's, or the policy's.",
    )
    cache_ram: int | None = Field(
        default=None,
        ge=LOAD_LIMITS["cache_ram"][0],
        le=LOAD_LIMITS["cache_ram"][1],
        description="MiB of llama-server's prompt cache (--cache-ram), on the model's bill; 0: off; "
        "default: the config's, or the planner's (two copies of the KV cache, bounded by free memory).",
    )
    extra_args: list[str] | None = Field(
        default=None, description="Extra llama-server flags; default: the last ones, or the config's."
    )
    ttl: float | None = Field(
        default=None,
        ge=RESIDENCY_LIMITS["ttl"][0],
        le=RESIDENCY_LIMITS["ttl"][1],
        description="Seconds idle before the model is unloaded (0: never); default: the config's.",
    )
    pinned: bool | None = Field(default=None, description="Never evict this model; default: the config's.")
    chat_template: str | None = Field(
        default=None,
        max_length=256 * 1024,
        description="A chat template to use instead of the model's own: Jinja text, or the name of one of "
        "llama.cpp's built-in templates (chatml, llama3, command-r, ...); default: the config's.",
    )
    threads: int | None = Field(
        default=None,
        ge=LOAD_LIMITS["threads"][0],
        le=LOAD_LIMITS["threads"][1],
        description="CPU threads; default: the config's, or the usable cores divided among the models on the CPU.",
    )
    threads_batch: int | None = Field(
        default=None,
        ge=LOAD_LIMITS["threads_batch"][0],
        le=LOAD_LIMITS["threads_batch"][1],
        description="Prompt-processing threads; default: the config's, or the same as threads.",
    )
    flash_attn: FlashAttn | None = Field(
        default=None,
        description="Flash attention: on, off or auto (a quantized cache needs on or auto); default: the "
        "config's, or on when the cache type needs it, else auto.",
    )
    context_shift: bool | None = Field(
        default=None,
        description="Past the context, drop the oldest tokens instead of answering with an error; default: the "
        "config's, or off.",
    )
    jinja: bool | None = Field(
        default=None,
        description="Render chat templates with Jinja; false: llama-server's built-in renderer (--no-jinja), which "
        "refuses requests with tools; default: the config's, or Jinja unless chat_template names a built-in.",
    )
    force: bool = Field(default=False, description="Load even when the plan says it does not fit.")
    mmproj: str | None = Field(
        default=None,
        description='A multimodal projector .gguf to load with the model, or "none"; default: the '
        "config's, or the projector the library pairs with the model.",
    )

    def request(self) -> LoadRequest:
        return LoadRequest(
            model=self.model,
            n_ctx=self.n_ctx,
            n_parallel=self.n_parallel,
            spec=self.spec,
            spec_n_max=self.spec_n_max,
            cache_ram=self.cache_ram,
            cache_type=self.cache_type_kv,
            extra_args=tuple(self.extra_args) if self.extra_args is not None else None,
            ttl=self.ttl,
            pinned=self.pinned,
            force=self.force,
            chat_template=self.chat_template,
            mmproj=self.mmproj,
            threads=self.threads,
            threads_batch=self.threads_batch,
            flash_attn=self.flash_attn,
            context_shift=self.context_shift,
            jinja=self.jinja,
        )


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
    """Remove a model from the library (``studio.http.library_removal``); what was removed, or with ``dry_run``
    what would be. A resident or loading model is a 409 unless ``force`` unloads it first."""
    return await remove_from_library(_manager(request), name, force=force, dry_run=dry_run)


@router.post("/load")
async def load(request: Request, body: LoadBody) -> dict[str, Any]:
    """Make a model resident (evicting idle ones as needed) and the default; the status once it is ready."""
    manager = _manager(request)
    await check_model_path(request, body.model)
    await check_projector_path(request, body.mmproj)
    check_extra_args(request, body.extra_args)
    await manager.load(body.request())
    return status_json(manager)


@router.post("/plan")
async def plan_preview(request: Request, body: LoadBody) -> dict[str, Any]:
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
