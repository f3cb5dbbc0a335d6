"""An optional bearer token in front of the whole service, as pure ASGI middleware.

Pure ASGI (not ``BaseHTTPMiddleware``) so the streaming path is not buffered.
``/health`` stays open for supervisors and load balancers.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from studio.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class BearerTokenMiddleware:
    """Answer 401 (OpenAI error shape) unless ``Authorization: Bearer <token>`` matches."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(
            "missing or wrong API token; send `Authorization: Bearer <token>` (GGUF_STUDIO_API_TOKEN)",
            "authentication_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
