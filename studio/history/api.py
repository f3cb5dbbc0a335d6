"""``/api/conversations``: the stored chats: list and search, create, read, rename, delete, messages, export, import.

``POST /api/chat`` with a ``conversation_id`` stores its turn as it streams
(``studio.history.recorder``); these routes are everything else a history sidebar, a desktop
GUI or a backup script needs. A database the studio cannot use answers every route with a
503 that says why (``studio.history.database``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import FileResponse, Response
from pydantic import Field

from studio.errors import ConversationNotFoundError, HistoryUnavailableError
from studio.history import store
from studio.history.service import History
from studio.history.transfer import (
    HistoryFile,
    MessageFields,
    checked_files,
    export_document,
    export_markdown,
    import_document,
)
from studio.http.gui.bodies import ApiBody

router = APIRouter(prefix="/api")

#: Conversations one list answer holds at most (``scripts/bench_history.py`` times 10,000).
MAX_LIST = 10_000


class ConversationBody(ApiBody):
    """A new conversation, or the fields of one to change (``PATCH``: only those given)."""

    title: str | None = Field(default=None, max_length=1000, description="Its name; empty: from the first message.")
    model: str | None = Field(default=None, description="The model it continues with.")
    load: dict[str, Any] | None = Field(default=None, description="The load settings (as POST /api/load takes them).")
    options: dict[str, Any] | None = Field(default=None, description="Sampling options and the system prompt.")


class MessagesBody(ApiBody):
    """Messages to append, in order (a client that runs its own chat and stores it here)."""

    messages: list[MessageFields] = Field(min_length=1, max_length=1000)


def history_of(request: Request) -> History:
    """The app's store; a studio started without one answers as one whose store is unavailable."""
    history: History | None = getattr(request.app.state, "history", None)
    if history is None:
        raise HistoryUnavailableError("this studio keeps no chat history (it was started without a history folder)")
    return history


@router.get("/conversations")
async def conversations(
    request: Request,
    q: Annotated[str | None, Query(max_length=500, description="Words to search titles and messages for.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 200,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    """The stored conversations, the latest first; with ``q``, those matching it, best first, each with a snippet."""
    history = history_of(request)
    if q and q.strip():
        return {"conversations": await history.read(lambda c: store.search(c, q, limit=limit))}
    return {"conversations": await history.read(lambda c: store.list_conversations(c, limit=limit, offset=offset))}


@router.post("/conversations", status_code=201)
async def create(request: Request, body: ConversationBody | None = None) -> dict[str, Any]:
    """A new, empty conversation."""
    fields = (body or ConversationBody()).model_dump(exclude_none=True)
    return await history_of(request).write(lambda c: store.create_conversation(c, **fields))


@router.get("/conversations/export")
async def export_all(
    request: Request, id: Annotated[list[str] | None, Query(description="Only these conversations.")] = None
) -> Response:
    """Every conversation (or those ``id`` names) as one JSON file that ``/api/conversations/import`` takes back."""
    history = history_of(request)
    data = await history.read(export_document, history.attachments, id)
    return _download(data, "application/json", "gguf-studio-history.json")


@router.post("/conversations/import", status_code=201)
async def import_file(request: Request, body: HistoryFile) -> dict[str, Any]:
    """Add the conversations of an export; a file with anything wrong is refused whole, naming what."""
    history = history_of(request)
    files = await history.read(lambda _: checked_files(body))  # hashing megabytes: not on the event loop
    imported = await history.write(import_document, history.attachments, body, files)
    return {"imported": imported}


@router.get("/conversations/{cid}")
async def conversation(request: Request, cid: str) -> dict[str, Any]:
    """The conversation with its messages in order (an answer still streaming, or one that never ended, is ``cut``)."""
    return await history_of(request).read(store.get_conversation, cid)


@router.get("/conversations/{cid}/export")
async def export_one(request: Request, cid: str, format: Literal["json", "markdown"] = "json") -> Response:
    history = history_of(request)
    if format == "markdown":
        text = await history.read(export_markdown, cid)
        return _download(text.encode(), "text/markdown; charset=utf-8", f"chat-{cid}.md")
    await history.read(store.get_conversation, cid, False)  # a 404 for an id that is not there
    data = await history.read(export_document, history.attachments, [cid])
    return _download(data, "application/json", f"chat-{cid}.json")


@router.patch("/conversations/{cid}")
async def update(request: Request, cid: str, body: ConversationBody) -> dict[str, Any]:
    """Rename it, or change the model and settings it continues with."""
    changes = body.model_dump(exclude_unset=True)
    if changes.get("title") is None:
        changes.pop("title", None)
    return await history_of(request).write(store.update_conversation, cid, changes)


@router.delete("/conversations/{cid}")
async def delete(request: Request, cid: str) -> dict[str, Any]:
    """Delete it, its messages, and the attachments no other message names."""
    await history_of(request).delete_conversation(cid)
    return {"deleted": cid}


@router.get("/conversations/{cid}/messages")
async def messages(request: Request, cid: str) -> dict[str, Any]:
    history = history_of(request)
    return {"messages": (await history.read(store.get_conversation, cid))["messages"]}


@router.post("/conversations/{cid}/messages", status_code=201)
async def append(request: Request, cid: str, body: MessagesBody) -> dict[str, Any]:
    """Append messages after every one stored so far (two clients at once: both kept, in the order received)."""
    rows = [m.model_dump() for m in body.messages]
    return {"messages": await history_of(request).write(store.append_messages, cid, rows)}


@router.get("/attachments/{digest}")
async def attachment(request: Request, digest: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")]) -> FileResponse:
    """A stored attachment's bytes, by its sha256."""
    history = history_of(request)
    media_type = await history.read(store.attachment_type, digest)
    path = history.attachment_path(digest)
    if media_type is None or not path.is_file():
        raise ConversationNotFoundError(
            f"no stored attachment has the hash {digest}", param="digest", code="attachment_not_found"
        )
    return FileResponse(path, media_type=media_type, headers={"Cache-Control": "private, max-age=31536000, immutable"})


def _download(data: bytes, media_type: str, name: str) -> Response:
    return Response(data, media_type=media_type, headers={"Content-Disposition": f'attachment; filename="{name}"'})
