"""One studio per studio home: the lock that says one runs there, and the discovery file that says where.

Two studios on one home would each place models against the same memory as if it were theirs.
``serve`` (and ``run``, which starts a studio in-process) takes ``<home>/studio.lock`` with an
exclusive, non-blocking flock (``launcher.platform.try_lock``) before anything else, and writes
its pid and command into it; once the service answers, ``serve`` writes ``<home>/studio.json``::

    {"url": "http://127.0.0.1:41231", "pid": 4242, "version": "0.1.0", "token_required": false,
     "command": "serve", "started": 1764700000.25}

(mode 0600, written whole by a rename; never the token itself) and removes it when it stops. The
kernel drops the lock however the holder ends, so after a ``kill -9`` the next ``serve`` takes the
lock and replaces the file left behind. Clients (``ps``, ``load``, ``unload``, ``run``, ``rm``,
``logs``) read the file with ``running_studio``: it counts only while its pid is alive and is the
same process (its start time matches), so a stale file is never trusted.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from gguf.files import replacing
from launcher.platform import try_lock
from studio.errors import AlreadyRunningError, StudioHomeError

LOCK_NAME = "studio.lock"
DISCOVERY_NAME = "studio.json"

Command = Literal["serve", "run"]


@dataclass(frozen=True)
class Discovery:
    """What a running studio says about itself in its discovery file."""

    url: str
    pid: int
    version: str
    token_required: bool
    command: Command = "serve"
    started: float = 0.0  # the process's start time (psutil's create_time): a reused pid is not this studio

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object, *, path: Path) -> Discovery:
        """Parse a discovery file's content; ``ValueError`` naming ``path`` when it is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a studio discovery file (not a JSON object)")
        url, pid, version, token = data.get("url"), data.get("pid"), data.get("version"), data.get("token_required")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{path} is not a studio discovery file (no http URL)")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"{path} is not a studio discovery file (no pid)")
        if not isinstance(version, str) or not isinstance(token, bool):
            raise ValueError(f"{path} is not a studio discovery file (no version or token_required)")
        command = data.get("command", "serve")
        started = data.get("started", 0.0)
        return cls(
            url=url.rstrip("/"),
            pid=pid,
            version=version,
            token_required=token,
            command="run" if command == "run" else "serve",
            started=float(started) if isinstance(started, (int, float)) else 0.0,
        )


def _process_started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None when there is none."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def read_discovery(home: Path) -> Discovery | None:
    """The discovery file in ``home`` as it is (alive or not); None when there is none.

    Raises:
        ValueError: the file is there but is not a discovery file (garbage, truncated, another program's).
    """
    path = home / DISCOVERY_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(f"{path} is not a studio discovery file (not JSON)") from None
    return Discovery.from_json(data, path=path)


def is_alive(found: Discovery) -> bool:
    """Whether the process a discovery file names still runs and is the one that wrote it."""
    started = _process_started(found.pid)
    if started is None:
        return False
    return not found.started or abs(started - found.started) < 1.0


def running_studio(home: Path) -> Discovery | None:
    """The studio running in ``home`` by its discovery file; None when none is (no file, or a stale one).

    Raises:
        ValueError: the file is garbage (the caller says so and falls back to the configured address).
    """
    found = read_discovery(home)
    return found if found is not None and is_alive(found) else None


class HomeLock:
    """This process's hold on a studio home: the lock, and the discovery file once published."""

    def __init__(self, home: Path, fd: int, command: Command) -> None:
        self.home = home
        self.command = command
        self._fd: int | None = fd
        self._published = False
        self.started = _process_started(os.getpid()) or time.time()

    @classmethod
    def acquire(cls, home: Path, command: Command = "serve") -> HomeLock:
        """Take ``home``'s lock or say who holds it.

        Raises:
            AlreadyRunningError: another studio holds it (its pid and URL in the message and attributes).
            StudioHomeError: the home cannot hold a lock (read-only, not a folder).
        """
        path = home / LOCK_NAME
        try:
            home.mkdir(parents=True, exist_ok=True)
            fd = try_lock(path)
        except OSError as exc:
            raise StudioHomeError(
                f"cannot lock the studio home {home}: {exc.strerror or exc}; set GGUF_STUDIO_HOME to a writable folder",
                path=str(path),
            ) from exc
        if fd is None:
            raise _already_running(home)
        held = cls(home, fd, command)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command}).encode(), 0)
        except OSError as exc:
            held.release()
            raise StudioHomeError(f"cannot write {path}: {exc.strerror or exc}", path=str(path)) from exc
        return held

    def publish(self, url: str, *, token_required: bool, version: str) -> Discovery:
        """Write the discovery file (mode 0600, whole or not at all); return what it says."""
        found = Discovery(
            url=url.rstrip("/"),
            pid=os.getpid(),
            version=version,
            token_required=token_required,
            command=self.command,
            started=self.started,
        )
        path = self.home / DISCOVERY_NAME
        try:
            with replacing(path) as partial:  # a stale file of a killed studio is replaced here, in one step
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    json.dump(found.to_json(), out)
        except OSError as exc:
            raise StudioHomeError(f"cannot write {path}: {exc.strerror or exc}", path=str(path)) from exc
        self._published = True
        return found

    def release(self) -> None:
        """Remove the discovery file (if it is still this process's) and drop the lock; idempotent."""
        if self._fd is None:
            return
        if self._published:
            path = self.home / DISCOVERY_NAME
            with contextlib.suppress(ValueError, OSError):
                found = read_discovery(self.home)
                if found is not None and found.pid == os.getpid():
                    path.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self) -> HomeLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _already_running(home: Path) -> AlreadyRunningError:
    """The error for a home whose lock another process holds, naming it as best the files tell."""
    url: str | None = None
    pid: int | None = None
    command = "serve"
    with contextlib.suppress(ValueError, OSError):
        found = read_discovery(home)
        if found is not None and is_alive(found):
            url, pid, command = found.url, found.pid, found.command
    if pid is None:  # still starting, or a `ggstudio run`: the lock file names it
        with contextlib.suppress(ValueError, OSError, AttributeError):
            held = json.loads((home / LOCK_NAME).read_text(encoding="utf-8"))
            pid = int(held["pid"]) if isinstance(held.get("pid"), int) else None
            command = str(held.get("command") or command)
    who = f"`ggstudio {command}`" + (f" (pid {pid})" if pid else "")
    where = f" at {url}" if url else (" (still starting)" if command == "serve" else "")
    return AlreadyRunningError(
        f"a studio already runs in {home}: {who}{where}",
        home=str(home),
        pid=pid,
        url=url,
        hint="use that one (`ggstudio ps` finds it), stop it first, or set GGUF_STUDIO_HOME to another studio home",
    )
