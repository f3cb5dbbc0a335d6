"""The Ollama API on its own listener (``ggstudio serve --ollama-port 11434``).

Its own port, because Ollama's routes live under ``/api``, where the studio's GUI API is.
The app shares the studio app's state (``studio.http.app.create_app``): the same model
manager, so an Ollama request is routed by ``model``, waits in the same queue, holds its
model while it runs and is cancelled with its client like any other; the same pooled
upstream and the same metrics. The translation is ``studio.dialects.ollama``; this module
routes, and streams NDJSON (one JSON object a line). Like Ollama's own port, it also
answers the OpenAI and Anthropic routes (``/v1/...``), through the same forwarding as the
studio's main port.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

import gguf
from gguf.templates import template_capabilities
from studio import json_codec
from studio.chat.sse import EventSplitter, event_json
from studio.dialects import ollama
from studio.errors import BadRequestError, ModelNotResidentError
from studio.http.access import AccessPolicy
from studio.http.app import NO_TELEMETRY
from studio.http.auth import BearerTokenMiddleware
from studio.http.browser_guard import BrowserGuard
from studio.http.errors import (
    Dialect,
    dialect_of,
    error_response,
    install_error_handlers,
    ollama_shape,
    upstream_answer,
)
from studio.http.library_removal import remove_from_library
from studio.http.limits import BodySizeLimit
from studio.http.load_wait import answer_surviving, answer_when_loaded
from studio.http.metrics import RequestMetrics, StudioMetrics
from studio.http.model_paths import check_model_path
from studio.http.openai_proxy import (
    FORM_PATHS,
    FORWARDED,
    OpenAIRoutes,
    answer_unless_client_leaves,
    broke_off,
    close_upstream,
    read_answer,
    send_upstream,
)
from studio.http.openai_proxy import router as proxy_router
from studio.http.post_routes import PostRoutes
from studio.http.relay import Relay
from studio.http.router_api import router as router_api
from studio.http.streams import router as streams_router
from studio.library.downloads import DownloadManager
from studio.residency.lifecycle import ResidentState
from studio.residency.manager import ModelManager
from studio.residency.requests import base_name
from studio.residency.resident import Lease, LoadedModel
from studio.views.residency import status_json

router = APIRouter()

_NDJSON = "application/x-ndjson"
#: ``keep_alive`` not given: the model's TTL stays as it is.
_UNCHANGED = object()
#: Unloads started by ``keep_alive: 0``, kept until they are done (a task nobody holds may be collected).
_unloading: set[asyncio.Task[None]] = set()


def create_ollama_app(studio: FastAPI, *, api_token: str | None = None, access: AccessPolicy | None = None) -> FastAPI:
    """The Ollama listener's app, sharing ``studio``'s state, behind the same guards: the studio's body limit,
    ``api_token`` as the studio's, and ``access``, which ``Host`` names and page origins are let in (a page's
    request to a local Ollama port is the classic drive-by)."""
    app = FastAPI(
        title="GGUF Studio: Ollama API", docs_url=None, redoc_url=None, openapi_url=None, telemetry=NO_TELEMETRY
    )
    app.state = studio.state  # the same manager, upstream and metrics (the studio's lifespan makes the upstream)
    app.include_router(router)
    app.include_router(proxy_router)
    app.include_router(router_api)
    app.include_router(streams_router)  # the chats that name a conversation answer here too
    app.add_middleware(OpenAIRoutes, on_error=error_response)
    ahead = {"/api/chat": chat, "/api/generate": generate}
    app.add_middleware(PostRoutes, routes=ahead, on_error=error_response, dialect="ollama")
    app.add_middleware(BodySizeLimit, max_body_bytes=studio.state.max_body_bytes, dialect_for=dialect_on_ollama_port)
    if api_token:
        app.add_middleware(BearerTokenMiddleware, token=api_token, dialect=dialect_on_ollama_port)
    app.add_middleware(
        BrowserGuard,
        policy=access or AccessPolicy.create(),
        other_bodies=FORM_PATHS,
        dialect_for=dialect_on_ollama_port,
    )
    app.add_middleware(RequestMetrics, metrics=studio.state.metrics, listener="ollama", known=[*FORWARDED, *ahead])

    install_error_handlers(app, dialect_on_ollama_port)
    return app


def dialect_on_ollama_port(path: str) -> Dialect:
    """Ollama's error shape on its own routes; OpenAI's or Anthropic's on theirs (``/v1/...``)."""
    return dialect_of(path) if path.startswith("/v1/") else "ollama"


def main_port_hint(request: Request, ollama_port: int | None) -> str | None:
    """What the main port's 404 adds for one of this listener's ``/api/`` routes: where the Ollama API is, or how
    to turn it on; None for any other path.

    Only a path the main port does not serve gets its 404, so the studio's own routes of the same path
    (``/api/chat``, ``/api/pull``) are never hinted at. The routes are this module's table: one added here is
    hinted at there too.
    """
    path = request.url.path
    if not path.startswith("/api/") or not any(
        isinstance(route, APIRoute) and route.path == path for route in router.routes
    ):
        return None
    if ollama_port is None:
        return (
            "that is an Ollama API route: the studio serves the Ollama API on a port of its own, which is off; start "
            "the studio with `--ollama-port 11434` (or GGUF_STUDIO_OLLAMA_PORT=11434, or `ollama_port` in the config "
            "file) and point Ollama clients at that port"
        )
    url = str(request.base_url.replace(port=ollama_port)).rstrip("/")
    return (
        "that is an Ollama API route: the studio serves the Ollama API on a port of its own (`--ollama-port`, "
        f"GGUF_STUDIO_OLLAMA_PORT); point Ollama clients at {url}"
    )


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager


def _metrics(request: Request) -> StudioMetrics:
    return request.app.state.metrics


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()  # outside the try: a body over the limit is a 413, not "not valid JSON"
    try:
        body = json_codec.loads(raw or b"{}")
    except ValueError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def _ttl(body: dict[str, Any]) -> Any:
    return ollama.keep_alive_seconds(body["keep_alive"]) if body.get("keep_alive") is not None else _UNCHANGED


def _keep_alive(manager: ModelManager, model: str, ttl: Any) -> None:
    """Set a resident model's TTL from ``keep_alive`` (the manager's TTL 0 means never)."""
    if ttl is _UNCHANGED or ttl == 0:
        return
    manager.set_ttl(model, 0 if ttl is None else ttl)


def _unload_when_done(manager: ModelManager, model: str, ttl: Any) -> None:
    """``keep_alive: 0``: unload the model once its requests (this one included) are done: every instance of it,
    its chat and its embedding instance alike, as in Ollama one model is one thing to unload."""
    if ttl != 0:
        return

    async def unload() -> None:
        try:
            await manager.unload(base_name(model), grace=float("inf"))
        except ModelNotResidentError:
            pass  # already gone

    task = asyncio.create_task(unload(), name=f"keep_alive 0: {model}")
    _unloading.add(task)
    task.add_done_callback(_unloading.discard)


def _durations(began: float, acquired: float) -> ollama.Durations:
    now = time.perf_counter()
    return ollama.Durations(total_ns=int((now - began) * 1e9), load_ns=int((acquired - began) * 1e9))


def _upstream_error(status: int, content: bytes) -> JSONResponse:
    """llama-server's (OpenAI-shaped) error answer as Ollama writes errors, with its status."""
    answer = upstream_answer(status, content)
    return JSONResponse(ollama_shape(answer), answer.status)


def _line(obj: dict[str, Any]) -> bytes:
    return json_codec.dumps(obj) + b"\n"


# -- the server --------------------------------------------------------------------------------------


@router.get("/", response_class=PlainTextResponse)
@router.head("/", response_class=PlainTextResponse)
async def root() -> str:
    """What Ollama answers here; clients probe it to find a server."""
    return "Ollama is running"


@router.get("/api/version")
async def version() -> dict[str, str]:
    """The Ollama API version these routes answer as."""
    return {"version": ollama.OLLAMA_API_VERSION}


# -- models ------------------------------------------------------------------------------------------


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    """Every servable model (an unreadable file is left out)."""
    out = []
    for entry in _manager(request).catalog.entries():
        try:
            model = await asyncio.to_thread(gguf.read, entry.path)
            stat = entry.path.stat()
        except (gguf.GGUFError, OSError):
            continue
        out.append(ollama.tags_entry(entry.name, entry.path, model.file_size, stat.st_mtime_ns, _details(model)))
    return {"models": out}


def _details(model: gguf.GGUFFile) -> dict[str, Any]:
    f = model.facts
    return ollama.details(f.architecture, f.parameter_count, f.quant_label)


@router.post("/api/show")
async def show(request: Request) -> dict[str, Any]:
    """A model's details, GGUF metadata, chat template, capabilities and (when resident) its context."""
    body = await _body(request)
    manager = _manager(request)
    name = ollama.model_name(body)
    await check_model_path(request, name)
    entry = manager.catalog.resolve(name)
    model = await asyncio.to_thread(gguf.read, entry.path)
    f = model.facts
    caps = template_capabilities(f.chat_template) if f.chat_template else None
    resident = manager.find(entry.model)
    loaded = resident.loaded if resident is not None else None
    return {
        "modelfile": f"# served by GGUF Studio\nFROM {entry.path}\n",
        "parameters": f"num_ctx {loaded.n_ctx}" if loaded is not None else "",
        "template": f.chat_template or "",
        "details": _details(model),
        "model_info": ollama.model_info(model.metadata, f.parameter_count, verbose=bool(body.get("verbose"))),
        "capabilities": ollama.capabilities(
            tools=bool(caps and caps.supports_tools),
            thinking=bool(caps and caps.supports_reasoning),
            vision=entry.mmproj is not None,
        ),
        "modified_at": ollama.modified_at(entry.path.stat().st_mtime_ns),
    }


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """The models serving now, their memory, context and when they expire."""
    out = []
    for status in status_json(_manager(request))["models"]:
        if status["state"] != ResidentState.READY.value:
            continue
        model = await asyncio.to_thread(gguf.read, status["path"])
        memory = status.get("memory") or {}
        bill = memory.get("actual") or memory.get("predicted") or {}
        devices = bill.get("by_device") or {}
        stat = model.path.stat()
        out.append(
            {
                "name": status["model"],
                "model": status["model"],
                "size": bill.get("startup_total") or model.file_size,
                "size_vram": sum(n for device, n in devices.items() if not device.upper().startswith("CPU")),
                "digest": ollama.digest(model.path, model.file_size, stat.st_mtime_ns),
                "details": _details(model),
                "expires_at": ollama.expires_at(
                    status.get("ttl_left"), status.get("ttl") or 0, bool(status.get("pinned"))
                ),
                "context_length": status.get("effective_context"),
            }
        )
    return {"models": out}


@router.post("/api/pull")
async def pull(request: Request) -> Response:
    """Download ``owner/repo[:VARIANT]`` from Hugging Face into the shared cache; NDJSON progress.

    The download is the studio's (``studio.library.downloads``): it joins one already fetching the
    same files, shows in ``GET /api/pulls`` on the main port, and goes on if this client leaves.
    """
    body = await _body(request)
    spec = ollama.pull_spec(ollama.model_name(body))
    downloads: DownloadManager = request.app.state.downloads
    download, _ = await asyncio.to_thread(downloads.start, spec)
    if not ollama.wants_stream(body):
        await downloads.wait(download)
        [last] = ollama.pull_lines(download.snapshot(), {})[-1:]
        status = 200 if "status" in last else int((download.error or {}).get("status") or 500)
        return JSONResponse(last, status)

    async def lines() -> AsyncIterator[bytes]:
        yield _line({"status": "pulling manifest"})
        shown: dict[str, int] = {}
        async for snapshot in downloads.events(download):
            for line in ollama.pull_lines(snapshot, shown):
                yield _line(line)

    return StreamingResponse(lines(), media_type=_NDJSON)


@router.delete("/api/delete")
async def delete(request: Request) -> Response:
    """``ollama rm``: the model leaves the library as with ``ggstudio rm`` (``studio.http.library_removal``).
    Ollama deletes a running model's files under it; the studio refuses a resident one (409) instead."""
    name = ollama.model_name(await _body(request))
    await remove_from_library(_manager(request), name, force=False, instead=f"with `ollama stop {name}`")
    return Response(status_code=200)


@router.post("/api/create")
@router.post("/api/copy")
@router.post("/api/push")
async def unsupported(request: Request) -> JSONResponse:
    """Model management the studio does through its model folders and Hugging Face, not here."""
    return JSONResponse(
        {
            "error": f"{request.url.path} is not supported by GGUF Studio: add GGUF files to a "
            "models folder, or pull owner/repo[:VARIANT] from Hugging Face"
        },
        501,
    )


# -- generation --------------------------------------------------------------------------------------


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    """Ollama's chat: NDJSON chunks, then one with ``done``, counts and durations (answered ahead of the
    router, ``PostRoutes``; this route says so in FastAPI's table)."""
    return await _generate(request, "chat")


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    """Ollama's completion of a prompt (a chat turn where the model has a template; infill with ``suffix``)."""
    return await _generate(request, "generate")


async def _generate(request: Request, kind: ollama.Kind) -> Response:
    began = time.perf_counter()
    body = await _body(request)
    name = ollama.model_name(body)
    ttl = _ttl(body)
    manager = _manager(request)
    await check_model_path(request, name)
    if not (body.get("messages") if kind == "chat" else body.get("prompt") or body.get("images")):
        return await _load_or_unload(manager, kind, name, ttl)
    chat = ollama.chat_request(body) if kind == "chat" else None  # checked before any load

    async def answer(loaded: LoadedModel, lease: Lease) -> Response:
        acquired = time.perf_counter()
        _keep_alive(manager, loaded.name, ttl)
        _unload_when_done(manager, loaded.name, ttl)
        route, payload = (
            (ollama.CHAT, chat)
            if chat is not None
            else ollama.generate_request(body, has_chat_template=loaded.template is not None)
        )
        payload["model"] = loaded.name
        FORWARDED[route].prepare(payload, loaded)
        if route == ollama.CHAT:
            await manager.warm(loaded, payload)  # a conversation saved before an eviction comes back warm
        reply = ollama.Reply(kind, loaded.name)
        count = _counter(_metrics(request), request.url.path, loaded.name)
        if not payload.get("stream"):

            def finish(status: int, content: bytes, headers: dict[str, str]) -> Response:
                if status != 200:
                    return _upstream_error(status, content)
                reply.add(ollama.piece_of(route, json_codec.loads(content)))
                final = reply.final(_durations(began, acquired), streamed=False)
                count(None, final, reply)
                return JSONResponse(final)

            return await answer_unless_client_leaves(request, loaded, route, payload, lease, finish)
        resp = await send_upstream(request, loaded, route, payload, lease)
        if resp.status_code != 200:
            status, content = resp.status_code, await read_answer(resp, lease, loaded)
            return _upstream_error(status, content)
        ndjson = NdjsonStream(route, reply, began, acquired)

        async def closed(first_at: float | None, tail: bytes) -> None:
            await close_upstream(resp, lease)
            first_token = None if ndjson.first_at is None else ndjson.first_at - began
            count(first_token, ndjson.final, reply)

        async def broken(exc: httpx.HTTPError) -> bytes:
            if lease.interruption:
                return _line({"error": lease.interruption.message})
            message, _ = await broke_off(loaded, "llama-server went away mid-stream", exc)
            return _line({"error": message})

        return Relay(resp, on_close=closed, on_break=broken, reshape=ndjson, media_type=_NDJSON)

    if ollama.wants_stream(body):  # a cold load: empty chunks meanwhile, which Ollama's clients add as nothing
        waiting = ollama.Reply(kind, name)
        return await answer_when_loaded(
            manager, name, answer, dialect="ollama", beat=lambda: _line(waiting.keep_alive()), media_type=_NDJSON
        )
    return await answer_surviving(manager, name, answer)


async def _load_or_unload(manager: ModelManager, kind: ollama.Kind, name: str, ttl: Any) -> JSONResponse:
    """A request without a prompt: ``keep_alive`` 0 unloads the model now (as ``/api/unload``), else it is loaded."""
    if ttl == 0:
        entry = manager.catalog.resolve(name)  # an alias or a path unloads the model it names
        try:
            await manager.unload(entry.name)
        except ModelNotResidentError:
            pass  # not loaded: nothing to do, as Ollama answers
        return JSONResponse(ollama.load_reply(kind, entry.name, "unload"))
    loaded, lease = await manager.acquire(name)
    try:
        _keep_alive(manager, loaded.name, ttl)
    finally:
        await lease()
    return JSONResponse(ollama.load_reply(kind, loaded.name, "load"))


def _counter(
    metrics: StudioMetrics, route: str, model: str
) -> Callable[[float | None, dict[str, Any], ollama.Reply], None]:
    """How one answer is counted for ``/metrics``, from its final chunk and llama-server's timings."""

    def count(first_token_s: float | None, final: dict[str, Any], reply: ollama.Reply) -> None:
        rate = (reply.timings or {}).get("predicted_per_second")
        metrics.observe_counts(
            "ollama", route, model, first_token_s=first_token_s, tokens=final.get("eval_count"), rate=rate
        )

    return count


class NdjsonStream:
    """llama-server's server-sent events as Ollama's NDJSON chunks, as they arrive: a ``Relay``'s reshape.

    Each ``data:`` event becomes the chunk ``ollama.Reply`` makes of it (none for a piece without text); an
    ``error`` event becomes Ollama's ``{"error": ...}`` line, the stream's last; a whole stream ends with the
    final chunk (``done``, counts and durations), kept in ``final`` for ``/metrics``.
    """

    def __init__(self, route: str, reply: ollama.Reply, began: float, acquired: float) -> None:
        self._split = EventSplitter()
        self._route = route
        self._reply = reply
        self._began = began
        self._acquired = acquired
        self.first_at: float | None = None  # when the first chunk with text went out
        self.final: dict[str, Any] = {}
        self._ended = False  # an error line ended it

    def feed(self, data: bytes) -> bytes:
        if self._ended:
            return b""
        out = []
        for event in self._split.feed(data):
            payload = event_json(event)
            if not isinstance(payload, dict):
                continue  # a ping, [DONE]
            if "error" in payload:
                out.append(_line({"error": (payload["error"] or {}).get("message", "llama-server failed")}))
                self._ended = True
                break
            chunk = self._reply.add(ollama.piece_of(self._route, payload))
            if chunk is not None:
                self.first_at = self.first_at or time.perf_counter()
                out.append(_line(chunk))
        return b"".join(out)

    def finish(self) -> bytes:
        if self._ended:
            return b""
        self.final = self._reply.final(_durations(self._began, self._acquired), streamed=True)
        return _line(self.final)

    def close(self) -> bytes:
        return b""  # the error line follows; a broken stream has no final chunk


# -- embeddings --------------------------------------------------------------------------------------


@router.post("/api/embed")
async def embed(request: Request) -> JSONResponse:
    """Embeddings of ``input``, by the model's embedding instance (or its own, when it was given ``--embeddings``)."""
    began = time.perf_counter()
    body = await _body(request)
    status, content, loaded, acquired = await _embeddings(request, body)
    if status != 200:
        return _upstream_error(status, content)
    return JSONResponse(ollama.embed_reply(base_name(loaded.name), json.loads(content), _durations(began, acquired)))


@router.post("/api/embeddings")
async def embeddings(request: Request) -> JSONResponse:
    """The older embeddings route: one ``prompt``, one ``embedding``."""
    body = await _body(request)
    status, content, _, _ = await _embeddings(request, body)
    if status != 200:
        return _upstream_error(status, content)
    return JSONResponse(ollama.embeddings_reply(json.loads(content)))


async def _embeddings(request: Request, body: dict[str, Any]) -> tuple[int, bytes, LoadedModel, float]:
    name = ollama.model_name(body)
    ttl = _ttl(body)
    payload = ollama.embed_request(body)
    manager = _manager(request)
    await check_model_path(request, name)
    loaded, lease = await manager.acquire(name, embeddings=True)
    acquired = time.perf_counter()
    try:
        _keep_alive(manager, loaded.name, ttl)
        _unload_when_done(manager, loaded.name, ttl)
        payload["model"] = base_name(loaded.name)
        resp = await send_upstream(request, loaded, ollama.EMBEDDINGS, payload, lease)
    except BaseException:
        await lease()
        raise
    status, content = resp.status_code, await read_answer(resp, lease, loaded)
    return status, content, loaded, acquired
