"""The studio service: FastAPI app with the GUI API, the forwarded model routes and ``/metrics``.

Errors from every layer are translated here, at one boundary (``studio.http.errors``), into
the shape of the route's dialect: OpenAI's, or Anthropic's on the Messages routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.telemetry import TelemetryConfig
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST

from studio import __version__
from studio.activity.api import router as activity_router
from studio.activity.recorder import Activity
from studio.activity.store import Retention
from studio.activity.trace import RequestTrace
from studio.chat.toolbox import Toolbox
from studio.history.api import router as history_router
from studio.history.service import History
from studio.http.clients.openai_proxy import forward
from studio.http.clients.openai_proxy import router as proxy_router
from studio.http.clients.speech_api import router as speech_router
from studio.http.errors import dialect_of
from studio.http.guards.access import AccessPolicy
from studio.http.gui.gui_api import load_routes
from studio.http.gui.gui_api import router as api_router
from studio.http.gui.gui_chat import router as chat_router
from studio.http.gui.gui_hub import router as hub_router
from studio.http.gui.gui_pull import router as pull_router
from studio.http.gui.page import router as page_router
from studio.http.metrics import StudioMetrics
from studio.http.router.router_api import RouterLoads
from studio.http.router.router_api import router as router_api
from studio.http.router.stream_owners import StreamOwners
from studio.http.router.streams import router as streams_router
from studio.http.stack import stack
from studio.http.wire.upstream import Upstream
from studio.library.downloads import DownloadManager
from studio.library.hub_headers import header_cache
from studio.library.paths import PathPolicy
from studio.load_options import OPTIONS, Option
from studio.residency.manager import ModelManager
from studio.residency.requests import LoadRequest
from studio.settings import DEFAULT_MAX_BODY_BYTES, studio_home

log = structlog.get_logger(__name__)

#: FastAPI's own OpenTelemetry, off: the studio reports through ``/metrics``, and asking OpenTelemetry's global
#: providers whether they are configured was ~2.5 % of a forwarded request's CPU under cProfile (within the noise
#: of scripts/bench_proxy.py's CPU per request).
NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


def create_app(
    manager: ModelManager,
    *,
    preload: Sequence[LoadRequest] = (),
    api_token: str | None = None,
    access: AccessPolicy | None = None,
    paths: PathPolicy | None = None,
    max_connections: int = 64,
    toolbox: Toolbox | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    downloads: DownloadManager | None = None,
    history: History | None = None,
    hub_headers: Path | None = None,
    not_found_hint: Callable[[Request], str | None] | None = None,
    load_options: Sequence[Option] = OPTIONS,
    activity_kept: Retention | None = Retention(),
) -> FastAPI:
    """Return the service app around ``manager``; the ``preload`` models start loading at start-up, in order.

    With ``api_token`` every route but ``/health`` needs ``Authorization: Bearer <token>`` (or
    ``x-api-key``). ``access`` says which ``Host`` names and web-page origins are let in (default:
    loopback names, the studio's own page); ``paths`` where API clients may load model files from
    (default: the catalog's folders and Hugging Face cache).
    ``toolbox`` holds the tools ``/api/chat`` may run; its MCP servers start and stop with the app
    (in the background: the app serves at once, and a server that fails is shown in ``/api/tools``).
    Request bodies over ``max_body_bytes`` get a 413. ``downloads`` serves ``/api/pull`` (default: the
    manager's, else one over huggingface_hub's environment, without auto-download). ``history`` stores
    conversations (``/api/conversations``, ``/api/chat`` with a ``conversation_id``); it opens with the app, and
    a database it cannot use leaves the rest of the studio working. ``hub_headers`` keeps the headers Hub
    searches and plans read (default: under the studio home, ``studio.library.hub_headers``). ``not_found_hint``
    adds to the 404 of a path the app does not serve (``ggstudio serve`` says where the Ollama API is:
    ``studio.http.clients.ollama_app.main_port_hint``, wired there so that this app knows nothing of that one).
    ``load_options``: what ``/api/load`` and ``/api/plan`` take (``studio.load_options``). ``activity_kept``: how long
    the activity records are kept (``studio.activity``); ``None``: none are made.
    ``app.state`` holds what the routes share (the manager, the metrics, the path policy, the body limit and, once
    started, the pooled upstream, the downloads and the toolbox): the Ollama listener's app shares
    it too (``studio.http.clients.ollama_app``).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.upstream = upstream = Upstream(max_connections=max_connections)
        app.state.downloads = downloads or manager.downloads or DownloadManager()
        app.state.toolbox = tools = toolbox or Toolbox.empty()
        app.state.tools_started = asyncio.create_task(tools.start())
        manager.start_preload(preload)  # none from ``serve``: it began its own before building this app
        if history is not None:
            history.start()
        try:
            yield
        finally:
            try:
                activity.flush()  # the last records go with the answers' last saves
                if history is not None:
                    await asyncio.to_thread(history.close)  # the answers' last saves are written first
                app.state.tools_started.cancel()
                await asyncio.gather(app.state.tools_started, return_exceptions=True)
                await tools.aclose()
                await manager.aclose()
            finally:
                await upstream.aclose()

    # /docs (Swagger UI) with its script and styles served by the studio itself, under /static-offline-docs, from
    # the fastapi-offline package: FastAPI's own page loads them from a CDN, so offline it was blank. Behind the
    # same guards as every route (and the token, where one is set). No /redoc: ReDoc's build loads its maker's
    # logo from their CDN on every opening, with no option to leave it out, and shows what /docs shows.
    app = FastAPIOffline(
        title="GGUF Studio", version=__version__, lifespan=lifespan, telemetry=NO_TELEMETRY, redoc_url=None
    )
    app.state.paths = paths or PathPolicy.for_catalog(manager.catalog)
    app.state.path_checks = {}  # model -> its path check in flight (``studio.http.guards.model_paths``)
    app.state.manager = manager
    app.state.history = history
    app.state.hub_headers = hub_headers or header_cache(studio_home())
    app.state.max_body_bytes = max_body_bytes  # the Ollama listener's limit too
    app.state.metrics = metrics = StudioMetrics(manager)
    app.state.activity = activity = Activity(
        manager, history, retention=activity_kept, recording=activity_kept is not None
    )
    activity.listeners.append(_phases_to(metrics))
    app.state.router_loads = RouterLoads()
    app.state.stream_owners = StreamOwners()  # conv_id -> model, for /v1/stream (studio.http.router.streams)
    if tuple(load_options) != OPTIONS:  # another table (a test's made-up option): its routes answer first
        app.include_router(load_routes(load_options), prefix="/api")
    app.include_router(api_router)
    app.include_router(chat_router)
    app.include_router(pull_router)
    app.include_router(history_router)
    app.include_router(activity_router)
    app.include_router(hub_router)
    app.include_router(proxy_router)
    app.include_router(router_api)
    app.include_router(speech_router)
    app.include_router(streams_router)
    app.include_router(page_router)
    stack(
        app,
        listener="studio",
        dialect_for=dialect_of,
        metrics=metrics,
        max_body_bytes=max_body_bytes,
        api_token=api_token,
        access=access,
        not_found_hint=not_found_hint,
        activity=activity,
    )

    @app.get("/health")
    @app.get("/v1/health")  # llama-server answers both
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus' text format: requests, latency, tokens, loads, evictions, memory, speculative acceptance.
        With ``?model=``, that model's llama-server's own ``/metrics`` (a forwarded route)."""
        if request.query_params.get("model"):
            return await forward(request)
        activity.flush()  # the phases of the requests that ended since the last batch are counted first
        return Response(await metrics.render(request.app.state.upstream), media_type=CONTENT_TYPE_LATEST)

    return app


def _phases_to(metrics: StudioMetrics) -> Callable[[RequestTrace], None]:
    """What tells ``/metrics`` the phases of each generating request that ends."""

    def observe(trace: RequestTrace) -> None:
        if trace.generates and trace.model is not None:  # a resident's name, never a client's word
            metrics.observe_phases(trace.model, trace.route, trace.phases())

    return observe
