"""An on-disk registry of the llama-server children we launched, so none outlives us.

Each child gets a small JSON record: its pid and create time (so a recycled pid
is never mistaken for it), the binary, the owner token of the supervisor that
started it, and the studio process (pid + create time). At start-up
``reap_orphans`` stops only records that are provably ours and orphaned: the
same owner, or a studio process that no longer exists. An unrelated
llama-server, or one owned by another live studio, is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import structlog

from gguf.files import write_atomically
from launcher import platform

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ChildRecord:
    """One launched child and who launched it."""

    pid: int
    create_time: float
    binary: str
    owner: str
    studio_pid: int
    studio_create_time: float


def _create_time(pid: int) -> float | None:
    """The process's create time, or None when it is gone (an exited, unreaped zombie counts as gone)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class ChildRegistry:
    """Records of live children under ``directory``; ``owner`` identifies this supervisor."""

    def __init__(self, directory: Path, owner: str) -> None:
        self.directory = directory
        self.owner = owner

    def _path(self, pid: int) -> Path:
        return self.directory / f"llama-server-{pid}.json"

    def add(self, pid: int, binary: str) -> ChildRecord:
        """Record a freshly started child."""
        me = os.getpid()
        record = ChildRecord(
            pid=pid,
            create_time=_create_time(pid) or time.time(),
            binary=binary,
            owner=self.owner,
            studio_pid=me,
            studio_create_time=_create_time(me) or 0.0,
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self._path(pid), json.dumps(asdict(record)))
        return record

    def remove(self, pid: int) -> None:
        """Forget a child that has been reaped."""
        self._path(pid).unlink(missing_ok=True)

    def records(self) -> list[ChildRecord]:
        """Every readable record (unreadable files are dropped)."""
        out = []
        for path in sorted(self.directory.glob("llama-server-*.json")):
            try:
                out.append(ChildRecord(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                path.unlink(missing_ok=True)
        return out

    def reap_orphans(self, grace: float = 3.0) -> list[int]:
        """Stop our orphaned children; return the pids that were stopped."""
        reaped = []
        for rec in self.records():
            alive = _create_time(rec.pid)
            if alive is None or abs(alive - rec.create_time) > 1.0:
                self.remove(rec.pid)  # gone, or the pid now belongs to another process
                continue
            studio_alive = _create_time(rec.studio_pid)
            studio_gone = studio_alive is None or abs(studio_alive - rec.studio_create_time) > 1.0
            if rec.owner != self.owner and not studio_gone:
                continue  # another live studio's child
            log.warning("reaping an orphaned child", pid=rec.pid, binary=rec.binary)
            _stop_group(rec.pid, grace)
            self.remove(rec.pid)
            reaped.append(rec.pid)
        return reaped


def _stop_group(pid: int, grace: float) -> None:
    platform.signal_group(pid, signal.SIGTERM)
    try:
        psutil.Process(pid).wait(timeout=grace)
    except psutil.TimeoutExpired:
        platform.kill_group(pid)
    except psutil.NoSuchProcess:
        pass
