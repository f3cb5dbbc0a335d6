"""Debian's Chromium as the browser tests and the README's screenshot drive it (through Playwright)."""

from __future__ import annotations

from pathlib import Path

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
