"""GGUF Studio: the service, CLI and model manager in front of llama-server."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gguf-studio")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0+unknown"
