"""The history database file: open it, check it is ours and sound, migrate it, and never harm one that is not.

One SQLite file, ``history.db``, in WAL mode (readers never wait for the writer; a commit
survives a ``kill -9`` of the studio). ``schema_version`` holds one row per migration
applied; ``MIGRATIONS[n - 1]`` takes a database from version ``n - 1`` to ``n``.

A file that is not SQLite, fails SQLite's own check, or was written by a newer studio is
refused with ``HistoryUnavailableError`` before anything is written to it: no journal-mode
change, no migration, no "repair". The user keeps the file to recover or to open with the
newer studio.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

from studio.errors import HistoryUnavailableError

_HEADER = b"SQLite format 3\x00"

#: Version 1: conversations, their messages and the attachments they name.
_V1 = """
CREATE TABLE conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    model TEXT,
    load TEXT NOT NULL DEFAULT '{}',      -- JSON: the load settings (n_ctx, n_parallel, cache_type_kv, spec, ...)
    options TEXT NOT NULL DEFAULT '{}',   -- JSON: sampling options and the system prompt
    created TEXT NOT NULL,
    updated TEXT NOT NULL
);
CREATE INDEX conversations_by_updated ON conversations (updated);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,                 -- the order within the conversation, given by the one writer
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    tool_calls TEXT NOT NULL DEFAULT '[]',    -- JSON: the calls the model made
    tool_results TEXT NOT NULL DEFAULT '[]',  -- JSON: what the studio's tools answered
    attachments TEXT NOT NULL DEFAULT '[]',   -- JSON: [{"hash", "media_type", "name"}], files by content hash
    usage TEXT,                           -- JSON: token counts, once the answer is done
    timings TEXT,                         -- JSON: llama-server's timings, once the answer is done
    cut INTEGER NOT NULL DEFAULT 0,       -- 1 while streaming and for an answer that never ended
    created TEXT NOT NULL,
    UNIQUE (conversation_id, seq)
);
CREATE TABLE attachments (
    hash TEXT PRIMARY KEY,                -- sha256 of the bytes; the file is attachments/<hash>
    media_type TEXT NOT NULL,
    size INTEGER NOT NULL,
    created TEXT NOT NULL
);
"""

#: Version 2: full-text search (FTS5) over titles and messages, kept current by triggers, filled from version 1's rows.
_V2 = """
CREATE VIRTUAL TABLE message_search USING fts5 (content, reasoning, content='messages', content_rowid='id');
CREATE TRIGGER message_search_insert AFTER INSERT ON messages BEGIN
    INSERT INTO message_search (rowid, content, reasoning) VALUES (new.id, new.content, new.reasoning);
END;
CREATE TRIGGER message_search_delete AFTER DELETE ON messages BEGIN
    INSERT INTO message_search (message_search, rowid, content, reasoning)
        VALUES ('delete', old.id, old.content, old.reasoning);
END;
CREATE TRIGGER message_search_update AFTER UPDATE OF content, reasoning ON messages BEGIN
    INSERT INTO message_search (message_search, rowid, content, reasoning)
        VALUES ('delete', old.id, old.content, old.reasoning);
    INSERT INTO message_search (rowid, content, reasoning) VALUES (new.id, new.content, new.reasoning);
END;
CREATE VIRTUAL TABLE title_search USING fts5 (title, content='conversations', content_rowid='rowid');
CREATE TRIGGER title_search_insert AFTER INSERT ON conversations BEGIN
    INSERT INTO title_search (rowid, title) VALUES (new.rowid, new.title);
END;
CREATE TRIGGER title_search_delete AFTER DELETE ON conversations BEGIN
    INSERT INTO title_search (title_search, rowid, title) VALUES ('delete', old.rowid, old.title);
END;
CREATE TRIGGER title_search_update AFTER UPDATE OF title ON conversations BEGIN
    INSERT INTO title_search (title_search, rowid, title) VALUES ('delete', old.rowid, old.title);
    INSERT INTO title_search (rowid, title) VALUES (new.rowid, new.title);
END;
INSERT INTO message_search (message_search) VALUES ('rebuild');
INSERT INTO title_search (title_search) VALUES ('rebuild');
"""

#: Version 3: the activity records (``studio.activity``): one row per request, load or eviction, its fields as
#: JSON; and the captured bodies of requests, while a capture is on.
_V3 = """
CREATE TABLE activity (
    id TEXT NOT NULL,                     -- unique (not a key: one index less to keep on every insert)
    kind TEXT NOT NULL,                   -- request, load, eviction, crash, restart
    model TEXT,
    route TEXT,
    outcome TEXT NOT NULL,
    started REAL NOT NULL,                -- epoch seconds: arrival, or the load's first step
    ended REAL,
    record TEXT NOT NULL                  -- JSON: a load's record as /api/activity shows it; a request's state
);
CREATE INDEX activity_by_started ON activity (started);
CREATE TABLE activity_captures (
    id TEXT PRIMARY KEY,                  -- the request's record id
    model TEXT,
    created REAL NOT NULL,
    size INTEGER NOT NULL,                -- bytes of request and answer together
    request BLOB NOT NULL,
    answer BLOB NOT NULL
);
CREATE INDEX activity_captures_by_created ON activity_captures (created);
"""

#: Version 4: no index on the activity's start times. Records are inserted as they end, so their rowid is their
#: order: the retention drops the lowest rowids and a read walks them from the highest, and every insert keeps
#: one b-tree, not two (``studio.activity.store``).
_V4 = """
DROP INDEX activity_by_started;
"""

MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3, _V4)
#: The schema this studio writes.
SCHEMA_VERSION = len(MIGRATIONS)


def now() -> str:
    """The time as the store writes it: UTC, ISO 8601, milliseconds (sorts as text)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def connect(path: Path) -> sqlite3.Connection:
    """A connection to a database ``open_database`` accepted, for one thread."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=True)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA synchronous = NORMAL")  # WAL: a commit survives a crash of the studio, if not of the OS
    return conn


def open_database(path: Path, *, upto: int = SCHEMA_VERSION) -> sqlite3.Connection:
    """Return the writer's connection to ``path``, created or migrated to version ``upto``.

    Raises:
        HistoryUnavailableError: the file is not a SQLite database, is damaged, or has a newer schema;
            nothing was written to it.
    """
    fresh = not path.exists() or path.stat().st_size == 0
    if not fresh:
        _check_header(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = connect(path)
    try:
        version = 0 if fresh else _checked_version(conn, path)
        conn.execute("PRAGMA journal_mode = WAL")
        for target in range(version + 1, upto + 1):
            _migrate(conn, target)
    except BaseException:
        conn.close()
        raise
    return conn


def _check_header(path: Path) -> None:
    """Refuse a file that is not SQLite before SQLite itself opens it."""
    try:
        with path.open("rb") as f:
            header = f.read(len(_HEADER))
    except OSError as exc:
        raise HistoryUnavailableError(f"the history database {path} cannot be read: {exc.strerror or exc}") from exc
    if header != _HEADER:
        raise HistoryUnavailableError(
            f"the history database {path} is not a SQLite database (damaged or replaced); it was left as it is. "
            "Move it away (or restore a backup) and restart the studio to start a new history."
        )


def _checked_version(conn: sqlite3.Connection, path: Path) -> int:
    """The schema version of an existing database, after SQLite's own integrity check."""
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise HistoryUnavailableError(
                f"the history database {path} is damaged ({'; '.join(problems)}); it was left as it is. Move it away "
                "(or restore a backup) and restart the studio to start a new history."
            )
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "schema_version" not in tables:
            if tables:
                raise HistoryUnavailableError(
                    f"{path} is a SQLite database but not the studio's history (no schema_version table); "
                    "it was left as it is. Move it away and restart the studio."
                )
            return 0
        version = int(conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        raise HistoryUnavailableError(
            f"the history database {path} is damaged ({exc}); it was left as it is. Move it away "
            "(or restore a backup) and restart the studio to start a new history."
        ) from exc
    if version > SCHEMA_VERSION:
        raise HistoryUnavailableError(
            f"the history database {path} was written by a newer GGUF Studio (schema {version}; this one knows up to "
            f"{SCHEMA_VERSION}); it was left as it is. Run the newer studio, or export from it and import here."
        )
    return version


def _migrate(conn: sqlite3.Connection, target: int) -> None:
    """Apply migration ``target`` and record it, in one transaction."""
    statements = [s.strip() for s in _split(MIGRATIONS[target - 1]) if s.strip()]
    conn.execute("BEGIN IMMEDIATE")
    try:
        if target == 1:
            conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied TEXT NOT NULL)")
        for statement in statements:
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version (version, applied) VALUES (?, ?)", (target, now()))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _split(script: str) -> list[str]:
    """``script``'s statements (``executescript`` would commit on its own, outside the migration's transaction)."""
    statements, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current)
            current = ""
    return statements
