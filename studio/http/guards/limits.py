"""Request body limits, as pure ASGI middleware (no ``BaseHTTPMiddleware`` on the streaming path).

A body longer than ``max_body_bytes`` is refused with 413 in the error shape of
the path's dialect: at once when ``Content-Length`` says so, else as soon as the
bytes read pass the limit (a chunked upload), without reading the rest. Both
listeners have it, with the same limit (the Ollama one's app reads it from the
studio app's state). Responses pass through untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from studio.errors import PayloadTooLargeError
from studio.http.errors import SHAPES, Dialect, describe, dialect_of


class BodySizeLimit:
    """Refuse request bodies over ``max_body_bytes`` with a 413, shaped for the path by ``dialect_for``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, dialect_for: Callable[[str], Dialect] = dialect_of) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.dialect_for = dialect_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope.get("headers") or () if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, send, int(declared))
            return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise PayloadTooLargeError(self._message(seen, at_least=True), limit=self.max_body_bytes)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except PayloadTooLargeError:
            if started:
                raise
            await self._refuse(scope, send, seen, at_least=True)

    def _message(self, size: int, *, at_least: bool = False) -> str:
        return (
            f"the request body is {'more than ' if at_least else ''}{size:,} bytes, over the limit of "
            f"{self.max_body_bytes:,} (max_body_bytes in the config, GGUF_STUDIO_MAX_BODY_BYTES); send smaller "
            "media (downscale images, shorter audio) or raise the limit"
        )

    async def _refuse(self, scope: Scope, send: Send, size: int, *, at_least: bool = False) -> None:
        answer = describe(PayloadTooLargeError(self._message(size, at_least=at_least), limit=self.max_body_bytes))
        body = json.dumps(SHAPES[self.dialect_for(scope["path"])](answer)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
