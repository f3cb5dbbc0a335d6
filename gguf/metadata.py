"""Typed reads of a GGUF's metadata, as llama.cpp's ``llama_model_loader::get_key`` / ``get_arr`` read them.

``Metadata`` reads one model's keys under its architecture's prefix; a value of
the wrong type or shape raises ``GGUFError`` naming the key, a missing key the
loader requires is recorded (``missing_required``) for the facts to flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard, overload

from gguf.errors import GGUFError
from gguf.reader import LazyArray

#: llama.cpp's LLAMA_MAX_LAYERS: per-layer arrays longer than this cannot load.
MAX_LAYERS = 512


def is_int(v: object) -> TypeGuard[int]:
    """``v`` is an integer and not a bool (a GGUF bool reads as a Python bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _type_name(v: Any) -> str:
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, LazyArray)):
        return f"an array of {len(v)}"
    return type(v).__name__


class Metadata:
    """Typed reads of one model's metadata; wrong types raise GGUFError naming the key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, path: Path | None, notes: list[str]) -> None:
        self.md = metadata
        self.arch = arch
        self.path = path
        self.notes = notes
        self.missing_required: list[str] = []

    def key(self, name: str) -> str:
        """The full key of an architecture key: ``<arch>.<name>``."""
        return f"{self.arch}.{name}"

    def error(self, key: str, value: Any, expected: str) -> GGUFError:
        """The error for ``key`` holding ``value`` where ``expected`` belongs."""
        return GGUFError(
            f"metadata key {key!r} is {_type_name(value)} ({_short(value)}); expected {expected}", path=self.path
        )

    def has(self, name: str) -> bool:
        """The architecture key ``name`` is present."""
        return self.key(name) in self.md

    @overload
    def raw_u32(self, key: str, default: int) -> int: ...
    @overload
    def raw_u32(self, key: str, default: None = None) -> int | None: ...

    def raw_u32(self, key: str, default: int | None = None) -> int | None:
        """The non-negative integer under the full ``key``, else ``default``."""
        if key not in self.md:
            return default
        v = self.md[key]
        if not is_int(v):
            raise self.error(key, v, "an unsigned integer")
        if v < 0:
            raise self.error(key, v, "a non-negative integer")
        return v

    @overload
    def u32(self, name: str, default: int, *, required: bool = False) -> int: ...
    @overload
    def u32(self, name: str, default: None = None, *, required: bool = False) -> int | None: ...

    def u32(self, name: str, default: int | None = None, *, required: bool = False) -> int | None:
        """``raw_u32`` of the architecture key ``name``; a missing ``required`` one is recorded."""
        key = self.key(name)
        if required and key not in self.md:
            self.missing_required.append(key)
        return self.raw_u32(key, default)

    @overload
    def f32(self, name: str, default: float) -> float: ...
    @overload
    def f32(self, name: str, default: None = None) -> float | None: ...

    def f32(self, name: str, default: float | None = None) -> float | None:
        """The number under the architecture key ``name``, else ``default``."""
        key = self.key(name)
        if key not in self.md:
            return default
        v = self.md[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(key, v, "a number")
        return float(v)

    def raw_str(self, key: str) -> str | None:
        """The string under the full ``key``, else None."""
        if key not in self.md:
            return None
        v = self.md[key]
        if not isinstance(v, str):
            raise self.error(key, v, "a string")
        return v

    def int_array(self, name: str) -> list[int] | None:
        """The key's values when it is an array of integers/bools; None when absent or a scalar."""
        key = self.key(name)
        v = self.md.get(key)
        if not isinstance(v, (list, LazyArray)):
            return None
        values = list(v)
        if len(values) > MAX_LAYERS:
            raise GGUFError(
                f"metadata key {key!r} has {len(values)} values; llama.cpp allows at most {MAX_LAYERS}", path=self.path
            )
        out: list[int] = []
        for x in values:
            if isinstance(x, bool):
                out.append(int(x))
            elif is_int(x):
                out.append(x)
            else:
                raise self.error(key, v, "an array of integers")
        return out

    @overload
    def per_layer(self, name: str, n: int, default: int) -> list[int]: ...
    @overload
    def per_layer(self, name: str, n: int, default: None) -> list[int] | None: ...

    def per_layer(self, name: str, n: int, default: int | None) -> list[int] | None:
        """A scalar repeated ``n`` times, or an array that must hold exactly ``n`` values."""
        key = self.key(name)
        if key not in self.md:
            return None if default is None else [default] * n
        v = self.md[key]
        if isinstance(v, (list, LazyArray)):
            if len(v) != n:
                raise GGUFError(
                    f"metadata key {key!r} has {len(v)} values but the model has {n} layers "
                    "(block_count); llama.cpp refuses such a file",
                    path=self.path,
                )
            return self.int_array(name)
        return [self.raw_u32(key, 0)] * n


def _short(v: Any) -> str:
    if isinstance(v, LazyArray):
        return repr(v)
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
