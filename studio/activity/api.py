"""``/api/activity``: the records, live events, deletion, export and the capture switch.

The routes are ordinary ``/api`` routes: the browser guard and the token (beyond loopback) stand in
front of them as of every other (``studio.http.app``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field

from studio.activity.captures import Mode
from studio.activity.recorder import Activity
from studio.activity.store import Query as RecordQuery
from studio.activity.store import capture_of
from studio.errors import BadRequestError, CaptureNotFoundError, HistoryUnavailableError
from studio.http.gui.bodies import ApiBody

router = APIRouter(prefix="/api")

#: Records one answer holds at most.
MAX_LIST = 10_000
#: Seconds between two snapshots of the requests in flight on the live stream (while there are any).
LIVE_EVERY = 0.5
#: Seconds between two comments on an idle live stream (a proxy with an idle timeout keeps it).
KEEP_ALIVE = 15.0

Kind = Literal["request", "load", "eviction", "crash", "restart"]
OutcomeFilter = Literal["finished", "length", "cancelled", "error", "retried"]


def activity_of(request: Request) -> Activity:
    return request.app.state.activity


def _query(
    model: str | None,
    route: str | None,
    outcome: str | None,
    kind: str | None,
    since: float | None,
    until: float | None,
    limit: int,
) -> RecordQuery:
    return RecordQuery(model=model, route=route, outcome=outcome, kind=kind, since=since, until=until, limit=limit)


@router.get("/activity")
async def activity(
    request: Request,
    model: Annotated[str | None, Query(max_length=500, description="Only this model's records.")] = None,
    route: Annotated[str | None, Query(max_length=200, description="Only requests to this path.")] = None,
    outcome: Annotated[OutcomeFilter | None, Query(description="Only records that ended so.")] = None,
    kind: Annotated[Kind | None, Query(description="Only requests, loads, evictions, crashes or restarts.")] = None,
    since: Annotated[float | None, Query(description="Epoch seconds: records that ended since.")] = None,
    until: Annotated[float | None, Query(description="Epoch seconds: records begun before.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 500,
) -> dict[str, Any]:
    """The records, the latest first, and the requests in flight now; the models resident and the queue."""
    found = activity_of(request)
    records = await found.select(_query(model, route, outcome, kind, since, until, limit))
    return {
        "records": records,
        "in_flight": [found.live(t) for t in list(found.in_flight.values())],
        "captures": found.captures.to_json(),
        "retention": {
            "max_age_s": found.retention.max_age,
            "max_records": found.retention.max_records,
            "capture_bytes": found.retention.capture_bytes,
        },
        "stored": found.history is not None and found.history.problem is None,
    }


@router.get("/activity/events")
async def activity_events(request: Request) -> StreamingResponse:
    """Server-sent events: the requests in flight at once and as they change, then each record as it is made."""
    found = activity_of(request)
    queue = found.subscribe()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield _sse({"type": "in_flight", "requests": [found.live(t) for t in list(found.in_flight.values())]})
            idle_since = time.monotonic()
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), LIVE_EVERY)
                except TimeoutError:
                    if found.in_flight:
                        live = [found.live(t) for t in list(found.in_flight.values())]
                        yield _sse({"type": "in_flight", "requests": live})
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > KEEP_ALIVE:
                        yield b": idle\n\n"
                        idle_since = time.monotonic()
                    continue
                yield _sse(event)
                if event["type"] == "record" and event["record"].get("kind") == "request":
                    live = [found.live(t) for t in list(found.in_flight.values())]
                    yield _sse({"type": "in_flight", "requests": live})
        finally:
            found.unsubscribe(queue)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


@router.delete("/activity")
async def delete_activity(
    request: Request,
    before: Annotated[float | None, Query(description="Epoch seconds: only records begun before.")] = None,
) -> dict[str, Any]:
    """Delete the records and captures (all, or those begun ``before``)."""
    return {"deleted": await activity_of(request).delete(before)}


@router.get("/activity/export")
async def export_activity(
    request: Request,
    model: Annotated[str | None, Query(max_length=500)] = None,
    route: Annotated[str | None, Query(max_length=200)] = None,
    outcome: Annotated[OutcomeFilter | None, Query()] = None,
    kind: Annotated[Kind | None, Query()] = None,
    since: Annotated[float | None, Query()] = None,
    until: Annotated[float | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1_000_000)] = 100_000,
) -> Response:
    """The records as JSON Lines, one record a line, oldest first: for a spreadsheet, ``jq`` or another tool."""
    records = await activity_of(request).select(_query(model, route, outcome, kind, since, until, limit))
    body = "".join(json.dumps(r) + "\n" for r in reversed(records))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Response(
        body,
        media_type="application/x-ndjson",
        headers={"content-disposition": f'attachment; filename="ggstudio-activity-{stamp}.jsonl"'},
    )


@router.get("/activity/captures/{record_id}")
async def capture(request: Request, record_id: str) -> dict[str, Any]:
    """The bodies a capture kept of one request."""
    found = activity_of(request)
    if found.history is None:
        raise HistoryUnavailableError("this studio keeps no history database, where captures are kept")
    kept = await found.history.read(capture_of, record_id)
    if kept is None:
        raise CaptureNotFoundError(f"no capture of {record_id!r} is kept")
    return kept


class CaptureBody(ApiBody):
    """Switch captures: for every model (``model`` left out) or for one."""

    mode: Mode = Field(description="off; failed: the bodies of failed requests; all: every request's.")
    model: str | None = Field(default=None, max_length=500, description="The model it is for; none: every model.")


@router.put("/activity/captures")
async def set_captures(request: Request, body: CaptureBody) -> dict[str, Any]:
    """Switch a capture on or off; returns the switches now."""
    found = activity_of(request)
    if body.mode != "off" and found.history is None:
        raise BadRequestError("this studio keeps no history database, where captures would be kept", param="mode")
    if body.model is None:
        found.captures.default = body.mode
    elif body.mode == found.captures.default:
        found.captures.models.pop(body.model, None)
    else:
        found.captures.models[body.model] = body.mode
    return found.captures.to_json()


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
