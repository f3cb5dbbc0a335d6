"""Typed settings; the one place that reads GGUF Studio's environment variables and config file.

Precedence: environment variables, then the optional TOML file
(``$GGUF_STUDIO_CONFIG``, default ``<home>/config.toml``), then the defaults::

    host = "127.0.0.1"
    port = 8080
    api_token = "..."
    model_dirs = ["~/models"]

    [aliases]                       # extra names a client may send as `model`
    chat = "gemma-3-270m-Q4_K_M"    # a model name, a .gguf path, or owner/repo:VARIANT in the HF cache

    [models."gemma-3-270m-Q4_K_M"]  # load defaults for one model (a request's own values win)
    n_ctx = 8192
    n_parallel = 2
    extra_args = ["--temp", "0.7"]
    spec = "ngram"                  # a speculative mode, as the load API takes it
    spec_n_max = 4                  # drafted tokens per step
    cache_type_kv = "q8_0"          # KV cache type for K and V

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
| ``GGUF_STUDIO_CONFIG``  | the TOML config file (default ``<home>/config.toml``)    |
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.memory import CacheType
    from launcher.speculative import SpecMode

_TOP_KEYS = {"host", "port", "api_token", "model_dirs", "aliases", "models"}
_MODEL_KEYS = {"n_ctx", "n_parallel", "extra_args", "spec", "spec_n_max", "cache_type_kv"}
#: (least, most) a load may ask for; the load API and the config file check the same bounds.
LOAD_LIMITS: Mapping[str, tuple[int, int | None]] = MappingProxyType({
    "n_ctx": (256, None), "n_parallel": (1, 64), "spec_n_max": (1, 64),
})


@dataclass(frozen=True)
class ModelDefaults:
    """Load settings one model gets when a request leaves them out."""

    n_ctx: int | None = None
    n_parallel: int | None = None
    extra_args: tuple[str, ...] | None = None
    spec: SpecMode | None = None
    spec_n_max: int | None = None
    cache_type_kv: CacheType | None = None


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
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    model_defaults: Mapping[str, ModelDefaults] = field(default_factory=lambda: MappingProxyType({}))

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
        config_path = Path(env.get("GGUF_STUDIO_CONFIG") or home / "config.toml").expanduser()
        config = _read_config(config_path, explicit="GGUF_STUDIO_CONFIG" in env)
        port_text = env.get("GGUF_STUDIO_PORT") or str(config.get("port", 8080))
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"GGUF_STUDIO_PORT must be a port number, not {port_text!r}") from None
        dirs = [p for p in env.get("GGUF_STUDIO_MODEL_DIRS", "").split(os.pathsep) if p] or config.get("model_dirs", [])
        return cls(
            home=home,
            llama_server_path=_optional_path(env.get("LLAMA_SERVER_PATH")),
            llama_cpp_dir=_optional_path(env.get("GGUF_STUDIO_LLAMA_CPP")),
            host=env.get("GGUF_STUDIO_HOST") or config.get("host", "127.0.0.1"),
            port=port,
            log_json=env.get("GGUF_STUDIO_LOG_JSON", "") in {"1", "true", "yes"},
            cmake_args=env.get("CMAKE_ARGS", ""),
            api_token=env.get("GGUF_STUDIO_API_TOKEN") or config.get("api_token") or None,
            model_dirs=tuple(Path(p).expanduser() for p in dirs),
            aliases=MappingProxyType(dict(config.get("aliases", {}))),
            model_defaults=MappingProxyType({
                name: ModelDefaults(
                    n_ctx=d.get("n_ctx"), n_parallel=d.get("n_parallel"),
                    extra_args=tuple(d["extra_args"]) if "extra_args" in d else None,
                    spec=_spec_mode(d["spec"]) if "spec" in d else None,
                    spec_n_max=d.get("spec_n_max"), cache_type_kv=d.get("cache_type_kv"),
                ) for name, d in config.get("models", {}).items()
            }),
        )


def _read_config(path: Path, *, explicit: bool) -> dict[str, Any]:
    """The TOML config at ``path`` checked for shape, or {} when there is none (and none was asked for)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if explicit:
            raise ValueError(f"GGUF_STUDIO_CONFIG names {path}, which does not exist") from None
        return {}
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    problems = [f"unknown key {k!r}" for k in config if k not in _TOP_KEYS]
    if not isinstance(config.get("aliases", {}), dict) or not all(
            isinstance(v, str) for v in config.get("aliases", {}).values()):
        problems.append("[aliases] must map names to model names or paths (strings)")
    for name, d in (config.get("models", {}) or {}).items():
        if not isinstance(d, dict):
            problems.append(f"[models.{name!r}] must be a table")
            continue
        problems += [f"[models.{name!r}]: {problem}" for problem in _model_problems(d)]
    if not isinstance(config.get("model_dirs", []), list):
        problems.append("model_dirs must be a list of folders")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return config


def _spec_mode(text: str) -> SpecMode:
    from launcher.speculative import normalize_mode  # not at import: ``ggstudio --help`` never needs it

    return normalize_mode(text)


def _model_problems(d: dict[str, Any]) -> list[str]:
    """What is wrong with one ``[models.NAME]`` table, checked as the load API checks a request."""
    # imported here, not at the top: the launcher's planning modules cost ~80 ms of every command's start-up
    from launcher.memory import CACHE_TYPES
    from launcher.speculative import MODES, SpeculativeConfigError, normalize_mode

    problems = [f"unknown key {k!r} (known: {', '.join(sorted(_MODEL_KEYS))})" for k in d if k not in _MODEL_KEYS]
    for k, (least, most) in LOAD_LIMITS.items():
        if k in d and (not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < least
                       or (most is not None and d[k] > most)):
            problems.append(f"{k} must be an integer from {least}" + (f" to {most}" if most else " up"))
    if "extra_args" in d and not (isinstance(d["extra_args"], list)
                                  and all(isinstance(a, str) for a in d["extra_args"])):
        problems.append("extra_args must be a list of strings")
    if "spec" in d and not isinstance(d["spec"], str):
        problems.append(f"spec must be a string, one of: {', '.join(MODES)}")
    elif "spec" in d:
        try:
            normalize_mode(d["spec"])
        except SpeculativeConfigError as exc:
            problems.append(f"spec: {exc}")
    if "cache_type_kv" in d and d["cache_type_kv"] not in CACHE_TYPES:
        problems.append(f"cache_type_kv: unknown cache type {d['cache_type_kv']!r}; valid: {', '.join(CACHE_TYPES)}")
    return problems


def _optional_path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None
