"""Routes answered ahead of FastAPI's routing: pure ASGI, for the paths every model request goes through.

FastAPI's middleware, routing, body and dependency layers cost about 0.3 ms a request, more than
relaying a whole answer's chunks (``scripts/bench_proxy.py``), and a fan-out of 32 chats pays it 32
times before the last one's first token. So the routes that generate (every forwarded model route,
Ollama's, the GUI's ``/api/chat``) are answered by ``AheadRoutes`` before the router, and the other
middleware. Its table is FastAPI's own: a route is declared as any other (for ``/docs``, and the
405 of a method it does not take) with its endpoint marked by ``ahead``, and ``AheadRoutes`` calls
that endpoint (or the handler the mark names) itself. Grepping a path leads to the code that runs.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import iter_route_contexts
from starlette.routing import BaseRoute, compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from studio.activity.recorder import Activity
from studio.activity.trace import RequestTrace, current, error_message
from studio.http.errors import Dialect, describe
from studio.http.wire.relay import LoadWait, Relay

#: Answers one request: the response, or an exception ``on_error`` turns into one.
Handler = Callable[[Request], Awaitable[Response]]
#: The attribute ``ahead`` sets on an endpoint: its handler, the dialect of its errors, and how it is recorded.
MARK = "_gguf_studio_ahead"
#: What the mark holds (``ahead``'s arguments).
Mark = tuple[Handler, Dialect, bool | None]

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def ahead(
    dialect: Dialect, handler: Handler | None = None, *, recorded: bool | None = None
) -> Callable[[Endpoint], Endpoint]:
    """Mark a route's endpoint as answered by ``AheadRoutes``: by ``handler``, or the endpoint itself (called with
    the request alone); its errors in ``dialect``'s shape. ``recorded``: whether its requests get an activity record
    as a generating route (True) or another model route (False); None: none."""

    def mark(endpoint: Endpoint) -> Endpoint:
        setattr(endpoint, MARK, (handler or endpoint, dialect, recorded))
        return endpoint

    return mark


def ahead_paths(routes: Sequence[BaseRoute]) -> list[str]:
    """The paths of ``routes`` answered ahead of the router."""
    return [path for path, _, _ in _marked(routes)]


def _marked(routes: Sequence[BaseRoute]) -> Iterator[tuple[str, set[str], Mark]]:
    """Each route of ``routes`` (the included routers' too) marked by ``ahead``: its path, methods and mark."""
    for route in iter_route_contexts(routes):
        found = getattr(route.endpoint, MARK, None)
        if found is not None and route.path is not None:
            yield route.path, route.methods or set(), found


class AheadRoutes:
    """Pure ASGI middleware that answers the routes marked ``ahead`` in ``routes`` (the app's FastAPI table) itself;
    everything else goes on to the app.

    The table is read when the app builds its middleware, at its first request, once every route is in. An error
    is answered by ``on_error`` (the app's one translation) in the route's dialect; one it returns ``None`` for is
    raised, a 500.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Sequence[BaseRoute],
        on_error: Callable[[Exception, Dialect], Response | None],
        activity: Activity | None = None,
    ) -> None:
        self.app = app
        self.on_error = on_error
        self.activity = activity
        self.exact: dict[tuple[str, str], Mark] = {}  # (method, path) ->
        self.templated: list[tuple[re.Pattern[str], set[str], Mark]] = []  # /slots/{id_slot}
        for path, methods, found in _marked(routes):
            if "{" in path:
                self.templated.append((compile_path(path)[0], methods, found))
            else:
                for method in methods:  # the first route of a path and method, as FastAPI's routing takes it
                    self.exact.setdefault((method, path), found)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.exact.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        if found is None and self.templated and scope["type"] == "http":
            found = next(
                (
                    f
                    for regex, methods, f in self.templated
                    if scope["method"] in methods and regex.match(scope["path"])
                ),
                None,
            )
        if found is None:
            await self.app(scope, receive, send)
            return
        handler, dialect, recorded = found
        if self.activity is None or recorded is None:
            await self._serve(scope, receive, send, handler, dialect)
            return
        trace, token = self.activity.begin(scope["headers"], scope["path"], dialect, generates=recorded)
        complete = False
        try:
            complete = await self._serve(scope, receive, send, handler, dialect)
        except BaseException:
            trace.failed(500, "internal error", "server_error")
            raise
        finally:
            if not complete or trace.status == 499:
                trace.left()
            self.activity.end(trace, token)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, handler: Handler, dialect: Dialect) -> bool:
        """Answer the request; return whether the whole answer went out (a stream's client may leave before).

        The record's status is the response's, read here rather than from its start message: a wrapper around
        ``send`` cost every request another frame for each message it sent."""
        trace = current()
        try:
            response = await handler(Request(scope, receive))
        except Exception as exc:
            answer = self.on_error(exc, dialect)
            if answer is None:
                raise
            note_error(trace, exc)
            response = answer
        else:
            if isinstance(response, Relay | LoadWait):
                trace.streaming(response.first_byte_at)
            elif response.status_code >= 400 and trace.error is None:
                trace.failed(response.status_code, error_message(bytes(response.body)), "upstream_error")
        trace.answering(response.status_code)
        await response(scope, receive, send)
        return getattr(response, "complete", True)  # a whole answer's last bytes went out once it returns


def note_error(trace: RequestTrace, exc: BaseException) -> None:
    """Put ``exc`` on the request's record, as its client is told it."""
    found = describe(exc)
    if found is None:
        trace.failed(500, f"internal error: {type(exc).__name__}", "server_error")
    else:
        trace.failed(found.status, found.message, found.code or found.type)
