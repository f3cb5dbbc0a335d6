"""``/api/chat``: the studio GUI's chat stream, as typed server-sent events.

Unlike the OpenAI proxy (bytes passed through), this stream is re-shaped for
the GUI: ``content`` and ``reasoning`` deltas, ``tool_call`` deltas, and one
final ``done`` event with usage, timings, tokens/s and the speculative
acceptance rate (``draft_n_accepted / draft_n``); or an ``error`` event whose
``error`` field has OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from studio.chat.tool_schema import check_tool_fields
from studio.errors import error_body
from studio.residency.manager import ModelManager
from studio.residency.resident import Lease, LoadedModel
from studio.http.openai_proxy import broke_off, close_upstream, prepare_chat_body, send_upstream

router = APIRouter(prefix="/api")


class ChatBody(BaseModel):
    """A chat turn from the GUI; other OpenAI sampling fields pass through unchanged."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)


@router.post("/chat")
async def chat(request: Request, body: ChatBody) -> StreamingResponse:
    manager: ModelManager = request.app.state.manager
    payload = body.model_dump(exclude_none=True)
    check_tool_fields(payload)
    loaded, lease = await manager.acquire(body.model)
    try:
        prepare_chat_body(payload, loaded)
        payload.update(stream=True, stream_options={"include_usage": True})
        resp = await send_upstream(request, loaded, "/v1/chat/completions", payload, lease)
    except BaseException:
        await lease()
        raise
    return StreamingResponse(_events(resp, lease, loaded), media_type="text/event-stream")


async def _events(resp: httpx.Response, lease: Lease, loaded: LoadedModel) -> AsyncIterator[bytes]:
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    finish: str | None = None
    try:
        if resp.status_code != 200:
            body = json.loads(await resp.aread() or b"{}")
            error = body.get("error", {}) if isinstance(body, dict) else {}
            yield _sse({"type": "error", "status": resp.status_code, "error": error})
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                yield _sse({"type": "error", "status": 500, "error": chunk["error"]})
                return
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("reasoning_content"):
                    yield _sse({"type": "reasoning", "text": delta["reasoning_content"]})
                if delta.get("content"):
                    yield _sse({"type": "content", "text": delta["content"]})
                for call in delta.get("tool_calls") or ():
                    yield _sse({"type": "tool_call", **call})
                finish = choice.get("finish_reason") or finish
        yield _sse(_done(usage, timings, finish))
    except httpx.HTTPError as exc:
        cut = lease.interruption
        if cut:
            yield _sse({"type": "error", "status": cut.status, **error_body(cut.message, cut.type, code=cut.code)})
        else:
            message, code = await broke_off(loaded, "llama-server went away mid-stream", exc)
            yield _sse({"type": "error", "status": 502, **error_body(message, "upstream_error", code=code)})
    finally:
        await close_upstream(resp, lease)


def _done(usage: dict[str, Any] | None, timings: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
    t = timings or {}
    drafted = t.get("draft_n") or 0
    return {
        "type": "done",
        "finish_reason": finish,
        "usage": usage,
        "timings": timings,
        "tokens_per_second": t.get("predicted_per_second"),
        "draft_acceptance": (t.get("draft_n_accepted", 0) / drafted) if drafted else None,
    }


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()
