"""Streamed requests that wait for a cold load hear from the studio: headers at once, then keep-alives.

A load takes seconds to minutes; a client, or a proxy in between, with an idle timeout would cut a stream
that sends nothing meanwhile, and a client that sees no response cannot tell a load from a hung server.
A streamed request whose model is not ready within ``FIRST_BEAT`` seconds gets its ``200`` and headers
then, and one keep-alive line at least every ``BEAT`` seconds until the answer begins: an SSE comment
(``: loading SmolLM2 45%``, the share of the weights read when llama-server reports it; then
``: SmolLM2 is reading the prompt`` until its first token) that SSE clients
skip by the standard, or on Ollama's listener a chunk with empty content and ``done: false``, which
Ollama's clients add to the answer as nothing (Ollama itself sends nothing while it loads). The first
``FIRST_BEAT`` seconds let the quick refusals (an unknown model, one that cannot fit) stay plain HTTP
errors; an error after the headers ends the stream with the dialect's error event instead
(``studio.http.errors.stream_error_line``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import structlog
from starlette.responses import Response

from studio.http.errors import SHAPES, Dialect, ErrorAnswer, describe, stream_error_line
from studio.http.relay import LoadWait
from studio.residency.manager import ModelManager
from studio.residency.resident import Lease, LoadedModel

log = structlog.get_logger(__name__)

#: Seconds a streamed request waits for its model before its headers go out.
FIRST_BEAT = 1.0
#: Seconds between keep-alive lines while the load goes on (the promise is at most 2).
BEAT = 1.0

#: What a request does with its model once it has it: returns the response (a stream, or a whole answer).
Answer = Callable[[LoadedModel, Lease], Awaitable[Response]]


def loading_comment(name: str, share: float | None) -> bytes:
    """The SSE comment line a waiting stream gets: ``: loading <model> 45%``, without a share when unknown."""
    return f": loading {name}{f' {share:.0%}' if share is not None else ''}\n\n".encode()


def reading_comment(name: str) -> bytes:
    """The line once the model is loaded and has the request: llama-server answers nothing (not even its headers)
    until its first token, so a long prompt would otherwise still read as ``loading``."""
    return f": {name} is reading the prompt\n\n".encode()


async def answer_when_loaded(
    manager: ModelManager,
    model: str | None,
    answer: Answer,
    *,
    dialect: Dialect,
    beat: Callable[[], bytes] | None = None,
    media_type: str = "text/event-stream",
    detach: bool = False,
) -> Response:
    """``answer``'s response for ``model``; when the model is not ready, a stream that keeps the client company
    until it is (see the module docstring). ``beat`` makes the keep-alive line (default: the SSE comment).
    With ``detach`` a client that leaves during the load leaves the request going (``LoadWait``).
    """
    found = manager.acquire_now(model)
    if found is not None:
        return await _answer(found, answer)
    acquired: list[str] = []  # the model's name once the load is done and the request is on its way to it
    task = asyncio.ensure_future(_loaded_then(manager, model, answer, acquired))
    try:
        done, _ = await asyncio.wait({task}, timeout=FIRST_BEAT)
    except BaseException:
        task.cancel()
        raise
    if done:
        return task.result()  # ready or refused quickly: an ordinary answer, or an HTTP error

    def comment() -> bytes:
        return reading_comment(acquired[0]) if acquired else loading_comment(*manager.load_progress(model))

    return LoadWait(
        task,
        beat=beat or comment,
        ended=lambda outcome: _error_line(outcome, dialect),
        every=BEAT,
        headers={"cache-control": "no-cache"},
        media_type=media_type,
        detach=detach,
    )


async def _loaded_then(manager: ModelManager, model: str | None, answer: Answer, acquired: list[str]) -> Response:
    found = await manager.acquire(model)
    acquired.append(found[0].name)
    return await _answer(found, answer)


async def _answer(found: tuple[LoadedModel, Lease], answer: Answer) -> Response:
    loaded, lease = found
    try:
        return await answer(loaded, lease)
    except BaseException:
        await lease()
        raise


def _error_line(outcome: BaseException | bytes, dialect: Dialect) -> bytes:
    """The last part of a stream whose answer failed: an exception, or a whole error answer's body."""
    if isinstance(outcome, bytes):
        return stream_error_line(outcome, dialect)
    found = describe(outcome)
    if found is None:  # a bug: the client hears that much, the log the rest
        log.error("a streamed answer failed while its model loaded", exc_info=outcome)
        found = ErrorAnswer(500, f"internal error: {type(outcome).__name__}", "server_error")
    return stream_error_line(json.dumps(SHAPES[dialect](found)).encode(), dialect)
