"""One translation of errors into HTTP answers, and one shape function per dialect.

``describe`` turns an error from any layer below into an ``ErrorAnswer`` (status, type, message,
param, code) through the one table of ``studio.error_table``. A dialect's shape function then
writes that answer the way its clients parse errors:

- OpenAI: ``{"error": {"message", "type", "param", "code"}}`` (``studio.errors.error_body``);
- Anthropic: ``{"type": "error", "error": {"type", "message"}}``, with Anthropic's type names,
  chosen by status as Anthropic's API does (``not_found_error`` for 404, ``overloaded_error``
  for 503...);
- Ollama: ``{"error": "message"}``.

llama-server answers its own errors in OpenAI's shape on every route; ``upstream_response``
rewrites such an answer for a dialect that is not OpenAI's, and words anew the few whose status or
words are llama-server's own business (``_reworded``: an embedding input longer than one ubatch is a
500 that tells the client to raise a server flag).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, overload

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from studio.error_table import ROOTS, outcome
from studio.errors import BusyError, StudioError, error_body, error_in

Dialect = Literal["openai", "anthropic", "ollama"]

#: Path prefixes on the main listener whose clients expect Anthropic's error shape.
ANTHROPIC_PATHS = ("/v1/messages",)


@dataclass(frozen=True)
class ErrorAnswer:
    """What to tell the client, before it is shaped for a dialect."""

    status: int
    message: str
    type: str  # OpenAI's (and the studio's) error type, e.g. "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: Mapping[str, str] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # more OpenAI fields, e.g. ``n_ctx``


@overload
def describe(exc: StudioError) -> ErrorAnswer: ...
@overload
def describe(exc: BaseException) -> ErrorAnswer | None: ...
def describe(exc: BaseException) -> ErrorAnswer | None:
    """Return the answer to an error from the layers below (``studio.error_table``); ``None`` for a bug (a 500)."""
    found = outcome(exc)
    if found is None:
        return None
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, BusyError) else None
    message = exc.message if isinstance(exc, StudioError) else str(exc)
    return ErrorAnswer(found.status, message, found.type, found.param, found.code, headers)


#: The exception classes ``describe`` answers; the app registers its handlers for these.
HANDLED = ROOTS


def validation_answer(exc: RequestValidationError) -> ErrorAnswer:
    """A body FastAPI's validation refused, named by its first bad field (a 422)."""
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if param is None:  # the body as a whole: not a JSON object (curl -d sends a form's content type)
        message = (
            f"the request body: {first.get('msg', 'invalid')}; send a JSON object with the header "
            "Content-Type: application/json"
        )
        return ErrorAnswer(422, message, "invalid_request_error")
    return ErrorAnswer(422, f"{param}: {first.get('msg', 'invalid')}", "invalid_request_error", param)


def http_answer(exc: StarletteHTTPException, method: str, path: str) -> ErrorAnswer:
    """The router's own refusals (an unknown route, a method a route does not take), not FastAPI's ``detail``."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = {404: f"no such route: {method} {path}", 405: f"{method} is not allowed on {path}"}.get(
        exc.status_code, str(exc.detail)
    )
    return ErrorAnswer(exc.status_code, message, kind, headers=exc.headers)


# -- shapes ------------------------------------------------------------------------------------------

#: Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    """Anthropic's error type name for an HTTP status."""
    return ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


#: The header an error answer carries its code in, in every dialect (``answer_response``).
CODE_HEADER = "X-Error-Code"


def openai_shape(answer: ErrorAnswer) -> dict[str, Any]:
    return error_body(answer.message, answer.type, answer.param, answer.code, **answer.extra)


def anthropic_shape(answer: ErrorAnswer) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_type(answer.status), "message": answer.message}}


def ollama_shape(answer: ErrorAnswer) -> dict[str, Any]:
    return {"error": answer.message}


SHAPES: Mapping[Dialect, Callable[[ErrorAnswer], dict[str, Any]]] = {
    "openai": openai_shape,
    "anthropic": anthropic_shape,
    "ollama": ollama_shape,
}


def dialect_of(path: str) -> Dialect:
    """The error dialect of a path on the main listener: Anthropic's routes, else OpenAI's."""
    return "anthropic" if path.startswith(ANTHROPIC_PATHS) else "openai"


def answer_response(answer: ErrorAnswer, dialect: Dialect) -> JSONResponse:
    """``answer`` as a JSON response in ``dialect``'s shape, its code in the ``X-Error-Code`` header too: the
    Anthropic and Ollama shapes have no field for it, and a client of theirs can still tell one error from another
    (``retries_spent``: the studio sent it again already, until its retries ran out)."""
    headers = dict(answer.headers or {})
    if answer.code:
        headers[CODE_HEADER] = answer.code
    return JSONResponse(SHAPES[dialect](answer), answer.status, headers=headers or None)


def error_response(exc: BaseException, dialect: Dialect = "openai") -> JSONResponse | None:
    """The answer to ``exc`` in ``dialect``'s shape; ``None`` for an error no entry covers."""
    answer = describe(exc)
    return None if answer is None else answer_response(answer, dialect)


def install_error_handlers(
    app: FastAPI,
    dialect_for: Callable[[str], Dialect],
    *,
    not_found_hint: Callable[[Request], str | None] | None = None,
) -> None:
    """Answer the layers' errors, bad bodies and the router's refusals in the dialect of each path.

    ``not_found_hint`` may say more about a path the app does not serve (where that route is served instead).
    """

    async def translate(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc, dialect_for(request.url.path))
        if response is None:  # not registered for such errors
            raise exc
        return response

    for error_type in HANDLED:
        app.add_exception_handler(error_type, translate)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer_response(validation_answer(exc), dialect_for(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and refused methods get the route's error shape too, not FastAPI's ``detail``."""
        answer = http_answer(exc, request.method, request.url.path)
        if exc.status_code == 404 and not_found_hint is not None and (hint := not_found_hint(request)):
            answer = replace(answer, message=f"{answer.message}; {hint}")
        return answer_response(answer, dialect_for(request.url.path))


#: llama-server b11434's 500 for an embedding input longer than one ubatch (``server-context.cpp``).
_INPUT_TOO_LARGE = re.compile(r"input \((\d+) tokens\) is too large to process\. increase the physical batch size")
_BATCH = re.compile(r"current batch size: (\d+)")


def _reworded(error: Mapping[str, Any] | None) -> ErrorAnswer | None:
    """The studio's answer to a llama-server error that is the client's to fix, not llama-server's flags."""
    message = str(error.get("message", "")) if error is not None else ""
    found = _INPUT_TOO_LARGE.search(message)
    if found is None:
        return None
    batch = _BATCH.search(message)
    most = f"at most {batch.group(1)} tokens" if batch else "fewer tokens"
    return ErrorAnswer(
        400,
        f"the input is {found.group(1)} tokens, and the model embeds {most} in one input: split it into shorter "
        "pieces and embed each",
        "invalid_request_error",
        "input",
        "input_too_long",
    )


def upstream_answer(status: int, content: bytes) -> ErrorAnswer:
    """The answer inside llama-server's own (OpenAI-shaped) error body, reworded where ``_reworded`` says."""
    error = error_in(content)
    return _reworded(error) or _as_sent(status, content, error)


def _as_sent(status: int, content: bytes, error: Mapping[str, Any] | None) -> ErrorAnswer:
    if error is None:
        return ErrorAnswer(
            status, content.decode("utf-8", "replace")[:2000] or f"llama-server answered {status}", "upstream_error"
        )
    return ErrorAnswer(status, str(error.get("message", "")), str(error.get("type", "upstream_error")))


def upstream_response(
    status: int, content: bytes, dialect: Dialect, headers: Mapping[str, str] | None = None
) -> Response:
    """llama-server's error answer as ``dialect`` writes errors: OpenAI's passes as it came, unless reworded."""
    error = error_in(content)
    reworded = _reworded(error)
    if dialect == "openai" and reworded is None:
        return Response(content, status_code=status, headers=headers)  # llama-server's own words, as they came
    answer = reworded or _as_sent(status, content, error)
    return Response(json.dumps(SHAPES[dialect](answer)).encode(), status_code=answer.status, headers=headers)


def stream_error_event(answer: ErrorAnswer, dialect: Dialect) -> bytes:
    """The event that ends a broken stream, as the dialect's clients read errors mid-stream."""
    return stream_error_line(json.dumps(SHAPES[dialect](answer)).encode(), dialect)


def stream_error_line(body: bytes, dialect: Dialect) -> bytes:
    """An error ``body`` already in ``dialect``'s shape as the last part of a stream: a server-sent event
    (Anthropic's ``event: error``), or for Ollama one NDJSON line."""
    if dialect == "ollama":
        return body + b"\n"
    if dialect == "anthropic":
        return b"event: error\ndata: " + body + b"\n\n"
    return b"data: " + body + b"\n\n"
