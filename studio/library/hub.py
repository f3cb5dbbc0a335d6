"""Hugging Face models: ``owner/repo[:variant]`` to GGUF files in the shared Hugging Face cache.

``resolve`` lists the repo's files (``HfApi.model_info`` with file sizes) and picks
one *candidate*: a single ``.gguf`` or a complete group of shards
(``name-00001-of-00009.gguf``). The variant (``Q4_K_M``) is matched as a whole
token, case-insensitively, against the file's path inside the repo, folders
included (``BF16/model-00001-of-00002.gguf`` is a BF16 candidate); ``Q4_K_M``
does not match ``Q4_K_M_XL``. Projectors are never candidates (the Hub lists no
headers, so a listed file is one by its name, ``studio.library.projectors``); the
projector of a vision model is picked separately (F16 preferred). Without a
variant the Q4_K_M candidate is taken, else the smallest, and ``reason`` says so.

``pull`` resolves, checks the disk (``preflight``), and downloads what the cache
does not hold yet through ``hf_hub_download`` (pinned to the commit the listing
came from), so the cache keeps huggingface_hub's own layout and every other tool
sees the files. A download goes to a process-unique temporary file that
huggingface_hub renames into ``blobs/`` only when complete and deletes otherwise,
so a failed or cancelled download never leaves a half file taken for whole.

Cancellation: a ``threading.Event`` is checked before each file and on every
progress update within a file. huggingface_hub has no cancel hook; its progress
bar class (``tqdm_class``) is called once per received chunk, and raising
``DownloadCancelledError`` there unwinds its download loop (temporary file
removed, lock released). Chunks are 10 MiB (``DOWNLOAD_CHUNK_SIZE``), so a
cancel lands within 10 MiB of transfer, or when a stalled read times out
(``HF_HUB_DOWNLOAD_TIMEOUT``, 10 s).

Offline: with ``HF_HUB_OFFLINE=1`` (read per call), ``offline=True``, or when the
Hub cannot be reached (connect failure or timeout within ``HubConfig.timeout``),
the repo is resolved from the cache's ``refs/`` and ``snapshots/`` only. Nothing
global is changed for the rest of the process.

The ``HF_*`` variables are huggingface_hub's; they are read here, per call,
because huggingface_hub reads some of them (``HF_ENDPOINT``, ``HF_HUB_OFFLINE``,
``HF_HUB_CACHE``) once at import time: passing ``endpoint``/``cache_dir``
explicitly makes a later change of the environment count.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import structlog

from gguf.files import write_atomically
from gguf.shards import parse_shard, shard_name
from launcher.units import MIB, format_gib, format_mib
from studio.env import env_flag
from studio.errors import (
    BadRequestError,
    DiskSpaceError,
    DownloadCancelledError,
    HubAuthError,
    HubError,
    HubUnreachableError,
    ModelNotFoundError,
)
from studio.library.projectors import named_like_projector, projector_problem

log = structlog.get_logger("studio.library.hub")

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_VARIANT = "Q4_K_M"
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Za-z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|FP16|F16|FP32|F32))"
    r"(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_MMPROJ_PREFERENCE = ("F16", "BF16", "F32")


# ---------------------------------------------------------------- file names (no huggingface_hub needed)


def is_mmproj(path: str) -> bool:
    """Return whether a repo path is a multimodal projector: the Hub lists no headers, so by its name
    (``studio.library.projectors``: ``mmproj`` anywhere in the file name)."""
    return named_like_projector(path)


def group_key(path: str) -> str:
    """Return the path without ``.gguf`` and the ``-0000N-of-0000M`` shard suffix."""
    stem = path[:-5] if path.lower().endswith(".gguf") else path
    shard = parse_shard(stem)
    return shard.stem if shard else stem


def quant_label(path: str) -> str | None:
    """Return the quant label in a file name (``Q4_K_M``, ``BF16``), else the folder's, else None."""
    parts = PurePosixPath(group_key(path)).parts
    for part in reversed(parts):
        found = _QUANT.findall(part)
        if found:
            return found[-1]
    return None


def variant_matches(variant: str, path: str) -> bool:
    """Return whether ``variant`` is a whole token of ``path`` (folders count; case-insensitive).

    A token ends at a separator other than ``_``, so ``Q4_K_M`` does not match ``Q4_K_M_XL``.
    """
    pattern = rf"(?<![A-Za-z0-9]){re.escape(variant)}(?![A-Za-z0-9_])"
    return re.search(pattern, group_key(path), re.IGNORECASE) is not None


@dataclass(frozen=True)
class HubFile:
    """One file of a repo: its path there, its size, and the blob name the cache stores it under."""

    path: str
    size: int
    blob: str | None = None  # LFS sha256 (or git blob id): the name in ``blobs/``


@dataclass(frozen=True)
class Candidate:
    """A loadable model in a repo: one file or every shard of a split one."""

    key: str  # path without .gguf and shard suffix
    label: str  # quant label (``Q4_K_M``) or the file name
    files: tuple[HubFile, ...]  # shards in order; only those present
    missing: tuple[str, ...] = ()  # shard paths the listing lacks

    @property
    def size(self) -> int:
        """Bytes of every file present."""
        return sum(f.size for f in self.files)

    @property
    def complete(self) -> bool:
        return not self.missing


def candidates(files: list[HubFile], *, is_projector: Callable[[str], bool] = is_mmproj) -> list[Candidate]:
    """Return the model candidates among ``files`` (projectors excluded, shards grouped), sorted by size.

    ``is_projector`` tells projectors by path: by name for a Hub listing; the local library reads headers.
    """
    groups: dict[str, list[tuple[int, int, HubFile]]] = {}
    for f in files:
        if not f.path.lower().endswith(".gguf") or is_projector(f.path):
            continue
        shard = parse_shard(f.path[:-5])
        no, count = (shard.number, shard.count) if shard else (1, 1)
        groups.setdefault(group_key(f.path), []).append((no, count, f))
    out = []
    for key, members in groups.items():
        members.sort(key=lambda t: t[0])
        count = max(c for _, c, _ in members)
        have = {no for no, _, _ in members}
        sample = members[0][2].path
        missing: tuple[str, ...] = ()
        if count > 1:
            missing = tuple(shard_name(key, i, count) for i in range(1, count + 1) if i not in have)
        label = quant_label(sample) or PurePosixPath(key).name
        out.append(Candidate(key, label, tuple(f for _, _, f in members), missing))
    return sorted(out, key=lambda c: (c.size, c.key))


def pick_mmproj(
    files: list[HubFile], model_key: str | None = None, *, is_projector: Callable[[str], bool] = is_mmproj
) -> HubFile | None:
    """Return the projector to use: same folder as the model first, then F16, BF16, F32, then any."""
    projectors = [f for f in files if f.path.lower().endswith(".gguf") and is_projector(f.path)]
    if not projectors:
        return None
    folder = str(PurePosixPath(model_key).parent) if model_key else None

    def rank(f: HubFile) -> tuple[int, int, int, str]:
        label = (quant_label(f.path) or "").upper()
        pref = _MMPROJ_PREFERENCE.index(label) if label in _MMPROJ_PREFERENCE else len(_MMPROJ_PREFERENCE)
        return (0 if str(PurePosixPath(f.path).parent) == folder else 1, pref, f.size, f.path)

    return min(projectors, key=rank)


def choose(cands: list[Candidate], variant: str | None, repo: str, listing: list[str]) -> tuple[Candidate, str]:
    """Return the candidate for ``variant`` (or the default) and a sentence saying why.

    Raises:
        ModelNotFoundError: no GGUF in the repo, or none matches the variant, or shards are missing.
        BadRequestError: the variant matches several candidates (they are listed).
    """
    if not cands:
        shown = ", ".join(listing[:20]) + (f", ... ({len(listing)} files)" if len(listing) > 20 else "")
        raise ModelNotFoundError(
            f"{repo} has no GGUF model file; it holds: {shown or 'nothing'}", param="model", code="no_gguf"
        )
    labels = ", ".join(f"{c.label} ({c.key})" for c in cands)
    if variant:
        exact = [c for c in cands if variant.lower() in (c.key.lower(), c.files[0].path.lower())]
        found = exact or [c for c in cands if variant_matches(variant, c.key)]
        if not found:
            raise ModelNotFoundError(
                f"{repo} has no {variant!r} variant; it has: {labels}", param="model", code="variant_not_found"
            )
        if len(found) > 1:
            raise BadRequestError(
                f"{variant!r} matches {len(found)} files in {repo}: "
                + "; ".join(c.files[0].path for c in found)
                + ". Name one of them as the variant.",
                param="model",
                code="ambiguous_variant",
            )
        chosen, reason = found[0], f"variant {variant} as asked"
    else:
        complete = [c for c in cands if c.complete] or cands
        preferred = [c for c in complete if c.label.upper() == DEFAULT_VARIANT]
        if preferred:
            chosen, reason = preferred[0], f"no variant given: {DEFAULT_VARIANT} is the default"
        else:
            chosen = complete[0]
            reason = f"no variant given and no {DEFAULT_VARIANT}: {chosen.label} is the smallest"
    if chosen.missing:
        raise ModelNotFoundError(
            f"{repo}: {chosen.label} is split in shards and {len(chosen.missing)} are missing: "
            + ", ".join(chosen.missing),
            param="model",
            code="missing_shard",
        )
    return chosen, reason


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Return ``(repo, variant)`` from ``owner/repo[:variant]``.

    Raises:
        BadRequestError: not of that shape.
    """
    repo, _, variant = spec.strip().partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise BadRequestError(
            f"{spec!r} is not a Hugging Face model: expected owner/repo[:variant]", param="model", code="bad_repo"
        )
    return repo, variant or None


# ---------------------------------------------------------------- configuration and the cache layout


@dataclass(frozen=True)
class HubConfig:
    """Where the Hub is, where its cache lives, and how to authenticate (the token is never shown)."""

    endpoint: str = DEFAULT_ENDPOINT
    cache_dir: Path = Path("~/.cache/huggingface/hub").expanduser()
    token: str | None = field(default=None, repr=False)
    offline: bool = False
    timeout: float = 5.0  # seconds to wait for the Hub's answer before working from the cache

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HubConfig:
        """Return the config huggingface_hub's variables describe now (``HF_ENDPOINT``, ``HF_HUB_CACHE``...)."""
        env = os.environ if env is None else env
        home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface").expanduser()
        cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
        return cls(
            endpoint=(env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
            cache_dir=Path(cache).expanduser() if cache else home / "hub",
            token=env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None,
            offline=env_flag(env, "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") or False,
        )


def repo_folder(cache_dir: Path, repo: str) -> Path:
    """Return ``cache_dir/models--owner--name``, huggingface_hub's folder for a model repo."""
    return cache_dir / ("models--" + repo.replace("/", "--"))


def cached_snapshot(cache_dir: Path, repo: str, revision: str = "main") -> tuple[str, Path] | None:
    """Return ``(commit, snapshot dir)`` the cache holds for ``revision``, or None."""
    folder = repo_folder(cache_dir, repo)
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        commit = revision
    else:
        ref = folder / "refs" / revision
        try:
            commit = ref.read_text().strip()
        except OSError:
            snaps = (
                sorted((p for p in (folder / "snapshots").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
                if (folder / "snapshots").is_dir()
                else []
            )
            if revision != "main" or not snaps:
                return None
            return snaps[-1].name, snaps[-1]
    snap = folder / "snapshots" / commit
    return (commit, snap) if snap.is_dir() else None


def snapshot_files(snapshot: Path) -> list[HubFile]:
    """Return the complete files of a snapshot (links to existing blobs), as repo paths."""
    out = []
    for dirpath, _dirs, names in os.walk(snapshot):
        for name in names:
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size  # follows the link: a missing blob raises
            except OSError:
                continue
            blob = Path(os.readlink(path)).name if path.is_symlink() else None
            out.append(HubFile(path.relative_to(snapshot).as_posix(), size, blob))
    return sorted(out, key=lambda f: f.path)


# ---------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Resolved:
    """What ``resolve`` picked: the repo's commit, the model's files and the projector."""

    repo: str
    revision: str
    commit: str
    model: Candidate
    mmproj: HubFile | None
    reason: str  # why this variant
    candidates: tuple[Candidate, ...]
    offline_reason: str | None = None  # set when resolved from the cache only

    @property
    def files(self) -> tuple[HubFile, ...]:
        """Every file to have locally: the model's shards, then the projector."""
        return self.model.files + ((self.mmproj,) if self.mmproj else ())


def resolve(
    spec: str,
    *,
    variant: str | None = None,
    revision: str = "main",
    config: HubConfig | None = None,
    offline: bool | None = None,
) -> Resolved:
    """Return the files ``owner/repo[:variant]`` stands for, from the Hub or, offline, from the cache.

    Raises:
        ModelNotFoundError: unknown repo, no GGUF, no such variant, missing shards, not cached when offline.
        BadRequestError: a malformed spec or an ambiguous variant.
        HubAuthError: the repo needs a token (set HF_TOKEN).
        HubError: any other answer of the Hub.
    """
    cfg = config or HubConfig.from_env()
    repo, spec_variant = parse_spec(spec)
    variant = variant or spec_variant
    go_offline = cfg.offline if offline is None else offline
    reason = "offline mode (HF_HUB_OFFLINE or offline=True)" if go_offline else None
    if not go_offline:
        try:
            commit, files = _list_remote(repo, revision, cfg)
        except _Unreachable as exc:
            reason = f"the Hub at {cfg.endpoint} is unreachable ({exc})"
            log.info("hub.offline", repo=repo, reason=reason)
        else:
            return _pick(repo, revision, commit, files, variant, None)
    found = cached_snapshot(cfg.cache_dir, repo, revision)
    if found is None:
        raise ModelNotFoundError(
            f"{repo} is not in the local cache ({cfg.cache_dir}) and cannot be downloaded: {reason}",
            param="model",
            code="not_cached",
        )
    commit, snap = found
    return _pick(repo, revision, commit, snapshot_files(snap), variant, reason)


def _pick(
    repo: str, revision: str, commit: str, files: list[HubFile], variant: str | None, offline_reason: str | None
) -> Resolved:
    cands = candidates(files)
    try:
        model, why = choose(cands, variant, repo, [f.path for f in files])
    except ModelNotFoundError as exc:
        if offline_reason is None:
            raise
        raise ModelNotFoundError(
            f"{exc.message} (looked in the local cache only: {offline_reason})", param=exc.param, code=exc.code
        ) from exc
    return Resolved(repo, revision, commit, model, pick_mmproj(files, model.key), why, tuple(cands), offline_reason)


class _Unreachable(Exception):
    """The Hub could not be reached (connection refused, DNS, timeout, offline mode)."""


def _network_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for name in ("httpx2", "httpx"):  # huggingface_hub 2.x talks httpx2; 1.x httpx
        try:
            module = __import__(name)
        except ImportError:
            continue
        errors += [module.ConnectError, module.TimeoutException]
    return tuple(errors)


def _list_remote(repo: str, revision: str, cfg: HubConfig) -> tuple[str, list[HubFile]]:
    from huggingface_hub import HfApi

    with _hub_errors(repo, cfg):
        try:
            info = HfApi(endpoint=cfg.endpoint).model_info(
                repo, revision=revision, files_metadata=True, timeout=cfg.timeout, token=cfg.token
            )
        except _network_errors() as exc:
            raise _Unreachable(type(exc).__name__) from exc
    files = [
        HubFile(s.rfilename, s.size or (s.lfs.size if s.lfs else 0), s.lfs.sha256 if s.lfs else s.blob_id)
        for s in info.siblings or []
    ]
    return info.sha or revision, files


def list_files(repo: str, revision: str = "main", config: HubConfig | None = None) -> tuple[str, list[HubFile]]:
    """Return the commit ``revision`` names and the repo's files with their sizes, from the Hub itself.

    Raises:
        HubUnreachableError: the Hub did not answer within ``config.timeout`` (nothing is taken from the cache).
        plus the errors of ``resolve``.
    """
    cfg = config or HubConfig.from_env()
    try:
        return _list_remote(repo, revision, cfg)
    except _Unreachable as exc:
        raise HubUnreachableError(
            f"the Hub at {cfg.endpoint} cannot be reached ({exc}); check the network or HF_ENDPOINT"
        ) from exc


@contextmanager
def _hub_errors(repo: str, cfg: HubConfig, file: str | None = None) -> Iterator[None]:
    """Translate huggingface_hub's and the OS's errors into the studio's, at this one boundary."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token_hint = (
        "set HF_TOKEN to a token that has access"
        if cfg.token is None
        else "the token in HF_TOKEN has no access to it: accept the repo's terms on the Hub or use another token"
    )
    try:
        yield
    except (_Unreachable, DownloadCancelledError):
        raise
    except GatedRepoError as exc:
        raise HubAuthError(f"{repo} is gated: {token_hint}", param="model", code="gated_repo") from exc
    except RepositoryNotFoundError as exc:
        status = exc.response.status_code if exc.response is not None else 404
        hint = f" (if it is private, {token_hint})" if status in (401, 403) else ""
        raise ModelNotFoundError(
            f"{repo} not found on {cfg.endpoint}{hint}", param="model", code="repo_not_found"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(
            f"{repo} has no such revision (branch, tag or commit)", param="model", code="revision_not_found"
        ) from exc
    except RemoteEntryNotFoundError as exc:
        raise ModelNotFoundError(f"{repo} has no file {file}", param="model", code="file_not_found") from exc
    except LocalEntryNotFoundError as exc:
        raise HubError(
            f"cannot download {file or repo}: the Hub at {cfg.endpoint} is unreachable and the file is not in the cache"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubAuthError(
                f"{repo}: the Hub refused access ({status}): {token_hint}", param="model", code="unauthorized"
            ) from exc
        raise HubError(f"{repo}: the Hub answered {status} for {file or 'the file list'}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskSpaceError(
                f"the disk holding {cfg.cache_dir} is full while downloading {file}; the partial "
                "file was removed (free some space and pull again)"
            ) from exc
        raise


# ---------------------------------------------------------------- preflight


def free_bytes(path: Path) -> int:
    """Return the free bytes on the file system holding ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage(Path.cwd()).free


@dataclass(frozen=True)
class Preflight:
    """What a pull still has to download, and whether it fits."""

    to_fetch: tuple[HubFile, ...]  # files whose blob the cache does not hold complete
    needed: int  # bytes of those
    cached: int  # bytes already complete in the cache
    free: int  # free bytes on the cache's disk

    @property
    def fits(self) -> bool:
        return self.needed <= self.free


def _blob_complete(cfg: HubConfig, repo: str, commit: str, f: HubFile) -> bool:
    folder = repo_folder(cfg.cache_dir, repo)
    for path in ([folder / "blobs" / f.blob] if f.blob else []) + [folder / "snapshots" / commit / f.path]:
        try:
            if path.stat().st_size == f.size:
                return True
        except OSError:
            pass
    return False


def preflight(
    resolved: Resolved,
    config: HubConfig | None = None,
    *,
    disk_free: Callable[[Path], int] = free_bytes,
    files: tuple[HubFile, ...] | None = None,
) -> Preflight:
    """Return the bytes still to download for ``resolved`` (complete blobs subtracted) against free disk."""
    cfg = config or HubConfig.from_env()
    wanted = resolved.files if files is None else files
    fetch = tuple(f for f in wanted if not _blob_complete(cfg, resolved.repo, resolved.commit, f))
    needed = sum(f.size for f in fetch)
    return Preflight(fetch, needed, sum(f.size for f in wanted) - needed, disk_free(cfg.cache_dir))


def largest_that_fits(
    resolved: Resolved, config: HubConfig | None = None, *, disk_free: Callable[[Path], int] = free_bytes
) -> Candidate | None:
    """Return the largest complete variant whose missing bytes (projector included) fit on the disk."""
    extra = (resolved.mmproj,) if resolved.mmproj else ()
    by_label = {c.label: c for c in resolved.candidates}
    return largest_variant(
        resolved,
        lambda _size, label: preflight(resolved, config, disk_free=disk_free, files=by_label[label].files + extra).fits,
    )


# ---------------------------------------------------------------- download


@dataclass(frozen=True)
class DownloadProgress:
    """Where a pull is: the file in flight and the bytes, rate and ETA over the whole pull."""

    file: str
    file_index: int  # 1-based, among the files that need downloading
    file_count: int
    done: int  # bytes received in this pull
    total: int  # bytes this pull downloads
    rate: float  # bytes per second since the pull started
    eta_s: float | None  # seconds left at that rate (None before any byte)


ProgressCallback = Callable[[DownloadProgress], None]


class _Tracker:
    """Sums bytes over the files of one pull, reports progress and stops on cancel."""

    def __init__(
        self, total: int, count: int, on_progress: ProgressCallback | None, cancel: threading.Event | None
    ) -> None:
        self.total, self.count, self.done = total, count, 0
        self.file, self.index = "", 0
        self.on_progress, self.cancel = on_progress, cancel
        self.started = time.monotonic()

    def begin(self, file: str, index: int) -> None:
        self.check()
        self.file, self.index = file, index
        self.report()

    def add(self, n: int) -> None:
        self.done += n
        self.check()  # before reporting: a cancel set by the report of a file's last chunk stops the next file
        self.report()

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelledError(
                f"download cancelled during {self.file or 'the first file'} after {self.done} of {self.total} bytes"
            )

    def report(self) -> None:
        if self.on_progress is None:
            return
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else None
        self.on_progress(DownloadProgress(self.file, self.index, self.count, self.done, self.total, rate, eta))


class _Meter:
    """Stands in for the tqdm bar huggingface_hub updates once per received chunk."""

    def __init__(self, tracker: _Tracker, *_args: Any, **_kwargs: Any) -> None:
        self._tracker = tracker

    def update(self, n: float | None = 1) -> None:
        self._tracker.add(int(n or 0))

    def close(self) -> None:
        pass

    def __enter__(self) -> _Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@dataclass(frozen=True)
class Pulled:
    """A model ready in the cache: its shard paths (snapshot links), the projector, and what was fetched."""

    resolved: Resolved
    paths: tuple[Path, ...]
    mmproj: Path | None
    downloaded: int  # bytes fetched by this pull (0: everything was cached)
    notes: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        """The file to hand to llama-server (the first shard)."""
        return self.paths[0]


def pull(
    spec: str,
    *,
    variant: str | None = None,
    revision: str = "main",
    config: HubConfig | None = None,
    offline: bool | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    disk_free: Callable[[Path], int] = free_bytes,
    fallback: bool = False,
    check_mmproj: bool = True,
) -> Pulled:
    """Return the model ``spec`` names with every file in the cache, downloading what is missing.

    ``resolve``, then ``fetch``.

    Args:
        fallback: when the variant does not fit on the disk, take the largest that does instead of failing.
        disk_free: the free-bytes source for the preflight (injectable for tests).

    Raises:
        DiskSpaceError: the files do not fit; carries ``needed``, ``free`` and the ``fallback`` label.
        DownloadCancelledError: ``cancel`` was set; complete files stay cached, the partial one is gone.
        plus the errors of ``resolve``.
    """
    cfg = config or HubConfig.from_env()
    resolved = resolve(spec, variant=variant, revision=revision, config=cfg, offline=offline)
    return fetch(
        resolved,
        config=cfg,
        progress=progress,
        cancel=cancel,
        disk_free=disk_free,
        fallback=fallback,
        check_mmproj=check_mmproj,
    )


#: Held around each file's download: lets a caller make sure one file is fetched by one thread at a time.
FileLock = Callable[[str, HubFile], AbstractContextManager[object]]


def fetch(
    resolved: Resolved,
    *,
    config: HubConfig | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    disk_free: Callable[[Path], int] = free_bytes,
    fallback: bool = False,
    check_mmproj: bool = True,
    file_lock: FileLock | None = None,
) -> Pulled:
    """Return ``resolved`` with every file in the cache: the disk preflight, then the downloads still needed.

    ``file_lock(repo, file)`` (optional) is held while that file is fetched. See ``pull`` for the rest.
    """
    cfg = config or HubConfig.from_env()
    revision = resolved.revision
    check = preflight(resolved, cfg, disk_free=disk_free)
    if check.needed and resolved.offline_reason:
        raise HubError(
            f"{resolved.repo}:{resolved.model.label} is not complete in the cache and cannot be "
            f"downloaded: {resolved.offline_reason}; missing: " + ", ".join(f.path for f in check.to_fetch)
        )
    if not check.fits:
        better = largest_that_fits(resolved, cfg, disk_free=disk_free)
        if fallback and better is not None and better is not resolved.model:
            resolved = with_variant(
                resolved,
                better,
                f"{better.label}: the largest variant that fits the free disk ({_disk_size(check.free)})",
            )
            check = preflight(resolved, cfg, disk_free=disk_free)
        else:
            offer = (
                (
                    f"; the largest variant that fits is {better.label} ({_disk_size(better.size)}): "
                    f"pull {resolved.repo}:{better.label}"
                )
                if better
                else "; no variant of this repo fits"
            )
            raise DiskSpaceError(
                f"{resolved.repo}:{resolved.model.label} needs {_disk_size(check.needed)} more in {cfg.cache_dir} "
                f"but only {_disk_size(check.free)} {'is' if check.free >= MIB else 'are'} free{offer}",
                needed=check.needed,
                free=check.free,
                fallback=better.label if better else None,
            )
    downloaded = _download(resolved, check, cfg, progress, cancel, file_lock)
    folder = repo_folder(cfg.cache_dir, resolved.repo)
    _write_ref(folder, revision, resolved.commit)
    snap = folder / "snapshots" / resolved.commit
    paths = tuple(snap / f.path for f in resolved.model.files)
    mmproj = snap / resolved.mmproj.path if resolved.mmproj else None
    notes: list[str] = []
    if mmproj is not None and check_mmproj:
        problem = mmproj_mismatch(paths[0], mmproj)
        if problem:
            notes.append(f"{resolved.mmproj.path} not used: {problem}")  # type: ignore[union-attr]
            mmproj = None
    return Pulled(resolved, paths, mmproj, downloaded, tuple(notes))


def with_variant(resolved: Resolved, candidate: Candidate, reason: str) -> Resolved:
    """``resolved`` with another of its candidates chosen (its projector picked again for it)."""
    files = [f for c in resolved.candidates for f in c.files] + ([resolved.mmproj] if resolved.mmproj else [])
    picked = _pick(resolved.repo, resolved.revision, resolved.commit, files, candidate.key, resolved.offline_reason)
    return dataclasses.replace(picked, reason=reason)


def largest_variant(resolved: Resolved, fits: Callable[[int, str], bool]) -> Candidate | None:
    """Return the largest complete variant of the repo for which ``fits(bytes, label)`` holds, or None.

    ``bytes`` counts the variant's files and the projector a load would take with it: what a memory
    plan weighs before any header can be read (the files may not be downloaded yet).
    """
    extra = resolved.mmproj.size if resolved.mmproj else 0
    fitting = [c for c in resolved.candidates if c.complete and fits(c.size + extra, c.label)]
    return max(fitting, key=lambda c: (c.size, c.key), default=None)


def _download(
    resolved: Resolved,
    check: Preflight,
    cfg: HubConfig,
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
    file_lock: FileLock | None = None,
) -> int:
    from huggingface_hub import hf_hub_download

    tracker = _Tracker(check.needed, len(check.to_fetch), progress, cancel)
    fetch = set(check.to_fetch)
    index = 0
    for f in resolved.files:
        pointer = repo_folder(cfg.cache_dir, resolved.repo) / "snapshots" / resolved.commit / f.path
        if f not in fetch and pointer.exists():
            continue
        if f in fetch:
            index += 1
            tracker.begin(f.path, index)
            log.debug("hub.download", repo=resolved.repo, file=f.path, bytes=f.size)
        else:
            tracker.check()  # blob present: huggingface_hub only links it into this snapshot
        with file_lock(resolved.repo, f) if file_lock else nullcontext(), _hub_errors(resolved.repo, cfg, f.path):
            hf_hub_download(
                resolved.repo,
                f.path,
                revision=resolved.commit,
                cache_dir=cfg.cache_dir,
                endpoint=cfg.endpoint,
                token=cfg.token,
                etag_timeout=cfg.timeout,
                tqdm_class=functools.partial(_Meter, tracker),
            )  # type: ignore[call-overload]
    return tracker.done


def _write_ref(folder: Path, revision: str, commit: str) -> None:
    """Record ``refs/<revision>`` as huggingface_hub does (atomically), so offline resolution finds it."""
    if revision == commit:
        return
    ref = folder / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(ref, commit)
    except OSError as exc:  # a read-only cache still serves the files
        log.warning("hub.ref_not_written", ref=str(ref), error=str(exc))


def mmproj_mismatch(model_path: Path, mmproj_path: Path) -> str | None:
    """Return why the projector does not fit the model (its output width vs the model's embedding), or None."""
    return projector_problem(model_path, mmproj_path)


def _disk_size(n: int) -> str:
    """A download's or a disk's size: GiB from 128 MiB on, MiB from 1 MiB, else bytes."""
    if n >= 128 * MIB:
        return format_gib(n, decimals=2)
    return format_mib(n, decimals=1) if n >= MIB else f"{n:,} bytes"
