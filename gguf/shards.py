"""Split models: ``name-00001-of-00003.gguf`` files and their ``split.*`` keys.

``parse_shard`` is the one reading of a shard's file name (the library's folder
scan and the Hugging Face listing use it too); ``shard_name`` writes one the way
llama.cpp's ``llama_split_path`` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.errors import CorruptHeaderError, MissingShardError

__all__ = ["ShardName", "check_split_keys", "parse_shard", "shard_name", "shard_paths"]

_SHARD_SUFFIX = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})$")


@dataclass(frozen=True)
class ShardName:
    """What a split model's file name says: ``<stem>-<number>-of-<count>``, five digits each."""

    stem: str  # the name (or path) without the shard suffix
    number: int  # 1-based, as written
    count: int


def parse_shard(name: str) -> ShardName | None:
    """Return the shard numbering that ends ``name`` (a file name or path without ``.gguf``), or None if unsplit."""
    m = _SHARD_SUFFIX.match(name)
    return None if m is None else ShardName(m.group("stem"), int(m.group("no")), int(m.group("count")))


def shard_name(stem: str, number: int, count: int) -> str:
    """Return the file name of shard ``number`` of ``count`` (``llama_split_path``: ``stem-0000N-of-0000M.gguf``)."""
    return f"{stem}-{number:05d}-of-{count:05d}.gguf"


def shard_paths(path: Path) -> list[Path] | None:
    """Return every shard path of the split model ``path`` belongs to, or None if unsplit.

    Raises:
        MissingShardError: some sibling files are absent; they are named.
    """
    shard = parse_shard(path.name[:-5]) if path.name.endswith(".gguf") else None
    if shard is None:
        return None
    count = shard.count
    if count < 1 or not 1 <= shard.number <= count:
        raise CorruptHeaderError(f"shard name {path.name!r} has an impossible number", path=path)
    paths = [path.with_name(shard_name(shard.stem, i, count)) for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise MissingShardError(
            f"{len(missing)} of {count} shards are missing: {', '.join(missing)}; download them into "
            f"{path.parent} (every shard is needed to load the model)",
            path=path,
            missing=missing,
        )
    return paths


def check_split_keys(metadata: Mapping[str, Any], index: int, count: int, path: Path) -> None:
    """Check a shard's ``split.no``/``split.count`` agree with its file name."""
    no = metadata.get("split.no")
    total = metadata.get("split.count")
    if no is not None and no != index:
        raise CorruptHeaderError(f"split.no is {no} but the file name says shard {index + 1}", path=path)
    if total is not None and total != count:
        raise CorruptHeaderError(f"split.count is {total} but the file name says {count} shards", path=path)
