"""``/api/chat``: the studio GUI's chat stream, as typed server-sent events.

Unlike the OpenAI proxy (bytes passed through), this stream is re-shaped for
the GUI: ``content`` and ``reasoning`` deltas, ``tool_call`` deltas, and one
final ``done`` event with usage, timings, tokens/s and the speculative
acceptance rate (``draft_n_accepted / draft_n``); or an ``error`` event whose
``error`` field has OpenAI's error shape.

With ``use_tools`` (names from ``GET /api/tools``) the studio runs those tools
itself: ``studio.chat.tool_loop`` calls the model, runs its calls and feeds the
results back until it answers, adding ``tool_start``, ``tool_end`` and ``status``
events, and ``done`` sums every model call. Each model call acquires the model
for itself, so a long tool run holds no model. Without ``use_tools`` a request's
own OpenAI ``tools`` go to the model and its calls come back as ``tool_call``
events for the GUI to handle (healed from leaked markup).

With ``conversation_id`` (one of ``/api/conversations``) the turn is stored as it happens
(``studio.history.recorder``): the user's message first, then the answer while it streams; the
conversation remembers the model, its load settings and the options. A failure to store adds a
``history`` event and the answer goes on.

``POST /api/chat`` is answered by ``answer_chat``, pure ASGI ahead of FastAPI's routing
(``studio.http.ahead``), and its events go out through
``studio.http.wire.relay.EventStream``: both cost less per request and per event
than FastAPI's routing and ``StreamingResponse`` (``scripts/bench_proxy.py``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

import anyio
import httpx
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from studio import json_codec
from studio.activity.trace import RequestTrace
from studio.chat.media import preflight_chat
from studio.chat.model_turn import Turn, TurnError, read_turn
from studio.chat.tool_loop import LoopLimits, run_tool_loop
from studio.chat.tool_schema import check_tool_fields, tool_parameters
from studio.chat.toolbox import Toolbox
from studio.chat.usage import UsageTotals
from studio.errors import (
    BadRequestError,
    ConversationNotFoundError,
    HistoryError,
    StudioError,
    error_body,
)
from studio.history.api import history_of
from studio.history.recorder import Turn as StoredTurn
from studio.history.recorder import begin_turn, recorded
from studio.http.ahead import ahead
from studio.http.clients.load_wait import Retries, Survival, acquire_surviving
from studio.http.clients.openai_proxy import broke_off, first_bytes, prepare_chat_body, send_upstream, traced
from studio.http.errors import answer_response, describe, openai_shape, validation_answer
from studio.http.guards.model_paths import check_model_path
from studio.http.gui.bodies import ApiBody
from studio.http.metrics import Listener, StudioMetrics, listener_of
from studio.http.wire.relay import EventStream
from studio.residency.manager import ModelManager
from studio.residency.requests import LoadSettings
from studio.residency.resident import Lease, LoadedModel

router = APIRouter(prefix="/api")

PATH = "/api/chat"


class ToolLimits(ApiBody):
    """Per-chat bounds of the tool loop (defaults: ``LoopLimits``)."""

    max_iterations: int = Field(LoopLimits.max_iterations, ge=1, le=200)
    tool_timeout: float = Field(LoopLimits.tool_timeout, gt=0, le=3600)
    total_timeout: float = Field(LoopLimits.total_timeout, gt=0, le=24 * 3600)


class ChatBody(BaseModel):
    """A chat turn from the GUI; other OpenAI sampling fields pass through unchanged."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    use_tools: list[str] | None = None  # studio tools the model may call; the studio runs them
    tool_limits: ToolLimits | None = None
    conversation_id: str | None = Field(
        default=None, max_length=64, description="Store this turn in that conversation (POST /api/conversations)."
    )


@router.get("/tools")
async def tools(request: Request) -> dict[str, Any]:
    """The tools ``use_tools`` may name, the python tool's sandbox and each MCP server's state."""
    return _toolbox(request).status()


async def answer_chat(request: Request) -> Response:
    """``POST /api/chat`` as ``studio.http.ahead.AheadRoutes`` answers it, ahead of FastAPI's routing: the body
    checked as FastAPI would, for less."""
    body = await _chat_body(request)
    return body if isinstance(body, Response) else await _chat(request, body)


async def _chat_body(request: Request) -> ChatBody | Response:
    """The validated body, or the app's 422 answer for one that does not match ``ChatBody``."""
    raw = await request.body()  # outside the try: a body over the limit is a 413, not "not valid JSON"
    try:
        data = json_codec.loads(raw)
    except ValueError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    try:
        return ChatBody.model_validate(data)
    except ValidationError as exc:  # named as FastAPI names a body's fields
        refused = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()])
        return answer_response(validation_answer(refused), "openai")


@router.post("/chat")
@ahead("openai", answer_chat, recorded=True)
async def chat(request: Request, body: ChatBody) -> Response:
    """The GUI's chat turn, as typed server-sent events (answered by ``answer_chat``, ahead of the router)."""
    return await _chat(request, body)


async def _chat(request: Request, body: ChatBody) -> Response:
    began = time.perf_counter()
    manager: ModelManager = request.app.state.manager
    payload = body.model_dump(exclude_none=True, exclude={"use_tools", "tool_limits", "conversation_id"})
    asked = body.model_dump(exclude_none=True, exclude={"conversation_id"})  # as stored: before the model's changes
    check_tool_fields(payload)
    selected = []
    if body.use_tools is not None:
        if payload.get("tools"):
            raise BadRequestError(
                "send either `tools` (the GUI runs them) or `use_tools` (the studio runs them)", param="use_tools"
            )
        selected = _toolbox(request).select(body.use_tools)
    await check_model_path(request, body.model)
    await preflight_chat(manager, payload)
    trace = await traced(request, body.model)
    trace.streaming()
    retries = Retries()  # the load's and the first model call's: one request to llama-server
    loaded, lease = await acquire_surviving(manager, body.model, retries=retries)
    trace.got_model(loaded.name)
    try:
        prepare_chat_body(payload, loaded)
        turn, unsaved = await _store_turn(request, body.conversation_id, asked, loaded)
    except BaseException:
        await lease()
        raise
    held: list[tuple[LoadedModel, Lease]] = [(loaded, lease)]
    counted = _Counts(request.app.state.metrics, listener_of(request.scope), began, trace)

    async def call_model(
        messages: list[dict[str, Any]],
        offer: list[dict[str, Any]] | None,
    ) -> AsyncIterator[dict[str, Any] | Turn]:
        """One streamed model call; the first uses the model acquired above, later ones acquire their own. Each is
        sent again when its llama-server dies before the first byte of its answer (``Survival``)."""
        turn_body = {**payload, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
        if body.use_tools is not None:
            turn_body.pop("tool_choice", None)
            turn_body.pop("tools", None)
            if offer:
                turn_body["tools"] = offer

        async def ask(loaded: LoadedModel, lease: Lease) -> _Asked:
            restored = await manager.warm(loaded, turn_body)  # a resumed conversation after an eviction: its slot
            if trace.sent is None:  # the first model call: a tool loop's later calls are in its decode
                trace.restoring(restored)
                trace.sending()
            return await send_upstream(request, loaded, "/v1/chat/completions", turn_body, lease), loaded, lease

        first = held.pop() if held else None
        own: tuple[LoadedModel, Lease] | None = None
        resp: httpx.Response | None = None
        try:
            try:
                sent = Survival(manager, body.model, ask, _opening, found=first, retries=retries if first else None)
                asked = await sent.answered()
                resp, own = asked[0], asked[1:]
            except StudioError:
                raise
            except Exception as exc:  # a failed load mid-chat: an error event, not a broken stream
                raise _turn_error(exc, "the model could not be loaded") from exc
            heal = tool_parameters(turn_body) if turn_body.get("tool_choice") != "none" else None
            template = own[0].template
            async for item in read_turn(
                resp, heal or None, split_think=bool(template and template.reasoning_style == "always")
            ):
                counted.saw(own[0].name, item)
                yield item
        except TurnError as exc:
            if own is None or not isinstance(exc.__cause__, httpx.HTTPError):  # no ``own``: it was never sent
                raise
            raise await _broken_stream(own, exc.__cause__) from exc
        except StudioError as exc:  # refused, or failed before its answer began (TurnError is one: caught above)
            raise _turn_error(exc) from exc
        finally:
            with anyio.CancelScope(shield=True):
                if resp is not None:
                    await resp.aclose()
                if own is not None:  # else ``Survival`` let every lease go
                    await own[1]()

    if body.use_tools is not None:
        limits = LoopLimits(**(body.tool_limits or ToolLimits()).model_dump())
        events = run_tool_loop(payload["messages"], selected, call_model, limits)
    else:
        events = _one_turn(payload["messages"], call_model)
    if body.conversation_id is not None:
        events = recorded(events, getattr(request.app.state, "history", None), turn, unsaved)

    async def release_unused() -> None:
        for _, unused in held:  # acquired but never used (the client left first)
            await unused()

    return EventStream(_sse_events(events, trace), on_close=release_unused, media_type="text/event-stream")


class _Counts:
    """A chat's figures for ``/metrics``, counted as its model calls go: the time to the first generated event
    (from the request's arrival, a load included), and each call's tokens and llama-server's tokens/s; the first
    generated event is the first byte of its activity record's (``studio.activity``)."""

    def __init__(self, metrics: StudioMetrics, listener: Listener, began: float, trace: RequestTrace) -> None:
        self._metrics = metrics
        self._listener = listener
        self._began = began
        self._trace = trace
        self._first_seen = False

    def saw(self, model: str, item: dict[str, Any] | Turn) -> None:
        """Count what ``item`` says: a model call's end (its ``Turn``), or the chat's first generated event."""
        if isinstance(item, Turn):
            tokens = (item.usage or {}).get("completion_tokens")
            rate = (item.timings or {}).get("predicted_per_second")
            self._metrics.observe_counts(self._listener, PATH, model, first_token_s=None, tokens=tokens, rate=rate)
        elif not self._first_seen:
            self._first_seen = True
            self._trace.first_bytes()
            first_token_s = time.perf_counter() - self._began
            self._metrics.observe_counts(
                self._listener, PATH, model, first_token_s=first_token_s, tokens=None, rate=None
            )


async def _store_turn(
    request: Request, conversation_id: str | None, asked: dict[str, Any], loaded: LoadedModel
) -> tuple[StoredTurn | None, HistoryError | None]:
    """The stored turn, or why it could not be stored (the chat answers anyway); an unknown conversation is refused."""
    if conversation_id is None:
        return None, None
    try:
        history = history_of(request)
        return await begin_turn(history, conversation_id, asked, loaded.name, _load_fields(loaded.settings)), None
    except ConversationNotFoundError:
        raise
    except HistoryError as exc:
        return None, exc


def _load_fields(settings: LoadSettings) -> dict[str, Any]:
    """The settings a conversation continues with, named as ``POST /api/load`` takes them."""
    fields = {
        "n_ctx": settings.n_ctx,
        "n_parallel": settings.n_parallel,
        "cache_type_kv": settings.cache_type,
        "spec": settings.spec,
        "spec_n_max": settings.spec_n_max,
    }
    return {k: v for k, v in fields.items() if v is not None}


async def _one_turn(messages: list[dict[str, Any]], call_model: Any) -> AsyncIterator[dict[str, Any]]:
    """A chat without studio tools: one model call, its events, then ``done``."""
    totals = UsageTotals()
    try:
        async for item in call_model(messages, None):
            if isinstance(item, Turn):
                totals.add(item.usage, item.timings)
                yield totals.done(item.finish_reason)
            else:
                yield item
    except TurnError as exc:
        yield {"type": "error", "status": exc.status, "error": exc.error}


async def _broken_stream(own: tuple[LoadedModel, Lease], exc: httpx.HTTPError) -> TurnError:
    """Why llama-server broke off mid-stream: the model went away under the request, or an RPC worker died."""
    cut = own[1].interruption
    if cut:
        return _turn_error(cut)
    message, code = await broke_off(own[0], "llama-server went away mid-stream", exc)
    return TurnError(502, error_body(message, "upstream_error", code=code)["error"])


async def _sse_events(events: AsyncIterator[dict[str, Any]], trace: RequestTrace) -> AsyncGenerator[bytes, None]:
    """The events as server-sent events; the chat's end (``done``, ``error``) goes on its activity record."""
    try:
        async for event in events:
            kind = event.get("type")
            if kind == "done":
                trace.concluded(event.get("timings"), event.get("finish_reason"))
            elif kind == "error":
                error = event.get("error") or {}
                trace.failed(event.get("status"), str(error.get("message")), error.get("code") or error.get("type"))
            yield b"data: " + json_codec.dumps(event) + b"\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]


#: A model call's answer as ``Survival`` hands it over: llama-server's stream, and the model and lease it is on.
_Asked = tuple[httpx.Response, LoadedModel, Lease]


def _opening(asked: _Asked) -> Awaitable[None] | None:
    """The wait for a model call's stream to begin: a death before it is survived; none for an error answer."""
    return first_bytes(*asked) if asked[0].status_code == 200 else None


def _turn_error(exc: BaseException, doing: str | None = None) -> TurnError:
    """``exc`` as the error event of a chat turn: the table's answer, or a 502 for an error no one's."""
    answer = describe(exc)
    if answer is None:
        return TurnError(502, error_body(f"{doing or 'the model call failed'}: {exc}", "server_error")["error"])
    return TurnError(answer.status, openai_shape(answer)["error"])


def _toolbox(request: Request) -> Toolbox:
    return getattr(request.app.state, "toolbox", None) or Toolbox.empty()
