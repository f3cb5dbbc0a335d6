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

    memory_budget = "6GiB"          # all resident models together; or per device: {CPU = "6GiB", CUDA0 = "20GiB"}
    ttl = 0                         # seconds idle before a model is unloaded (0: never)
    max_resident = 3                # at most this many models at once (default: as many as fit)
    preload = ["gemma-3-270m-Q4_K_M"]  # loaded at start, in this order
    unload_grace = 10               # seconds an unload waits for requests in flight before it ends them
    busy_wait = 30                  # seconds a load waits for busy models to go idle before a 503
    group_size = 4                  # requests a busy model still takes once a load waits for its memory (0: none)
    slot_cache_disk = "4GiB"        # disk for conversations saved before an eviction; 0: none saved
    activity_days = 7               # days the activity records (/api/activity) are kept; 0: none are made
    activity_records = 50000        # activity records kept at most
    default_for_unknown = false     # true: a request naming no known model goes to the default (llama-server's way)

    [aliases]                       # extra names a client may send as `model`
    chat = "gemma-3-270m-Q4_K_M"    # a model name, a .gguf path, or owner/repo:VARIANT in the HF cache

    [mcp_servers.files]             # an MCP server whose tools /api/chat may run (stdio: a command)
    command = "npx"
    args = ["-y", "@modelcontextprotocol/server-filesystem", "/srv/notes"]
    env = { LOG_LEVEL = "warn" }
    cwd = "/srv/notes"              # the folder it runs in (unset: the studio's)

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
| ``GGUF_STUDIO_ACTIVITY_DAYS``  | days the activity records are kept (0: none)      |
| ``GGUF_STUDIO_AUTO_DOWNLOAD`` | ``1``: loads download uncached Hugging Face models (off) |
| ``GGML_RPC_SERVER_PATH`` | the ggml-rpc-server ``ggstudio rpc-worker`` runs        |
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

from launcher.sampling import Sampling
from studio.env import env_flag
from studio.home import studio_home
from studio.load_options import BY_NAME, OPTIONS, Kind, Option, OptionValues, config_problems, joined

_SAMPLING_KEYS = frozenset(o.name for o in OPTIONS if o.plan == "sampling")
#: The largest request body by default: a photo of a few MB is ~4/3 larger in base64, a minute of WAV ~2 MB.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: Disk for the slots saved before a stop (``studio.residency.slot_cache``), unless the config says otherwise.
SLOT_CACHE_DISK = 4 * 2**30
#: MCP server names become part of tool names (``NAME__tool``), which OpenAI limits to these characters.
_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
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


def parse_size(text: str | float) -> int:
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


# -- the checks beyond a key's type: each returns the value as kept, or raises ValueError saying what is wrong --


def _slot_cache_disk(value: str | float) -> int:
    """``slot_cache_disk``: a size, or 0 (which ``parse_size`` refuses) for no saved slots."""
    return 0 if value in (0, "0") else parse_size(value)


def _budget(value: object) -> MemoryBudget:
    return MemoryBudget.parse(value, where="")


def _port(value: int | str | bool) -> int:
    try:
        port = -1 if isinstance(value, bool) else int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"must be a port number (1-65535), not {str(value)!r}")
    return port


def _port_or_off(value: int | str | bool) -> int | None:
    """A port, or 0, "" or false for none (the listener is off)."""
    return None if value is False or value in (0, "") else _port(value)


def _rpc_workers(values: str | Iterable[str]) -> tuple[str, ...]:
    from launcher.rpc import parse_endpoints  # small and import-free, but the launcher stays out of --help

    return parse_endpoints(values)


def _normalize_origin(text: str) -> str:
    from studio.http.guards.access import normalize_origin  # light (no web framework), but only settings that need it

    return normalize_origin(text)


def _normalize_host(text: str) -> str:
    from studio.http.guards.access import normalize_host

    return normalize_host(text)


def _each(normalize: Callable[[str], str]) -> Callable[[Iterable[str]], tuple[str, ...]]:
    """A check of each item of a list, saying what is wrong with every wrong one."""

    def check(items: Iterable[str]) -> tuple[str, ...]:
        kept, wrong = [], []
        for item in items:
            try:
                kept.append(normalize(item))
            except ValueError as exc:
                wrong.append(str(exc))
        if wrong:
            raise ValueError("; ".join(wrong))
        return tuple(kept)

    return check


def _folders(items: Iterable[str]) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser() for p in items)


def _token(text: str) -> str | None:
    return text or None


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be a positive number")
    return value


def _program(text: str) -> str:
    if not text:
        raise ValueError("must be a program name or path")
    return text


def _http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// address")
    return text


# -- the config file's keys, each defined once ---------------------------------------------------------------


def config_key(name: str, kind: Kind, help: str, value: Any, **more: Any) -> Option:
    """A key of the config file: its help, its value when left out, and what else its row says."""
    return Option(name, kind, help, more.pop("default", repr(value)), value=value, api=False, cli=None, **more)


def _number(name: str, help: str, value: float | None, least: float, most: float) -> Option:
    return config_key(name, "number", help, value, least=least, most=most)


def _positive_int(name: str, help: str, value: int) -> Option:
    return config_key(name, "int", help, value, least=1, wrong="{name} must be a positive integer")


#: An ``[mcp_servers.NAME]`` table: an MCP server whose tools ``/api/chat`` may run.
MCP_KEYS: tuple[Option, ...] = (
    config_key("command", "text", "The program of a stdio server", None, check=_program),
    config_key("args", "texts", "Its arguments", ()),
    config_key("env", "map", "Variables it runs with", {}, default="{}", wrong="{name} must map names to strings"),
    config_key("cwd", "text", "The folder it runs in", None, wrong="{name} must be a folder"),
    config_key("url", "text", "The address of a streamable-HTTP server", None, check=_http_url),
)

#: ``[tools.python]``: the built-in python tool's switch and limits.
PYTHON_KEYS: tuple[Option, ...] = (
    config_key("enabled", "bool", "Offer the python tool", False),
    config_key(
        "timeout",
        "number",
        "Wall-clock seconds per call",
        30.0,
        check=_positive,
        wrong="{name} must be a positive number",
    ),
    _positive_int("cpu_seconds", "CPU seconds per call", 10),
    _positive_int("memory_mb", "Memory per call, MiB", 512),
    _positive_int("max_output_kb", "Output kept per call, KiB", 64),
    _positive_int("max_processes", "Processes alive at once, the program itself included", 64),
)

#: The config file's top-level keys and tables; ``[models.NAME]`` takes the load options (``config_keys``).
CONFIG_KEYS: tuple[Option, ...] = (
    config_key("host", "text", "Address the studio listens on", "127.0.0.1", env="GGUF_STUDIO_HOST"),
    config_key("port", "port", "Port the studio listens on", 8080, check=_port, env="GGUF_STUDIO_PORT"),
    config_key(
        "ollama_port",
        "port",
        "Also serve the Ollama API on this port",
        None,
        default="off",
        check=_port_or_off,
        env="GGUF_STUDIO_OLLAMA_PORT",
    ),
    config_key(
        "api_token",
        "text",
        "Bearer token every API call must send",
        None,
        default="none; generated beyond loopback",
        check=_token,
        env="GGUF_STUDIO_API_TOKEN",
    ),
    config_key(
        "model_dirs",
        "texts",
        "More folders of GGUF files for the library",
        (),
        check=_folders,
        wrong="{name} must be a list of folders",
        env="GGUF_STUDIO_MODEL_DIRS",
        env_sep=os.pathsep,
    ),
    config_key(
        "rpc_workers",
        "texts",
        "ggml-rpc-server workers (ggstudio rpc-worker) to split layers over, host:port",
        (),
        check=_rpc_workers,
        wrong='{name} must be a list of "host:port" strings',
        env="GGUF_STUDIO_RPC_WORKERS",
    ),
    config_key(
        "allowed_origins",
        "texts",
        'Web pages that may use the studio, besides its own ("*": any)',
        (),
        check=_each(_normalize_origin),
        env="GGUF_STUDIO_ORIGINS",
    ),
    config_key(
        "allowed_hosts",
        "texts",
        "Host names it answers to, besides loopback and the address it binds",
        (),
        check=_each(_normalize_host),
        env="GGUF_STUDIO_HOSTS",
    ),
    config_key("allow_any_path", "bool", "API clients may load a .gguf from anywhere on the disk", False),
    config_key(
        "max_body_bytes",
        "int",
        "The largest request body accepted, bytes (413 above)",
        DEFAULT_MAX_BODY_BYTES,
        least=1024,
        wrong="{name} must be a number of bytes of at least 1024, not {value!r}",
        env="GGUF_STUDIO_MAX_BODY_BYTES",
    ),
    config_key(
        "auto_download",
        "bool",
        "A load of an uncached owner/repo:VARIANT downloads it first",
        False,
        env="GGUF_STUDIO_AUTO_DOWNLOAD",
    ),
    replace(BY_NAME["max_tokens"], default="4096"),
    replace(BY_NAME["max_seconds"], default="600"),
    config_key(
        "memory_budget",
        "sizes",
        'All resident models together: "6GiB", or per device: {CPU = "6GiB", CUDA0 = "20GiB"}',
        None,
        default="the planner's share of free memory",
        check=_budget,
        wrong='{name} must be a size such as "2GiB" or a table of sizes per device',
        env="GGUF_STUDIO_MEMORY_BUDGET",
    ),
    replace(BY_NAME["ttl"], help="Seconds idle before a model is unloaded (0: never)", default="0", value=0),
    config_key("max_resident", "int", "At most this many models at once", None, least=1, most=64, floors=True),
    config_key(
        "preload", "texts", "Models loaded at start, in this order", (), wrong="{name} must be a list of model names"
    ),
    _number("unload_grace", "Seconds an unload waits for requests in flight before it ends them", 10.0, 0, 3600),
    _number("busy_wait", "Seconds a load waits for busy models to go idle before a 503", 30.0, 0, 3600),
    config_key(
        "group_size",
        "int",
        "Requests a busy model still takes once a load waits for its memory (0: none)",
        4,
        least=0,
        most=1000,
        floors=True,
    ),
    config_key(
        "slot_cache_disk",
        "size",
        "Disk for conversations saved before an eviction; 0: none saved",
        SLOT_CACHE_DISK,
        default="4GiB",
        check=_slot_cache_disk,
    ),
    config_key(
        "activity_days",
        "number",
        "Days each request's and load's activity record is kept (0: none is made)",
        7.0,
        least=0,
        most=3650,
        env="GGUF_STUDIO_ACTIVITY_DAYS",
    ),
    _positive_int("activity_records", "Activity records kept at most, the oldest dropped first", 50_000),
    config_key(
        "default_for_unknown",
        "bool",
        "A request naming no known model goes to the default (llama-server's way)",
        False,
    ),
    config_key(
        "aliases",
        "map",
        "Extra names a client may send as model: a model name, a .gguf path, or owner/repo:VARIANT",
        {},
        default="{}",
        wrong="[aliases] must map names to model names or paths (strings)",
    ),
    config_key(
        "models",
        "tables",
        "Load defaults per model (a request's own values win)",
        {},
        default="{}",
        table=OPTIONS,
        wrong="[models] must hold one table per model: [models.NAME]",
    ),
    config_key(
        "mcp_servers",
        "tables",
        "MCP servers whose tools /api/chat may run (stdio: a command; streamable HTTP: a url)",
        {},
        default="{}",
        table=MCP_KEYS,
        wrong="[mcp_servers] must hold one table per server: [mcp_servers.NAME]",
    ),
    config_key(
        "tools",
        "table",
        "The built-in tools",
        {},
        default="{}",
        table=(
            config_key(
                "python",
                "table",
                "The python tool, off unless enabled",
                {},
                default="{}",
                table=PYTHON_KEYS,
                wrong="[tools.python] must be a table",
            ),
        ),
        unknown="holds only [tools.python]",
        wrong="[tools] holds only [tools.python]",
    ),
)
#: Each top-level key by name.
CONFIG_KEY: Mapping[str, Option] = MappingProxyType({o.name: o for o in CONFIG_KEYS})


@cache
def config_keys(options: tuple[Option, ...] = OPTIONS) -> tuple[Option, ...]:
    """The config file's keys with ``options`` as the keys of a ``[models.NAME]`` table."""
    return tuple(replace(o, table=options) if o.name == "models" else o for o in CONFIG_KEYS)


_TOP_KEYS = frozenset(CONFIG_KEY)
#: The keys of a ``[models.NAME]`` table: the load options (``studio.load_options``).
_MODEL_KEYS = frozenset(BY_NAME)
#: (least, most) for the residency keys, in seconds or models.
RESIDENCY_LIMITS: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        k: (CONFIG_KEY[k].least or 0, CONFIG_KEY[k].most or 0)
        for k in ("ttl", "max_resident", "unload_grace", "busy_wait", "group_size")
    }
)
#: A variable set to "" lists none (over the file's list); any other variable set to "" counts as unset.
_EMPTY_IS_NONE = frozenset({"allowed_origins", "allowed_hosts"})


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
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return cls(total=parse_size(value))
        except ValueError as exc:
            raise ValueError(joined(where, str(exc)) if where else str(exc)) from None
        raise ValueError(
            joined(where or "memory_budget", 'must be a size such as "2GiB" or a table of sizes per device')
        )


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
    activity_days: float = 7.0  # how long activity records are kept; 0: none are made
    activity_records: int = 50_000

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
        values = config_values(env, config_keys(tuple(options)))
        tools = values["tools"]
        return cls(
            home=home,
            llama_server_path=_optional_path(env.get("LLAMA_SERVER_PATH")),
            llama_cpp_dir=_optional_path(env.get("GGUF_STUDIO_LLAMA_CPP")),
            host=values["host"],
            port=values["port"],
            ollama_port=values["ollama_port"],
            log_json=env_flag(env, "GGUF_STUDIO_LOG_JSON") or False,
            cmake_args=env.get("CMAKE_ARGS", ""),
            api_token=values["api_token"],
            model_dirs=values["model_dirs"],
            max_body_bytes=values["max_body_bytes"],
            auto_download=values["auto_download"],
            aliases=MappingProxyType(dict(values["aliases"])),
            rpc_workers=values["rpc_workers"],
            rpc_server_path=_optional_path(env.get("GGML_RPC_SERVER_PATH")),
            model_defaults=MappingProxyType({name: ModelDefaults.of(t) for name, t in values["models"].items()}),
            residency=ResidencySettings(
                memory_budget=values["memory_budget"],
                ttl=values["ttl"],
                max_resident=values["max_resident"],
                preload=tuple(values["preload"]),
                unload_grace=values["unload_grace"],
                busy_wait=values["busy_wait"],
                group_size=values["group_size"],
                slot_cache_disk=values["slot_cache_disk"],
                default_for_unknown=values["default_for_unknown"],
            ),
            tools=ToolSettings(
                mcp_servers=MappingProxyType(
                    {name: _server(name, table) for name, table in values["mcp_servers"].items()}
                ),
                python=PythonToolConfig(**tools.get("python", {})),
            ),
            allowed_origins=values["allowed_origins"],
            allowed_hosts=values["allowed_hosts"],
            allow_any_path=values["allow_any_path"],
            sampling=Sampling(max_tokens=values["max_tokens"], max_seconds=values["max_seconds"]),
            activity_days=values["activity_days"],
            activity_records=values["activity_records"],
        )


def config_values(env: Mapping[str, str], keys: Sequence[Option] = CONFIG_KEYS) -> dict[str, Any]:
    """Each of ``keys`` from its environment variable, else the config file, else its row's value.

    Raises:
        ValueError: what is wrong, naming the variable, or the file with its table and key.
    """
    path = Path(env.get("GGUF_STUDIO_CONFIG") or studio_home(env) / "config.toml").expanduser()
    return {
        **{o.name: o.value for o in keys},
        **_read_config(path, explicit="GGUF_STUDIO_CONFIG" in env, keys=keys),
        **_env_values(env, keys),
    }


def _read_config(path: Path, *, explicit: bool, keys: Sequence[Option] = CONFIG_KEYS) -> dict[str, Any]:
    """The keys the TOML config at ``path`` sets, read through the pydantic model of ``keys`` and checked, or {}
    when there is none (and none was asked for).

    Raises:
        ValueError: the file, and what is wrong in it: each problem's table, key, and what to write.
    """
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
    values, problems = config_problems(config, keys)
    for name, table in values.get("mcp_servers", {}).items():
        problems += _server_problems(f"[mcp_servers.{name!r}]", name, table)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return values


def _env_values(env: Mapping[str, str], keys: Sequence[Option]) -> dict[str, Any]:
    """The keys their environment variables set, each read as its row says.

    Raises:
        ValueError: the variable, and what is wrong with its value.
    """
    values: dict[str, Any] = {}
    for key in keys:
        text = env.get(key.env) if key.env else None
        if key.env is None or text is None or (text == "" and key.name not in _EMPTY_IS_NONE):
            continue
        value: Any = text
        if key.kind == "bool":
            value = env_flag(env, key.env)
        elif key.kind == "texts":
            value = tuple(item.strip() for item in text.split(key.env_sep) if item.strip())
        elif key.kind in ("int", "number"):
            try:
                value = int(text) if key.kind == "int" else float(text)
            except ValueError:
                value = None
            if value is None or not (key.least or value) <= value <= (key.most or value):
                raise ValueError(f"{key.must(text, name=key.env)} (the variable of the config key {key.name})")
        if key.check is not None:
            try:
                value = key.check(value)
            except ValueError as exc:
                raise ValueError(joined(key.env, str(exc))) from None
        values[key.name] = value
    return values


def _server_problems(where: str, name: str, table: Mapping[str, Any]) -> list[str]:
    """What is wrong with one ``[mcp_servers.NAME]`` table beyond its keys' types."""
    problems = []
    if not _SERVER_NAME.fullmatch(name):
        problems.append(f"{where}: a server name is 1-32 letters, digits, '_' or '-' (it prefixes tool names)")
    if ("command" in table) == ("url" in table):
        problems.append(f"{where}: give either command (a stdio server) or url (streamable HTTP)")
    if "url" in table and any(k in table for k in ("args", "env", "cwd")):
        problems.append(f"{where}: args, env and cwd are for a command, not a url")
    return problems


def _server(name: str, table: Mapping[str, Any]) -> MCPServerConfig:
    d = {**{o.name: o.value for o in MCP_KEYS}, **table}
    return MCPServerConfig(
        name=name,
        command=d["command"],
        args=tuple(d["args"]),
        env=MappingProxyType(dict(d["env"])),
        cwd=_optional_path(d["cwd"]),
        url=d["url"],
    )


def _optional_path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None
