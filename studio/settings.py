"""Typed settings; the one place that reads GGUF Studio's environment variables.

| variable                | meaning                                                  |
|-------------------------|----------------------------------------------------------|
| ``GGUF_STUDIO_HOME``    | studio home: builds, models, caches (``~/.gguf-studio``) |
| ``LLAMA_SERVER_PATH``   | use this llama-server instead of the pinned build        |
| ``GGUF_STUDIO_LLAMA_CPP`` | a llama.cpp checkout/build dir to take llama-server from |
| ``GGUF_STUDIO_HOST``    | address the studio listens on (``127.0.0.1``)            |
| ``GGUF_STUDIO_PORT``    | port the studio listens on (``8080``)                    |
| ``GGUF_STUDIO_LOG_JSON``| ``1`` for JSON log lines instead of console ones         |
| ``CMAKE_ARGS``          | extra CMake arguments for ``ggstudio build-llama``        |
| ``GGUF_STUDIO_MODEL_DIRS`` | more folders of GGUF files for the library (``os.pathsep``-separated) |
| ``GGUF_STUDIO_API_TOKEN`` | bearer token every API call must send (default: none)  |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """Where the studio keeps its files and how it listens."""

    home: Path
    llama_server_path: Path | None = None
    llama_cpp_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    log_json: bool = False
    cmake_args: str = ""
    api_token: str | None = None
    model_dirs: tuple[Path, ...] = ()  # extra folders the local library scans, besides models_dir

    @property
    def models_dir(self) -> Path:
        """Models the studio assembled or downloaded itself."""
        return self.home / "models"

    @property
    def logs_dir(self) -> Path:
        """One log file per llama-server launch."""
        return self.home / "logs"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Return settings read from ``env`` (default: the process environment)."""
        env = os.environ if env is None else env
        home = Path(env.get("GGUF_STUDIO_HOME") or Path.home() / ".gguf-studio").expanduser()
        port_text = env.get("GGUF_STUDIO_PORT", "8080")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"GGUF_STUDIO_PORT must be a port number, not {port_text!r}") from None
        return cls(
            home=home,
            llama_server_path=_optional_path(env.get("LLAMA_SERVER_PATH")),
            llama_cpp_dir=_optional_path(env.get("GGUF_STUDIO_LLAMA_CPP")),
            host=env.get("GGUF_STUDIO_HOST", "127.0.0.1"),
            port=port,
            log_json=env.get("GGUF_STUDIO_LOG_JSON", "") in {"1", "true", "yes"},
            cmake_args=env.get("CMAKE_ARGS", ""),
            api_token=env.get("GGUF_STUDIO_API_TOKEN") or None,
            model_dirs=tuple(Path(p).expanduser() for p in env.get("GGUF_STUDIO_MODEL_DIRS", "").split(os.pathsep) if p),
        )


def _optional_path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None
