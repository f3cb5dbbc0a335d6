"""Errors for bad GGUF files. ``GGUFError`` is the only type that escapes ``gguf``.

::

    GGUFError (+ValueError)        any file we cannot read as GGUF
    ├── NotGGUFError               the file does not start with the GGUF magic
    ├── UnsupportedVersionError    version 1, an unknown version, or big-endian
    ├── TruncatedError             the file ends inside the header or tensor data
    │   └── NeedMoreBytes            a prefix of a file ends inside its header (``read_header_prefix``)
    ├── CorruptHeaderError         lengths, counts, types or text that cannot be right
    │   ├── InconsistentHeaderError  a hyper-parameter its own tensors (or another key) contradict
    │   └── ImplausibleValueError    a hyper-parameter beyond any real model (or llama.cpp's own limit)
    └── MissingShardError          a split model is missing sibling files

Each carries ``path`` and ``offset`` (the byte where the problem starts, or None);
the two hyper-parameter errors also the ``key`` and its ``value``.
"""

from __future__ import annotations

from pathlib import Path


class GGUFError(ValueError):
    """A file that cannot be read as a GGUF model."""

    def __init__(self, message: str, *, path: Path | str | None = None, offset: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}"
            if offset is not None:
                where += f" (byte {offset})"
            where += ": "
        super().__init__(where + message)
        self.path = Path(path) if path is not None else None
        self.offset = offset
        self.reason = message


class NotGGUFError(GGUFError):
    """The file is not a GGUF file at all."""


class UnsupportedVersionError(GGUFError):
    """A GGUF version or byte order this reader does not handle."""


class TruncatedError(GGUFError):
    """The file ends before the header or the tensor data it declares."""


class NeedMoreBytes(TruncatedError):
    """The prefix ``read_header_prefix`` was given ends inside the header; read up to ``needed`` and parse again.

    A ``TruncatedError``: a caller that does not fetch more reports a short file, which it is.
    """

    def __init__(self, needed: int, *, path: Path | str | None = None, have: int = 0) -> None:
        super().__init__(f"the header goes on past the first {have} bytes (at least to byte {needed})", path=path)
        self.needed = needed  # a lower bound of the header's end
        self.have = have


class CorruptHeaderError(GGUFError):
    """A header field holds a value no valid file can have."""


class InconsistentHeaderError(CorruptHeaderError):
    """A metadata value the file's tensors (or another key) contradict, so llama.cpp refuses the file."""

    def __init__(self, message: str, *, key: str, value: object, found: object, path: Path | str | None = None) -> None:
        super().__init__(message, path=path)
        self.key = key
        self.value = value
        self.found = found  # what the tensors (or the other key) say instead


class ImplausibleValueError(CorruptHeaderError):
    """A metadata value no real model has: corrupt or hostile metadata, refused before any work scales with it."""

    def __init__(self, message: str, *, key: str, value: object, limit: int, path: Path | str | None = None) -> None:
        super().__init__(message, path=path)
        self.key = key
        self.value = value
        self.limit = limit


class MissingShardError(GGUFError):
    """Some shards of a split model are missing."""

    def __init__(self, message: str, *, path: Path | str | None = None, missing: list[str] | None = None) -> None:
        super().__init__(message, path=path)
        self.missing = missing or []
