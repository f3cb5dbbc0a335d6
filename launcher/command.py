"""Build the llama-server argv for a model.

This is the minimal form the foundation needs; the planner adds context, GPU,
cache and speculative flags on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def server_argv(
    binary: Path,
    model: Path,
    *,
    host: str,
    port: int,
    n_ctx: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """Return the argv that serves ``model`` on ``host:port`` with chat templates on."""
    argv = [str(binary), "-m", str(model), "--host", host, "--port", str(port), "--jinja"]
    if n_ctx is not None:
        argv += ["-c", str(n_ctx)]
    return argv + list(extra)
