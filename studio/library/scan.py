"""The local library: every GGUF model in the configured folders and in the Hugging Face cache.

Shards are grouped into one entry (a missing shard is named in ``error``), and
projector files (``studio.library.projectors``: by header, by name when the header
is unreadable) are paired with the model beside them when their projection width
matches the model's embedding length. Facts come from the gguf reader; an index
file keyed by each file's (size, mtime_ns, inode) keeps them between runs, so a
scan of hundreds of unchanged files only stats them (well under a second), and
``gguf.read``'s in-memory cache does the same within one process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

import gguf
from gguf.files import write_atomically
from gguf.projector import projector_facts
from gguf.shards import parse_shard
from gguf.speech import speech_facts
from studio.library.hub import HubFile, candidates, pick_mmproj, snapshot_files
from studio.library.projectors import named_like_projector

log = structlog.get_logger("studio.library.scan")

INDEX_VERSION = 2
Source = Literal["folder", "hf-cache"]


def model_name(path: Path) -> str:
    """Return the name a model file is served under: its name without ``.gguf`` and a shard's ``-0000N-of-0000M``."""
    stem = path.name.removesuffix(".gguf")
    shard = parse_shard(stem)
    return shard.stem if shard else stem


@dataclass(frozen=True)
class LibraryEntry:
    """One model on disk: where its files are and what the reader says it is."""

    name: str  # ``owner/repo:LABEL`` for the Hugging Face cache, the file name (no .gguf) for folders
    path: Path  # the file to load (first shard)
    shards: tuple[Path, ...]
    size: int  # bytes of every shard present
    source: Source
    repo: str | None
    variant: str | None  # quant label, from the file name or the header
    architecture: str | None
    parameters: int | None
    context_length: int | None
    mmproj: Path | None
    error: str | None = None  # unreadable, or shards missing
    vision: bool = False  # the paired projector reads images
    audio: bool = False  # the paired projector hears audio (speech in)
    tts: str | None = None  # a text-to-speech model: what it is (``gguf.speech``), not a chat model

    def to_json(self) -> dict[str, Any]:
        """Return the entry as JSON-able values."""
        out = asdict(self)
        for key in ("path", "mmproj"):
            out[key] = str(out[key]) if out[key] is not None else None
        out["shards"] = [str(p) for p in self.shards]
        return out


@dataclass(frozen=True)
class _Group:
    """Files of one folder (or snapshot) to turn into entries."""

    root: Path
    files: list[HubFile]  # paths relative to root
    source: Source
    repo: str | None


class Library:
    """Scans ``folders`` and ``hf_cache``; ``index_path`` (optional) keeps header facts between runs."""

    def __init__(
        self, folders: Sequence[Path], hf_cache: Path | None = None, *, index_path: Path | None = None
    ) -> None:
        self.folders = list(folders)
        self.hf_cache = hf_cache
        self.index_path = index_path
        self._index: dict[str, dict[str, Any]] | None = None
        self._dirty = False

    def scan(self) -> list[LibraryEntry]:
        """Return every model found, sorted by name."""
        entries = [e for group in self._groups() for e in self._entries(group)]
        self._save_index()
        return sorted(entries, key=lambda e: (e.name, str(e.path)))

    # -- discovery

    def _groups(self) -> Iterable[_Group]:
        for folder in self.folders:
            if not folder.is_dir():
                continue
            by_dir: dict[Path, list[HubFile]] = {}
            for path in folder.rglob("*.gguf"):
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                by_dir.setdefault(path.parent, []).append(HubFile(path.name, size))
            for root, files in sorted(by_dir.items()):
                yield _Group(root, files, "folder", None)
        if self.hf_cache is not None and self.hf_cache.is_dir():
            for repo_dir in sorted(self.hf_cache.glob("models--*")):
                yield from self._snapshots(repo_dir)

    def _snapshots(self, repo_dir: Path) -> Iterable[_Group]:
        repo = repo_dir.name[len("models--") :].replace("--", "/")
        try:
            current = (repo_dir / "refs" / "main").read_text().strip()
        except OSError:
            current = None
        snaps = sorted(
            (p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()), key=lambda p: (p.name != current, p.name)
        )
        seen: set[str] = set()
        for snap in snaps:  # the snapshot refs/main names first; older ones only add what it lacks
            files = [f for f in snapshot_files(snap) if f.path.lower().endswith(".gguf") and f.path not in seen]
            seen.update(f.path for f in files)
            if files:
                yield _Group(snap, files, "hf-cache", repo)

    def _entries(self, group: _Group) -> Iterable[LibraryEntry]:
        def is_projector(rel: str) -> bool:
            return self._is_projector(group.root / rel)

        cands = candidates(group.files, is_projector=is_projector)
        projectors = [f for f in group.files if f.path.lower().endswith(".gguf") and is_projector(f.path)]
        labels = [c.label for c in cands]
        for cand in cands:
            shards = tuple(group.root / f.path for f in cand.files)
            facts = self._facts(shards) if cand.complete else {}
            error = facts.get("error")
            if cand.missing:
                error = f"{len(cand.missing)} shard(s) missing: " + ", ".join(cand.missing)
            mmproj = self._pair(group, cand.key, facts, projectors) if projectors else None
            if group.repo is not None:
                tail = cand.label if labels.count(cand.label) == 1 else cand.key
                name = f"{group.repo}:{tail}"
            else:
                name = model_name(shards[0])
            projector = self._facts((mmproj,)) if mmproj is not None else {}
            yield LibraryEntry(
                name=name,
                path=shards[0],
                shards=shards,
                size=cand.size,
                source=group.source,
                repo=group.repo,
                variant=cand.label if cand.label != Path(cand.key).name else facts.get("quant"),
                architecture=facts.get("architecture"),
                parameters=facts.get("parameters"),
                context_length=facts.get("context_length"),
                mmproj=mmproj,
                error=error,
                vision=bool(projector.get("vision")),
                audio=bool(projector.get("audio")),
                tts=facts.get("speech"),
            )

    def _pair(self, group: _Group, key: str, facts: dict[str, Any], projectors: list[HubFile]) -> Path | None:
        """The best projector beside the model among the readable ones of its width
        (``gguf.projector.width_mismatch``'s rule): same folder first, then F16, BF16, F32."""
        n_embd = facts.get("embedding_length")

        def fits(rel: str) -> bool:
            found = self._facts((group.root / rel,))
            dims = found.get("projection_dims") or []
            return found.get("architecture") == "clip" and not (dims and n_embd and any(d != n_embd for d in dims))

        projector = pick_mmproj(projectors, key, is_projector=fits)
        return group.root / projector.path if projector is not None else None

    def _is_projector(self, path: Path) -> bool:
        facts = self._facts((path,))
        if "error" in facts:
            return named_like_projector(path.name)
        return facts.get("architecture") == "clip"

    # -- facts, through the index

    def _facts(self, shards: tuple[Path, ...]) -> dict[str, Any]:
        index = self._load_index()
        try:
            stamp = [[s.st_size, s.st_mtime_ns, s.st_ino] for s in (os.stat(p) for p in shards)]
        except OSError as exc:
            return {"error": f"cannot stat: {exc}"}
        key = str(shards[0])
        hit = index.get(key)
        if hit is not None and hit.get("stamp") == stamp:
            return hit["facts"]
        facts = _read_facts(shards[0])
        index[key] = {"stamp": stamp, "facts": facts}
        self._dirty = True
        return facts

    def _load_index(self) -> dict[str, dict[str, Any]]:
        if self._index is None:
            self._index = {}
            if self.index_path is not None:
                try:
                    data = json.loads(self.index_path.read_text())
                    if data.get("version") == INDEX_VERSION:
                        self._index = data["files"]
                except (OSError, ValueError, KeyError, AttributeError):
                    pass  # no index, or a broken one: rebuilt from the files
        return self._index

    def _save_index(self) -> None:
        if self.index_path is None or not self._dirty or self._index is None:
            return
        try:
            self.index_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.index_path, json.dumps({"version": INDEX_VERSION, "files": self._index}))
            self._dirty = False
        except OSError as exc:  # a read-only home only costs speed
            log.warning("library.index_not_written", path=str(self.index_path), error=str(exc))


def _read_facts(path: Path) -> dict[str, Any]:
    """Return the JSON-able facts the library shows for a model or projector file."""
    try:
        model = gguf.read(path)
        projector = projector_facts(model)
        if projector is not None:
            return {
                "architecture": "clip",
                "projection_dims": list(projector.projection_dims),
                "vision": projector.vision,
                "audio": projector.audio,
            }
        facts = model.facts
        speech = speech_facts(model)
        return {
            "architecture": facts.architecture,
            "parameters": facts.parameter_count,
            "context_length": facts.context_length,
            "embedding_length": facts.embedding_length,
            "quant": facts.quant_label,
            "speech": speech.describe() if speech else None,
        }
    except (gguf.GGUFError, ValueError) as exc:
        return {"error": str(exc)}


def scan(
    folders: Sequence[Path], hf_cache: Path | None = None, *, index_path: Path | None = None
) -> list[LibraryEntry]:
    """Return every model in ``folders`` and the Hugging Face cache ``hf_cache``, sorted by name."""
    return Library(folders, hf_cache, index_path=index_path).scan()


def projector_for(model_path: Path) -> Path | None:
    """Return the projector the library pairs with the model file at ``model_path`` (its folder only), or None."""
    files = []
    for path in model_path.parent.glob("*.gguf"):
        try:
            files.append(HubFile(path.name, path.stat().st_size))
        except OSError:
            continue
    library = Library([])
    entries = library._entries(_Group(model_path.parent, files, "folder", None))
    return next((e.mmproj for e in entries if e.path == model_path), None)
