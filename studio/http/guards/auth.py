"""An optional API token in front of the whole service, as pure ASGI middleware.

Pure ASGI (not ``BaseHTTPMiddleware``) so the streaming path is not buffered.
``/health`` (and ``/v1/health``, as llama-server spells it too) stays open for supervisors and load
balancers, and so do the studio page's files (``/`` and ``/static/``, which hold no data): the page
asks for the token itself.
The token comes as ``Authorization: Bearer <token>`` (OpenAI's clients) or ``x-api-key: <token>``
(Anthropic's); it is compared in constant time and never logged. A refusal is
shaped for the dialect of the path (Anthropic's on its routes, Ollama's on its port).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from studio.http.errors import SHAPES, Dialect, ErrorAnswer, dialect_of

OPEN_PATHS = frozenset({"/health", "/v1/health", "/"})
OPEN_PREFIXES = ("/static/",)


class BearerTokenMiddleware:
    """Answer 401 (in the path's dialect) unless ``Authorization: Bearer <token>`` or ``x-api-key`` matches."""

    def __init__(self, app: ASGIApp, token: str, dialect: Callable[[str], Dialect] = dialect_of) -> None:
        self.app = app
        self._expected = token.encode()
        self._dialect = dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or _open(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        answer = ErrorAnswer(
            401,
            "missing or wrong API token; send `Authorization: Bearer <token>` or "
            "`x-api-key: <token>` (the token `ggstudio serve` printed, or GGUF_STUDIO_API_TOKEN)",
            "authentication_error",
            None,
            "invalid_api_key",
        )
        body = json.dumps(SHAPES[self._dialect(scope["path"])](answer)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        given: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given.append(credentials.strip())
            elif name == b"x-api-key":
                given.append(value.strip())
        # every candidate is compared, so the time taken does not depend on which one matched
        return any([hmac.compare_digest(g, self._expected) for g in given])


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
