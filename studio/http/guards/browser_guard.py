"""What keeps web pages from using the studio: ``Host``, ``Origin`` and body-type checks, as pure ASGI.

Pure ASGI (not ``BaseHTTPMiddleware``) so the streaming path is not buffered: a
request that passes is handed on untouched, and an allowed cross-origin one only
gains two response headers. It runs before the token check, on every route and
every method, ``/health`` included:

1. ``Host`` must name the studio in a way DNS cannot fake (``studio.http.guards.access``), else 403:
   the DNS-rebinding defence. A request without ``Host`` (HTTP/1.0) carries no name to check.
2. A request with an ``Origin`` comes from a web page: only the studio's own origin (its
   own page, as the ``Host`` that passed names it) and allow-listed ones get through, else
   403. A CORS preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered
   here, 204 with ``Access-Control-Allow-*`` for an allowed origin, 403 for any other. A
   request without ``Origin`` (SDKs, curl) is not from a page and is unaffected.
3. A body declared as anything but JSON is a 415: ``text/plain``, form and multipart bodies
   are what a browser sends cross-site without a preflight. A route that takes another
   type of body (an upload) is named in ``other_bodies``. Without ``Origin`` this holds for
   browsers only (``from_a_browser``): every browser sends ``Origin`` with a page's ``POST``
   now, and the one left sending none is an old browser's form, whose ``User-Agent`` (a
   browser's, ``Mozilla/...``) the page cannot change. So ``curl -d '{...}'``, Ollama's own
   documented call, which declares a form, is read as the JSON it is, as Ollama reads it.

A refusal is shaped for the path's dialect (``dialect_for``): Anthropic's on its routes,
Ollama's on the Ollama port, as the token check and the body limit shape theirs.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from studio.http.errors import SHAPES, Dialect, ErrorAnswer, dialect_of
from studio.http.guards.access import AccessPolicy, origin_of, own_origin

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_ALLOW_METHODS = b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
_PREFLIGHT_MAX_AGE = b"600"


class BrowserGuard:
    """Refuse requests from web pages and host names the studio does not trust; see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        policy: AccessPolicy,
        *,
        other_bodies: frozenset[str] = frozenset(),
        dialect_for: Callable[[str], Dialect] = dialect_of,
    ) -> None:
        self.app = app
        self.policy = policy
        self.other_bodies = other_bodies  # paths whose bodies need not be JSON
        self.dialect_for = dialect_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        host = headers.get("host")
        if host is not None and not self.policy.host_allowed(host):
            await self._refuse(
                scope,
                send,
                ErrorAnswer(
                    403,
                    f"the Host header {host!r} names neither a loopback address nor a host the studio is allowed to "
                    "answer to; add the name to `allowed_hosts` in the config file (or GGUF_STUDIO_HOSTS)",
                    "permission_error",
                    code="host_not_allowed",
                ),
            )
            return
        origin = headers.get("origin")
        if origin is None:
            if from_a_browser(headers) and self._needs_json(scope, headers):
                await self._refuse(scope, send, _not_json(headers))
                return
            await self.app(scope, receive, send)
            return
        own = own_origin(_page_scheme(scope), host) if host is not None else None
        allowed = self.policy.origin_allowed(origin, own)
        if scope["type"] == "http" and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(scope, send, origin, headers, allowed)
            return
        if not allowed:
            await self._refuse(
                scope,
                send,
                ErrorAnswer(
                    403,
                    f"requests from web pages at {origin} are not allowed; to let that page use the studio, add "
                    "its origin to `allowed_origins` in the config file (or GGUF_STUDIO_ORIGINS)",
                    "permission_error",
                    code="origin_not_allowed",
                ),
            )
            return
        if self._needs_json(scope, headers):
            await self._refuse(scope, send, _not_json(headers), cors_origin=origin)
            return
        if own is not None and origin_of(origin) == own:  # the studio's own page: same-origin, no CORS needed
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _with_cors(send, origin))

    def _needs_json(self, scope: Scope, headers: dict[str, str]) -> bool:
        """True for a request whose body is declared as something other than JSON, on a route that takes JSON."""
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS or scope["path"] in self.other_bodies:
            return False
        declared = headers.get("content-type")
        if declared is None:  # no body, or one a client sends untyped: parsed as JSON, as it always was
            return False
        return declared.split(";", 1)[0].strip().lower() != "application/json"

    async def _preflight(self, scope: Scope, send: Send, origin: str, headers: dict[str, str], allowed: bool) -> None:
        """Answer a CORS preflight: 204 with what the page may send for an allowed origin, 403 for any other."""
        if not allowed:
            refusal = ErrorAnswer(
                403,
                f"web pages at {origin} may not use the studio; add the origin to `allowed_origins` in the config "
                "file (or GGUF_STUDIO_ORIGINS)",
                "permission_error",
                code="origin_not_allowed",
            )
            await self._refuse(scope, send, refusal)
            return
        answer = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", _ALLOW_METHODS),
            (b"access-control-max-age", _PREFLIGHT_MAX_AGE),
            (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
        ]
        if "access-control-request-headers" in headers:  # the origin is trusted: it may send the headers it names
            requested = headers["access-control-request-headers"].encode("latin-1")
            answer.append((b"access-control-allow-headers", requested))
        if headers.get("access-control-request-private-network") == "true":  # Chrome, from a public page to loopback
            answer.append((b"access-control-allow-private-network", b"true"))
        await _send(send, 204, b"", answer)

    async def _refuse(self, scope: Scope, send: Send, answer: ErrorAnswer, *, cors_origin: str | None = None) -> None:
        """Answer ``answer`` in the path's dialect; a WebSocket is closed before it opens (the server sends 403)."""
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = [(b"content-type", b"application/json")]
        if cors_origin is not None:  # an allowed page may read why it was refused
            headers += [(b"access-control-allow-origin", cors_origin.encode("latin-1")), (b"vary", b"Origin")]
        body = json.dumps(SHAPES[self.dialect_for(scope["path"])](answer)).encode()
        await _send(send, answer.status, body, headers)


def from_a_browser(headers: dict[str, str]) -> bool:
    """Whether a request without ``Origin`` may come from a web page: from a browser, whose every ``User-Agent``
    begins ``Mozilla/`` and cannot be changed by a page's form (curl, the SDKs and scripts send their own)."""
    return headers.get("user-agent", "").startswith("Mozilla/")


#: The request headers the guard reads; only these are decoded (all of them cost ~10 µs a request).
_READ = frozenset(
    {
        b"host",
        b"origin",
        b"content-type",
        b"user-agent",
        b"access-control-request-method",
        b"access-control-request-headers",
        b"access-control-request-private-network",
    }
)


def _headers(scope: Scope) -> dict[str, str]:
    """The request headers the guard reads, decoded (latin-1, as HTTP defines them); the first of each wins."""
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name in _READ and (key := name.decode("latin-1")) not in out:
            out[key] = value.decode("latin-1")
    return out


def _page_scheme(scope: Scope) -> str:
    """The scheme a page on this studio has: ``ws``/``wss`` requests come from ``http``/``https`` pages."""
    scheme: str = scope.get("scheme", "http")
    return {"ws": "http", "wss": "https"}.get(scheme, scheme)


def _not_json(headers: dict[str, str]) -> ErrorAnswer:
    return ErrorAnswer(
        415,
        f"this route takes a JSON body, not {headers.get('content-type')!r}; send `Content-Type: application/json`",
        "invalid_request_error",
        code="unsupported_media_type",
    )


def _with_cors(send: Send, origin: str) -> Send:
    """``send`` that lets the allowed page at ``origin`` read the response."""
    extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return sending


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
