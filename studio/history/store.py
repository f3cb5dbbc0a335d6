"""The conversation store's queries: each a function of one connection, run on the thread that owns it.

Writes run on the one writer thread (``studio.history.service``), so a message's ``seq`` is
given there, inside its transaction: two tabs writing one conversation lose nothing and keep
the order the studio received their writes in. Reads run on reader threads with their own
connections (WAL: they never wait for the writer).
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from studio.errors import ConversationNotFoundError
from studio.history.database import now

#: Words of the first message a conversation is titled with until someone names it.
TITLE_WORDS = 8
TITLE_CHARS = 60
#: The message fields stored as JSON, with their empty value.
_JSON_FIELDS = {"tool_calls": "[]", "tool_results": "[]", "attachments": "[]", "usage": None, "timings": None}
_MESSAGE_COLUMNS = (
    "id, seq, role, content, reasoning, tool_calls, tool_results, attachments, usage, timings, cut, created"
)
_CONVERSATION_COLUMNS = "id, title, model, load, options, created, updated"


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``, or ``ROLLBACK`` on any error: a write is all there or not at all."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def new_id() -> str:
    return uuid.uuid4().hex


def propose_title(text: str) -> str:
    """A title from a first message: its first words, shortened."""
    words = " ".join(text.split()[:TITLE_WORDS])
    return words if len(words) <= TITLE_CHARS else words[: TITLE_CHARS - 1].rstrip() + "…"


# -- conversations ------------------------------------------------------------------------------


def create_conversation(
    conn: sqlite3.Connection,
    *,
    title: str = "",
    model: str | None = None,
    load: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the new, empty conversation."""
    cid, stamp = new_id(), now()
    with transaction(conn):
        conn.execute(
            f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (cid, title, model, json.dumps(dict(load or {})), json.dumps(dict(options or {})), stamp, stamp),
        )
    return get_conversation(conn, cid, messages=False)


def list_conversations(conn: sqlite3.Connection, *, limit: int, offset: int = 0) -> list[dict[str, Any]]:
    """The conversations, the most recently updated first, without their messages."""
    rows = conn.execute(
        f"SELECT {_CONVERSATION_COLUMNS}, "
        "(SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count "
        "FROM conversations c ORDER BY updated DESC, id LIMIT ? OFFSET ?",
        (limit, offset),
    ).fetchall()
    return [_conversation(row) for row in rows]


def get_conversation(conn: sqlite3.Connection, cid: str, *, messages: bool = True) -> dict[str, Any]:
    """The conversation ``cid``, with its messages in order unless ``messages`` is false.

    Raises:
        ConversationNotFoundError: there is none with that id.
    """
    row = conn.execute(
        f"SELECT {_CONVERSATION_COLUMNS}, "
        "(SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count "
        "FROM conversations c WHERE id = ?",
        (cid,),
    ).fetchone()
    if row is None:
        raise ConversationNotFoundError(f"no stored conversation has the id {cid!r}", param="conversation_id")
    found = _conversation(row)
    if messages:
        found["messages"] = list_messages(conn, cid)
    return found


def update_conversation(conn: sqlite3.Connection, cid: str, changes: Mapping[str, Any]) -> dict[str, Any]:
    """Set ``changes`` (``title``, ``model``, ``load``, ``options``) and return the conversation."""
    columns = {k: json.dumps(v) if k in ("load", "options") else v for k, v in changes.items()}
    with transaction(conn):
        _require(conn, cid)
        if columns:
            assignments = ", ".join(f"{name} = ?" for name in columns)
            conn.execute(
                f"UPDATE conversations SET {assignments}, updated = ? WHERE id = ?", (*columns.values(), now(), cid)
            )
    return get_conversation(conn, cid, messages=False)


def delete_conversation(conn: sqlite3.Connection, cid: str) -> list[str]:
    """Delete ``cid`` with its messages; return the attachment hashes no message names any more."""
    with transaction(conn):
        _require(conn, cid)
        conn.execute("DELETE FROM conversations WHERE id = ?", (cid,))
        orphans = [row[0] for row in conn.execute(_ORPHANS)]
        conn.executemany("DELETE FROM attachments WHERE hash = ?", [(h,) for h in orphans])
    return orphans


_ORPHANS = """
SELECT hash FROM attachments a WHERE NOT EXISTS (
    SELECT 1 FROM messages m, json_each(m.attachments) j WHERE json_extract(j.value, '$.hash') = a.hash
)
"""


# -- messages -----------------------------------------------------------------------------------


def list_messages(conn: sqlite3.Connection, cid: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY seq", (cid,)
    ).fetchall()
    return [_message(row) for row in rows]


def append_messages(conn: sqlite3.Connection, cid: str, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Append ``messages`` in one transaction, after every message already there; return them as stored.

    The first user message titles a conversation nobody has named yet.
    """
    stamp = now()
    with transaction(conn):
        conversation = _require(conn, cid)
        seq = conn.execute("SELECT coalesce(max(seq), 0) FROM messages WHERE conversation_id = ?", (cid,)).fetchone()[0]
        ids = []
        for message in messages:
            seq += 1
            values = _message_values(message)
            cursor = conn.execute(
                "INSERT INTO messages (conversation_id, seq, role, content, reasoning, tool_calls, tool_results, "
                "attachments, usage, timings, cut, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cid, seq, *values, message.get("created") or stamp),
            )
            ids.append(cursor.lastrowid)
        title = conversation["title"]
        first_user = next((m for m in messages if m.get("role") == "user" and m.get("content")), None)
        if not title and first_user is not None:
            title = propose_title(str(first_user["content"]))
        conn.execute("UPDATE conversations SET title = ?, updated = ? WHERE id = ?", (title, stamp, cid))
    marks = ",".join("?" * len(ids))
    rows = conn.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id IN ({marks}) ORDER BY seq", ids)
    return [_message(row) for row in rows]


def update_message(conn: sqlite3.Connection, message_id: int, changes: Mapping[str, Any]) -> None:
    """Set fields of a stored message (an answer as it streams: content so far, then usage, timings, ``cut``)."""
    columns = {k: _column_value(k, v) for k, v in changes.items()}
    assignments = ", ".join(f"{name} = ?" for name in columns)
    with transaction(conn):
        conn.execute(f"UPDATE messages SET {assignments} WHERE id = ?", (*columns.values(), message_id))
        conn.execute(
            "UPDATE conversations SET updated = ? WHERE id = (SELECT conversation_id FROM messages WHERE id = ?)",
            (now(), message_id),
        )


def delete_message(conn: sqlite3.Connection, message_id: int) -> None:
    with transaction(conn):
        conn.execute("DELETE FROM messages WHERE id = ?", (message_id,))


def add_attachment(conn: sqlite3.Connection, digest: str, media_type: str, size: int) -> None:
    """Record an attachment whose file is written (once per content: a second copy is the same row)."""
    with transaction(conn):
        conn.execute(
            "INSERT OR IGNORE INTO attachments (hash, media_type, size, created) VALUES (?, ?, ?, ?)",
            (digest, media_type, size, now()),
        )


def attachment_type(conn: sqlite3.Connection, digest: str) -> str | None:
    row = conn.execute("SELECT media_type FROM attachments WHERE hash = ?", (digest,)).fetchone()
    return None if row is None else str(row[0])


# -- search -------------------------------------------------------------------------------------


def search(conn: sqlite3.Connection, text: str, *, limit: int) -> list[dict[str, Any]]:
    """Conversations whose title or messages hold every word of ``text`` (the last one as a prefix).

    Those whose title matches come first, then those with a matching message, the newest message
    first; each with ``snippet``, the text around its newest hit (``None`` for a title hit). Newest
    first, not by relevance: ranking every hit of a common word costs a scan of them all
    (``scripts/bench_history.py``: 250 ms for one in most of 100,000 messages), while FTS5 walks
    its matches newest first and stops at ``limit``.
    """
    query = fts_query(text)
    if not query:
        return []
    hits: dict[str, dict[str, Any]] = {}
    for row in conn.execute(
        "SELECT c.id FROM title_search JOIN conversations c ON c.rowid = title_search.rowid "
        "WHERE title_search MATCH ? ORDER BY c.updated DESC LIMIT ?",
        (query, limit),
    ):
        hits[row["id"]] = {"snippet": None, "message_id": None}
    seen = 0
    while len(hits) < limit:  # a conversation may hold many hits: read on until ``limit`` conversations
        batch = conn.execute(
            "SELECT rowid, snippet(message_search, -1, '', '', '…', 16) AS snippet FROM message_search "
            "WHERE message_search MATCH ? ORDER BY rowid DESC LIMIT ? OFFSET ?",
            (query, limit * 4, seen),
        ).fetchall()
        for row in batch:
            owner = conn.execute("SELECT conversation_id FROM messages WHERE id = ?", (row["rowid"],)).fetchone()
            if owner is not None and owner[0] not in hits:
                hits[owner[0]] = {"snippet": row["snippet"], "message_id": row["rowid"]}
        seen += len(batch)
        if len(batch) < limit * 4:
            break
    out = []
    for cid, hit in list(hits.items())[:limit]:
        out.append({**get_conversation(conn, cid, messages=False), **hit})
    return out


def fts_query(text: str) -> str:
    """``text`` as an FTS5 query that cannot be a syntax error: each word quoted, the last one a prefix."""
    words = [w.replace('"', '""') for w in text.split()]
    return " ".join(f'"{w}"' for w in words[:-1]) + (f' "{words[-1]}"*' if words else "")


# -- rows ---------------------------------------------------------------------------------------


def _require(conn: sqlite3.Connection, cid: str) -> sqlite3.Row:
    row = conn.execute("SELECT id, title FROM conversations WHERE id = ?", (cid,)).fetchone()
    if row is None:
        raise ConversationNotFoundError(f"no stored conversation has the id {cid!r}", param="conversation_id")
    return row


def _conversation(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "title": row["title"],
        "model": row["model"],
        "load": json.loads(row["load"]),
        "options": json.loads(row["options"]),
        "created": row["created"],
        "updated": row["updated"],
        "message_count": row["message_count"],
    }


def _message(row: sqlite3.Row) -> dict[str, Any]:
    out: dict[str, Any] = {key: row[key] for key in ("id", "seq", "role", "content", "reasoning", "created")}
    for key in _JSON_FIELDS:
        out[key] = None if row[key] is None else json.loads(row[key])
    out["cut"] = bool(row["cut"])
    return out


def _message_values(message: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        message["role"],
        message.get("content") or "",
        message.get("reasoning") or "",
        *(_column_value(k, message.get(k)) for k in _JSON_FIELDS),
        int(bool(message.get("cut"))),
    )


def _column_value(key: str, value: Any) -> Any:
    if key in _JSON_FIELDS:
        return _JSON_FIELDS[key] if value is None else json.dumps(value)
    if key == "cut":
        return int(bool(value))
    return value
