"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub 2.x calls to list and download.

It imitates what the real Hub answers to the requests ``studio.library.hub`` makes through
the real huggingface_hub client (``HF_ENDPOINT=http://127.0.0.1:PORT``):

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` (``HfApi.model_info``):
  the repo's ``sha`` and ``siblings``; with ``?blobs=true`` each sibling also has
  ``size``, ``blobId`` and ``lfs`` (``size``, ``sha256``, ``pointerSize``), as on the Hub.
- ``POST /api/models/{repo}/paths-info/{rev}`` (``HfApi.get_paths_info``): per-path size and LFS oid.
- ``GET /api/models?search=&filter=gguf&sort=downloads&limit=`` (``HfApi.list_models``): the repos whose
  id contains the search words (case-insensitive) and that hold a ``.gguf``, most downloaded first,
  up to ``limit``, in one page (the Hub pages with a ``Link`` header, which huggingface_hub follows).
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (``hf_hub_download``): ``ETag`` (the LFS sha256
  for ``.gguf`` files, the git blob id otherwise), ``X-Repo-Commit``, ``Content-Length``,
  ``Accept-Ranges`` and ``Range`` requests answered with 206 + ``Content-Range``.
  The real Hub redirects LFS files to a CDN host; huggingface_hub then takes the
  metadata from ``X-Linked-Etag``/``X-Linked-Size``. Serving the bytes directly, as
  the Hub does for small files and mirrors do for all, exercises the same cache code.
- Errors as the Hub signals them, with ``X-Error-Code``/``X-Error-Message``: an unknown
  repo is 404 ``RepoNotFound``; an unknown file 404 ``EntryNotFound`` (with
  ``X-Repo-Commit``); a gated repo lists its files but answers ``resolve`` with 401
  ``GatedRepo`` without a token and 403 with a token that was not granted access.

Faults on demand: ``cut[path] = n`` ends every body of that file at byte ``n`` of the file and closes the
connection (a transfer cut short), ``search_delay`` holds a search's answer back, and ``ignore_ranges``
answers a ``Range`` with the whole file (200), as some mirrors do.

Requests are recorded (method, path, range, whether an Authorization header came)
so tests can assert what was downloaded; token values are never recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class FakeRepo:
    """One model repo: its files (path -> bytes), one commit, and access rules."""

    repo_id: str
    files: dict[str, bytes] = field(default_factory=dict)
    commit: str = ""
    gated: bool = False
    granted_token: str | None = None  # the one token that may download a gated repo
    downloads: int = 0  # what the search sorts by
    _etags: dict[str, tuple[bytes, str]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit = hashlib.sha1(self.repo_id.encode()).hexdigest()

    def add(self, path: str, data: bytes | Path) -> None:
        """Add a file: bytes, or a local file whose bytes are read now."""
        self.files[path] = data if isinstance(data, bytes) else Path(data).read_bytes()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(".gguf")

    def etag(self, path: str) -> str:
        """The blob name huggingface_hub stores the file under (LFS sha256 or git blob id), hashed once per content."""
        data = self.files[path]
        known = self._etags.get(path)
        if known is None or known[0] is not data:  # the very bytes hashed before: a large file hashes once
            if self.is_lfs(path):
                known = (data, hashlib.sha256(data).hexdigest())
            else:
                known = (data, hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
            self._etags[path] = known
        return known[1]

    def sibling(self, path: str, blobs: bool) -> dict:
        if not blobs:
            return {"rfilename": path}
        data = self.files[path]
        entry: dict = {
            "rfilename": path,
            "size": len(data),
            "blobId": hashlib.sha1(path.encode() + data[:64]).hexdigest(),
        }
        if self.is_lfs(path):
            entry["lfs"] = {"size": len(data), "sha256": self.etag(path), "pointerSize": 134}
        return entry


@dataclass(frozen=True)
class Request:
    """One request as the server saw it (never the token itself)."""

    method: str
    path: str
    range: str | None
    authorized: bool


class HubServer:
    """The stand-in Hub in a background thread; ``url`` is what ``HF_ENDPOINT`` should be."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.chunk_delay = 0.0  # seconds between 1 MiB chunks of a body (slow downloads)
        self.cut: dict[str, int] = {}  # repo path -> the byte of the file where every body ends early
        self.ignore_ranges = False
        self.search_delay = 0.0  # seconds a search waits before it answers (a Hub that hangs on it)
        self.request_delay = 0.0  # seconds before every answer: a round trip to a distant Hub
        self._lock = threading.Lock()
        self._sent: dict[str, int] = {}
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def repo(self, repo_id: str, **kwargs) -> FakeRepo:
        """Create (or replace) a repo and return it."""
        self.repos[repo_id] = FakeRepo(repo_id, **kwargs)
        return self.repos[repo_id]

    def record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def downloads(self) -> list[str]:
        """Paths of every GET on a resolve URL (a body was sent)."""
        with self._lock:
            return [r.path for r in self.requests if r.method == "GET" and "/resolve/" in r.path]

    def bytes_sent(self, path: str) -> int:
        """Bytes of body sent for the file at ``path`` in its repo (every request for it together)."""
        with self._lock:
            return self._sent.get(path, 0)

    def count_sent(self, path: str, n: int) -> None:
        with self._lock:
            self._sent[path] = self._sent.get(path, 0) + n

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_PATHS_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/paths-info/(?P<rev>[^/]+)$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 1 << 20


def _make_handler(server: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # keep pytest output clean
            pass

        def _record(self) -> str:
            if server.request_delay:
                time.sleep(server.request_delay)
            path = unquote(urlsplit(self.path).path)
            server.record(
                Request(self.command, path, self.headers.get("Range"), self.headers.get("Authorization") is not None)
            )
            return path

        def _token(self) -> str | None:
            auth = self.headers.get("Authorization") or ""
            return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, payload: object) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo(self, repo_id: str) -> FakeRepo | None:
            repo = server.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
            return repo

        def _revision_ok(self, repo: FakeRepo, rev: str) -> bool:
            if unquote(rev) in ("main", repo.commit):
                return True
            self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            return False

        def do_GET(self) -> None:
            path = self._record()
            if path == "/api/models":
                self._search(parse_qs(urlsplit(self.path).query))
            elif m := _API.match(path):
                repo = self._repo(m["repo"])
                if repo is None or (m["rev"] and not self._revision_ok(repo, m["rev"])):
                    return
                blobs = parse_qs(urlsplit(self.path).query).get("blobs", ["false"])[0].lower() == "true"
                self._json(
                    {
                        "_id": repo.commit[:24],
                        "id": repo.repo_id,
                        "modelId": repo.repo_id,
                        "author": repo.repo_id.split("/")[0],
                        "sha": repo.commit,
                        "private": False,
                        "disabled": False,
                        "gated": "manual" if repo.gated else False,
                        "tags": ["gguf"],
                        "lastModified": "2025-01-01T00:00:00.000Z",
                        "siblings": [repo.sibling(p, blobs) for p in sorted(repo.files)],
                    }
                )
            elif m := _RESOLVE.match(path):
                self._resolve(m, body=True)
            else:
                self._error(404, "NotFound", f"no route for {path}")

        def _search(self, query: dict[str, list[str]]) -> None:
            time.sleep(server.search_delay)
            words = (query.get("search") or [""])[0].lower()
            limit = int((query.get("limit") or ["1000"])[0])
            found = [
                r
                for r in server.repos.values()
                if words in r.repo_id.lower() and any(p.endswith(".gguf") for p in r.files)
            ]
            found.sort(key=lambda r: (-r.downloads, r.repo_id))
            self._json(
                [
                    {
                        "_id": r.commit[:24],
                        "id": r.repo_id,
                        "modelId": r.repo_id,
                        "likes": 0,
                        "downloads": r.downloads,
                        "private": False,
                        "tags": ["gguf"],
                        "library_name": "gguf",
                        "createdAt": "2025-01-01T00:00:00.000Z",
                    }
                    for r in found[:limit]
                ]
            )

        def do_HEAD(self) -> None:
            path = self._record()
            if m := _RESOLVE.match(path):
                self._resolve(m, body=False)
            else:
                self._error(404, "NotFound", f"no route for {path}")

        def do_POST(self) -> None:
            path = self._record()
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode()) if length else {}
            if m := _PATHS_INFO.match(path):
                repo = self._repo(m["repo"])
                if repo is None or not self._revision_ok(repo, m["rev"]):
                    return
                out = []
                for p in form.get("paths", []):
                    if p in repo.files:
                        entry = {"type": "file", "path": p, "size": len(repo.files[p]), "oid": repo.etag(p)}
                        if repo.is_lfs(p):
                            entry["lfs"] = {"oid": repo.etag(p), "size": len(repo.files[p]), "pointerSize": 134}
                        out.append(entry)
                self._json(out)
            else:
                self._error(404, "NotFound", f"no route for {path}")

        def _resolve(self, m: re.Match, *, body: bool) -> None:
            repo = self._repo(m["repo"])
            if repo is None or not self._revision_ok(repo, m["rev"]):
                return
            if repo.gated:
                token = self._token()
                if token is None:
                    self._error(
                        401,
                        "GatedRepo",
                        f"Access to model {repo.repo_id} is restricted. You must have "
                        "access to it and be authenticated to access it. Please log in.",
                    )
                    return
                if token != repo.granted_token:
                    self._error(
                        403,
                        "GatedRepo",
                        f"Access to model {repo.repo_id} is restricted and you are not in the authorized list.",
                    )
                    return
            name = m["path"]
            if name not in repo.files:
                self._error(404, "EntryNotFound", f'{name} does not exist on "main"', commit=repo.commit)
                return
            data = repo.files[name]
            start, end, status = 0, len(data) - 1, 200
            if (rng := self.headers.get("Range")) and not server.ignore_ranges:
                r = _RANGE.match(rng.strip())
                if r is None or int(r[1]) >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end, status = int(r[1]), min(int(r[2] or len(data) - 1), len(data) - 1), 206
            self.send_response(status)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start + 1))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if not body:
                return
            last = min(end + 1, server.cut.get(name, end + 1))
            try:
                for pos in range(start, last, _CHUNK):
                    part = data[pos : min(pos + _CHUNK, last)]
                    self.wfile.write(part)
                    server.count_sent(name, len(part))
                    if server.chunk_delay:
                        time.sleep(server.chunk_delay)
            except (BrokenPipeError, ConnectionResetError):  # the client cancelled
                self.close_connection = True
            if last < end + 1:  # cut short: the body ends before its Content-Length
                self.close_connection = True

    return Handler
