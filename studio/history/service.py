"""The conversation store as the event loop uses it: one writer thread, a few reader threads, none on the loop.

SQLite connections belong to the thread that made them, and SQLite lets one writer in at a
time: so every write goes through one queue to one thread (which also gives a message its
place: the order writes were sent in), and reads go to reader threads with a connection
each. The threads are daemons, as ``studio.blocking``'s: a stuck disk never holds up Ctrl-C.

A database that cannot be used (``studio.history.database``) leaves the studio running:
``problem`` says why, ``/api/status`` shows it and every history route answers it as a 503.
A write that fails (a full disk) raises ``HistoryWriteError`` to whoever awaits it; the chat
that recorded it goes on and says so (``studio.history.recorder``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import structlog

from gguf.files import write_atomically
from studio.errors import HistoryError, HistoryUnavailableError, HistoryWriteError
from studio.history import store
from studio.history.database import SCHEMA_VERSION, connect, open_database

log = structlog.get_logger(__name__)

T = TypeVar("T")
Job = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any]"]

#: Reader threads: enough for a page's list, a search and an export at once.
READERS = 2
DATABASE = "history.db"
ATTACHMENTS = "attachments"


class History:
    """The store in ``folder`` (``history.db``, ``attachments/``); ``start`` opens it, ``close`` stops its threads."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / DATABASE
        self.attachments = folder / ATTACHMENTS
        self.problem: HistoryUnavailableError | None = None
        self._writes: queue.Queue[Job | None] = queue.Queue()
        self._reads: queue.Queue[Job | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._opened: Future[None] = Future()

    def start(self) -> None:
        """Start the threads (unless they run); the writer opens (creates, migrates) the database first.

        Returns at once. The app starts it; the first read or write does too, where no app did.
        """
        if self._threads:
            return
        if self._opened.done():  # started again after ``close``: the writer opens the file again
            self._opened = Future()
        self._threads.append(threading.Thread(target=self._write_loop, name="studio: history writer", daemon=True))
        self._threads += [
            threading.Thread(target=self._read_loop, name=f"studio: history reader {i}", daemon=True)
            for i in range(READERS)
        ]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Let the threads finish the work queued so far and stop (bounded: they are daemons)."""
        for _ in self._threads[1:]:
            self._reads.put(None)
        if self._threads:
            self._writes.put(None)
        for thread in self._threads:
            thread.join(5)
        self._threads = []

    def status(self) -> dict[str, Any]:
        """For ``/api/status``: where the history lives and whether it can be used."""
        if not self._opened.done():
            state = "opening"
        else:
            state = "unavailable" if self.problem is not None else "ready"
        return {
            "state": state,
            "path": str(self.path),
            "schema_version": SCHEMA_VERSION,
            "problem": None if self.problem is None else self.problem.message,
        }

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Return ``fn(connection, *args)`` run on the writer thread."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(connection, *args)`` for the writer and return its future at once (usable in a ``finally``
        that may not await)."""
        self.start()  # a write after ``close`` (an answer's last save at shutdown) is still done
        future: Future[T] = Future()
        self._writes.put((fn, args, future))
        return future

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Return ``fn(connection, *args)`` run on a reader thread."""
        self.start()
        await asyncio.wrap_future(self._opened)  # readers need the migrated schema
        future: Future[T] = Future()
        self._reads.put((fn, args, future))
        return await asyncio.wrap_future(future)

    # -- attachments ------------------------------------------------------------------------------

    async def store_attachment(self, data: bytes | str, media_type: str) -> str:
        """Store ``data`` (bytes, or base64 text) once by its sha256 (a file in ``attachments/``, then its row);
        return the hash.

        Raises:
            binascii.Error: ``data`` is text that is not base64.
        """
        return await self.write(self._write_attachment, data, media_type)

    async def delete_conversation(self, cid: str) -> None:
        """Delete ``cid``, its messages, and the files of the attachments no other message names."""
        await self.write(self._delete, cid)

    def attachment_path(self, digest: str) -> Path:
        return self.attachments / digest

    def _delete(self, conn: sqlite3.Connection, cid: str) -> None:
        for digest in store.delete_conversation(conn, cid):
            self.attachment_path(digest).unlink(missing_ok=True)

    def _write_attachment(self, conn: sqlite3.Connection, data: bytes | str, media_type: str) -> str:
        if isinstance(data, str):  # decoded and hashed here, not on the event loop: an image may be megabytes
            data = base64.b64decode(data, validate=True)
        digest = hashlib.sha256(data).hexdigest()
        target = self.attachment_path(digest)
        if not target.exists():
            self.attachments.mkdir(parents=True, exist_ok=True)
            write_atomically(target, data)  # a crash never leaves a half file under the hash
        store.add_attachment(conn, digest, media_type, len(data))
        return digest

    # -- threads ----------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        try:
            conn = open_database(self.path)
        except HistoryUnavailableError as exc:
            self._refuse(exc)
            return
        except (OSError, sqlite3.Error) as exc:
            self._refuse(HistoryUnavailableError(f"the history database {self.path} cannot be opened: {exc}"))
            return
        self._opened.set_result(None)
        log.info("history open", path=str(self.path), schema_version=SCHEMA_VERSION)
        self._serve(self._writes, conn, writing=True)
        conn.close()

    def _refuse(self, exc: HistoryUnavailableError) -> None:
        """The database cannot be used: every job, now and later, gets ``exc``."""
        self.problem = exc
        log.error("history unavailable", path=str(self.path), problem=exc.message)
        self._opened.set_exception(exc)
        while (job := self._writes.get()) is not None:
            job[2].set_exception(exc)

    def _read_loop(self) -> None:
        try:
            self._opened.result()
        except HistoryError:
            conn = None
        else:
            conn = connect(self.path)
            conn.execute("PRAGMA query_only = ON")
        self._serve(self._reads, conn, writing=False)
        if conn is not None:
            conn.close()

    def _serve(self, jobs: queue.Queue[Job | None], conn: sqlite3.Connection | None, *, writing: bool) -> None:
        while (job := jobs.get()) is not None:
            fn, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            if conn is None:
                future.set_exception(self.problem or HistoryUnavailableError("the history database is not open"))
                continue
            try:
                future.set_result(fn(conn, *args))
            except (OSError, sqlite3.OperationalError) as exc:
                future.set_exception(_write_error(exc) if writing else _read_error(exc))
            except BaseException as exc:  # ours (ConversationNotFoundError, ...) or a bug: the caller's to see
                future.set_exception(exc)


def _write_error(exc: OSError | sqlite3.OperationalError) -> HistoryWriteError:
    """A failed write as the user reads it: nothing was stored, and why."""
    return HistoryWriteError(f"the chat history could not be saved: {exc}; free some disk space, then keep chatting")


def _read_error(exc: OSError | sqlite3.OperationalError) -> HistoryError:
    return HistoryError(f"the chat history could not be read: {exc}")
