"""Writing a file so that no reader ever sees half of it: write a sibling, then ``os.replace`` it into place.

The GGUF writer, the launcher's caches and records and the studio's library
index all write this way; ``gguf`` is the lowest package that needs it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["replacing", "write_atomically"]


@contextmanager
def replacing(path: Path, *, temporary: Path | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; when the block ends it replaces ``path`` in one step.

    On any error (or cancellation) the temporary file is removed and ``path`` is
    left as it was. The temporary name is fresh and hidden (``.<name>.<random>.tmp``),
    so concurrent writers never collide; ``temporary`` fixes it instead, for a
    large file a rerun after a kill should overwrite rather than leave beside it.
    """
    tmp = temporary or path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: Path, content: str | bytes) -> None:
    """Write ``content`` (text as UTF-8) to ``path`` through ``replacing``."""
    with replacing(path) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content, encoding="utf-8")
