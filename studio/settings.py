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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from launcher.sampling import Sampling
from studio.env import env_flag
from studio.home import studio_home
from studio.load_options import BY_NAME, OPTIONS, Option, OptionValues, config_problems

_SAMPLING_KEYS = frozenset(o.name for o in OPTIONS if o.plan == "sampling")

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
#: The keys of a ``[models.NAME]`` table: the load options (``studio.load_options``).
_MODEL_KEYS = frozenset(BY_NAME)
#: (least, most) for the residency keys, in seconds or models.
RESIDENCY_LIMITS: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "ttl": (BY_NAME["ttl"].least or 0, BY_NAME["ttl"].most or 0),
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


class ModelDefaults(OptionValues):
    """Load settings one model gets when a request leaves them out: its ``[models.NAME]`` table."""

    __slots__ = ()

    @property
    def sampling(self) -> Sampling:
        """Its sampling defaults and answer limits (``launcher.sampling``)."""
        return Sampling(**{k: v for k, v in self.values.items() if k in _SAMPLING_KEYS})


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
    def from_env(cls, env: Mapping[str, str] | None = None, *, options: Sequence[Option] = OPTIONS) -> Settings:
        """Return settings read from ``env`` (default: the process environment); ``options``: the load options
        a ``[models.NAME]`` table may set."""
        env = os.environ if env is None else env
        home = studio_home(env)
        config_path = Path(env.get("GGUF_STUDIO_CONFIG") or home / "config.toml").expanduser()
        config = _read_config(config_path, explicit="GGUF_STUDIO_CONFIG" in env, options=options)
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
                {name: ModelDefaults.of(table) for name, table in config.get("models", {}).items()}
            ),
            residency=_residency(config, env, config_path),
            tools=_tool_settings(config),
            allowed_origins=origins,
            allowed_hosts=hosts,
            allow_any_path=config.get("allow_any_path", False),
            sampling=Sampling(max_tokens=config.get("max_tokens"), max_seconds=config.get("max_seconds")),
        )


def _read_config(path: Path, *, explicit: bool, options: Sequence[Option] = OPTIONS) -> dict[str, Any]:
    """The TOML config at ``path`` checked for shape, or {} when there is none (and none was asked for); its
    ``[models.NAME]`` tables as the load options' values they set (``studio.load_options``)."""
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
    tables = config.get("models", {})
    if not isinstance(tables, dict):
        problems.append("[models] must hold one table per model: [models.NAME]")
        tables = {}
    for name, d in tables.items():
        if not isinstance(d, dict):
            problems.append(f"[models.{name!r}] must be a table")
            continue
        tables[name], wrong = config_problems(d, options)
        problems += [f"[models.{name!r}]: {problem}" for problem in wrong]
    for switch in ("auto_download", "default_for_unknown"):
        if not isinstance(config.get(switch, False), bool):
            problems.append(f"{switch} must be true or false")
    if not isinstance(config.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES), int):
        problems.append("max_body_bytes must be an integer (bytes)")
    limits = [BY_NAME[k] for k in ("max_tokens", "max_seconds") if k in config]
    problems += config_problems({o.name: config[o.name] for o in limits}, limits)[1]
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
    from studio.http.guards.access import normalize_origin  # light (no web framework), but only settings that need it

    return normalize_origin(text)


def _normalize_host(text: str) -> str:
    from studio.http.guards.access import normalize_host

    return normalize_host(text)


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
