"""Types of the optional C loop (``gguf/_skip.c``), which mypy cannot read from the compiled module."""

from typing_extensions import Buffer

def skip_strings(buffer: Buffer, offset: int, count: int, /) -> int | None:
    """The offset after ``count`` GGUF strings from ``offset``, or None if they run past the end."""
