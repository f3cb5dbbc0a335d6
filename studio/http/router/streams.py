"""llama-server's resumable streams through the studio: ``GET``/``DELETE /v1/stream``, ``POST /v1/streams/lookup``.

llama-server b11434 records a generation whose request carries ``X-Conversation-Id`` as a stream session
(``tools/server/server-stream.cpp``): ``GET /v1/stream?conv_id=<id>&from=<n>`` replays its server-sent
events from byte ``n`` and follows it live until it ends; ``DELETE /v1/stream?conv_id=<id>`` stops the
generation and evicts the session (204, also for one it does not know; a ``GET`` then is a 404);
``POST /v1/streams/lookup`` ``{"conversation_ids": [...]}`` lists the sessions of the ids asked for (done or
not, bytes so far). llama.cpp's router serves each by the child that owns the conversation
(``tools/server/server-models.cpp``: ``router_stream_get``, ``router_stream_delete``,
``router_streams_lookup``, which asks only the children that own some of the ids).

The studio does the same: the generating routes pass the header on and remember the model that served it
(``studio.http.router.stream_owners``); these routes go to that model, else to the one ``?model=`` names (a
conversation the studio has forgotten). They never load a model: one that is not resident has no session.
A conversation no resident model holds is a 404 (``StreamNotFoundError``), one whose model still loads a 503
to retry, as the router answers; a ``DELETE`` then cancels the request waiting for that load
(``StreamOwners.forget``).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from studio.errors import BadRequestError, NotReadyError, StreamNotFoundError, UpstreamError
from studio.http.clients.openai_proxy import Method, broken_stream_event, close_upstream, read_answer, send_upstream
from studio.http.router.stream_owners import stream_owners
from studio.http.wire.relay import Relay
from studio.residency.lifecycle import COMING_UP
from studio.residency.manager import ModelManager
from studio.residency.resident import Lease, LoadedModel

router = APIRouter()

#: llama-server's paths.
STREAM, LOOKUP = "/v1/stream", "/v1/streams/lookup"


@router.get(STREAM, summary="Replay a conversation's stream from byte `from`, then follow it live")
async def replay_stream(request: Request) -> Response:
    """llama-server's server-sent events of the conversation's last generation, from the model that made it."""
    conv_id = _conv_id(request)
    loaded, lease = _resident_owner(request, conv_id)
    query = {"conv_id": conv_id}
    if (start := request.query_params.get("from")) is not None:
        query["from"] = start  # llama-server checks it
    resp = await _send(request, loaded, lease, STREAM, None, query=urlencode(query, quote_via=quote))
    headers = {"content-type": resp.headers.get("content-type", "text/event-stream")}
    if resp.status_code != 200:  # llama-server's own "not found or expired", in the OpenAI shape already
        return Response(await read_answer(resp, lease, loaded), status_code=resp.status_code, headers=headers)

    async def closed(first_at: float | None, tail: bytes) -> None:
        await close_upstream(resp, lease)

    return Relay(
        resp,
        headers={**headers, "cache-control": "no-cache"},
        on_close=closed,
        on_break=lambda exc: broken_stream_event(exc, lease, loaded, "openai"),
    )


@router.delete(STREAM, status_code=204, summary="Stop a conversation's generation and drop its stream")
async def stop_stream(request: Request) -> Response:
    """Stop and evict the conversation's stream where it runs; 204 whether or not there was one, as llama-server."""
    conv_id = _conv_id(request)
    claim = stream_owners(request).forget(conv_id)  # a request still waiting for its model is cancelled
    model = claim.model if claim is not None else request.query_params.get("model")
    found = _manager(request).acquire_now(model) if model is not None else None
    if found is not None:
        loaded, lease = found
        query = urlencode({"conv_id": conv_id}, quote_via=quote)
        resp = await _send(request, loaded, lease, STREAM, None, query=query, method="DELETE")
        await read_answer(resp, lease, loaded)  # 204, or the error llama-server logs itself
    return Response(status_code=204)


@router.post(LOOKUP, summary="The stream sessions of the conversations asked for")
async def lookup_streams(request: Request) -> Response:
    """Each remembered conversation's session (``conversation_id``, ``is_done``, ``total_bytes``, ...), from the
    model that holds it; a body that is not ``{"conversation_ids": [...]}`` finds none, as the router answers."""
    per_model: dict[str, list[str]] = {}
    owners = stream_owners(request)
    for conv_id in _requested(await request.body()):
        claim = owners.owner(conv_id)
        if claim is not None and claim.model is not None:
            per_model.setdefault(claim.model, []).append(conv_id)
    sessions: list[Any] = []
    for model, ids in per_model.items():
        found = _manager(request).acquire_now(model)
        if found is None:
            continue  # not ready: no session to list
        loaded, lease = found
        try:
            resp = await _send(request, loaded, lease, LOOKUP, {"conversation_ids": ids})
        except UpstreamError:
            continue  # the router leaves out a child that does not answer
        answer = _json_or_none(await read_answer(resp, lease, loaded))
        if resp.status_code == 200 and isinstance(answer, list):
            sessions += [entry for entry in answer if isinstance(entry, dict)]
    return JSONResponse(sessions)


async def _send(
    request: Request,
    loaded: LoadedModel,
    lease: Lease,
    path: str,
    body: dict[str, Any] | None,
    *,
    query: str = "",
    method: Method | None = None,
) -> httpx.Response:
    """``send_upstream`` that lets ``lease`` go when nothing comes back (``read_answer`` lets it go otherwise)."""
    try:
        return await send_upstream(request, loaded, path, body, lease, query=query, method=method)
    except BaseException:
        await lease()
        raise


def _requested(raw: bytes) -> list[str]:
    body = _json_or_none(raw)
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    return [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _conv_id(request: Request) -> str:
    conv_id = request.query_params.get("conv_id")
    if not conv_id:
        raise BadRequestError("name the conversation: `?conv_id=<X-Conversation-Id>`", param="conv_id")
    return conv_id


def _resident_owner(request: Request, conv_id: str) -> tuple[LoadedModel, Lease]:
    """The ready model that holds ``conv_id``'s stream, with its lease; never loads one.

    Raises:
        StreamNotFoundError: no resident model holds it (or none is remembered and ``?model=`` names none).
        NotReadyError: its model is still loading; the session appears once the request reaches it.
    """
    claim = stream_owners(request).owner(conv_id)
    model = claim.model if claim is not None else request.query_params.get("model")
    manager = _manager(request)
    found = manager.acquire_now(model) if model is not None else None
    if found is not None:
        return found
    if claim is not None and (model is None or _loading(manager, model)):
        raise NotReadyError(f"the model of conversation {conv_id!r} is loading; retry in a moment")
    raise StreamNotFoundError(
        f"no stream of conversation {conv_id!r}: no resident model holds one (it may have ended and been"
        " dropped, or been stopped)",
        param="conv_id",
    )


def _loading(manager: ModelManager, model: str) -> bool:
    resident = manager.find(model)
    if resident is not None:
        return resident.state in COMING_UP
    return any(load.names(model) for load in manager.loads)


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager
