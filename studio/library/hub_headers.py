"""GGUF headers of Hub files, read with HTTP range requests and kept in the studio home; no weights are fetched.

``fetch_header`` reads the first 64 KiB of a file's resolve URL, parses what it has
(``gguf.read_header_prefix``), and, while the header goes on, asks for the bytes up to the
lower bound of its end the parser gives, plus 64 KiB: the bytes read never exceed the
header (the metadata and the tensor infos) by more than 64 KiB. A header whose lower bound
is past ``limit`` is refused before its bytes are asked for, as the reader refuses a local
file's impossible counts and lengths.

The header is kept as a *sparse* file of the remote file's size whose first bytes are the
header (the rest reads as zeros and takes no disk), under
``<home>/cache/hub-headers/models--owner--repo/snapshots/<commit>/<path in the repo>``:
``gguf.read`` and the library read it as they read the downloaded file, the shards of a split
model and the projector beside it, so the planner runs on the very header it will see after the
download. A commit never changes, so a kept header is never read again.

A server that ignores ``Range`` is read only as far as asked and then cut off; a body that ends
early, or an answer of another size than the listing's, is a clear ``HubError``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import structlog

import gguf
from gguf.files import replacing
from launcher.units import MIB, format_mib
from studio.errors import HubAuthError, HubError, HubUnreachableError, ModelNotFoundError
from studio.library.hub import HubConfig, HubFile, repo_folder

log = structlog.get_logger(__name__)

#: What a read may go past the header's end: the first read, and the margin after each lower bound.
MARGIN = 64 * 1024
#: The largest header read: an embedded tokenizer.json (33 MB for Gemma 3) with its vocabulary fits many times.
HEADER_LIMIT = 256 * MIB

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


@dataclass(frozen=True)
class HeaderRead:
    """A Hub file's header, kept locally: where, how large, and what reading it cost."""

    path: Path  # the kept (sparse) file: the header, then zeros up to the remote file's size
    header_bytes: int  # where the tensor data begins (metadata and tensor infos, padded)
    bytes_read: int  # bytes fetched from the Hub for it now (0: it was kept already)
    requests: int  # ranged requests made now

    @property
    def cached(self) -> bool:
        return self.bytes_read == 0


def header_cache(home: Path) -> Path:
    """Return the folder that keeps Hub headers under the studio home."""
    return home / "cache" / "hub-headers"


def kept_path(root: Path, repo: str, commit: str, file: str) -> Path:
    """Return where the header of ``repo``'s ``file`` at ``commit`` is kept (a snapshot-like layout)."""
    return repo_folder(root, repo) / "snapshots" / commit / file


def fetch_header(
    repo: str,
    commit: str,
    file: HubFile,
    *,
    root: Path,
    config: HubConfig | None = None,
    limit: int = HEADER_LIMIT,
    shard: int = 0,
) -> HeaderRead:
    """Return the header of ``repo``'s ``file`` at ``commit``, kept under ``root``; read from the Hub if not kept.

    Raises:
        HubUnreachableError: the Hub did not answer within ``config.timeout``.
        HubAuthError: the repo needs a token with access.
        ModelNotFoundError: the file is not in the repo.
        HubError: the Hub cut the header short, ignored the size, or the header is over ``limit``.
        gguf.GGUFError: the bytes are not a GGUF header.
    """
    cfg = config or HubConfig.from_env()
    dest = kept_path(root, repo, commit, file.path)
    with _lock(dest):
        kept = _kept(dest, file.size)
        if kept is not None:
            return HeaderRead(dest, kept, 0, 0)
        data, header, requests = _read_remote(repo, commit, file, cfg, dest, limit, shard)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with replacing(dest) as tmp:
            with tmp.open("wb") as fh:
                fh.write(data[: header.data_offset])
                fh.truncate(file.size)  # sparse: the size the reader checks the tensor table against
        log.debug("hub.header", repo=repo, file=file.path, header=header.data_offset, read=len(data))
        return HeaderRead(dest, header.data_offset, len(data), requests)


def _lock(path: Path) -> threading.Lock:
    """One reader per kept header at a time: a second caller waits and finds it kept."""
    with _locks_guard:
        return _locks.setdefault(path, threading.Lock())


def _kept(path: Path, size: int) -> int | None:
    """The header size of a kept, readable header of a ``size``-byte file, else None (and a bad one is removed)."""
    try:
        if path.stat().st_size != size:
            return None
        return gguf.read_header(path).data_offset
    except FileNotFoundError:
        return None
    except (OSError, gguf.GGUFError) as exc:
        log.warning("hub.header_dropped", path=str(path), error=str(exc))
        path.unlink(missing_ok=True)
        return None


def _read_remote(
    repo: str, commit: str, file: HubFile, cfg: HubConfig, dest: Path, limit: int, shard: int
) -> tuple[bytes, gguf.Header, int]:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, file.path, revision=commit, endpoint=cfg.endpoint)
    headers = build_hf_headers(token=cfg.token)
    data = bytearray()
    want = min(MARGIN, file.size)
    requests = 0
    try:
        with httpx.Client(timeout=cfg.timeout, follow_redirects=True, headers=headers) as client:
            while True:
                if want > len(data):  # a file shorter than 24 bytes is read whole, once
                    data += _ranged(client, url, len(data), want, file, repo)
                    requests += 1
                try:
                    return bytes(data), gguf.read_header_prefix(bytes(data), file.size, dest, shard), requests
                except gguf.NeedMoreBytes as more:
                    if more.needed > limit:
                        raise HubError(
                            f"{repo}/{file.path}: its header claims more than {format_mib(limit)} (at least "
                            f"{format_mib(more.needed, decimals=1)}); it is refused unread",
                            code="header_too_large",
                        ) from None
                    want = min(more.needed + MARGIN, file.size)
    except (httpx.ConnectError, httpx.TimeoutException) as exc:
        raise HubUnreachableError(
            f"the Hub at {cfg.endpoint} cannot be reached within {cfg.timeout:g} s ({type(exc).__name__}) while "
            f"reading the header of {repo}/{file.path}; check the network or HF_ENDPOINT"
        ) from exc
    except httpx.HTTPError as exc:  # the connection closed inside the body, or a malformed answer
        raise HubError(
            f"the Hub cut the header of {repo}/{file.path} short after {len(data):,} bytes ({exc}); try again",
            code="header_cut_short",
        ) from exc


def _ranged(client: httpx.Client, url: str, start: int, end: int, file: HubFile, repo: str) -> bytes:
    """Bytes ``start`` to ``end`` (exclusive) of the file: exactly those, whatever the server sends."""
    where = f"{repo}/{file.path}"
    with client.stream("GET", url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
        if r.status_code in (401, 403):
            raise HubAuthError(f"{repo}: the Hub refused access ({r.status_code}): set HF_TOKEN to a token with access")
        if r.status_code == 404:
            raise ModelNotFoundError(f"{repo} has no file {file.path}", param="model", code="file_not_found")
        if r.status_code == 200 and start > 0:
            raise HubError(f"the Hub ignores range requests for {where}; its header cannot be read alone")
        if r.status_code not in (200, 206):
            raise HubError(f"{where}: the Hub answered {r.status_code} to a range request")
        total = _total(r)
        if total is not None and total != file.size:
            raise HubError(
                f"{where} is {total:,} bytes on the Hub but {file.size:,} in its listing; the repo changed: try again"
            )
        out = bytearray()
        for chunk in r.iter_bytes():
            out += chunk
            if len(out) >= end - start:
                break  # a 200 goes on to the end of the file: cut it off
    if len(out) < end - start:
        raise HubError(
            f"the Hub cut the header of {where} short: {len(out):,} of the {end - start:,} bytes asked for came; "
            "try again",
            code="header_cut_short",
        )
    return bytes(out[: end - start])


def _total(r: httpx.Response) -> int | None:
    rng = r.headers.get("Content-Range", "")
    total = rng.rpartition("/")[2]
    return int(total) if total.isdigit() else None
