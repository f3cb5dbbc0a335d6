"""Routes answered ahead of FastAPI's routing: pure ASGI, for the paths every chat goes through.

FastAPI's middleware, routing, body and dependency layers cost about 0.3 ms a request, more than
relaying a whole answer's chunks (``scripts/bench_proxy.py``), and a fan-out of 32 chats pays it 32
times before the last one's first token. So the hot ``POST`` routes (the GUI's ``/api/chat``,
Ollama's ``/api/chat`` and ``/api/generate``) are answered by ``PostRoutes`` before the router;
the OpenAI-dialect routes have their own table (``studio.http.openai_proxy.OpenAIRoutes``). The
FastAPI routes of the same paths stay, for ``/docs`` and for the methods they refuse.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from studio.http.errors import Dialect

#: Answers one request: the response, or an exception ``on_error`` turns into one.
Handler = Callable[[Request], Awaitable[Response]]


class PostRoutes:
    """Pure ASGI middleware that answers ``POST`` on ``routes``' paths itself; everything else goes on to the app.

    An error is answered by ``on_error`` (the app's one translation) in ``dialect``'s shape; one it returns
    ``None`` for is raised, a 500.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Mapping[str, Handler],
        on_error: Callable[[Exception, Dialect], Response | None],
        dialect: Dialect,
    ) -> None:
        self.app = app
        self.routes = dict(routes)
        self.on_error = on_error
        self.dialect: Dialect = dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except Exception as exc:
            answer = self.on_error(exc, self.dialect)
            if answer is None:
                raise
            response = answer
        await response(scope, receive, send)
