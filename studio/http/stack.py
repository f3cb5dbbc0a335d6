"""The middleware both listeners stack around their routes, listed once, in order (starlette's
``build_middleware_stack`` shape): the studio's main app and the Ollama listener's call ``stack``.

Every layer is pure ASGI: nothing buffers a stream. From the outside in: the request metrics (the
refusals below are counted too), the browser guard (a preflight carries no token, and a bad
``Host`` learns nothing else), the API token, the body limit, and the routes answered ahead of
FastAPI's routing (``studio.http.ahead``). Each shapes its errors by the listener's ``dialect_for``.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request

from studio.activity.recorder import Activity
from studio.http.ahead import AheadRoutes, ahead_paths
from studio.http.clients.openai_proxy import FORM_PATHS
from studio.http.errors import Dialect, error_response, install_error_handlers
from studio.http.guards.access import AccessPolicy
from studio.http.guards.auth import BearerTokenMiddleware
from studio.http.guards.browser_guard import BrowserGuard
from studio.http.guards.limits import BodySizeLimit
from studio.http.metrics import Listener, RequestMetrics, StudioMetrics


def stack(
    app: FastAPI,
    *,
    listener: Listener,
    dialect_for: Callable[[str], Dialect],
    metrics: StudioMetrics,
    max_body_bytes: int,
    api_token: str | None = None,
    access: AccessPolicy | None = None,
    not_found_hint: Callable[[Request], str | None] | None = None,
    activity: Activity | None = None,
) -> None:
    """Put the studio's middleware around ``app``'s routes, and its error handlers in; call it once its routers are
    included (the routes answered ahead are read from its table); ``activity`` records their requests, if it
    records at all."""
    recorder = activity if activity is not None and activity.recording else None
    app.add_middleware(AheadRoutes, routes=app.router.routes, on_error=error_response, activity=recorder)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes, dialect_for=dialect_for)
    if api_token:
        app.add_middleware(BearerTokenMiddleware, token=api_token, dialect=dialect_for)
    app.add_middleware(
        BrowserGuard, policy=access or AccessPolicy.create(), other_bodies=FORM_PATHS, dialect_for=dialect_for
    )
    app.add_middleware(RequestMetrics, metrics=metrics, listener=listener, known=ahead_paths(app.router.routes))
    install_error_handlers(app, dialect_for, not_found_hint=not_found_hint)
