"""Where the studio home is: the one rule, in a module light enough for ``ggstudio --help`` (``studio.cli.entry``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["studio_home"]


def studio_home(env: Mapping[str, str] | None = None) -> Path:
    """Return the studio home ``GGUF_STUDIO_HOME`` names (default ``~/.gguf-studio``)."""
    env = os.environ if env is None else env
    return Path(env.get("GGUF_STUDIO_HOME") or Path.home() / ".gguf-studio").expanduser()
