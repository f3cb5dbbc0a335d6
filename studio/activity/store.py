"""The activity records' queries, each a function of one connection (the history store's threads run them).

A record is one row: the columns a filter needs (kind, model, route, outcome, times) and the whole
record as JSON. Writes come in batches from ``studio.activity.recorder``, each in one transaction
that also applies the retention (by age, then by count) and the captures' size bound.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from studio import json_codec
from studio.activity.trace import RequestTrace
from studio.history.store import transaction


@dataclass(frozen=True)
class Retention:
    """How long records are kept: at most ``max_age`` seconds and ``max_records`` rows; captures' bytes in all."""

    max_age: float = 7 * 24 * 3600.0
    max_records: int = 50_000
    capture_bytes: int = 64 << 20


@dataclass(frozen=True)
class Capture:
    """A request's and its answer's bodies, kept while a capture is on (or because the request failed)."""

    id: str
    model: str | None
    created: float
    request: bytes
    answer: bytes


def write_batch(
    conn: sqlite3.Connection,
    records: Sequence[RequestTrace | dict[str, Any]],
    captures: Sequence[Capture],
    retention: Retention,
    now: float,
) -> None:
    """Insert ``records`` (a finished request's trace, or a load's record) and ``captures``, then
    drop what the retention no longer keeps."""
    rows = [_trace_row(r) if isinstance(r, RequestTrace) else _row(r) for r in records]
    with transaction(conn):
        conn.executemany(_INSERT, rows)
        conn.executemany(
            "INSERT OR REPLACE INTO activity_captures (id, model, created, size, request, answer)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            [(c.id, c.model, c.created, len(c.request) + len(c.answer), c.request, c.answer) for c in captures],
        )
        prune(conn, retention, now)


def prune(conn: sqlite3.Connection, retention: Retention, now: float) -> None:
    """Drop records older than the retention's age, then the oldest beyond its count; captures beyond its bytes.

    Records are in their rowid's order (the order they ended in): both walk the rowids from the lowest, and
    stop at the first record kept."""
    oldest = now - retention.max_age
    first_kept = conn.execute(
        "SELECT rowid FROM activity WHERE ended >= ? OR started >= ? ORDER BY rowid LIMIT 1", (oldest, oldest)
    )
    found = first_kept.fetchone()
    if found is None:
        conn.execute("DELETE FROM activity")
    else:
        conn.execute("DELETE FROM activity WHERE rowid < ?", (found[0],))
    conn.execute("DELETE FROM activity WHERE rowid <= (SELECT max(rowid) FROM activity) - ?", (retention.max_records,))
    conn.execute("DELETE FROM activity_captures WHERE created < ?", (now - retention.max_age,))
    total = conn.execute("SELECT coalesce(sum(size), 0) FROM activity_captures").fetchone()[0]
    if total > retention.capture_bytes:
        kept = 0
        rows = conn.execute("SELECT id, size FROM activity_captures ORDER BY created DESC").fetchall()
        drop = []
        for row in rows:
            kept += row["size"]
            if kept > retention.capture_bytes:
                drop.append((row["id"],))
        conn.executemany("DELETE FROM activity_captures WHERE id = ?", drop)


#: A row a record; measured against one ``INSERT ... SELECT`` over a JSON array of the batch (``json_each``), which
#: parses each row's JSON once per column: 5.4 against 8.6 us a row.
_INSERT = (
    "INSERT INTO activity (id, kind, model, route, outcome, started, ended, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


def _trace_row(trace: RequestTrace) -> tuple[Any, ...]:
    """A request's row: its state as compact JSON, not its record (built when it is read)."""
    ended = trace.wall(trace.ended)
    model = trace.model or trace.asked
    state = json_codec.dumps(trace.state()).decode()
    return (trace.id, "request", model, trace.route, trace.filed_as(), trace.wall0, ended, state)


def _row(record: dict[str, Any]) -> tuple[Any, ...]:
    times = record.get("times") or {}
    started = times.get("arrived", times.get("began"))
    outcome = record.get("outcome") or "finished"
    return (
        record["id"],
        record["kind"],
        record.get("model"),
        record.get("route"),
        outcome,
        started,
        times.get("ended"),
        json_codec.dumps(record),
    )


@dataclass(frozen=True)
class Query:
    """Filters of ``GET /api/activity``; ``None``: any."""

    model: str | None = None
    route: str | None = None
    outcome: str | None = None
    kind: str | None = None
    since: float | None = None
    until: float | None = None
    limit: int = 500


def select(conn: sqlite3.Connection, query: Query) -> list[dict[str, Any]]:
    """The records matching ``query``, the latest to end first (as the recent ones in memory), each with whether
    a capture of it is kept."""
    where: list[str] = ["1 = 1"]
    args: list[Any] = []
    for column, value in (("model", query.model), ("route", query.route), ("kind", query.kind)):
        if value is not None:
            where.append(f"a.{column} = ?")
            args.append(value)
    if query.outcome is not None:
        where.append("a.outcome = ?")
        args.append(query.outcome)
    if query.since is not None:
        where.append("coalesce(a.ended, a.started) >= ?")
        args.append(query.since)
    if query.until is not None:
        where.append("a.started <= ?")
        args.append(query.until)
    rows = conn.execute(
        "SELECT a.kind, a.record, c.size AS captured FROM activity a LEFT JOIN activity_captures c ON c.id = a.id"
        f" WHERE {' AND '.join(where)} ORDER BY a.rowid DESC LIMIT ?",
        (*args, query.limit),
    ).fetchall()
    found = []
    for row in rows:
        if row["kind"] == "request":
            record = RequestTrace.from_state(row["record"]).record()
        else:
            record = json.loads(row["record"])
        record["captured"] = row["captured"]
        found.append(record)
    return found


def capture_of(conn: sqlite3.Connection, record_id: str) -> dict[str, Any] | None:
    """The bodies kept for ``record_id``, as text (``None``: none kept)."""
    row = conn.execute("SELECT * FROM activity_captures WHERE id = ?", (record_id,)).fetchone()
    if row is None:
        return None
    return {
        "id": row["id"],
        "model": row["model"],
        "created": row["created"],
        "size": row["size"],
        "request": bytes(row["request"]).decode("utf-8", "replace"),
        "answer": bytes(row["answer"]).decode("utf-8", "replace"),
    }


def captures_size(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT coalesce(sum(size), 0) FROM activity_captures").fetchone()[0])


def delete_all(conn: sqlite3.Connection, before: float | None) -> int:
    """Delete the records (and captures) that began before ``before`` (all: ``None``); return how many records."""
    with transaction(conn):
        if before is None:
            gone = conn.execute("DELETE FROM activity").rowcount
            conn.execute("DELETE FROM activity_captures")
        else:
            gone = conn.execute("DELETE FROM activity WHERE started < ?", (before,)).rowcount
            conn.execute("DELETE FROM activity_captures WHERE created < ?", (before,))
    return int(gone)
