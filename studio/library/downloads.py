"""Downloads through the service: Hugging Face pulls with progress, cancel, and one transfer per file.

``DownloadManager.start("owner/repo:QUANT")`` resolves the spec at once (an
unknown repo, a missing variant, offline without the files: the caller's error,
before anything runs), then fetches in a worker thread through the hub code
(``studio.library.hub.fetch``: variant rules, shards, the projector of a vision
repo, disk preflight, offline rules, ``HF_TOKEN``). Each download is a
``Download`` whose ``snapshot()`` has the bytes, rate and ETA overall and per file.

Sharing: a second request for the same files (same repo commit and variant)
while the first is running joins it and sees its progress. Two downloads that
share a file (the projector of two variants) never fetch it at the same time: a
lock per file makes the second wait, then find it in the cache.

Cancel: ``cancel(id)`` sets the download's event; the hub stops within one chunk
(10 MiB) and keeps complete files. A client that stops listening does not
cancel (another may be listening); only ``cancel`` does.

Waiting: ``wait`` (and so ``ensure_available``) waits on the event loop for the download's
``ended`` future, holding no thread: one thread each, as ``to_thread(Event.wait)`` took, let a
handful of waiters take the default executor's few threads (min(32, cpus + 4)) for the whole
download, and every other ``to_thread`` call of the studio waited behind them. A waiter that is
cancelled (its client left) stops waiting; the download goes on for the others.

``ensure_available(spec)`` is what a load calls for a repo name: the cached file,
or (``auto_download`` on) the file once downloaded, or a 404 saying how to pull it.
``suggest_variant`` names the largest variant of a repo a caller's ``fits`` accepts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from studio.errors import DownloadCancelledError, HubError, ModelNotFoundError, StudioError
from studio.library import hub

log = structlog.get_logger("studio.library.downloads")

#: Seconds between two looks at a download for an event stream.
POLL = 0.2
#: Finished downloads kept for ``GET /api/pulls``.
KEEP_FINISHED = 50


class DownloadState(enum.Enum):
    """Where a download is."""

    RUNNING = "running"  # files are being fetched (or linked from the cache)
    DONE = "done"  # every file is in the cache
    FAILED = "failed"  # stopped on an error; ``error`` says why
    CANCELLED = "cancelled"  # stopped by ``cancel``; complete files stay cached


@dataclass
class FileProgress:
    """One file of a download."""

    path: str
    size: int
    done: int = 0
    state: str = "pending"  # pending, downloading, done, cached

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "done": self.done, "state": self.state}


def _running_future() -> concurrent.futures.Future[None]:
    """A future that only its download can end: a running one ignores ``cancel()``, which
    ``wrap_future`` passes on when one waiter is cancelled (the others would be cancelled with it)."""
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


@dataclass
class Download:
    """One pull: what it fetches, how far it is, and how it ended. Mutated by its worker thread only."""

    id: str
    resolved: hub.Resolved
    files: list[FileProgress]
    total: int  # bytes to download (cached files excluded)
    started: float = field(default_factory=time.time)
    state: DownloadState = DownloadState.RUNNING
    done: int = 0
    rate: float = 0.0
    eta_s: float | None = None
    error: dict[str, Any] | None = None
    result: hub.Pulled | None = None
    finished: float | None = None
    version: int = 0  # bumped on every change, for event streams
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    ended: concurrent.futures.Future[None] = field(default_factory=_running_future, repr=False)

    @property
    def spec(self) -> str:
        """``owner/repo:LABEL`` of what is fetched."""
        return f"{self.resolved.repo}:{self.resolved.model.label}"

    @property
    def active(self) -> bool:
        return self.state == DownloadState.RUNNING

    def snapshot(self) -> dict[str, Any]:
        """The download as JSON-able values (the event and list payload)."""
        return {
            "id": self.id,
            "model": self.spec,
            "repo": self.resolved.repo,
            "variant": self.resolved.model.label,
            "commit": self.resolved.commit,
            "reason": self.resolved.reason,
            "state": self.state.value,
            "done_bytes": self.done,
            "total_bytes": self.total,
            "rate_bytes_per_s": round(self.rate, 1),
            "eta_s": round(self.eta_s, 1) if self.eta_s is not None else None,
            "files": [f.to_json() for f in self.files],
            "path": str(self.result.path) if self.result else None,
            "mmproj": str(self.result.mmproj) if self.result and self.result.mmproj else None,
            "notes": list(self.result.notes) if self.result else [],
            "error": self.error,
            "started": self.started,
            "finished": self.finished,
        }

    def on_progress(self, p: hub.DownloadProgress) -> None:
        """The hub's progress callback: overall bytes, and the file in flight."""
        fetched = [f for f in self.files if f.state != "cached"]
        before = 0
        for i, f in enumerate(fetched, start=1):
            if i < p.file_index:
                f.done, f.state = f.size, "done"
                before += f.size
            elif i == p.file_index:
                f.done, f.state = max(0, min(p.done - before, f.size)), "downloading"
        self.done, self.rate, self.eta_s = p.done, p.rate, p.eta_s
        self.version += 1


class DownloadManager:
    """Every download of this service; see the module docstring."""

    def __init__(
        self,
        *,
        config: Callable[[], hub.HubConfig] = hub.HubConfig.from_env,
        disk_free: Callable[[Path], int] = hub.free_bytes,
        auto_download: bool = False,
    ) -> None:
        self.config = config  # read per download: HF_* may change while the service runs
        self.disk_free = disk_free
        self.auto_download = auto_download
        self._downloads: dict[str, Download] = {}
        self._lock = threading.Lock()
        self._file_locks: dict[tuple[str, str], threading.Lock] = {}
        self._ids = itertools.count(1)

    # -- starting and joining ------------------------------------------------------
    def start(self, spec: str, *, revision: str = "main") -> tuple[Download, bool]:
        """Return the download of ``spec`` and whether it joined one already running (blocking: resolves first).

        Raises:
            ModelNotFoundError, BadRequestError, HubAuthError, HubError: as ``hub.resolve``.
        """
        cfg = self.config()
        resolved = hub.resolve(spec, revision=revision, config=cfg)
        with self._lock:
            for d in self._downloads.values():
                if d.active and _same(d.resolved, resolved):
                    log.info("download.joined", id=d.id, model=d.spec)
                    return d, True
            check = hub.preflight(resolved, cfg, disk_free=self.disk_free)
            fetch = {f.path for f in check.to_fetch}
            files = [
                FileProgress(
                    f.path, f.size, 0 if f.path in fetch else f.size, "pending" if f.path in fetch else "cached"
                )
                for f in resolved.files
            ]
            download = Download(id=f"pull-{next(self._ids)}", resolved=resolved, files=files, total=check.needed)
            self._downloads[download.id] = download
            self._forget_old()
        threading.Thread(target=self._run, args=(download, cfg), name=f"download-{download.id}", daemon=True).start()
        log.info("download.started", id=download.id, model=download.spec, bytes=download.total)
        return download, False

    def _run(self, download: Download, cfg: hub.HubConfig) -> None:
        try:
            download.result = hub.fetch(
                download.resolved,
                config=cfg,
                progress=download.on_progress,
                cancel=download.cancel_event,
                disk_free=self.disk_free,
                file_lock=self._file_lock,
            )
            for f in download.files:
                f.done, f.state = f.size, "cached" if f.state == "cached" else "done"
            download.state = DownloadState.DONE
        except DownloadCancelledError as exc:
            download.state, download.error = DownloadState.CANCELLED, _error(exc)
        except StudioError as exc:
            download.state, download.error = DownloadState.FAILED, _error(exc)
        except Exception as exc:  # a bug or a foreign error: shown, never raised into a thread's void
            log.exception("download.crashed", id=download.id)
            download.state = DownloadState.FAILED
            download.error = {
                "message": f"download failed: {exc}",
                "type": "server_error",
                "param": None,
                "code": "download_failed",
            }
        finally:
            download.finished = time.time()
            download.version += 1
            download.ended.set_result(None)
            log.info("download.ended", id=download.id, state=download.state.value)

    @contextmanager
    def _file_lock(self, repo: str, f: hub.HubFile) -> Iterator[None]:
        with self._lock:
            lock = self._file_locks.setdefault((repo, f.blob or f.path), threading.Lock())
        with lock:
            yield

    def _forget_old(self) -> None:
        finished = [d for d in self._downloads.values() if not d.active]
        for d in sorted(finished, key=lambda d: d.finished or 0)[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._downloads[d.id]

    # -- reading and cancelling ----------------------------------------------------
    def get(self, download_id: str) -> Download:
        """Return the download ``download_id``.

        Raises:
            ModelNotFoundError: no such download (or one forgotten long ago).
        """
        with self._lock:
            found = self._downloads.get(download_id)
        if found is None:
            raise ModelNotFoundError(
                f"no download {download_id!r}; GET /api/pulls lists them", param="id", code="download_not_found"
            )
        return found

    def list(self) -> list[Download]:
        """Every download kept, oldest first."""
        with self._lock:
            return sorted(self._downloads.values(), key=lambda d: d.started)

    def cancel(self, download_id: str) -> Download:
        """Ask ``download_id`` to stop (it ends within one chunk); a finished one is returned as it is."""
        download = self.get(download_id)
        download.cancel_event.set()
        return download

    async def events(self, download: Download) -> AsyncIterator[dict[str, Any]]:
        """Yield the download's snapshot whenever it changes, the last one when it has ended."""
        seen = -1
        while True:
            version = download.version
            if version != seen:
                seen = version
                yield download.snapshot()
            if download.ended.done() and download.version == seen:
                return
            await asyncio.sleep(POLL)

    async def wait(self, download: Download) -> Download:
        """Return ``download`` once it has ended; waits on the event loop, holding no thread."""
        await asyncio.wrap_future(download.ended)
        return download

    # -- for the model manager -----------------------------------------------------
    async def ensure_available(self, spec: str) -> Path:
        """Return the model file ``spec`` (``owner/repo[:VARIANT]``) names, downloading it when allowed.

        Cached and complete: its path, nothing fetched. Otherwise, with ``auto_download``, the download
        (joining one already running, listed in ``GET /api/pulls``) and then the path.

        Raises:
            ModelNotFoundError: not cached and ``auto_download`` is off (the message says how to pull it).
            HubError and the rest of ``start``: the download failed or was cancelled.
        """
        cfg = self.config()
        try:
            cached = await asyncio.to_thread(hub.resolve, spec, config=cfg, offline=True)
        except ModelNotFoundError:
            cached = None
        if cached is not None and not hub.preflight(cached, cfg, disk_free=self.disk_free).to_fetch:
            return (
                hub.repo_folder(cfg.cache_dir, cached.repo) / "snapshots" / cached.commit / cached.model.files[0].path
            )
        if not self.auto_download:
            raise ModelNotFoundError(
                f"{spec} is not in the Hugging Face cache ({cfg.cache_dir}); download it first with POST /api/pull "
                f'{{"model": "{spec}"}} or `ggstudio pull {spec}`, or set auto_download = true in the config',
                param="model",
                code="not_downloaded",
            )
        download, _ = await asyncio.to_thread(self.start, spec)
        await self.wait(download)
        if download.result is None:
            raise _raised(download)
        return download.result.path

    def suggest_variant(self, spec: str, fits: Callable[[int, str], bool]) -> str | None:
        """Return ``owner/repo:LABEL`` of the largest variant of ``spec``'s repo that ``fits(bytes, label)``
        accepts (bytes: its files and the projector), or None. Blocking: lists the repo (or the cache offline)."""
        resolved = hub.resolve(spec, config=self.config())
        best = hub.largest_variant(resolved, fits)
        return f"{resolved.repo}:{best.label}" if best is not None else None


def is_repo_spec(name: str) -> bool:
    """Return whether ``name`` reads as ``owner/repo[:VARIANT]`` and is no file here."""
    try:
        hub.parse_spec(name)
    except StudioError:
        return False
    return not Path(name).expanduser().exists()


def _same(a: hub.Resolved, b: hub.Resolved) -> bool:
    return (a.repo, a.commit, a.model.key) == (b.repo, b.commit, b.model.key)


def _error(exc: StudioError) -> dict[str, Any]:
    from studio.error_table import outcome  # here, not on serve's way to its first model's start: it imports httpx

    found = outcome(exc)
    return {
        "message": exc.message,
        "type": found.type,
        "param": found.param,
        "code": found.code,
        "status": found.status,
    }


def _raised(download: Download) -> StudioError:
    """The error a download ended with, as an exception to raise again for the caller waiting on it."""
    error = download.error or {}
    kind = DownloadCancelledError if download.state == DownloadState.CANCELLED else HubError
    exc = kind(error.get("message") or f"download {download.id} did not finish")
    exc.code = error.get("code")
    return exc
