"""The studio service: FastAPI app with the GUI API and the OpenAI-compatible proxy.

Errors from every layer are translated here, at one boundary, into the one
OpenAI error shape (``studio.errors.error_body``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import gguf
from launcher.errors import LauncherError, LoadError, StartAbortedError
from studio import __version__
from studio.chat.toolbox import Toolbox
from studio.http.access import AccessPolicy
from studio.http.gui_api import router as api_router
from studio.http.auth import BearerTokenMiddleware
from studio.http.browser_guard import BrowserGuard
from studio.http.gui_chat import router as chat_router
from studio.http.gui_pull import router as pull_router
from studio.http.page import router as page_router
from studio.errors import BusyError, StudioError, error_body
from studio.library.paths import PathPolicy
from studio.residency.manager import ModelManager
from studio.residency.requests import LoadRequest
from studio.http.openai_proxy import OpenAIRoutes
from studio.http.openai_proxy import router as proxy_router
from studio.http.limits import BodySizeLimit
from studio.library.downloads import DownloadManager
from studio.http.upstream import Upstream
from studio.settings import DEFAULT_MAX_BODY_BYTES

log = structlog.get_logger(__name__)


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
) -> FastAPI:
    """Return the service app around ``manager``; the ``preload`` models start loading at start-up, in order.

    With ``api_token`` every route but ``/health`` needs ``Authorization: Bearer <token>`` (or
    ``x-api-key``). ``access`` says which ``Host`` names and web-page origins are let in (default:
    loopback names, the studio's own page); ``paths`` where API clients may load model files from
    (default: the catalog's folders and Hugging Face cache).
    ``toolbox`` holds the tools ``/api/chat`` may run; its MCP servers start and stop with the app
    (in the background: the app serves at once, and a server that fails is shown in ``/api/tools``).
    Request bodies over ``max_body_bytes`` get a 413. ``downloads`` serves ``/api/pull`` (default: the
    manager's, else one over huggingface_hub's environment, without auto-download).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.upstream = upstream = Upstream(max_connections=max_connections)
        app.state.manager = manager
        app.state.downloads = downloads or manager.downloads or DownloadManager()
        app.state.toolbox = tools = toolbox or Toolbox.empty()
        app.state.tools_started = asyncio.create_task(tools.start())
        if preload:
            app.state.preload = asyncio.create_task(manager.preload(preload))
        try:
            yield
        finally:
            try:
                app.state.tools_started.cancel()
                await asyncio.gather(app.state.tools_started, return_exceptions=True)
                await tools.aclose()
                await manager.aclose()
            finally:
                await upstream.aclose()

    app = FastAPI(title="GGUF Studio", version=__version__, lifespan=lifespan)
    app.state.paths = paths or PathPolicy.for_catalog(manager.catalog)
    app.include_router(api_router)
    app.include_router(chat_router)
    app.include_router(pull_router)
    app.include_router(proxy_router)
    app.include_router(page_router)
    app.add_middleware(OpenAIRoutes, on_error=error_response)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)
    if api_token:
        app.add_middleware(BearerTokenMiddleware, token=api_token)
    # added last, so it runs first: a preflight carries no token, and a bad Host learns nothing else
    app.add_middleware(BrowserGuard, policy=access or AccessPolicy.create())

    async def translate(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc)
        if response is None:  # not registered for such errors
            raise exc
        return response

    for error_type in (StudioError, gguf.GGUFError, LauncherError):
        app.add_exception_handler(error_type, translate)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{param}: {first.get('msg', 'invalid')}", "invalid_request_error", param), 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and refused methods get the one error shape too, not FastAPI's ``detail``."""
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = {404: f"no such route: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(message, kind, None, None), exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def error_response(exc: Exception) -> JSONResponse | None:
    """Return the OpenAI-shaped answer to an error from the layers below; ``None`` for any other error (a bug)."""
    if isinstance(exc, StudioError):
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, BusyError) else None
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status, headers=headers)
    if isinstance(exc, gguf.GGUFError):
        return JSONResponse(error_body(str(exc), "invalid_request_error", "model", "invalid_gguf"), 400)
    if isinstance(exc, LauncherError):
        if isinstance(exc, ValueError):  # a request the planner refuses: bad cache type, spec mode, extra args
            return JSONResponse(error_body(str(exc), "invalid_request_error", None, type(exc).__name__), 400)
        if isinstance(exc, StartAbortedError):
            return JSONResponse(error_body(str(exc), "load_cancelled", None, "load_cancelled"), 409)
        code = getattr(exc, "cause", None) or "load_failed"
        status = 500 if isinstance(exc, LoadError) else 502
        return JSONResponse(error_body(str(exc), "server_error", None, code), status)
    return None

