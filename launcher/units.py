"""Byte units, and the one way the launcher and the studio write a size for a person."""

from __future__ import annotations

__all__ = ["GIB", "MIB", "format_gib", "format_mib", "format_size"]

MIB = 1024 * 1024
GIB = 1024 * MIB


def format_mib(n: float, *, decimals: int = 0) -> str:
    """Return ``n`` bytes in MiB with thousands separators: ``"1,234 MiB"``, or ``"3.25 MiB"`` with two decimals."""
    return f"{n / MIB:,.{decimals}f} MiB"


def format_gib(n: float, *, decimals: int = 1) -> str:
    """Return ``n`` bytes in GiB with thousands separators: ``"12.5 GiB"``."""
    return f"{n / GIB:,.{decimals}f} GiB"


def format_size(n: int, *, fine: bool = False) -> str:
    """Return ``n`` bytes as whole MiB with thousands separators (``"1,234 MiB"``), or as GiB from 10 GiB on.

    ``fine``: two decimals below 10 MiB (``"3.25 MiB"``), for parts that small (a projector's).
    """
    if fine and n < 10 * MIB:
        return format_mib(n, decimals=2)
    return format_mib(n) if n < 10 * GIB else format_gib(n)
