"""Hugging Face downloads from the GUI: ``/api/pull`` and ``/api/pulls``.

- ``POST /api/pull {"model": "owner/repo:QUANT"}`` starts a download (or joins the one
  already fetching the same files) and streams server-sent events: ``progress`` with
  the download's snapshot (bytes, rate, ETA, per file) whenever it moves, then one
  ``done``, ``error`` or ``cancelled``. With ``"stream": false`` it answers at once
  (202) with the snapshot; the download goes on. A bad spec, an unknown repo or
  variant, a gated repo without a token, or offline without the files is an error
  answer before any event.
- ``GET /api/pulls``: every download kept (running and recent).
- ``GET /api/pulls/{id}``: one; ``GET /api/pulls/{id}/events``: its event stream.
- ``DELETE /api/pulls/{id}``: cancel (within one 10 MiB chunk; complete files stay).

Closing an event stream does not cancel the download: others may be watching.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from studio.http.gui.bodies import ApiBody
from studio.library.downloads import Download, DownloadManager, DownloadState

router = APIRouter(prefix="/api")

_END = {DownloadState.DONE: "done", DownloadState.FAILED: "error", DownloadState.CANCELLED: "cancelled"}


class PullBody(ApiBody):
    """A download request from the GUI."""

    model: str = Field(description="owner/repo[:VARIANT], e.g. unsloth/gemma-3-4b-it-GGUF:Q4_K_M.")
    revision: str = Field(default="main", description="Branch, tag or commit of the repo.")
    stream: bool = Field(default=True, description="Stream progress events (default), or answer at once.")


def _downloads(request: Request) -> DownloadManager:
    return request.app.state.downloads


@router.post("/pull", response_model=None)
async def pull(request: Request, body: PullBody) -> StreamingResponse | JSONResponse:
    """Start (or join) a download; server-sent progress events, or the snapshot at once with ``stream: false``."""
    downloads = _downloads(request)
    download, joined = await asyncio.to_thread(downloads.start, body.model, revision=body.revision)
    if not body.stream:
        return JSONResponse({**download.snapshot(), "joined": joined}, status_code=202)
    return StreamingResponse(_events(downloads, download, joined), media_type="text/event-stream")


@router.get("/pulls")
async def pulls(request: Request) -> list[dict[str, Any]]:
    """Every download kept: running ones and the last finished."""
    return [d.snapshot() for d in _downloads(request).list()]


@router.get("/pulls/{download_id}")
async def one_pull(request: Request, download_id: str) -> dict[str, Any]:
    return _downloads(request).get(download_id).snapshot()


@router.get("/pulls/{download_id}/events")
async def pull_events(request: Request, download_id: str) -> StreamingResponse:
    downloads = _downloads(request)
    return StreamingResponse(_events(downloads, downloads.get(download_id), True), media_type="text/event-stream")


@router.delete("/pulls/{download_id}")
async def cancel_pull(request: Request, download_id: str) -> dict[str, Any]:
    """Cancel a download; the answer is its snapshot (``running`` until it stops, within one chunk)."""
    return _downloads(request).cancel(download_id).snapshot()


async def _events(downloads: DownloadManager, download: Download, joined: bool) -> AsyncIterator[bytes]:
    async for snap in downloads.events(download):
        state = DownloadState(snap["state"])
        kind = _END.get(state, "progress")
        yield f"data: {json.dumps({'type': kind, 'joined': joined, **snap})}\n\n".encode()
