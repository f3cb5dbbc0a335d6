"""The Ollama API on its own listener (``ggstudio serve --ollama-port 11434``).

Its own port, because Ollama's routes live under ``/api``, where the studio's GUI API is.
The app shares the studio app's state (``studio.http.app.create_app``) and its middleware
(``studio.http.stack``): the same model manager, queue, pooled upstream and metrics. Ollama's
model routes (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``) are rows of
the one forward path (``studio.http.clients.openai_proxy.Route`` with a ``Face``): this module says how
an Ollama request becomes llama-server's (``studio.dialects.ollama``), what its ``keep_alive``
does to the model, and how the answer becomes Ollama's NDJSON chunks (one JSON object a line)
or whole answer; routing, the queue, the load and its keep-alives, the relay, cancellation and
the counts are the forward path's. Like Ollama's own port, it also answers the OpenAI and
Anthropic routes (``/v1/...``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

import gguf
from gguf.templates import template_capabilities
from studio import json_codec
from studio.chat.sse import EventSplitter, event_json
from studio.dialects import ollama
from studio.errors import ModelNotResidentError
from studio.http.app import NO_TELEMETRY
from studio.http.clients.openai_proxy import Route, Turn, declare, json_body, nothing_to_add
from studio.http.clients.openai_proxy import router as proxy_router
from studio.http.errors import Dialect, dialect_of
from studio.http.guards.access import AccessPolicy
from studio.http.guards.model_paths import check_model_path
from studio.http.gui.library_removal import remove_from_library
from studio.http.router.router_api import router as router_api
from studio.http.router.streams import router as streams_router
from studio.http.stack import stack
from studio.library.downloads import DownloadManager
from studio.residency.lifecycle import ResidentState
from studio.residency.manager import ModelManager
from studio.residency.requests import base_name
from studio.residency.resident import LoadedModel
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
    stack(
        app,
        listener="ollama",
        dialect_for=dialect_on_ollama_port,
        metrics=studio.state.metrics,
        max_body_bytes=studio.state.max_body_bytes,
        api_token=api_token,
        access=access,
        activity=studio.state.activity,
    )
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
    body = await json_body(request, empty=True)
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
    body = await json_body(request, empty=True)
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
    """``ollama rm``: the model leaves the library as with ``ggstudio rm`` (``studio.http.gui.library_removal``).
    Ollama deletes a running model's files under it; the studio refuses a resident one (409) instead."""
    name = ollama.model_name(await json_body(request, empty=True))
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


# -- generation and embeddings: rows of the forward path -----------------------------------------------


class _Turn:
    """One Ollama request on the forward path (``studio.http.clients.openai_proxy.Turn``): its ``keep_alive`` is applied
    once its model is had; what it asks of llama-server is the subclass's."""

    stream = False
    media_type = _NDJSON

    def __init__(self, manager: ModelManager, ttl: Any, began: float) -> None:
        self._manager = manager
        self._ttl = ttl
        self._began = began
        self._acquired = began

    def _have(self, loaded: LoadedModel) -> None:
        """The model is had: the request's clock notes it, and its ``keep_alive`` is applied."""
        self._acquired = time.perf_counter()
        _keep_alive(self._manager, loaded.name, self._ttl)
        _unload_when_done(self._manager, loaded.name, self._ttl)

    def _durations(self) -> ollama.Durations:
        return _durations(self._began, self._acquired)

    def beat(self) -> bytes:
        return b""

    def upstream(self, loaded: LoadedModel) -> tuple[str, dict[str, Any]] | Response:
        raise NotImplementedError

    def reshape(self) -> NdjsonStream:
        raise NotImplementedError  # only a generation streams

    def whole(self, content: bytes) -> bytes:
        return content


class _Load(_Turn):
    """A chat or generate request without a prompt: the model loaded is the answer."""

    def __init__(self, manager: ModelManager, ttl: Any, began: float, kind: ollama.Kind) -> None:
        super().__init__(manager, ttl, began)
        self._kind = kind

    def upstream(self, loaded: LoadedModel) -> Response:
        self._have(loaded)
        return JSONResponse(ollama.load_reply(self._kind, loaded.name, "load"))


class _Generation(_Turn):
    """A chat or generate request: llama-server's chat, completion or infill, answered as Ollama's chunks."""

    def __init__(self, manager: ModelManager, ttl: Any, began: float, kind: ollama.Kind, body: dict[str, Any]) -> None:
        super().__init__(manager, ttl, began)
        self._kind = kind
        self._body = body
        self._chat = ollama.chat_request(body) if kind == "chat" else None  # checked before any load
        self.stream = ollama.wants_stream(body)
        self._waiting = ollama.Reply(kind, ollama.model_name(body))
        self._route = ollama.CHAT
        self._reply = self._waiting

    def beat(self) -> bytes:
        """A chunk with empty content (``done: false``) while the model loads, which Ollama's clients add as
        nothing (Ollama itself sends nothing while it loads)."""
        return _line(self._waiting.keep_alive())

    def upstream(self, loaded: LoadedModel) -> tuple[str, dict[str, Any]]:
        self._have(loaded)
        if self._chat is not None:
            self._route, payload = ollama.CHAT, self._chat
        else:
            self._route, payload = ollama.generate_request(self._body, has_chat_template=loaded.template is not None)
        self._reply = ollama.Reply(self._kind, loaded.name)
        return self._route, payload

    def reshape(self) -> NdjsonStream:
        return NdjsonStream(self._route, self._reply, self._durations)

    def whole(self, content: bytes) -> bytes:
        self._reply.add(ollama.piece_of(self._route, json_codec.loads(content)))
        return json_codec.dumps(self._reply.final(self._durations(), streamed=False))


class _Embedding(_Turn):
    """An ``/api/embed`` or ``/api/embeddings`` request: llama-server's ``/v1/embeddings`` on the model's
    embedding instance (or its own, when it was given ``--embeddings``)."""

    def __init__(self, manager: ModelManager, ttl: Any, began: float, body: dict[str, Any], older: bool) -> None:
        super().__init__(manager, ttl, began)
        self._payload = ollama.embed_request(body)
        self._older = older
        self._model = ""

    def upstream(self, loaded: LoadedModel) -> tuple[str, dict[str, Any]]:
        self._have(loaded)
        self._model = base_name(loaded.name)
        return ollama.EMBEDDINGS, self._payload

    def whole(self, content: bytes) -> bytes:
        answer = json.loads(content)
        if self._older:
            return json_codec.dumps(ollama.embeddings_reply(answer))
        return json_codec.dumps(ollama.embed_reply(self._model, answer, self._durations()))


class _Generate:
    """The ``Face`` of Ollama's ``/api/chat`` and ``/api/generate``."""

    def __init__(self, kind: ollama.Kind) -> None:
        self.kind: ollama.Kind = kind

    def model(self, body: dict[str, Any]) -> str:
        return ollama.model_name(body)

    async def turn(self, request: Request, body: dict[str, Any], model: str, began: float) -> Turn | Response:
        ttl, manager = _ttl(body), _manager(request)
        if body.get("messages") if self.kind == "chat" else body.get("prompt") or body.get("images"):
            return _Generation(manager, ttl, began, self.kind, body)
        if ttl != 0:
            return _Load(manager, ttl, began, self.kind)
        entry = manager.catalog.resolve(model)  # keep_alive 0 unloads now, as /api/unload; an alias or a path too
        try:
            await manager.unload(entry.name)
        except ModelNotResidentError:
            pass  # not loaded: nothing to do, as Ollama answers
        return JSONResponse(ollama.load_reply(self.kind, entry.name, "unload"))


class _Embed:
    """The ``Face`` of Ollama's ``/api/embed`` and the older ``/api/embeddings`` (one ``prompt``, one vector)."""

    def __init__(self, *, older: bool) -> None:
        self.older = older

    def model(self, body: dict[str, Any]) -> str:
        return ollama.model_name(body)

    async def turn(self, request: Request, body: dict[str, Any], model: str, began: float) -> Turn:
        return _Embedding(_manager(request), _ttl(body), began, body, self.older)


#: Ollama's model routes: rows of the forward path, each answered ahead of the router (``studio.http.ahead``).
ROUTES = {
    "/api/chat": Route(
        "",
        nothing_to_add,
        "Ollama's chat: NDJSON chunks, then one with done, counts and durations",
        dialect="ollama",
        generates=True,
        face=_Generate("chat"),
    ),
    "/api/generate": Route(
        "",
        nothing_to_add,
        "Ollama's completion of a prompt (a chat turn where the model has a template; infill with suffix)",
        dialect="ollama",
        generates=True,
        face=_Generate("generate"),
    ),
    "/api/embed": Route(
        "",
        nothing_to_add,
        "Embeddings of input, by the model's embedding instance (or its own, with --embeddings)",
        dialect="ollama",
        embeds=True,
        face=_Embed(older=False),
    ),
    "/api/embeddings": Route(
        "",
        nothing_to_add,
        "The older embeddings route: one prompt, one embedding",
        dialect="ollama",
        embeds=True,
        face=_Embed(older=True),
    ),
}
for _path, _route in ROUTES.items():
    declare(router, _path, _route)


class NdjsonStream:
    """llama-server's server-sent events as Ollama's NDJSON chunks, as they arrive: a ``Relay``'s reshape.

    Each ``data:`` event becomes the chunk ``ollama.Reply`` makes of it (none for a piece without text); an
    ``error`` event becomes Ollama's ``{"error": ...}`` line, the stream's last; a whole stream ends with the
    final chunk (``done``, counts and durations).
    """

    def __init__(self, route: str, reply: ollama.Reply, durations: Callable[[], ollama.Durations]) -> None:
        self._split = EventSplitter()
        self._route = route
        self._reply = reply
        self._durations = durations
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
                out.append(_line(chunk))
        return b"".join(out)

    def finish(self) -> bytes:
        if self._ended:
            return b""
        return _line(self._reply.final(self._durations(), streamed=True))

    def close(self) -> bytes:
        return b""  # the error line follows; a broken stream has no final chunk
