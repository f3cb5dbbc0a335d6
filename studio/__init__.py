"""GGUF Studio: the service, CLI and model manager in front of llama-server.

Imports flow ``studio -> launcher -> gguf``. The wings:

- ``http``: the FastAPI app and every dialect it speaks (OpenAI, Anthropic, Responses, Ollama on
  its own listener, the GUI's ``/api``), metrics, the guards, the relay to llama-server;
- ``residency``: the resident models, each owned by one ``ResidentModel`` whose states and
  transitions are ``lifecycle``'s, placed by ``placement`` and run by the ``manager``;
- ``library``: model folders, the catalog, the Hugging Face Hub, downloads, the default model;
- ``chat``: what a conversation needs beyond relaying (reasoning, tool calls, media, usage);
- ``history``: conversations kept in SQLite in the studio home, searchable, exported and imported;
- ``views``: plans, models and residency as JSON and text; ``cli``: the command line.

``errors`` draws the studio's error tree and ``error_table`` says what every error of the three
packages means to a user (HTTP answer, CLI exit code).
"""

from __future__ import annotations

#: The one place the version is written; pyproject.toml reads it (``[tool.setuptools.dynamic]``). A literal,
#: not ``importlib.metadata.version(...)``: that import alone cost ``ggstudio --version`` ~45 ms.
__version__ = "0.1.0"
