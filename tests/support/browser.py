"""Debian's Chromium as the browser tests and the README's screenshot drive it (through Playwright)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Playwright, ViewportSize

#: Where Debian puts it; ``make chromium`` installs it (Playwright's own browser download is never used).
CHROMIUM = Path("/usr/bin/chromium")

#: What Chromium needs here: no sandbox as root, no GPU, nothing fetched from outside.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium(
    pw: Playwright, profile: Path, *, extra_args: Sequence[str] = (), viewport: ViewportSize | None = None
) -> BrowserContext:
    """Debian's Chromium, headless, with a persistent profile in ``profile`` and ``FLAGS`` (then ``extra_args``)."""
    return pw.chromium.launch_persistent_context(
        str(profile),
        executable_path=str(CHROMIUM),
        headless=True,
        args=[*FLAGS, *extra_args],
        **({"viewport": viewport} if viewport is not None else {}),
    )
