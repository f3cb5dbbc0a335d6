"""GGUF Studio: the service, CLI and model manager in front of llama-server."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # Looked up on first use: importlib.metadata costs ~45 ms, paid by every CLI start otherwise.
    if name != "__version__":
        raise AttributeError(f"module 'studio' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf-studio")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "0.0.0+unknown"
