"""Split models: ``name-00001-of-00003.gguf`` files and their ``split.*`` keys."""

from __future__ import annotations

import re
from pathlib import Path

from gguf.errors import CorruptHeaderError, MissingShardError

_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_paths(path: Path) -> list[Path] | None:
    """Return every shard path of the split model ``path`` belongs to, or None if unsplit.

    Raises:
        MissingShardError: some sibling files are absent; they are named.
    """
    m = _SHARD_NAME.match(path.name)
    if m is None:
        return None
    count = int(m.group("count"))
    if count < 1 or not 1 <= int(m.group("no")) <= count:
        raise CorruptHeaderError(f"shard name {path.name!r} has an impossible number", path=path)
    paths = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise MissingShardError(
            f"{len(missing)} of {count} shards are missing: {', '.join(missing)}; download them into "
            f"{path.parent} (every shard is needed to load the model)",
            path=path, missing=missing,
        )
    return paths


def check_split_keys(metadata: dict, index: int, count: int, path: Path) -> None:
    """Check a shard's ``split.no``/``split.count`` agree with its file name."""
    no = metadata.get("split.no")
    total = metadata.get("split.count")
    if no is not None and no != index:
        raise CorruptHeaderError(f"split.no is {no} but the file name says shard {index + 1}", path=path)
    if total is not None and total != count:
        raise CorruptHeaderError(f"split.count is {total} but the file name says {count} shards", path=path)
