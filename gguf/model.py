"""A whole GGUF model: one file or every shard of a split one, read through a cache."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf.errors import GGUFError
from gguf.reader import Header, StatKey, TensorInfo, read_header
from gguf.shards import check_split_keys, shard_paths

if TYPE_CHECKING:
    from gguf.facts import ModelFacts


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """A parsed model: metadata from the first shard, tensors from all of them."""

    shards: tuple[Header, ...]

    @property
    def path(self) -> Path:
        """The first (or only) file."""
        return self.shards[0].path

    @property
    def version(self) -> int:
        return self.shards[0].version

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.shards[0].metadata

    @cached_property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return tuple(t for h in self.shards for t in h.tensors)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data across every shard."""
        return sum(h.tensor_bytes for h in self.shards)

    @property
    def file_size(self) -> int:
        """Bytes on disk across every shard."""
        return sum(h.file_size for h in self.shards)

    @cached_property
    def facts(self) -> ModelFacts:
        """The architecture-aware view the planner uses."""
        from gguf.facts_builder import model_facts

        return model_facts(self)


_cache: dict[Path, tuple[tuple[StatKey, ...], GGUFFile]] = {}
_cache_lock = threading.Lock()


def read(path: str | os.PathLike[str], *, cache: bool = True) -> GGUFFile:
    """Return the parsed GGUF model at ``path`` (any shard of a split model works).

    An unchanged file (same path, size, mtime_ns, inode, device for every shard)
    is served from an in-memory cache; each link to a file is cached as its own path.

    Raises:
        GGUFError: the file, or one of its shards, is missing or malformed.
    """
    given = Path(path)
    paths = shard_paths(given) or [given]
    # By the path as given, not its target: a model holds the path it was read through, and two links to one
    # file (a models dir link, the Hugging Face cache, another studio's folder) must each launch their own.
    key = Path(os.path.abspath(paths[0]))
    try:
        stats = tuple(StatKey.of(os.stat(p)) for p in paths)
    except OSError as exc:
        raise GGUFError(f"cannot open the file: {exc.strerror or exc}", path=exc.filename or given) from exc
    if cache:
        with _cache_lock:
            hit = _cache.get(key)
        if hit is not None and hit[0] == stats:
            return hit[1]
    headers = tuple(read_header(p, shard=i) for i, p in enumerate(paths))
    if len(paths) > 1:
        for i, h in enumerate(headers):
            check_split_keys(dict(h.metadata), i, len(paths), h.path)
    model = GGUFFile(shards=headers)
    if cache:
        with _cache_lock:
            _cache[key] = (tuple(h.stat_key for h in headers), model)
    return model


def clear_cache() -> None:
    """Forget every cached header (tests and benchmarks use this for cold reads)."""
    with _cache_lock:
        _cache.clear()
