"""Typed settings; the one place that reads GGUF Studio's environment variables and config file.

Precedence: environment variables, then the optional TOML file
(``$GGUF_STUDIO_CONFIG``, default ``<home>/config.toml``), then the defaults::

    host = "127.0.0.1"
    port = 8080
    ollama_port = 11434             # also serve the Ollama API on this port (default: off)
    api_token = "..."
    model_dirs = ["~/models"]
    rpc_workers = ["192.168.1.20:50052"]  # ggml-rpc-server workers (``ggstudio rpc-worker``) to split layers over
    allowed_origins = ["http://localhost:3000"]  # web pages that may use the studio, besides its own ("*": any)
    allowed_hosts = ["studio.lan"]  # Host names it answers to, besides loopback and the address it binds
    allow_any_path = false          # true: API clients may load a .gguf from anywhere on the disk
    max_body_bytes = 33554432       # the largest request body accepted (32 MiB; 413 above)
    auto_download = false           # a load of an uncached owner/repo:VARIANT downloads it first
    max_tokens = 4096               # an answer's token limit when its request sets none (never past the context)
    max_seconds = 600               # wall-clock limit of one generation, seconds (0: none)

    [aliases]                       # extra names a client may send as `model`
    chat = "gemma-3-270m-Q4_K_M"    # a model name, a .gguf path, or owner/repo:VARIANT in the HF cache

    memory_budget = "6GiB"          # all resident models together; or per device: {CPU = "6GiB", CUDA0 = "20GiB"}
    ttl = 0                         # seconds idle before a model is unloaded (0: never)
    max_resident = 3                # at most this many models at once (default: as many as fit)
    preload = ["gemma-3-270m-Q4_K_M"]  # loaded at start, in this order
    unload_grace = 10               # seconds an unload waits for requests in flight before it ends them
    busy_wait = 30                  # seconds a load waits for busy models to go idle before a 503
    group_size = 4                  # requests a busy model still takes once a load waits for its memory (0: none)
    slot_cache_disk = "4GiB"        # disk for conversations saved before an eviction; 0: none saved
    default_for_unknown = false     # true: a request naming no known model goes to the default (llama-server's way)

    [mcp_servers.files]             # an MCP server whose tools /api/chat may run (stdio: a command)
    command = "npx"
    args = ["-y", "@modelcontextprotocol/server-filesystem", "/srv/notes"]
    env = { LOG_LEVEL = "warn" }

    [mcp_servers.search]            # ... or one reached over streamable HTTP
    url = "http://127.0.0.1:9000/mcp"

    [tools.python]                  # the built-in python tool, off unless enabled
    enabled = true
    timeout = 30                    # wall-clock seconds per call
    cpu_seconds = 10
    memory_mb = 512
    max_output_kb = 64
    max_processes = 64              # alive at once, the program itself included

    [models."gemma-3-270m-Q4_K_M"]  # load defaults for one model (a request's own values win)
    ttl = 600                       # this model's own idle TTL
    pinned = true                   # never evicted, never unloaded for idleness
    n_ctx = 8192
    n_parallel = 2
    extra_args = ["--temp", "0.7"]
    spec = "ngram"                  # a speculative mode, as the load API takes it
    spec_n_max = 4                  # drafted tokens per step
    cache_type_kv = "q8_0"          # KV cache type for K and V
    cache_ram = 512                 # MiB of prompt cache (--cache-ram), on the bill; 0: off
    mmproj = "~/models/mmproj-F16.gguf"  # the multimodal projector; "none" for none; unset: the one beside it
    threads = 4                     # CPU threads (unset: the usable cores, divided among models on the CPU)
    threads_batch = 8               # prompt-processing threads (unset: as threads)
    flash_attn = "on"               # on, off or auto (unset: on when the cache type needs it, else auto)
    context_shift = true            # past the context, drop the oldest tokens (unset: false, an error)
    chat_template = "chatml"        # a llama.cpp built-in template's name, or Jinja text (unset: the model's own)
    jinja = false                   # llama-server's built-in template renderer, no tools (unset: Jinja)
    thinking = true                 # start with thinking on or off (unset: the template's default; off for
                                    # Qwen3.5/3.6 under 9B); a request's enable_thinking still wins
    tags = ["chat", "small"]        # labels GET /models lists with the model (llama-server's --tags)
    temperature = 0.2               # sampling defaults a request's own values override (unset: the GGUF's
    top_p = 0.9                     # general.sampling.* keys, else llama-server's); also top_k, min_p,
    repeat_penalty = 1.1            # and max_tokens / max_seconds as above, for this model

| variable                | meaning                                                  |
|-------------------------|----------------------------------------------------------|
| ``GGUF_STUDIO_HOME``    | studio home: builds, models, caches (``~/.gguf-studio``) |
| ``LLAMA_SERVER_PATH``   | use this llama-server instead of the pinned build        |
| ``GGUF_STUDIO_LLAMA_CPP`` | a llama.cpp checkout/build dir to take llama-server from |
| ``GGUF_STUDIO_HOST``    | address the studio listens on (``127.0.0.1``)            |
| ``GGUF_STUDIO_PORT``    | port the studio listens on (``8080``)                    |
| ``GGUF_STUDIO_OLLAMA_PORT`` | also serve the Ollama API on this port (default: off) |
| ``GGUF_STUDIO_LOG_JSON``| ``1`` for JSON log lines instead of console ones         |
| ``CMAKE_ARGS``          | extra CMake arguments for ``ggstudio build-llama``        |
| ``GGUF_STUDIO_MODEL_DIRS`` | more folders of GGUF files for the library (``os.pathsep``-separated) |
| ``GGUF_STUDIO_API_TOKEN`` | bearer token every API call must send (default: none; generated beyond loopback) |
| ``GGUF_STUDIO_ORIGINS`` | web-page origins allowed besides the studio's own, comma-separated (``allowed_origins``) |
| ``GGUF_STUDIO_HOSTS``   | ``Host`` names allowed besides loopback ones, comma-separated (``allowed_hosts``) |
| ``GGUF_STUDIO_CONFIG``  | the TOML config file (default ``<home>/config.toml``)    |
| ``GGUF_STUDIO_MEMORY_BUDGET`` | ``2GiB`` (all models) or ``CPU=2GiB,CUDA0=20GiB``  |
| ``GGUF_STUDIO_RPC_WORKERS`` | RPC workers, ``host:port,...`` (over ``rpc_workers``)  |
| ``GGUF_STUDIO_MAX_BODY_BYTES`` | the largest request body, bytes (32 MiB)          |
| ``GGUF_STUDIO_AUTO_DOWNLOAD`` | ``1``: loads download uncached Hugging Face models (off) |
| ``GGML_RPC_SERVER_PATH`` | the ggml-rpc-server ``ggstudio rpc-worker`` runs        |
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from launcher import sampling
from launcher.sampling import Sampling
from studio.env import env_flag
from studio.home import studio_home

if TYPE_CHECKING:
    from launcher.memory import CacheType, FlashAttn
    from launcher.speculative import SpecMode

_TOP_KEYS = {
    "host",
    "port",
    "ollama_port",
    "api_token",
    "model_dirs",
    "aliases",
    "models",
    "memory_budget",
    "ttl",
    "max_resident",
    "preload",
    "unload_grace",
    "busy_wait",
    "group_size",
    "slot_cache_disk",
    "default_for_unknown",
    "rpc_workers",
    "mcp_servers",
    "tools",
    "allowed_origins",
    "allowed_hosts",
    "allow_any_path",
    "max_body_bytes",
    "auto_download",
    "max_tokens",
    "max_seconds",
}
#: The largest request body by default: a photo of a few MB is ~4/3 larger in base64, a minute of WAV ~2 MB.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
_MCP_KEYS = {"command", "args", "env", "cwd", "url"}
_PYTHON_KEYS = {"enabled", "timeout", "cpu_seconds", "memory_mb", "max_output_kb", "max_processes"}
#: MCP server names become part of tool names (``NAME__tool``), which OpenAI limits to these characters.
_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
_MODEL_KEYS = {
    "n_ctx",
    "n_parallel",
    "extra_args",
    "spec",
    "spec_n_max",
    "cache_type_kv",
    "cache_ram",
    "ttl",
    "pinned",
    "mmproj",
    "threads",
    "threads_batch",
    "flash_attn",
    "context_shift",
    "chat_template",
    "tags",
    "jinja",
    "thinking",
    *sampling.LIMITS,
}
#: (least, most) a load may ask for; the load API and the config file check the same bounds. No real model
#: has a context above 16M tokens (Llama 4 Scout's 10M is the largest); a bigger one is a typo, refused
#: before anything is planned.
LOAD_LIMITS: Mapping[str, tuple[int, int | None]] = MappingProxyType(
    {
        "n_ctx": (256, 1 << 24),
        "n_parallel": (1, 64),
        "spec_n_max": (1, 64),
        "cache_ram": (0, 1 << 20),  # MiB of llama-server's prompt cache; 0: off
        "threads": (1, 1024),
        "threads_batch": (1, 1024),
    }
)
#: (least, most) for the residency keys, in seconds or models.
RESIDENCY_LIMITS: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "ttl": (0, 365 * 86400),
        "max_resident": (1, 64),
        "unload_grace": (0, 3600),
        "busy_wait": (0, 3600),
        "group_size": (0, 1000),
    }
)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


#: Disk for the slots saved before a stop (``studio.residency.slot_cache``), unless the config says otherwise.
SLOT_CACHE_DISK = 4 * 2**30


def _slot_cache_disk(value: str | int) -> int:
    """``slot_cache_disk``: a size, or 0 (which ``parse_size`` refuses) for no saved slots."""
    return 0 if value in (0, "0") else parse_size(value)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``2GiB``, ``512 MiB``, ``1.5GB``, or a plain number of bytes.

    Raises:
        ValueError: not a size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{text!r} is not a size; write e.g. 2GiB, 512MiB or 8GB")
        value, unit = float(m.group(1)), m.group(2).lower()
    size = int(value * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{text!r} is not a size above zero")
    return size


@dataclass(frozen=True)
class MemoryBudget:
    """What all resident models together may hold: in total, or per device (``CPU``, ``CUDA0``...)."""

    total: int | None = None
    per_device: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def parse(cls, value: object, *, where: str) -> MemoryBudget:
        """``"2GiB"`` (all models), ``{CPU = "2GiB"}`` or ``"CPU=2GiB,CUDA0=20GiB"``; ``where`` names the source."""
        try:
            if isinstance(value, dict):
                return cls(per_device=MappingProxyType({str(k): parse_size(v) for k, v in value.items()}))
            if isinstance(value, str) and "=" in value:
                pairs = (item.split("=", 1) for item in value.split(",") if item.strip())
                return cls(per_device=MappingProxyType({k.strip(): parse_size(v) for k, v in pairs}))
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return cls(total=parse_size(value))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        raise ValueError(f'{where} must be a size such as "2GiB" or a table of sizes per device')


@dataclass(frozen=True)
class ResidencySettings:
    """How the studio keeps several models resident: see ``studio.residency``."""

    memory_budget: MemoryBudget | None = None  # None: the planner's share of free memory
    ttl: float = 0  # seconds idle before unloading a model without a ttl of its own; 0: never
    max_resident: int | None = None
    preload: tuple[str, ...] = ()
    unload_grace: float = 10.0
    busy_wait: float = 30.0
    group_size: int = 4  # requests a busy model still takes once a load waits for its memory: they go together
    slot_cache_disk: int = SLOT_CACHE_DISK  # bytes of saved slots in the studio home; 0: slots are not saved
    #: a chat naming a model the studio does not know goes to the default model, as a one-model llama-server
    #: ignores ``model`` (clients with a hard-wired name: "gpt-3.5-turbo"); off: a 404 that lists the models
    default_for_unknown: bool = False


@dataclass(frozen=True)
class ModelDefaults:
    """Load settings one model gets when a request leaves them out."""

    n_ctx: int | None = None
    n_parallel: int | None = None
    extra_args: tuple[str, ...] | None = None
    spec: SpecMode | None = None
    spec_n_max: int | None = None
    cache_ram: int | None = None  # MiB of prompt cache (--cache-ram); 0: off; None: the planner's
    cache_type_kv: CacheType | None = None
    ttl: float | None = None  # None: the global ttl
    pinned: bool = False
    chat_template: str | None = None  # a Jinja template, or a llama.cpp built-in's name, replacing the model's own
    mmproj: str | None = None  # a projector path, or "none"; unset: the one the library pairs
    threads: int | None = None
    threads_batch: int | None = None
    flash_attn: FlashAttn | None = None
    context_shift: bool | None = None
    jinja: bool | None = None  # False: llama-server's built-in template renderer (--no-jinja), which refuses tools
    thinking: bool | None = None  # thinking on or off at load; None: the template's default (launcher.thinking)
    tags: tuple[str, ...] = ()  # labels GET /models lists with the model (llama-server's --tags), no load setting
    sampling: Sampling = Sampling()  # its sampling defaults and answer limits (``launcher.sampling``)


@dataclass(frozen=True)
class MCPServerConfig:
    """One ``[mcp_servers.NAME]`` table: a command to run over stdio, or a streamable-HTTP ``url``."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    cwd: Path | None = None
    url: str | None = None


@dataclass(frozen=True)
class PythonToolConfig:
    """The built-in ``python`` tool's switch and limits (``[tools.python]``)."""

    enabled: bool = False
    timeout: float = 30.0  # wall-clock seconds per call
    cpu_seconds: int = 10
    memory_mb: int = 512
    max_output_kb: int = 64
    max_processes: int = 64  # alive at once, the program itself included


@dataclass(frozen=True)
class ToolSettings:
    """The tools ``/api/chat`` can run server-side."""

    mcp_servers: Mapping[str, MCPServerConfig] = field(default_factory=lambda: MappingProxyType({}))
    python: PythonToolConfig = field(default_factory=PythonToolConfig)


@dataclass(frozen=True)
class Settings:
    """Where the studio keeps its files and how it listens."""

    home: Path
    llama_server_path: Path | None = None
    llama_cpp_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    ollama_port: int | None = None  # the Ollama API's own listener; None: not served
    log_json: bool = False
    cmake_args: str = ""
    api_token: str | None = None
    model_dirs: tuple[Path, ...] = ()  # extra folders the local library scans, besides models_dir
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    model_defaults: Mapping[str, ModelDefaults] = field(default_factory=lambda: MappingProxyType({}))
    residency: ResidencySettings = field(default_factory=ResidencySettings)
    rpc_workers: tuple[str, ...] = ()  # ggml-rpc-server endpoints, host:port, in --rpc order
    rpc_server_path: Path | None = None  # the ggml-rpc-server for ``ggstudio rpc-worker``
    tools: ToolSettings = field(default_factory=ToolSettings)
    allowed_origins: tuple[str, ...] = ()  # normalized origins of web pages allowed besides the studio's own
    allowed_hosts: tuple[str, ...] = ()  # normalized Host names allowed besides loopback and the bound address
    allow_any_path: bool = False  # API clients may load model files from anywhere
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    # Off by default: any client of the API may name a model, and a typo or a stray name must not start a
    # many-gigabyte download to this disk; downloads are asked for (POST /api/pull, ggstudio pull) unless set.
    auto_download: bool = False
    #: the answer limits of every model whose own table sets none (``max_tokens``, ``max_seconds``)
    sampling: Sampling = Sampling()

    @property
    def models_dir(self) -> Path:
        """Models the studio assembled or downloaded itself."""
        return self.home / "models"

    @property
    def logs_dir(self) -> Path:
        """One log file per llama-server launch."""
        return self.home / "logs"

    @property
    def history_dir(self) -> Path:
        """The chat history: ``history.db`` (SQLite) and ``attachments/`` (``studio.history``)."""
        return self.home / "history"

    @property
    def spec_dir(self) -> Path:
        """``ggstudio bench-spec``'s measurements, which ``auto`` follows (``launcher.spec_measurements``)."""
        return self.home / "spec"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Return settings read from ``env`` (default: the process environment)."""
        env = os.environ if env is None else env
        home = studio_home(env)
        config_path = Path(env.get("GGUF_STUDIO_CONFIG") or home / "config.toml").expanduser()
        config = _read_config(config_path, explicit="GGUF_STUDIO_CONFIG" in env)
        port = _port("GGUF_STUDIO_PORT", env.get("GGUF_STUDIO_PORT") or str(config.get("port", 8080)))
        ollama_text = env.get("GGUF_STUDIO_OLLAMA_PORT") or config.get("ollama_port")
        ollama_port = _port("GGUF_STUDIO_OLLAMA_PORT", str(ollama_text)) if ollama_text else None
        dirs = [p for p in env.get("GGUF_STUDIO_MODEL_DIRS", "").split(os.pathsep) if p] or config.get("model_dirs", [])
        body_text = env.get("GGUF_STUDIO_MAX_BODY_BYTES") or str(config.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES))
        try:
            max_body = int(body_text)
        except ValueError:
            max_body = 0
        if max_body < 1024:
            raise ValueError(
                f"max_body_bytes (GGUF_STUDIO_MAX_BODY_BYTES) must be a number of bytes of at least "
                f"1024, not {body_text!r}"
            )
        auto = env_flag(env, "GGUF_STUDIO_AUTO_DOWNLOAD")
        workers_text = env.get("GGUF_STUDIO_RPC_WORKERS")
        try:
            workers = _rpc_workers(workers_text) if workers_text else _rpc_workers(config.get("rpc_workers", []))
        except ValueError as exc:
            raise ValueError(f"GGUF_STUDIO_RPC_WORKERS: {exc}") from None
        origins = _listed(env, "GGUF_STUDIO_ORIGINS", config, "allowed_origins", _normalize_origin)
        hosts = _listed(env, "GGUF_STUDIO_HOSTS", config, "allowed_hosts", _normalize_host)
        return cls(
            home=home,
            llama_server_path=_optional_path(env.get("LLAMA_SERVER_PATH")),
            llama_cpp_dir=_optional_path(env.get("GGUF_STUDIO_LLAMA_CPP")),
            host=env.get("GGUF_STUDIO_HOST") or config.get("host", "127.0.0.1"),
            port=port,
            ollama_port=ollama_port,
            log_json=env_flag(env, "GGUF_STUDIO_LOG_JSON") or False,
            cmake_args=env.get("CMAKE_ARGS", ""),
            api_token=env.get("GGUF_STUDIO_API_TOKEN") or config.get("api_token") or None,
            model_dirs=tuple(Path(p).expanduser() for p in dirs),
            max_body_bytes=max_body,
            auto_download=auto if auto is not None else bool(config.get("auto_download", False)),
            aliases=MappingProxyType(dict(config.get("aliases", {}))),
            rpc_workers=workers,
            rpc_server_path=_optional_path(env.get("GGML_RPC_SERVER_PATH")),
            model_defaults=MappingProxyType(
                {
                    name: ModelDefaults(
                        n_ctx=d.get("n_ctx"),
                        n_parallel=d.get("n_parallel"),
                        extra_args=tuple(d["extra_args"]) if "extra_args" in d else None,
                        spec=_spec_mode(d["spec"]) if "spec" in d else None,
                        spec_n_max=d.get("spec_n_max"),
                        cache_ram=d.get("cache_ram"),
                        cache_type_kv=d.get("cache_type_kv"),
                        ttl=d.get("ttl"),
                        pinned=bool(d.get("pinned", False)),
                        mmproj=str(Path(d["mmproj"]).expanduser())
                        if d.get("mmproj") not in (None, "none")
                        else d.get("mmproj"),
                        threads=d.get("threads"),
                        threads_batch=d.get("threads_batch"),
                        flash_attn=d.get("flash_attn"),
                        context_shift=d.get("context_shift"),
                        chat_template=d.get("chat_template"),
                        jinja=d.get("jinja"),
                        thinking=d.get("thinking"),
                        tags=tuple(d.get("tags", ())),
                        sampling=sampling.from_table(d),
                    )
                    for name, d in config.get("models", {}).items()
                }
            ),
            residency=_residency(config, env, config_path),
            tools=_tool_settings(config),
            allowed_origins=origins,
            allowed_hosts=hosts,
            allow_any_path=config.get("allow_any_path", False),
            sampling=Sampling(max_tokens=config.get("max_tokens"), max_seconds=config.get("max_seconds")),
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
        isinstance(v, str) for v in config.get("aliases", {}).values()
    ):
        problems.append("[aliases] must map names to model names or paths (strings)")
    for name, d in (config.get("models", {}) or {}).items():
        if not isinstance(d, dict):
            problems.append(f"[models.{name!r}] must be a table")
            continue
        problems += [f"[models.{name!r}]: {problem}" for problem in _model_problems(d)]
    for switch in ("auto_download", "default_for_unknown"):
        if not isinstance(config.get(switch, False), bool):
            problems.append(f"{switch} must be true or false")
    if not isinstance(config.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES), int):
        problems.append("max_body_bytes must be an integer (bytes)")
    problems += sampling.problems({k: v for k, v in config.items() if k in ("max_tokens", "max_seconds")})
    if not isinstance(config.get("model_dirs", []), list):
        problems.append("model_dirs must be a list of folders")
    problems += _number_problems(config, RESIDENCY_LIMITS)
    if not (isinstance(config.get("preload", []), list) and all(isinstance(p, str) for p in config.get("preload", []))):
        problems.append("preload must be a list of model names")
    if "memory_budget" in config:
        try:
            MemoryBudget.parse(config["memory_budget"], where="memory_budget")
        except ValueError as exc:
            problems.append(str(exc))
    if "slot_cache_disk" in config:
        try:
            _slot_cache_disk(config["slot_cache_disk"])
        except ValueError as exc:
            problems.append(f"slot_cache_disk: {exc}")
    workers = config.get("rpc_workers", [])
    if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
        problems.append('rpc_workers must be a list of "host:port" strings')
    else:
        try:
            _rpc_workers(workers)
        except ValueError as exc:
            problems.append(f"rpc_workers: {exc}")
    problems += _tool_problems(config)
    for key, normalize in (("allowed_origins", _normalize_origin), ("allowed_hosts", _normalize_host)):
        value = config.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"{key} must be a list of strings")
            continue
        for item in value:
            try:
                normalize(item)
            except ValueError as exc:
                problems.append(f"{key}: {exc}")
    if not isinstance(config.get("allow_any_path", False), bool):
        problems.append("allow_any_path must be true or false")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return config


def _residency(config: dict[str, Any], env: Mapping[str, str], path: Path) -> ResidencySettings:
    budget_env = env.get("GGUF_STUDIO_MEMORY_BUDGET")
    if budget_env:
        budget: MemoryBudget | None = MemoryBudget.parse(budget_env, where="GGUF_STUDIO_MEMORY_BUDGET")
    elif "memory_budget" in config:
        budget = MemoryBudget.parse(config["memory_budget"], where=f"{path}: memory_budget")
    else:
        budget = None
    return ResidencySettings(
        memory_budget=budget,
        ttl=config.get("ttl", 0),
        max_resident=config.get("max_resident"),
        preload=tuple(config.get("preload", ())),
        unload_grace=config.get("unload_grace", 10.0),
        busy_wait=config.get("busy_wait", 30.0),
        group_size=int(config.get("group_size", 4)),
        slot_cache_disk=_slot_cache_disk(config.get("slot_cache_disk", SLOT_CACHE_DISK)),
        default_for_unknown=config.get("default_for_unknown", False),
    )


def _number_problems(d: dict[str, Any], limits: Mapping[str, tuple[float, float]], prefix: str = "") -> list[str]:
    """Each key of ``limits`` in ``d`` that is not a number within its bounds."""
    return [
        f"{prefix}{k} must be a number from {least:g} to {most:g}"
        for k, (least, most) in limits.items()
        if k in d and (not isinstance(d[k], (int, float)) or isinstance(d[k], bool) or not least <= d[k] <= most)
    ]


def _rpc_workers(values: str | list[str]) -> tuple[str, ...]:
    from launcher.rpc import parse_endpoints  # small and import-free, but the launcher stays out of --help

    return parse_endpoints(values)


def _listed(
    env: Mapping[str, str], var: str, config: dict[str, Any], key: str, normalize: Callable[[str], str]
) -> tuple[str, ...]:
    """A comma-separated variable, else the config's list (checked already), each item normalized."""
    if var not in env:
        return tuple(normalize(item) for item in config.get(key, []))
    items = [item.strip() for item in env[var].split(",") if item.strip()]
    try:
        return tuple(normalize(item) for item in items)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from None


def _normalize_origin(text: str) -> str:
    from studio.http.access import normalize_origin  # light (no web framework), but only settings that need it

    return normalize_origin(text)


def _normalize_host(text: str) -> str:
    from studio.http.access import normalize_host

    return normalize_host(text)


def _spec_mode(text: str) -> SpecMode:
    from launcher.speculative import normalize_mode  # not at import: ``ggstudio --help`` never needs it

    return normalize_mode(text)


def _model_problems(d: dict[str, Any]) -> list[str]:
    """What is wrong with one ``[models.NAME]`` table, checked as the load API checks a request."""
    # imported here, not at the top: the launcher's planning modules cost ~80 ms of every command's start-up
    from launcher.chat_templates import check_chat_template
    from launcher.memory import CACHE_TYPES, FLASH_ATTN
    from launcher.speculative import MODES, SpeculativeConfigError, normalize_mode

    problems = [f"unknown key {k!r} (known: {', '.join(sorted(_MODEL_KEYS))})" for k in d if k not in _MODEL_KEYS]
    problems += _number_problems(d, {"ttl": RESIDENCY_LIMITS["ttl"]})
    problems += sampling.problems(d)
    for k in ("pinned", "context_shift", "jinja", "thinking"):
        if k in d and not isinstance(d[k], bool):
            problems.append(f"{k} must be true or false")
    if "flash_attn" in d and d["flash_attn"] not in FLASH_ATTN:
        problems.append(f"flash_attn must be one of {', '.join(FLASH_ATTN)}")
    if "chat_template" in d and not isinstance(d["chat_template"], str):
        problems.append("chat_template must be a llama.cpp built-in template's name or Jinja text")
    elif "chat_template" in d and (problem := check_chat_template(d["chat_template"])):
        problems.append(f"chat_template: {problem}")
    for k, (least, most) in LOAD_LIMITS.items():
        if k in d and (
            not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < least or (most is not None and d[k] > most)
        ):
            problems.append(f"{k} must be an integer from {least}" + (f" to {most}" if most else " up"))
    if "extra_args" in d and not (
        isinstance(d["extra_args"], list) and all(isinstance(a, str) for a in d["extra_args"])
    ):
        problems.append("extra_args must be a list of strings")
    if "tags" in d and not (isinstance(d["tags"], list) and all(isinstance(t, str) for t in d["tags"])):
        problems.append("tags must be a list of strings")
    if "spec" in d and not isinstance(d["spec"], str):
        problems.append(f"spec must be a string, one of: {', '.join(MODES)}")
    elif "spec" in d:
        try:
            normalize_mode(d["spec"])
        except SpeculativeConfigError as exc:
            problems.append(f"spec: {exc}")
    if "mmproj" in d and not isinstance(d["mmproj"], str):
        problems.append('mmproj must be the path of a projector .gguf, or "none"')
    if "cache_type_kv" in d and d["cache_type_kv"] not in CACHE_TYPES:
        problems.append(f"cache_type_kv: unknown cache type {d['cache_type_kv']!r}; valid: {', '.join(CACHE_TYPES)}")
    return problems


def _tool_problems(config: dict[str, Any]) -> list[str]:
    """What is wrong with ``[mcp_servers.*]`` and ``[tools]``."""
    problems = []
    servers = config.get("mcp_servers", {})
    if not isinstance(servers, dict):
        return ["[mcp_servers] must hold one table per server: [mcp_servers.NAME]"]
    for name, d in servers.items():
        where = f"[mcp_servers.{name}]"
        if not _SERVER_NAME.fullmatch(name):
            problems.append(f"{where}: a server name is 1-32 letters, digits, '_' or '-' (it prefixes tool names)")
        if not isinstance(d, dict):
            problems.append(f"{where} must be a table")
            continue
        problems += [
            f"{where}: unknown key {k!r} (known: {', '.join(sorted(_MCP_KEYS))})" for k in d if k not in _MCP_KEYS
        ]
        if ("command" in d) == ("url" in d):
            problems.append(f"{where}: give either command (a stdio server) or url (streamable HTTP)")
        if "command" in d and (not isinstance(d["command"], str) or not d["command"]):
            problems.append(f"{where}: command must be a program name or path")
        if "url" in d and not (isinstance(d["url"], str) and d["url"].startswith(("http://", "https://"))):
            problems.append(f"{where}: url must be an http:// or https:// address")
        if "args" in d and not (isinstance(d["args"], list) and all(isinstance(a, str) for a in d["args"])):
            problems.append(f"{where}: args must be a list of strings")
        if "env" in d and not (isinstance(d["env"], dict) and all(isinstance(v, str) for v in d["env"].values())):
            problems.append(f"{where}: env must map names to strings")
        if "cwd" in d and not isinstance(d["cwd"], str):
            problems.append(f"{where}: cwd must be a folder")
        if "url" in d and any(k in d for k in ("args", "env", "cwd")):
            problems.append(f"{where}: args, env and cwd are for a command, not a url")
    tools = config.get("tools", {})
    if not isinstance(tools, dict) or any(k != "python" for k in tools):
        return problems + ["[tools] holds only [tools.python]"]
    python = tools.get("python", {})
    if not isinstance(python, dict):
        return problems + ["[tools.python] must be a table"]
    problems += [
        f"[tools.python]: unknown key {k!r} (known: {', '.join(sorted(_PYTHON_KEYS))})"
        for k in python
        if k not in _PYTHON_KEYS
    ]
    if "enabled" in python and not isinstance(python["enabled"], bool):
        problems.append("[tools.python]: enabled must be true or false")
    for k in ("timeout", "cpu_seconds", "memory_mb", "max_output_kb", "max_processes"):
        if k in python and (
            isinstance(python[k], bool)
            or not isinstance(python[k], (int, float))
            or python[k] <= 0
            or (k != "timeout" and not isinstance(python[k], int))
        ):
            problems.append(f"[tools.python]: {k} must be a positive {'number' if k == 'timeout' else 'integer'}")
    return problems


def _tool_settings(config: dict[str, Any]) -> ToolSettings:
    servers = {
        name: MCPServerConfig(
            name=name,
            command=d.get("command"),
            args=tuple(d.get("args", ())),
            env=MappingProxyType(dict(d.get("env", {}))),
            cwd=_optional_path(d.get("cwd")),
            url=d.get("url"),
        )
        for name, d in config.get("mcp_servers", {}).items()
    }
    python = config.get("tools", {}).get("python", {})
    return ToolSettings(mcp_servers=MappingProxyType(servers), python=PythonToolConfig(**python))


def _port(name: str, text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{name} must be a port number (1-65535), not {text!r}")
    return port


def _optional_path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None
