"""GGUF Studio: the service, CLI and model manager in front of llama-server."""

from __future__ import annotations

#: The one place the version is written; pyproject.toml reads it (``[tool.setuptools.dynamic]``). A literal,
#: not ``importlib.metadata.version(...)``: that import alone cost ``ggstudio --version`` ~45 ms.
__version__ = "0.1.0"
