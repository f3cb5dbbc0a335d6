"""Conversations that survive an eviction: a model's slots saved to files, restored when a prompt continues one.

Before a ready model's llama-server stops (an eviction, an unload, its TTL, the shutdown) and once its
requests are done, each slot's KV is saved with ``POST /slots/{id}?action=save`` into the model's own
folder under the studio home. The folder is named by a key of everything that shapes the KV: the model
file (path, size, mtime), context, slots, cache types, flash attention, the speculative flags and the
llama-server binary (path, size, mtime). So a file is only ever offered to a llama-server that lays out
its KV the same way; another model's, another build's or another context's files are never restored.

When the model runs again, the first chat whose prompt continues a saved slot (the prompt's tokens share
at least half of the slot's, and 16 or more) restores it into an idle slot before the chat runs, so
llama-server processes only the new suffix; only the first chats after a start look (see ``warm``).
A new save of a conversation replaces the older file it extends. All files together stay within
``slot_cache_disk`` bytes, least recently used out first. A file that cannot be read or restored is
removed with a log line; it never fails a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from launcher.errors import SlotFileError
from launcher.planner import LaunchPlan
from launcher.slot_files import read_tokens
from studio.residency.resident import LoadedModel

if TYPE_CHECKING:  # imported where used: not on serve's way to its first model's start (the web stack imports it)
    import httpx

log = structlog.get_logger(__name__)

#: A saved slot is restored for a prompt sharing at least this share of its tokens...
MIN_SHARED = 0.5
#: ...and at least this many.
MIN_TOKENS = 16
#: After this many chats that continue no saved file, a llama-server stops looking.
MAX_MISSES = 3
#: The request fields that shape the rendered prompt (``/apply-template`` takes a chat body).
_TEMPLATE_FIELDS = (
    "messages",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "reasoning_format",
    "add_generation_prompt",
)


class SlotCache:
    """The saved slots of every model, in ``root``; see the module docstring."""

    def __init__(self, root: Path, *, binary: Path, disk_budget: int, timeout: float = 10.0) -> None:
        self.root = root
        self.binary = binary
        self.disk_budget = disk_budget
        self.timeout = timeout  # seconds one save or restore exchange may take
        self._warm: dict[str, _Warmth] = {}  # per llama-server URL (a restart has a new one)

    # -- where ---------------------------------------------------------------------------------------
    def folder(self, launch: LaunchPlan) -> Path:
        """The folder of ``launch``'s slot files (``--slot-save-path``), created private."""
        folder = self.root / _key(launch, self.binary)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return folder

    # -- save, before a stop -----------------------------------------------------------------------------
    async def save(self, loaded: LoadedModel) -> int:
        """Save every slot of ``loaded`` that holds tokens; return how many files were written."""
        import httpx

        folder = self.folder(loaded.plan)
        written = 0
        async with httpx.AsyncClient(base_url=loaded.url, headers=loaded.auth_headers, timeout=self.timeout) as client:
            for slot in range(loaded.plan.n_parallel):
                name = f"{time.time_ns()}-{slot}.bin"
                try:
                    resp = await client.post(f"/slots/{slot}", params={"action": "save"}, json={"filename": name})
                    saved = int(resp.json().get("n_saved", 0)) if resp.status_code == 200 else 0
                except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
                    log.warning("saving a slot failed", model=loaded.name, slot=slot, error=str(exc))
                    continue
                path = folder / name
                if saved <= 0:
                    path.unlink(missing_ok=True)
                    continue
                written += 1
                self._drop_extended(folder, path)
                self.prune()  # after each file: the budget is over by at most the one llama-server writes
        if written:
            log.info("slots saved", model=loaded.name, files=written, folder=str(folder))
        return written

    def _drop_extended(self, folder: Path, newest: Path) -> None:
        """Remove the older files of the conversation ``newest`` continues (their tokens are its prefix)."""
        try:
            tokens = read_tokens(newest)
        except SlotFileError:
            return
        for other in folder.glob("*.bin"):
            if other == newest:
                continue
            old = _tokens_or_none(other)
            if old is not None and len(old) <= len(tokens) and tokens[: len(old)] == old:
                other.unlink(missing_ok=True)

    def prune(self) -> None:
        """Keep every slot file together within the disk budget: the least recently used go first."""
        files = []
        for path in self.root.glob("*/*.bin"):
            with contextlib.suppress(OSError):
                stat = path.stat()
                files.append((stat.st_mtime_ns, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.disk_budget:
                break
            path.unlink(missing_ok=True)
            total -= size
            log.info("slot file dropped for the disk budget", file=str(path))

    # -- restore, before a chat ------------------------------------------------------------------------
    async def warm(self, loaded: LoadedModel, body: Mapping[str, Any]) -> int:
        """Restore the saved slot that ``body``'s prompt continues, once per slot file and llama-server.

        Only the first chats after a start try (until every slot was restored, or ``MAX_MISSES`` chats matched
        no file), and the saved files' tokens are read once per llama-server, so a model with no conversation
        to bring back costs its chats nothing after that. Returns the tokens restored (0: none). Never raises:
        a cold start is only slower.
        """
        import httpx

        warmth = self._warm.get(loaded.url)
        if warmth is None:
            warmth = self._warm[loaded.url] = _Warmth(self.folder(loaded.plan))
        if warmth.done or not isinstance(body.get("messages"), list):
            return 0
        async with warmth.lock:
            if warmth.done:
                return 0
            if warmth.candidates is None:  # once per llama-server: the folder's files and their tokens
                read = ((path, _tokens_or_none(path)) for path in warmth.folder.glob("*.bin"))
                warmth.candidates = {path: tokens for path, tokens in read if tokens is not None}
            restored = 0
            if warmth.candidates:
                try:
                    restored = await self._restore(loaded, body, warmth)
                except (httpx.HTTPError, ValueError, TypeError, KeyError) as exc:
                    log.warning("restoring a saved slot failed", model=loaded.name, error=str(exc))
            warmth.misses += restored == 0
            warmth.done = (
                not warmth.candidates or warmth.slots_restored >= loaded.plan.n_parallel or warmth.misses >= MAX_MISSES
            )
            return restored

    async def _restore(self, loaded: LoadedModel, body: Mapping[str, Any], warmth: _Warmth) -> int:
        """Restore the candidate sharing the longest prefix with ``body``'s prompt into an idle slot."""
        import httpx

        assert warmth.candidates is not None
        async with httpx.AsyncClient(base_url=loaded.url, headers=loaded.auth_headers, timeout=self.timeout) as client:
            rendered = await client.post("/apply-template", json={k: body[k] for k in _TEMPLATE_FIELDS if k in body})
            prompt = rendered.json()["prompt"]
            tokenized = await client.post(
                "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}
            )
            wanted = tokenized.json()["tokens"]
            best, shared = None, 0
            for path, tokens in warmth.candidates.items():
                n = _common_prefix(tokens, wanted)
                if n >= max(MIN_TOKENS, int(len(tokens) * MIN_SHARED)) and n > shared:
                    best, shared = path, n
            if best is None:
                return 0
            slot = await _idle_slot(client)
            if slot is None:
                return 0
            del warmth.candidates[best]  # tried once, whatever comes of it
            resp = await client.post(f"/slots/{slot}", params={"action": "restore"}, json={"filename": best.name})
            if resp.status_code != 200:
                log.warning("a saved slot could not be restored; removing it", file=best.name, answer=resp.text[:200])
                best.unlink(missing_ok=True)
                return 0
            restored = int(resp.json().get("n_restored", 0))
        warmth.slots_restored += 1
        with contextlib.suppress(OSError):
            best.touch()  # recently used: the last to go under the disk budget
        log.info("saved slot restored", model=loaded.name, slot=slot, tokens=restored, shared=shared)
        return restored

    def forget(self, url: str) -> None:
        """The llama-server at ``url`` stopped: its warm state goes with it."""
        self._warm.pop(url, None)


class _Warmth:
    """What one llama-server's first chats have tried to bring back."""

    def __init__(self, folder: Path) -> None:
        self.lock = asyncio.Lock()
        self.folder = folder
        self.candidates: dict[Path, list[int]] | None = None  # saved files not tried yet, and their tokens
        self.slots_restored = 0
        self.misses = 0  # chats that matched no saved file
        self.done = False


async def _idle_slot(client: httpx.AsyncClient) -> int | None:
    slots = (await client.get("/slots")).json()
    idle = [s["id"] for s in slots if isinstance(s, dict) and not s.get("is_processing")]
    return min(idle) if idle else None


def _tokens_or_none(path: Path) -> list[int] | None:
    """``path``'s tokens; an unreadable file is removed with a log line (it would never restore)."""
    try:
        return read_tokens(path)
    except SlotFileError as exc:
        log.warning("a saved slot file is unreadable; removing it", file=str(path), error=str(exc))
        path.unlink(missing_ok=True)
        return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _key(launch: LaunchPlan, binary: Path) -> str:
    """A name for everything that shapes a slot's KV layout: model file, context, caches, build."""

    def identity(path: Path) -> list[object]:
        try:
            stat = path.stat()
            return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
        except OSError:
            return [str(path), None, None]

    shape = [
        identity(launch.model.path),
        launch.n_ctx,
        launch.n_parallel,
        launch.cache_type_k,
        launch.cache_type_v,
        launch.flash_attn,
        list(launch.spec.argv),
        str(launch.model.mmproj) if launch.model.mmproj else None,
        identity(binary),
        *(["kv_unified"] if launch.kv_unified else []),  # the old key unchanged for a split cache
    ]
    digest = hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest()[:20]
    return f"{launch.model.path.stem[:40]}-{digest}"
