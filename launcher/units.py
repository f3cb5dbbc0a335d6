"""Byte units, and the one way the launcher and the studio write a size for a person."""

from __future__ import annotations

__all__ = ["GIB", "MIB", "format_size"]

MIB = 1024 * 1024
GIB = 1024 * MIB


def format_size(n: int, *, fine: bool = False) -> str:
    """Return ``n`` bytes as whole MiB with thousands separators (``"1,234 MiB"``), or as GiB from 10 GiB on.

    ``fine``: two decimals below 10 MiB (``"3.25 MiB"``), for parts that small (a projector's).
    """
    if fine and n < 10 * MIB:
        return f"{n / MIB:.2f} MiB"
    return f"{n / MIB:,.0f} MiB" if n < 10 * GIB else f"{n / GIB:,.1f} GiB"
