"""The studio GUI's API under ``/api``: models, load, unload, status, progress and logs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import gguf
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from launcher.memory import CacheType
from launcher.speculative import MODES
from studio.residency.manager import LoadRequest, ModelManager, ModelState
from studio.views.model import summary
from studio.views.plan import plan_json
from studio.settings import LOAD_LIMITS

router = APIRouter(prefix="/api")

#: Seconds between two looks at the state for the event streams.
POLL = 0.2


class LoadBody(BaseModel):
    """A load (or plan preview) request from the GUI."""

    model: str = Field(description="A registered model name or a path to a .gguf file.")
    n_ctx: int | None = Field(default=None, ge=LOAD_LIMITS["n_ctx"][0],
                              description="Context size; default: the config's, or the largest that fits.")
    n_parallel: int | None = Field(default=None, ge=LOAD_LIMITS["n_parallel"][0], le=LOAD_LIMITS["n_parallel"][1],
                                   description="Server slots; default: the config's, or 1.")
    cache_type_kv: CacheType | None = Field(
        default=None, description="KV cache type (quantized types need flash attention); default: the config's, or f16.")
    spec: str | None = Field(
        default=None, description=f"Speculative mode: {', '.join(MODES)}; default: the config's, or auto.")
    spec_n_max: int | None = Field(
        default=None, ge=LOAD_LIMITS["spec_n_max"][0], le=LOAD_LIMITS["spec_n_max"][1],
        description="Drafted tokens per step; default: the config's, or the policy's.")
    extra_args: list[str] | None = Field(default=None, description="Extra llama-server flags; default: the last ones, or the config's.")

    def request(self) -> LoadRequest:
        return LoadRequest(
            model=self.model, n_ctx=self.n_ctx, n_parallel=self.n_parallel, spec=self.spec,
            spec_n_max=self.spec_n_max, cache_type=self.cache_type_kv,
            extra_args=tuple(self.extra_args) if self.extra_args is not None else None,
        )


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager


@router.get("/models")
async def models(request: Request) -> list[dict[str, Any]]:
    """Every servable model with its facts."""
    out = []
    for entry in _manager(request).catalog.entries():
        try:
            info = summary(await asyncio.to_thread(gguf.read, entry.path))
        except gguf.GGUFError as exc:
            info = {"error": str(exc)}
        out.append({"name": entry.name, "path": str(entry.path), **info})
    return out


@router.get("/models/{name}")
async def inspect_model(request: Request, name: str) -> dict[str, Any]:
    """One model's facts (the same as ``ggstudio inspect --json``)."""
    entry = _manager(request).catalog.resolve(name)
    return {"name": entry.name, **summary(await asyncio.to_thread(gguf.read, entry.path))}


@router.post("/load")
async def load(request: Request, body: LoadBody) -> dict[str, Any]:
    """Load a model and return the status once it is ready."""
    manager = _manager(request)
    await manager.load(body.request())
    return manager.status()


@router.post("/plan")
async def plan_preview(request: Request, body: LoadBody) -> dict[str, Any]:
    """What a load would get (context, GPUs, speculative mode, memory per device, reasons), loading nothing."""
    return plan_json(await _manager(request).preview(body.request()))


@router.post("/unload")
async def unload(request: Request) -> dict[str, Any]:
    """Unload the model, cancelling a load in progress."""
    manager = _manager(request)
    await manager.unload()
    return manager.status()


@router.get("/status")
async def status(request: Request) -> dict[str, Any]:
    return _manager(request).status()


@router.get("/progress")
async def progress(request: Request) -> StreamingResponse:
    """Server-sent events with the status whenever it changes, until ready, failed or unloaded."""
    manager = _manager(request)

    async def events() -> AsyncIterator[bytes]:
        last = None
        while True:
            now = manager.status()
            if now != last:
                yield _sse(now)
                last = now
            if now["state"] in (ModelState.READY.value, ModelState.FAILED.value, ModelState.UNLOADED.value,
                                ModelState.CRASHED.value):
                return
            await asyncio.sleep(POLL)

    return StreamingResponse(events(), media_type="text/event-stream")


@router.get("/logs")
async def logs(request: Request, follow: bool = True) -> StreamingResponse:
    """Server-sent events with llama-server's log lines (the last 100, then new ones)."""
    manager = _manager(request)

    async def events() -> AsyncIterator[bytes]:
        path: Path | None = manager.supervisor.status().log_path
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
