"""Export and import of conversations: one JSON document a user can back up, move and bring back, and Markdown.

The JSON holds every field the store keeps, attachments inline (base64, once each by hash),
in a fixed order and layout, so exporting what an import wrote gives the same bytes. An import
is checked whole (the document's shape, then every attachment's hash and every reference to
one) before anything is written, and written in one transaction: a bad file changes nothing.
A conversation whose id is already taken comes in under a new one, so an import never
overwrites a conversation.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import sqlite3
from datetime import UTC
from pathlib import Path
from typing import Any, Literal

from pydantic import AwareDatetime, Field

from gguf.files import write_atomically
from studio.errors import BadRequestError
from studio.history import store
from studio.history.database import now
from studio.http.gui.bodies import ApiBody

FORMAT = "gguf-studio-history"
VERSION = 1
_HASH = r"^[0-9a-f]{64}$"


class AttachmentRef(ApiBody):
    """A message's attachment: the file by its sha256."""

    hash: str = Field(pattern=_HASH)
    media_type: str = Field(min_length=3, max_length=100)


class MessageFields(ApiBody):
    """A message as a client gives it (``POST /api/conversations/{id}/messages``); the store adds its time."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    tool_results: list[dict[str, Any]] = Field(default_factory=list)
    attachments: list[AttachmentRef] = Field(default_factory=list)
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    cut: bool = False


class ExportedMessage(MessageFields):
    created: AwareDatetime


class ExportedConversation(ApiBody):
    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    title: str = Field(default="", max_length=1000)
    model: str | None = None
    load: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)
    created: AwareDatetime
    updated: AwareDatetime
    messages: list[ExportedMessage] = Field(default_factory=list)


class ExportedAttachment(ApiBody):
    hash: str = Field(pattern=_HASH)
    media_type: str = Field(min_length=3, max_length=100)
    data: str = Field(description="The file, base64.")


class HistoryFile(ApiBody):
    """A history export, as ``GET /api/conversations/export`` writes it."""

    format: Literal["gguf-studio-history"]
    version: Literal[1]
    conversations: list[ExportedConversation]
    attachments: list[ExportedAttachment] = Field(default_factory=list)


# -- export -------------------------------------------------------------------------------------


def export_document(conn: sqlite3.Connection, attachments: Path, ids: list[str] | None = None) -> bytes:
    """The JSON export of the conversations ``ids`` (default: all), oldest first, with their attachments."""
    if ids is None:
        ids = [row[0] for row in conn.execute("SELECT id FROM conversations ORDER BY created, id")]
    conversations, hashes = [], {}
    for cid in ids:
        found = store.get_conversation(conn, cid)
        messages = []
        for m in found["messages"]:
            messages.append({k: m[k] for k in ExportedMessage.model_fields})
            for ref in m["attachments"]:
                hashes[ref["hash"]] = ref["media_type"]
        conversations.append({**{k: found[k] for k in ExportedConversation.model_fields if k != "messages"},
                              "messages": messages})  # fmt: skip
    files = [
        {"hash": h, "media_type": t, "data": base64.b64encode((attachments / h).read_bytes()).decode()}
        for h, t in sorted(hashes.items())
    ]
    document = {"format": FORMAT, "version": VERSION, "conversations": conversations, "attachments": files}
    return (json.dumps(document, ensure_ascii=False, indent=2) + "\n").encode()


def export_markdown(conn: sqlite3.Connection, cid: str) -> str:
    """One conversation as Markdown: title, model and settings, then each message under its speaker."""
    c = store.get_conversation(conn, cid)
    lines = [f"# {c['title'] or 'Untitled chat'}", "", f"- model: {c['model'] or '(default)'}"]
    lines.append(f"- created: {c['created']}")
    if c["options"]:
        lines.append(f"- options: `{json.dumps(c['options'], ensure_ascii=False)}`")
    for m in c["messages"]:
        who = {"user": "You", "assistant": f"Assistant ({c['model'] or 'model'})"}.get(m["role"], m["role"].title())
        lines += ["", f"## {who}", ""]
        if m["reasoning"]:
            lines += ["<details><summary>Reasoning</summary>", "", m["reasoning"], "", "</details>", ""]
        for call in m["tool_calls"]:
            lines.append(f"- tool call `{call.get('name')}({call.get('arguments') or ''})`")
        for ref in m["attachments"]:
            lines.append(f"- attachment `{ref['hash']}` ({ref['media_type']})")
        lines.append(m["content"] or "(no text)")
        if m["cut"]:
            lines += ["", "*(the answer was cut off here)*"]
    return "\n".join(lines) + "\n"


# -- import -------------------------------------------------------------------------------------


def checked_files(document: HistoryFile) -> dict[str, tuple[str, bytes]]:
    """The document's attachments by hash, once every one is proven to match and every reference to have one.

    Raises:
        BadRequestError: naming the first attachment or reference that is wrong.
    """
    files: dict[str, tuple[str, bytes]] = {}
    for i, a in enumerate(document.attachments):
        where = f"attachments[{i}]"
        try:
            data = base64.b64decode(a.data, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequestError(f"{where}.data is not base64", param=f"{where}.data", code="invalid_import") from None
        if hashlib.sha256(data).hexdigest() != a.hash:
            raise BadRequestError(
                f"{where}: the data does not match its hash {a.hash} (the file is damaged)",
                param=f"{where}.hash",
                code="invalid_import",
            )
        files[a.hash] = (a.media_type, data)
    for ci, c in enumerate(document.conversations):
        for mi, m in enumerate(c.messages):
            for ai, ref in enumerate(m.attachments):
                if ref.hash not in files:
                    where = f"conversations[{ci}].messages[{mi}].attachments[{ai}]"
                    raise BadRequestError(
                        f"{where} names the attachment {ref.hash}, which the file does not hold",
                        param=where,
                        code="invalid_import",
                    )
    return files


def import_document(
    conn: sqlite3.Connection, attachments: Path, document: HistoryFile, files: dict[str, tuple[str, bytes]]
) -> list[dict[str, Any]]:
    """Write a checked document (``checked_files``) in one transaction; return the conversations as stored."""
    written = _write_files(attachments, files)
    try:
        with store.transaction(conn):
            ids = [_insert(conn, c) for c in document.conversations]
            for digest, (media_type, data) in files.items():
                conn.execute(
                    "INSERT OR IGNORE INTO attachments (hash, media_type, size, created) VALUES (?, ?, ?, ?)",
                    (digest, media_type, len(data), now()),
                )
    except BaseException:
        for path in written:  # nothing half-imported: files only this import brought go too
            path.unlink(missing_ok=True)
        raise
    return [store.get_conversation(conn, cid, messages=False) for cid in ids]


def _write_files(folder: Path, files: dict[str, tuple[str, bytes]]) -> list[Path]:
    written = []
    for digest, (_, data) in files.items():
        target = folder / digest
        if target.exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(target, data)
        written.append(target)
    return written


def _insert(conn: sqlite3.Connection, c: ExportedConversation) -> str:
    taken = conn.execute("SELECT 1 FROM conversations WHERE id = ?", (c.id,)).fetchone() is not None
    cid = store.new_id() if taken else c.id
    conn.execute(
        "INSERT INTO conversations (id, title, model, load, options, created, updated) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (cid, c.title, c.model, json.dumps(c.load), json.dumps(c.options), _stamp(c.created), _stamp(c.updated)),
    )
    for seq, m in enumerate(c.messages, start=1):
        conn.execute(
            "INSERT INTO messages (conversation_id, seq, role, content, reasoning, tool_calls, tool_results, "
            "attachments, usage, timings, cut, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                cid,
                seq,
                m.role,
                m.content,
                m.reasoning,
                json.dumps(m.tool_calls),
                json.dumps(m.tool_results),
                json.dumps([r.model_dump() for r in m.attachments]),
                None if m.usage is None else json.dumps(m.usage),
                None if m.timings is None else json.dumps(m.timings),
                int(m.cut),
                _stamp(m.created),
            ),
        )
    return cid


def _stamp(moment: Any) -> str:
    """A time as the store writes it (``studio.history.database.now``)."""
    return str(moment.astimezone(UTC).isoformat(timespec="milliseconds"))
