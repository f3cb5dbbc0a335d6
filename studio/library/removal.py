"""Removing a model from the library: its files in a models folder, or its Hugging Face cache entry.

A model is removed whole: every shard, and its paired projector unless another model of the
library pairs with it too. In a folder that is the files themselves (and the ``.ok`` marker the
embedded models keep beside theirs). In the Hugging Face cache, huggingface_hub's own cache API
(``scan_cache_dir``) says which revisions hold the model's files: a revision whose GGUF files are
all this model's goes with ``delete_revisions`` (its snapshot, the blobs no other revision shares,
the refs that name it, the repo folder once it has no revision left); in a revision that also holds
other models only this model's links go, with each blob no other link points at. Nothing outside
the library is touched: a path that is not a library model's file is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from studio.errors import ModelNotFoundError, PathNotAllowedError
from studio.library.scan import Library, LibraryEntry


@dataclass(frozen=True)
class Removal:
    """What removing one model deletes: decided before anything is touched, so it can be shown first."""

    name: str
    source: Literal["folder", "hf-cache"]
    files: tuple[Path, ...]  # the model's files as the library lists them (shards, then the projector if it goes)
    size: int  # bytes freed, about (blobs shared with what stays are not counted)
    repo: str | None = None
    revisions: tuple[str, ...] = ()  # Hugging Face revisions deleted whole
    kept_projector: Path | None = None  # the paired projector, kept because another model pairs with it
    _links: tuple[Path, ...] = field(default=(), repr=False)  # snapshot links removed from revisions that stay

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "source": self.source,
            "files": [str(p) for p in self.files],
            "size": self.size,
            "repo": self.repo,
            "revisions": list(self.revisions),
            "kept_projector": str(self.kept_projector) if self.kept_projector else None,
        }


def find_entry(name_or_path: str, folders: Iterable[Path], hf_cache: Path | None) -> tuple[LibraryEntry, Library]:
    """The library entry ``name_or_path`` names (a name, or the path of one of its files), with the library.

    Raises:
        ModelNotFoundError: no such model in the library.
        PathNotAllowedError: an existing file that is not a library model's: removal only deletes library models.
    """
    library = Library(list(folders), hf_cache)
    entries = library.scan()
    for entry in entries:
        if entry.name == name_or_path:
            return entry, library
    path = Path(name_or_path).expanduser()
    if path.exists():
        wanted = {path.absolute(), path.resolve()}
        for entry in entries:
            if wanted & {p.absolute() for p in entry.shards}:
                return entry, library
        raise PathNotAllowedError(
            f"{path} is not a model of the library (the models folders and the Hugging Face cache): "
            "`rm` removes only library models; delete other files yourself",
            path=str(path),
        )
    known = ", ".join(e.name for e in entries) or "none"
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found in the library (known: {known})", param="model", code="model_not_found"
    )


def plan_removal(entry: LibraryEntry, library: Library) -> Removal:
    """What removing ``entry`` deletes (nothing is deleted here)."""
    others = [e for e in library.scan() if (e.name, e.path) != (entry.name, entry.path)]
    projector = entry.mmproj
    kept = None
    if projector is not None and any(o.mmproj == projector for o in others):
        projector, kept = None, entry.mmproj
    files = (*entry.shards, *([projector] if projector is not None else []))
    if entry.source == "folder" or entry.repo is None:
        return Removal(entry.name, "folder", files, sum(_size(p) for p in files), kept_projector=kept)
    return _plan_hf(entry, files, kept)


def _plan_hf(entry: LibraryEntry, files: tuple[Path, ...], kept: Path | None) -> Removal:
    from huggingface_hub import scan_cache_dir

    snapshot = _snapshot_of(entry.shards[0])
    rels = {p.relative_to(snapshot).as_posix() for p in files}
    info = scan_cache_dir(snapshot.parent.parent.parent)
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == entry.repo), None)
    if repo is None:  # the scan does not know it: leave it alone rather than guess
        raise ModelNotFoundError(f"{entry.name}: not found by huggingface_hub's cache scan", param="model")
    whole: list[str] = []
    links: list[Path] = []
    size = 0
    for rev in repo.revisions:
        ours = [f for f in rev.files if _rel(f.file_path, rev.snapshot_path) in rels]
        if not ours:
            continue
        ggufs = [f for f in rev.files if f.file_name.lower().endswith(".gguf")]
        if all(_rel(f.file_path, rev.snapshot_path) in rels for f in ggufs):
            whole.append(rev.commit_hash)
            size += rev.size_on_disk
        else:
            links += [f.file_path for f in ours]
            size += sum(f.size_on_disk for f in ours)
    return Removal(
        entry.name,
        "hf-cache",
        files,
        size,
        repo=entry.repo,
        revisions=tuple(whole),
        kept_projector=kept,
        _links=tuple(links),
    )


def remove(removal: Removal, hf_cache: Path | None) -> None:
    """Delete what ``removal`` lists."""
    if removal.source == "folder":
        for path in removal.files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            with contextlib.suppress(FileNotFoundError):
                path.with_name(path.name + ".ok").unlink()
        return
    from huggingface_hub import scan_cache_dir

    if removal._links:
        _remove_links(removal._links)
    if removal.revisions:
        cache = hf_cache if hf_cache is not None else _snapshot_of(removal.files[0]).parent.parent.parent
        scan_cache_dir(cache).delete_revisions(*removal.revisions).execute()


def _remove_links(links: tuple[Path, ...]) -> None:
    """Remove snapshot links, and each blob no link left in the repo points at."""
    repo_dir = _snapshot_of(links[0]).parent.parent
    blobs = {(p.parent / os.readlink(p)).resolve() if p.is_symlink() else None for p in links}
    for link in links:
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
    still = {p.resolve() for p in (repo_dir / "snapshots").rglob("*") if p.is_symlink()}
    for blob in blobs:
        if blob is not None and blob not in still and blob.parent == (repo_dir / "blobs").resolve():
            with contextlib.suppress(FileNotFoundError):
                blob.unlink()


def _snapshot_of(path: Path) -> Path:
    """The snapshot folder (``.../models--owner--repo/snapshots/<commit>``) a cached file's link is in."""
    for parent in path.parents:
        if parent.parent.name == "snapshots":
            return parent
    raise ValueError(f"{path} is not in a Hugging Face cache snapshot")


def _rel(path: Path, snapshot: Path) -> str:
    return path.relative_to(snapshot).as_posix()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
