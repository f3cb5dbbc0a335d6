"""The forwarded routes: route by ``model``, pass bytes through as they come.

Every route llama-server answers for a model goes through here, in every dialect it
speaks: OpenAI's chat, completions, embeddings, Responses and transcriptions, Anthropic's
Messages, token counting, rerank and infill, and llama-server's own routes (``/completion``,
``/tokenize``, ``/props``, ``/slots``, ...), under each spelling llama-server accepts
(``FORWARDED``: one row a route), and the dialects whose bodies are not llama-server's
(Ollama's ``/api/chat``, ``/api/generate`` and embeddings, ``studio.http.clients.ollama_app.ROUTES``): a
row with a ``Face``, whose hooks translate the request, reshape the answer and make the keep-alive
beat, and whose ``dialect`` shapes the errors. As llama.cpp's router does, a ``POST`` names its model by
the body's ``model``, a ``GET`` by ``?model=``, and either goes to the default model without
one. They share the routing, the residency, the queue and the cancellation; only the errors
differ, shaped for the route's dialect (``studio.http.errors``); llama-server's own error
bodies are reshaped to match. The routes that would reach files or programs on this machine
are refused with the reason (``REFUSED``), and a slot file is a plain name in the model's
slot folder (``check_slot_file``).

Each row is a FastAPI route (``declare``: ``/docs``, and the 405 of a method it does not
take) whose endpoint ``studio.http.ahead.AheadRoutes`` calls ahead of FastAPI's routing:
every millisecond of the proxy's CPU is added to a request's latency on a machine whose
cores llama-server keeps busy, and FastAPI's middleware, routing and dependency layers
cost more than relaying a whole answer.

Streams are relayed chunk by chunk from one pooled ``studio.http.wire.upstream.Upstream``
by ``studio.http.wire.relay.Relay``, with no buffering and no re-serialisation per chunk.
When the client goes away the relay is cancelled and the upstream response closed,
which closes the connection; llama-server notices and frees the slot. A non-streamed
answer is read while the client's side is watched: a client that leaves stops
the generation the same way, instead of keeping the slot busy to ``max_tokens``.

An embeddings request (``Route.embeds``) goes to an instance of its model that embeds: the model's
embedding instance, started beside its chat instance when that one does not
(``studio.residency.manager``).

A request holds its model through a ``Lease``; when the model goes away under it
(an unload past its grace, an eviction), the error it gets says so.

A llama-server that breaks off because an RPC worker died names no worker; the
error a client gets then names the workers that no longer accept a connection
(``broke_off``), since by then the dead one has closed its port.

A streamed ``usage`` is llama-server's own and no chunk is parsed for it: a
chat stream ends with OpenAI's usage chunk (empty ``choices``) exactly when the
request asks ``stream_options.include_usage``, as OpenAI specifies, and
``timings`` ride on the last chunk either way; a ``/v1/completions`` stream's
last chunk always has both (b11434 ``tools/server/server-task.cpp``:
``to_json_oaicompat_chat_stream`` and ``to_json_oaicompat``). A stream with
``timings`` but no ``usage`` is one whose client did not ask for usage.

A chat request that offers ``tools`` is checked first (``studio.chat.tool_schema``),
and its answer is healed (``studio.chat.tool_healing``): tool-call markup the model
wrote as text becomes ``tool_calls``. Only such a stream is parsed, event by event
(``studio.chat.tool_stream``), and a Responses stream, whose events get the indexes OpenAI's clients
read and b11434 leaves out (``studio.dialects.responses_stream``); every other stream stays bytes in,
bytes out.

For ``/metrics`` the relay keeps the time of the first chunk and the last two chunks
(two assignments a chunk), and reads the token counts from those once the stream
ends (``studio.http.metrics.generation_counts``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import parse_qs

import anyio
import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from launcher.chat_templates import uses_jinja
from launcher.rpc import unreachable
from studio import json_codec
from studio.activity.recorder import Activity
from studio.activity.trace import RequestTrace, current
from studio.chat.media import check_chat_media, check_dialect_images, media_capabilities, preflight_chat
from studio.chat.reasoning import reasoning_request, with_prompt_flag
from studio.chat.tool_healing import heal_completion
from studio.chat.tool_schema import check_tool_fields, tool_parameters
from studio.chat.tool_stream import HealingRelay
from studio.dialects.anthropic_stop import StopSequenceStream, mended_answer
from studio.dialects.chat_shape import chat_body
from studio.dialects.responses_stream import ResponsesIndexes
from studio.errors import BadRequestError, RouteRefusedError, StudioError, UpstreamDiedError, UpstreamError
from studio.http.ahead import ahead
from studio.http.clients.load_wait import DEATH_NOTICE, answer_surviving, answer_when_loaded
from studio.http.errors import Dialect, ErrorAnswer, describe, stream_error_event, upstream_response
from studio.http.guards.model_paths import check_model_path
from studio.http.metrics import listener_of
from studio.http.router.stream_owners import CONVERSATION_HEADER, conversation_of, stream_owners
from studio.http.wire.relay import Relay, Reshape, client_gone
from studio.http.wire.upstream import Upstream
from studio.http.wire.upstream_wire import body_first_bytes
from studio.residency.manager import ModelManager
from studio.residency.requests import base_name
from studio.residency.resident import Lease, LoadedModel
from studio.views.residency import template_source

router = APIRouter()

#: Response headers worth passing on from llama-server.
_PASS_HEADERS = ("content-type",)
#: The methods the studio sends llama-server.
Method = Literal["GET", "POST", "DELETE"]


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager


def _upstream(request: Request) -> Upstream:
    return request.app.state.upstream


#: Counts a finished answer for /metrics: the time of its first chunk (streams) and its last bytes.
Count = Callable[[float | None, bytes], None]
#: The tools a request offers: each function's parameter schema by its name (``tool_parameters``).
Tools = dict[str, dict[str, Any]]
#: llama-server's chat route, the one whose requests are checked for tools and media before a load.
CHAT = "/v1/chat/completions"


class Turn(Protocol):
    """One request of a ``Face``'s dialect, from before its model's load to its answer."""

    #: whether it is answered as a stream (with keep-alive beats while its model loads), and the stream's type
    stream: bool
    media_type: str

    def beat(self) -> bytes:
        """The keep-alive line a stream gets while its model loads."""

    def upstream(self, loaded: LoadedModel) -> tuple[str, dict[str, Any]] | Response:
        """llama-server's path and body for the request now that ``loaded`` is its model; or its whole answer,
        when having the model loaded is all it asked."""

    def reshape(self) -> Reshape:
        """What the stream's bytes become on the way."""

    def whole(self, content: bytes) -> bytes:
        """What a whole answer (llama-server's 200) becomes."""


class Face(Protocol):
    """A dialect whose bodies are not llama-server's (Ollama's): the hooks a route's row adds to the one forward
    path, which does the rest (routing, the queue, the load and its keep-alives, the relay, the counts); the
    row's ``dialect`` shapes its errors."""

    def model(self, body: dict[str, Any]) -> str:
        """The model the body names; raises when it names none."""

    async def turn(self, request: Request, body: dict[str, Any], model: str, began: float) -> Turn | Response:
        """The request, checked before any load, as a ``Turn``; or its answer, when it needs no model (an unload)."""


async def forward(request: Request) -> Response:
    """The forwarded route's answer to ``request`` (``route_for``); a 404 error for a path that is not one."""
    found = route_for(request.method, request.scope["path"], request.scope["query_string"])
    if found is None:
        raise HTTPException(404)
    return await _forward(request, *found)


async def _forward(request: Request, route: Route, upstream_path: str) -> Response:
    """Route the request to its model's llama-server (loading it if need be) and pass the answer back.

    A request with a body names its model by the body's ``model`` (a form's ``model`` field), one without
    (a ``GET``) by ``?model=``; a ``Face``'s by its own rule.
    """
    began = time.perf_counter()
    face = route.face
    form = await _form_body(request) if route.form else None
    body = await json_body(request, empty=face is not None) if request.method == "POST" and form is None else None
    if face is not None and body is not None:
        model: str | None = face.model(body)
    else:
        model = form.model if form else body.get("model") if body is not None else request.query_params.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequestError("`model` must be a string", param="model")
    chat = route.upstream == CHAT
    if body is not None:
        if chat:
            check_tool_fields(body)  # before a load: a malformed request never reaches llama-server
        if route.check is not None:
            route.check(body)
    await check_model_path(request, model)
    if chat and body is not None:
        await preflight_chat(_manager(request), body)
    turn: Turn | None = None
    if face is not None and body is not None and model is not None:
        faced = await face.turn(request, body, model, began)
        if isinstance(faced, Response):
            return faced
        turn = faced
    query = request.scope["query_string"].decode("latin-1")
    conv_id = conversation_of(request) if route.generates and turn is None else None
    claim = stream_owners(request).claim(conv_id, model) if conv_id else None  # before the load: a stop cancels it
    trace = await traced(request, model)

    async def answer(loaded: LoadedModel, lease: Lease) -> Response:
        trace.got_model(loaded.name)
        if conv_id and claim and not stream_owners(request).settle(conv_id, claim, loaded.name):
            raise BadRequestError("request cancelled by a stop while the model was loading")
        return await _answer(request, route, upstream_path, body, form, query, conv_id, loaded, lease, began, turn)

    if turn is not None and turn.stream:  # a cold load: the dialect's keep-alives meanwhile
        return await answer_when_loaded(
            _manager(request), model, answer, dialect=route.dialect, beat=turn.beat, media_type=turn.media_type
        )
    if turn is None and body is not None and body.get("stream") and route.generates:
        # a stream named by a conversation goes on to llama-server if its client leaves during the load: resumable
        return await answer_when_loaded(
            _manager(request), model, answer, dialect=route.dialect, detach=claim is not None
        )
    return await answer_surviving(_manager(request), model, answer, embeddings=route.embeds)


async def traced(request: Request, model: str | None) -> RequestTrace:
    """The request's trace, with the model it asked for, and its body when a capture may keep it."""
    trace = current()
    activity: Activity | None = getattr(request.app.state, "activity", None)
    wanted = activity is not None and activity.captures.wants(model)
    trace.asking(model, await request.body() if wanted else None)
    return trace


async def _answer(
    request: Request,
    route: Route,
    upstream_path: str,
    body: dict[str, Any] | None,
    form: Form | None,
    query: str,
    conv_id: str | None,
    loaded: LoadedModel,
    lease: Lease,
    began: float,
    turn: Turn | None,
) -> Response:
    """The answer of ``loaded``'s llama-server, streamed or whole; the caller lets ``lease`` go if this raises."""
    served = route  # the row of llama-server's route: a Face's request becomes one of those
    if turn is not None:
        target = turn.upstream(loaded)
        if isinstance(target, Response):  # the model loaded was all it asked
            await lease()
            return target
        upstream_path, body = target
        served = FORWARDED[upstream_path]
    count = _counter(request, route, request.scope["path"], loaded.name, began)
    session = {CONVERSATION_HEADER: conv_id} if conv_id else None  # llama-server records the stream under it
    tools: Tools = {}
    chat = served.upstream == CHAT
    reshaping = turn is None and (body is None or route.reshapes is None or route.reshapes(body))
    if body is not None:
        served.prepare(body, loaded)
        body["model"] = base_name(loaded.name)  # llama-server answers with it: an embedding instance's is its model's
        if chat:
            # a conversation saved before an eviction comes back warm
            current().restoring(await _manager(request).warm(loaded, body))
        elif served.generates and (as_chat := chat_body(served.upstream, body)) is not None:
            # an Anthropic or Responses one too, rendered as llama-server does
            current().restoring(await _manager(request).warm(loaded, as_chat))
        tools = tool_parameters(body) if chat and turn is None and body.get("tool_choice") != "none" else {}
    current().sending()
    if body is None or not body.get("stream"):  # a GET, a form, or a whole answer
        whole = turn.whole if turn is not None else _whole_reshape(route, tools) if reshaping else None
        return await answer_unless_client_leaves(
            request,
            loaded,
            upstream_path,
            form or body,
            lease,
            lambda status, content, headers: _answered(route, whole, count, status, content, headers),
            query=query,
            headers=session,
        )
    resp = await send_upstream(request, loaded, upstream_path, body, lease, query=query, headers=session)
    headers = {k: v for k, v in resp.headers.items() if k.lower() in _PASS_HEADERS}
    if resp.status_code == 200:

        async def closed(first_at: float | None, tail: bytes) -> None:
            await close_upstream(resp, lease)
            count(first_at, tail)

        reshape: Reshape | None = None  # none: the stream goes on as it came
        if turn is not None:
            reshape = turn.reshape()
        elif tools:
            reshape = HealingRelay(tools)
        elif route.stream_reshape is not None and reshaping:
            reshape = route.stream_reshape()

        return Relay(
            resp,
            headers=headers if turn is None else None,
            media_type=None if turn is None else turn.media_type,
            on_close=closed,
            on_break=lambda exc: broken_stream_event(exc, lease, loaded, route.dialect),
            on_early_break=lambda exc: unanswered(exc, lease, loaded),  # before its first byte: sent again if it died
            reshape=reshape,
        )
    content = await read_answer(resp, lease, loaded)
    return upstream_response(resp.status_code, content, route.dialect, headers)


async def read_answer(resp: httpx.Response, lease: Lease, loaded: LoadedModel) -> bytes:
    """The whole answer of ``resp``, then the upstream and the lease are let go; a broken answer says why."""
    try:
        return await resp.aread()
    except httpx.HTTPError as exc:
        raise await unanswered(exc, lease, loaded) from exc
    finally:
        await close_upstream(resp, lease)


async def first_bytes(resp: httpx.Response, loaded: LoadedModel, lease: Lease) -> None:
    """Wait until the body of ``resp`` has begun: a stream's head comes before its prompt is read, its first bytes
    after. A break before them raises ``unanswered``'s error (the request may be sent again); ``resp`` is closed
    when the wait ends otherwise than with them (a cancelled one too: the caller has no response to close)."""
    try:
        await body_first_bytes(resp)
    except httpx.HTTPError as exc:
        await resp.aclose()
        raise await unanswered(exc, lease, loaded) from exc
    except BaseException:
        await resp.aclose()
        raise


async def unanswered(exc: httpx.HTTPError, lease: Lease, loaded: LoadedModel) -> StudioError:
    """The error of an answer that broke off before any of its bytes reached the client: an ``UpstreamDiedError``
    when its llama-server died (the request may be sent again), else why it broke off (the model went away
    under it, or the upstream failed)."""
    if lease.interruption:
        return lease.interruption
    if died := await lease.died(within=DEATH_NOTICE):  # nothing reached the client: it may be sent again
        return UpstreamDiedError(f"llama-server died before it answered: {died}")
    message, code = await broke_off(loaded, "llama-server broke off its answer", exc)
    return UpstreamError(message, code=code)


def _counter(request: Request, route: Route, path: str, model: str, began: float) -> Count:
    metrics, listener, trace = request.app.state.metrics, listener_of(request.scope), current()

    def count(first_at: float | None, tail: bytes) -> None:
        trace.answered(first_at, tail)
        if route.generates:
            metrics.observe_generation(listener, path, model, began=began, first_at=first_at, tail=tail)

    return count


def _whole_reshape(route: Route, tools: Tools) -> Callable[[bytes], bytes] | None:
    """What a whole answer of ``route`` goes through, given the request's tools; ``None``: nothing."""
    reshape = route.whole_reshape
    return None if reshape is None else lambda content: reshape(content, tools)


def _answered(
    route: Route,
    whole: Callable[[bytes], bytes] | None,
    count: Count,
    status: int,
    content: bytes,
    headers: dict[str, str],
) -> Response:
    """A whole (non-streamed) answer of a forwarded route: counted, reshaped (``whole``), or an error in the
    route's shape."""
    if status != 200:
        return upstream_response(status, content, route.dialect, headers)
    count(None, content)
    if whole is not None:
        content = whole(content)
    return Response(content, status_code=200, headers=headers)


async def answer_unless_client_leaves(
    request: Request,
    loaded: LoadedModel,
    path: str,
    body: dict[str, Any] | Form | None,
    lease: Lease,
    finish: Callable[[int, bytes, dict[str, str]], Response],
    *,
    query: str = "",
    headers: Mapping[str, str] | None = None,
) -> Response:
    """``finish``'s response to the whole answer, unless the client disconnects first: then the upstream
    request is dropped, which stops llama-server (it answers a non-streamed request only once it is done,
    so the wait is the whole generation). ``finish`` takes the status, the body and the headers to pass on.
    Without a ``body`` the request is a ``GET``; a ``Form`` goes on as it came, as ``query`` and ``headers`` do."""

    async def exchange() -> Response:
        resp = await send_upstream(request, loaded, path, body, lease, query=query, headers=headers)
        content = await read_answer(resp, lease, loaded)
        return finish(resp.status_code, content, {k: v for k, v in resp.headers.items() if k.lower() in _PASS_HEADERS})

    answering = asyncio.ensure_future(exchange())
    leaving = asyncio.ensure_future(client_gone(request.receive))
    try:
        await asyncio.wait({answering, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (answering, leaving):
            if not task.done():
                task.cancel()
    if answering.done() and not answering.cancelled():
        return answering.result()
    with anyio.CancelScope(shield=True):  # the connection is closed: llama-server stops; free the lease
        await asyncio.gather(answering, return_exceptions=True)
        await lease()
    return Response(status_code=499)  # nobody reads it: the client is gone


async def broken_stream_event(exc: httpx.HTTPError, lease: Lease, loaded: LoadedModel, dialect: Dialect) -> bytes:
    """The event that ends a stream whose upstream broke off: why, in the dialect's error shape."""
    answer = await _broken_answer(exc, lease, loaded)
    current().failed(answer.status, answer.message, answer.code)
    return stream_error_event(answer, dialect)


async def _broken_answer(exc: httpx.HTTPError, lease: Lease, loaded: LoadedModel) -> ErrorAnswer:
    cut = lease.interruption
    if cut:
        answer = describe(cut)
    elif died := await lease.died(within=DEATH_NOTICE):
        _, code = await broke_off(loaded, "", exc)  # an RPC worker that went away is the cause to name
        answer = ErrorAnswer(
            502, f"llama-server died mid-answer: {died}", "upstream_error", code=code or "llama_server_died"
        )
    else:
        message, code = await broke_off(loaded, "llama-server went away mid-stream", exc)
        answer = ErrorAnswer(502, message, "upstream_error", code=code)
    return answer


async def broke_off(loaded: LoadedModel, what: str, exc: Exception) -> tuple[str, str | None]:
    """(message, code) for an upstream that broke off: naming the RPC workers that no longer answer, if any."""
    gone = await asyncio.to_thread(unreachable, loaded.plan.rpc_workers) if loaded.plan.rpc_workers else {}
    message = f"{what}: {exc}" + "".join(f"; RPC worker {w} failed ({why})" for w, why in gone.items())
    return message, "rpc_worker_failed" if gone else None


async def send_upstream(
    request: Request,
    loaded: LoadedModel,
    path: str,
    body: dict[str, Any] | Form | None,
    lease: Lease | None = None,
    *,
    query: str = "",
    headers: Mapping[str, str] | None = None,
    method: Method | None = None,
) -> httpx.Response:
    """Send ``body`` to llama-server's ``path`` on the pooled client; the response streams.

    ``method`` defaults to ``POST`` with a body, ``GET`` without; ``headers`` go along with the
    launch's API key (``X-Conversation-Id``).

    Raises:
        UpstreamError: llama-server did not answer.
        studio.errors.ModelUnloadedError: the model went away under the request.
    """
    url, upstream = loaded.url + path, _upstream(request)
    method = method or ("GET" if body is None else "POST")
    sent = {**loaded.auth_headers, **headers} if headers else loaded.auth_headers
    try:
        if isinstance(body, Form):
            form = {**sent, "content-type": body.content_type}
            return await upstream.send(method, url, form, query=query, content=body.content)
        return await upstream.send(method, url, sent, body, query)
    except httpx.HTTPError as exc:
        if lease is not None and lease.interruption:
            raise lease.interruption from exc
        if lease is not None and (died := await lease.died(within=DEATH_NOTICE)):
            raise UpstreamDiedError(f"llama-server died before it answered: {died}") from exc
        raise UpstreamError(f"llama-server did not answer: {exc}") from exc


async def close_upstream(resp: httpx.Response, lease: Callable[[], Any]) -> None:
    """Close the upstream response and end the request (the lease), the latter whatever the former raises."""
    try:
        await resp.aclose()
    finally:
        await lease()


@dataclass(frozen=True)
class Form:
    """A multipart form body, passed on to llama-server byte for byte; ``model`` is its ``model`` field."""

    content: bytes
    content_type: str
    model: str | None


async def _form_body(request: Request) -> Form:
    raw = await request.body()  # first: a body over the limit is a 413; the form is parsed from these bytes
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequestError("the request body must be a multipart form (multipart/form-data)")
    try:
        async with request.form() as fields:  # closed at once: only ``model`` is read, the bytes go on as they came
            model = fields.get("model")
    except (MultiPartException, HTTPException) as exc:  # starlette answers a broken form with the latter
        raise BadRequestError(f"the form cannot be read: {getattr(exc, 'detail', None) or exc}") from None
    return Form(raw, content_type, model if isinstance(model, str) else None)


async def json_body(request: Request, *, empty: bool = False) -> dict[str, Any]:
    """The request's body, a JSON object; with ``empty``, no body at all reads as ``{}`` (as Ollama takes it).

    Raises:
        BadRequestError: the body is not JSON, or not an object.
    """
    raw = await request.body()  # outside the try: a body over the limit is a 413, not "not valid JSON"
    try:
        body = json_codec.loads(raw or (b"{}" if empty else raw))
    except ValueError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def prepare_chat_body(body: dict[str, Any], loaded: LoadedModel) -> None:
    """Check the media and tools against the model, then fill what the studio adds: reasoning kwargs, the
    generation's time limit, and a base model's turn markers as stops."""
    check_chat_media(body, media_capabilities(loaded), loaded.name)
    _check_tools_render(body, loaded)
    _limit_generation(body, loaded)
    _stop_at_borrowed_turns(body, loaded)
    _apply_reasoning(body, loaded)


def _check_tools_render(body: dict[str, Any], loaded: LoadedModel) -> None:
    """Refuse ``tools`` for a model running without Jinja, which llama-server would refuse naming its own flag.

    Raises:
        BadRequestError: the request offers tools and the model renders its template without Jinja.
    """
    settings = loaded.settings
    if body.get("tools") and not uses_jinja(settings.chat_template, settings.jinja):
        why = "jinja = false" if settings.jinja is False else f"the built-in chat template {settings.chat_template!r}"
        raise BadRequestError(
            f"{base_name(loaded.name)} renders its chat template without Jinja ({why}), and llama-server "
            "renders tools only with Jinja: send the request without tools, or load the model with the load "
            "option jinja true (and a Jinja chat template)",
            param="tools",
            code="tools_need_jinja",
        )


def check_messages(body: dict[str, Any]) -> None:
    """Refuse a chat whose ``messages`` is missing or no list, before any load: a cold load for a request
    llama-server refuses anyway is seconds for nothing.

    And the refusal is the client's, said as one: b11434 answers a missing ``messages`` on ``/v1/messages``
    with a 500 (a ``runtime_error`` in ``server_chat_convert_anthropic_to_oai``). An empty list passes, as
    llama-server takes it (its suite's ``test_anthropic_empty_messages`` expects a 200).

    Raises:
        BadRequestError: ``messages`` is missing or not a list.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        why = "is missing" if messages is None else "must be a list"
        raise BadRequestError(f"`messages` {why}: send the conversation as a list of messages", param="messages")


def _limit_generation(body: dict[str, Any], loaded: LoadedModel) -> None:
    """Give a generation the model's wall-clock limit unless the request sets its own.

    Its token limit needs nothing here: the model's llama-server starts with it (``--n-predict``,
    ``launcher.sampling``) and takes a request's own ``max_tokens`` over it.
    """
    limit = loaded.settings.sampling.max_predict_ms
    if limit is not None and "t_max_predict_ms" not in body:
        body["t_max_predict_ms"] = limit


#: The turn markers of llama-server's fallback chat template (ChatML), which a model without a template of its
#: own renders its chats with, and which a base model then writes as text instead of ending its turn.
BORROWED_TURN_MARKERS = ("<|im_end|>", "<|im_start|>")


def borrows_template(loaded: LoadedModel) -> bool:
    """Whether ``loaded`` chats through llama-server's fallback template: no template of its own, none set."""
    return template_source(loaded.settings.chat_template, loaded.facts.chat_template) == "fallback"


def _stop_at_borrowed_turns(body: dict[str, Any], loaded: LoadedModel) -> None:
    """End a base model's answer at the fallback template's turn markers, beside the request's own stops."""
    if not borrows_template(loaded):
        return
    own = body.get("stop")
    stops = [own] if isinstance(own, str) else list(own) if isinstance(own, list) else []
    body["stop"] = stops + [m for m in BORROWED_TURN_MARKERS if m not in stops]


def prepare_generation(body: dict[str, Any], loaded: LoadedModel) -> None:
    """A completion or infill body (raw text, no template): the generation's time limit."""
    _limit_generation(body, loaded)


def _apply_reasoning(body: dict[str, Any], loaded: LoadedModel) -> None:
    """Turn per-request reasoning controls into the template's own kwargs (or its /think flag)."""
    if not isinstance(body.get("chat_template_kwargs") or {}, dict):
        raise BadRequestError("`chat_template_kwargs` must be a JSON object", param="chat_template_kwargs")
    controls = {k: body.pop(k) for k in ("enable_thinking", "reasoning_effort", "preserve_thinking") if k in body}
    if not controls:
        return
    wanted = reasoning_request(loaded.template, controls)
    if wanted.reasoning_effort is not None:
        body["reasoning_effort"] = wanted.reasoning_effort  # llama-server reads it too
    if wanted.template_kwargs:
        body["chat_template_kwargs"] = {**wanted.template_kwargs, **(body.get("chat_template_kwargs") or {})}
    if wanted.prompt_flag and isinstance(body.get("messages"), list):
        body["messages"] = with_prompt_flag(body["messages"], wanted.prompt_flag)


def prepare_messages_body(body: dict[str, Any], loaded: LoadedModel) -> None:
    """An Anthropic Messages body: images checked against the model, the answer's limit, then the reasoning
    controls."""
    check_dialect_images(body, "messages", "image", media_capabilities(loaded), loaded.name)
    if body.get("max_tokens") is None:  # b11434 gives a Messages body without one its own 4096, not the model's
        body["max_tokens"] = loaded.settings.sampling.answer_limit(loaded.n_ctx)
    _apply_reasoning(body, loaded)


def prepare_responses_body(body: dict[str, Any], loaded: LoadedModel) -> None:
    """An OpenAI Responses body: its assistant messages typed, images checked against the model, the
    generation's limits, then the reasoning controls."""
    _type_assistant_messages(body)
    check_dialect_images(body, "input", "input_image", media_capabilities(loaded), loaded.name)
    _limit_generation(body, loaded)
    _stop_at_borrowed_turns(body, loaded)
    _apply_reasoning(body, loaded)


def _type_assistant_messages(body: dict[str, Any]) -> None:
    """Give an ``input`` item with ``role`` "assistant" and no ``type`` the ``type`` "message" it stands for.

    OpenAI takes a message item without its ``type`` (an "easy input message"), and its own guide keeps a
    conversation so (``{"role": el.role, "content": el.content}`` for each output item); b11434 takes an
    untyped item only for the user, system and developer roles and refuses the assistant's turn with
    "Cannot determine type of 'item'" (``server_chat_convert_responses_to_chatcmpl``), so every second
    turn of such a conversation failed.
    """
    items = body.get("input")
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("role") == "assistant" and "type" not in item:
                item["type"] = "message"


def nothing_to_add(body: dict[str, Any], loaded: LoadedModel) -> None:
    """An embedding, rerank or infill request goes as it came."""


def check_slot_file(body: dict[str, Any]) -> None:
    """Refuse a slot file name that is not a plain name in the model's slot folder.

    llama-server joins the name to its ``--slot-save-path``, the launch's folder in the studio home
    (``studio.residency.slot_cache.SlotCache.folder``: one per model and KV layout, where the studio's own
    saves before a stop go too); a name with a folder, ``..`` or an absolute path would reach files
    elsewhere, so it is refused here with a reason, before any load.

    Raises:
        BadRequestError: ``filename`` is not a string or not a plain file name.
    """
    name = body.get("filename")
    if name is None:
        return  # erase takes none; llama-server says so for save and restore
    if not isinstance(name, str):
        raise BadRequestError("`filename` must be a string", param="filename")
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise BadRequestError(
            f"slot file {name!r} is refused: a slot file is a plain name (no folder, no `..`, not an absolute path);"
            " the studio keeps each model's slot files in its own folder under the studio home",
            param="filename",
        )


#: Where a ``GET`` without ``?model=`` goes: the default model, or the studio's own route (``/metrics``).
WithoutModel = Literal["default", "studio"]


def _finished_answer(content: bytes, tools: Tools) -> bytes:
    """An OpenAI chat or completion answer with leaked tool-call markup healed (when ``tools``) and ``usage``
    filled in from llama-server's ``timings``."""
    try:
        data = json_codec.loads(content)
    except ValueError:
        return content
    if not isinstance(data, dict):
        return content
    healed = bool(tools) and heal_completion(data, tools)
    if not _with_usage(data) and not healed:
        return content
    return json_codec.dumps(data)


def _with_usage(data: dict[str, Any]) -> bool:
    """Fill ``usage`` from llama-server's ``timings`` when the answer lacks it; return whether it did."""
    if data.get("usage") or not isinstance(data.get("timings"), dict):
        return False
    t = data["timings"]
    prompt, completion = int(t.get("prompt_n", 0)), int(t.get("predicted_n", 0))
    data["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return True


@dataclass(frozen=True)
class Route:
    """How one forwarded path is served."""

    upstream: str  # llama-server's path (its canonical spelling); "" for the request's own path
    prepare: Callable[[dict[str, Any], LoadedModel], None]  # what the studio fills in before forwarding
    summary: str  # for /docs
    dialect: Dialect = "openai"  # the shape of its errors
    generates: bool = False  # its answers are generated tokens: time to first token and tokens are counted
    methods: frozenset[str] = frozenset({"POST"})  # GET: the model comes from ``?model=``
    without_model: WithoutModel = "default"  # a GET that names no model
    check: Callable[[dict[str, Any]], None] | None = None  # refuses a body before any load
    form: bool = False  # its body is a multipart form (an upload), passed on as it came
    embeds: bool = False  # it needs an instance that embeds: the model's embedding instance, unless its own does
    stream_reshape: Callable[[], Reshape] | None = None  # makes what its streams' bytes go through on the way
    whole_reshape: Callable[[bytes, Tools], bytes] | None = None  # what a whole answer goes through, given the tools
    #: whether a request's answer can need the reshapes (none: every one); a stream that needs none goes on as it
    #: came, at the least cost (``studio.http.wire.upstream_wire.Framed``)
    reshapes: Callable[[dict[str, Any]], bool] | None = None
    face: Face | None = None  # a dialect whose bodies are not llama-server's: its hooks (``Face``)


def _native(summary: str, **options: Any) -> Route:
    """A llama-server route that keeps its own path and takes its body as it comes."""
    return Route("", nothing_to_add, summary, **options)


_GET = frozenset({"GET"})
_GET_POST = frozenset({"GET", "POST"})
_CHAT = Route(
    "/v1/chat/completions",
    prepare_chat_body,
    "OpenAI chat completions",
    generates=True,
    check=check_messages,
    whole_reshape=_finished_answer,
)
_CHAT_TOKENS = Route(
    "/v1/chat/completions/input_tokens", _apply_reasoning, "Tokens a chat completion request's prompt takes"
)
_NATIVE_COMPLETION = Route("/completion", prepare_generation, "llama-server's native completion", generates=True)
_RESPONSES = Route(
    "/v1/responses", prepare_responses_body, "OpenAI Responses", generates=True, stream_reshape=ResponsesIndexes
)
_RESPONSES_TOKENS = Route("/v1/responses/input_tokens", _apply_reasoning, "Tokens a Responses request's input takes")
_RERANK = Route("/v1/rerank", nothing_to_add, "Rerank documents by a query (a model loaded with --reranking)")
_EMBEDDING = Route(
    "/embedding", nothing_to_add, "llama-server's native embedding (any model: its embedding instance)", embeds=True
)

_TRANSCRIPTIONS = Route(
    "/v1/audio/transcriptions",
    nothing_to_add,
    "OpenAI audio transcriptions (a model with an audio projector)",
    form=True,
)

#: Every forwarded path, in each spelling llama-server b11434 routes (``tools/server/server.cpp``), each
#: served as llama-server serves it: the bare ``/completions`` is its native completion, as there.
#: ``{id_slot}`` stands for a slot number. A row is all a forwarded route needs.
FORWARDED: dict[str, Route] = {
    "/v1/chat/completions": _CHAT,
    "/chat/completions": _CHAT,
    "/v1/completions": Route(
        "/v1/completions", prepare_generation, "OpenAI completions", generates=True, whole_reshape=_finished_answer
    ),
    "/completion": _NATIVE_COMPLETION,
    "/completions": _NATIVE_COMPLETION,
    "/v1/embeddings": Route(
        "/v1/embeddings", nothing_to_add, "OpenAI embeddings (any model: its embedding instance)", embeds=True
    ),
    "/embedding": _EMBEDDING,
    "/embeddings": _EMBEDDING,
    "/v1/chat/completions/input_tokens": _CHAT_TOKENS,
    "/chat/completions/input_tokens": _CHAT_TOKENS,
    "/v1/responses": _RESPONSES,
    "/responses": _RESPONSES,
    "/v1/responses/input_tokens": _RESPONSES_TOKENS,
    "/responses/input_tokens": _RESPONSES_TOKENS,
    "/v1/messages": Route(
        "/v1/messages",
        prepare_messages_body,
        "Anthropic Messages",
        dialect="anthropic",
        generates=True,
        check=check_messages,
        stream_reshape=StopSequenceStream,
        whole_reshape=lambda content, _tools: mended_answer(content),
        reshapes=lambda body: bool(body.get("stop_sequences")),  # only a stop at the request's own is mended
    ),
    "/v1/messages/count_tokens": Route(
        "/v1/messages/count_tokens", _apply_reasoning, "Anthropic token counting", dialect="anthropic"
    ),
    "/v1/rerank": _RERANK,
    "/v1/reranking": _RERANK,
    "/rerank": _RERANK,
    "/reranking": _RERANK,
    "/infill": Route(
        "/infill", prepare_generation, "Fill in the middle (llama-server's native infill)", generates=True
    ),
    "/tokenize": _native("Tokens of a text, by the model's vocabulary"),
    "/detokenize": _native("The text of tokens, by the model's vocabulary"),
    "/apply-template": _native("A chat rendered by the model's chat template, as the prompt it would get"),
    "/v1/chat/completions/control": _native("Control a running chat completion (end its reasoning)"),
    "/props": _native(
        "The model's llama-server properties (GET ?model=); POST changes them where it was started with --props",
        methods=_GET_POST,
    ),
    "/slots": _native("The model's slots and what each is doing (?model=)", methods=_GET),
    "/slots/{id_slot}": _native(
        "Save, restore or erase a slot's KV cache (?action=save|restore|erase), in the model's slot folder",
        check=check_slot_file,
    ),
    "/lora-adapters": _native("The model's LoRA adapters (GET ?model=), or set their scales (POST)", methods=_GET_POST),
    "/v1/audio/transcriptions": _TRANSCRIPTIONS,
    "/audio/transcriptions": _TRANSCRIPTIONS,
    "/metrics": _native(
        "With ?model=: that model's own llama-server metrics; without: the studio's",
        methods=_GET,
        without_model="studio",
    ),
}

#: llama-server's routes that reach files, URLs or programs on its machine, and why the studio refuses them.
REFUSED: dict[str, str] = {
    "/tools": "llama-server's built-in tools read and write files and run commands on this machine;"
    " the studio runs tools in its own tool loop (/api/chat with tools, see docs/tools.md)",
    "/cors-proxy": "llama-server's CORS proxy fetches any URL a web page names, from this machine",
}

#: The forwarded paths whose bodies are forms, not JSON (``studio.http.guards.browser_guard`` lets them through).
FORM_PATHS = frozenset(path for path, route in FORWARDED.items() if route.form)

_SLOT_ACTION = re.compile(r"/slots/[0-9]+")


def route_for(method: str, path: str, query: bytes) -> tuple[Route, str] | None:
    """The forwarded route that serves ``method path`` and llama-server's path for it; ``None``: not forwarded."""
    route = FORWARDED.get(path)
    if route is None and _SLOT_ACTION.fullmatch(path):
        route = FORWARDED["/slots/{id_slot}"]
    if route is None or method not in route.methods:
        return None
    if method == "GET" and route.without_model == "studio" and "model" not in parse_qs(query.decode("latin-1")):
        return None
    return route, route.upstream or path


def declare(router: APIRouter, path: str, route: Route) -> None:
    """Declare ``route`` on ``path`` in ``router``: one FastAPI route per method (each its own operation in
    ``/docs``), whose endpoint ``studio.http.ahead.AheadRoutes`` calls ahead of the router."""

    @ahead(route.dialect, recorded=route.generates)
    async def forwarded(request: Request) -> Response:
        return await _forward(request, route, route.upstream or request.scope["path"])

    forwarded.__doc__ = f"Forwarded to llama-server's ``{route.upstream or path}``." if not route.face else None
    for method in sorted(route.methods):
        router.add_api_route(path, forwarded, methods=[method], summary=route.summary)


for _path, _route in FORWARDED.items():
    if _route.without_model == "default":  # else the studio's own route of the path serves it (``forward``)
        declare(router, _path, _route)


def _refuse(reason: str) -> Callable[[Request], Awaitable[Response]]:
    async def refused(request: Request) -> Response:
        raise RouteRefusedError(f"the studio does not serve {request.url.path}: {reason}")

    return refused


for _path, _reason in REFUSED.items():
    router.add_api_route(
        _path, _refuse(_reason), methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
    )
