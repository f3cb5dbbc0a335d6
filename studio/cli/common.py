"""What every ``ggstudio`` command shares: the app, errors as a line and an exit code, settings, a running studio.

The command groups live beside it, one module each (``service``, ``models``, ``library``, ``chat``,
``build``, ``rpc``); ``studio.cli.app`` is the entry point that gathers them. Annotations here and
there are evaluated once, not as strings (no ``from __future__ import annotations``): typer reads
every command's signature at each start and compiled each string annotation anew, about 20 ms per
start. Names imported only for type checking are quoted.
"""

import functools
import inspect
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from launcher.errors import BuildError, LauncherError, ProcessError
from studio.cli.help_options import HELP_OPTIONS
from studio.errors import AnsweredError, CommandError, Exit, StudioError
from studio.load_options import OPTIONS, Option, api_options

if TYPE_CHECKING:  # the service's modules load only in the commands that need them
    from typer._click.core import Context  # typer carries its own click
    from typer._click.formatting import HelpFormatter

    from launcher.discovery import Discovered
    from studio.instance import Discovery
    from studio.library.catalog import Catalog, CatalogEntry
    from studio.library.hub_search import VariantHeaders
    from studio.residency.manager import ModelManager
    from studio.settings import Settings


class _Commands(TyperGroup):
    """The command group, whose listing shows each command's first sentence whole (wrapped, never cut)."""

    def format_commands(self, ctx: "Context", formatter: "HelpFormatter") -> None:
        """List the commands; click would cut each line at the terminal's width with "..." instead."""
        found = ((name, self.get_command(ctx, name)) for name in self.list_commands(ctx))
        rows = [(name, cmd.get_short_help_str(limit=sys.maxsize)) for name, cmd in found if cmd and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    name="ggstudio",
    cls=_Commands,
    help="GGUF Studio: run GGUF models locally with a supervised llama-server.",
    context_settings={"help_option_names": list(HELP_OPTIONS)},  # the subcommands inherit it
    invoke_without_command=True,  # bare `ggstudio`: the help, exit 0 (the root callback prints it)
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rendering it with rich imports rich, most of what `ggstudio --help` cost (scripts/bench_cli.py).
    rich_markup_mode=None,
)


@dataclass
class CliState:
    """What the root options set for the whole command line."""

    debug: bool = False  # the root ``--debug``: errors then show their traceback and llama-server's output too
    warned_discovery: bool = False  # a garbage discovery file is named once per command, not per call


state = CliState()


# -- exit codes and the one place errors become a line ---------------------------------------------


def exit_code(exc: BaseException) -> int:
    """Return the exit code ``studio.error_table`` gives ``exc`` (1 for an error that is no one's)."""
    from studio.error_table import outcome  # loads the layers' errors: only once something failed

    found = outcome(exc)
    return found.exit if found is not None else Exit.ERROR


def error_lines(exc: BaseException) -> list[str]:
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
    if state.debug and isinstance(exc, ProcessError) and exc.log_tail:
        lines.append(f"--- last lines of llama-server's output ---\n{exc.log_tail}")
    return lines


def studio_settings() -> "Settings":
    """The settings from the environment and the config file (imported here: ``--help`` needs none of it)."""
    from studio.settings import Settings

    return Settings.from_env()


def as_json(value: Any) -> str:
    """``value`` as indented JSON (``json`` imported on use: commands that print none start faster)."""
    import json

    return json.dumps(value, indent=2)


def find_binary(settings: "Settings") -> "Discovered":
    """The llama-server to use (``launcher.discovery.find_llama_server``: LLAMA_SERVER_PATH, else a search)."""
    return find_build(settings)[0]


def find_build(settings: "Settings") -> tuple["Discovered", dict[str, Any]]:
    """The llama-server to use, and which build it is and why (``launcher.backends.running_build``).

    Of the pinned builds, the one whose backend reaches this machine's GPUs runs (``launcher.backends``).
    """
    from launcher.backends import choose_backend, detect_machine, running_build
    from launcher.discovery import find_llama_server

    choice = choose_backend(detect_machine())
    found = find_llama_server(
        home=settings.home,
        explicit=settings.llama_server_path,
        llama_cpp_dir=settings.llama_cpp_dir,
        backends=choice.run_order,
    )
    return found, running_build(found, choice)


def catalog_of(settings: "Settings") -> "Catalog":
    """Every model the studio can serve: the models dirs and the Hugging Face cache."""
    from studio.library.catalog import Catalog
    from studio.library.hub import HubConfig

    return Catalog(
        [settings.models_dir, *settings.model_dirs], hf_cache=HubConfig.from_env().cache_dir, aliases=settings.aliases
    )


def model_entry(settings: "Settings", model: str) -> "tuple[CatalogEntry, VariantHeaders | None]":
    """The catalog entry of ``model`` (a name, an alias, a path), as ``plan`` and ``inspect`` find it.

    An ``owner/repo:VARIANT`` not downloaded is its header, read from the Hub and kept
    (``studio.library.hub_search``), returned beside it.

    Raises:
        ModelNotFoundError: neither a known name, a file, nor a Hub repo's variant (exit 3).
    """
    from studio.errors import ModelNotFoundError
    from studio.library.downloads import is_repo_spec

    catalog = catalog_of(settings)
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


def model_manager(
    settings: "Settings", rpc_workers: tuple[str, ...] = (), *, reap_orphans: bool = True
) -> tuple["ModelManager", "Discovered"]:
    """A model manager over the models dir with the llama-server found here (orphans of earlier runs reaped,
    unless ``reap_orphans`` is False: ``plan`` starts nothing, and leaves them to the commands that do).

    With ``rpc_workers``, every plan asks them for their devices (``launcher.rpc.RpcWorkers``).
    """
    import psutil

    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.registry import ChildRegistry
    from launcher.rpc import RpcWorkers
    from launcher.supervisor import owner_token
    from studio.library.default_model import builtin_model_defaults
    from studio.library.downloads import DownloadManager
    from studio.residency.manager import ModelManager, supervisor_factory
    from studio.residency.slot_cache import SlotCache

    found, build = find_build(settings)
    registry = ChildRegistry(settings.home / "run", owner_token())
    if reap_orphans:
        registry.reap_orphans()
    workers = RpcWorkers(rpc_workers) if rpc_workers else None
    manager = ModelManager(
        catalog=catalog_of(settings),
        binary=found.path,
        build=build,
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
        own_memory=lambda: psutil.Process().memory_info().rss,
        sampling=settings.sampling,
    )
    return manager, found


def with_load_options(
    options: "Sequence[Option]" = OPTIONS,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command an option for each load option the load API takes, derived from ``studio.load_options``
    (flag, type, bounds, help); the command receives those given as ``options``, by the API's names."""
    rows = [o for o in api_options(options) if o.flag]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(command).parameters.values()]
        own = [p for p in own if p.name != "options"]
        last = [p for p in own if p.name in ("json_output", "url")]  # the load options go before these
        added = [
            inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_cli_option(o))
            for o in rows
        ]
        params = [*(p for p in own if p not in last), *added, *last]

        @functools.wraps(command)
        def run(**given: Any) -> Any:
            values = {o.name: given.pop(o.name, None) for o in rows}
            return command(**given, options=_checked_options(rows, values))

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate


def _cli_option(option: "Option") -> Any:
    """The typer annotation of ``option``'s command-line flag."""
    flag = option.flag or ""
    if option.kind == "bool" and "/" not in flag:
        flag = f"{flag}/--no-{flag.removeprefix('--')}"
    kind: Any = {"int": int, "number": float, "bool": bool, "texts": list[str]}.get(option.kind, str)
    ranged = option.kind in ("int", "number")
    least, most = (option.least, option.most) if ranged else (None, None)
    return Annotated[kind | None, typer.Option(flag, help=option.described, min=least, max=most)]


def _checked_options(rows: "Sequence[Option]", values: dict[str, Any]) -> dict[str, Any]:
    """The options given, by the load API's names; a choice taken in any case, and refused naming its flag."""
    out = {}
    for option in rows:
        value = values.get(option.name)
        if value is None:
            continue
        if option.kind == "choice":
            value = str(value).lower()
            if value not in option.allowed():
                raise typer.BadParameter(option.must(value), param_hint=option.flag)
        out[option.name] = value
    return out


RpcOption = Annotated[
    str | None,
    typer.Option(
        "--rpc",
        metavar="HOST:PORT,...",
        help="RPC workers (`ggstudio rpc-worker`) to split the layers over (default: rpc_workers in the config file; "
        "'' for none).",
    ),
]


def chosen_rpc_workers(option: str | None, settings: "Settings") -> tuple[str, ...]:
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


@contextmanager
def graceful_termination() -> Iterator[Callable[[], None]]:
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
    str | None,
    typer.Option(
        help="The studio's address (default: the one running in this studio home, else "
        "http://GGUF_STUDIO_HOST:GGUF_STUDIO_PORT)."
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def studio_url(url: str | None, settings: "Settings") -> str:
    """The studio to call: ``url`` when given, else the one running in the studio home (its discovery file,
    ``studio.instance``), else the configured host and port."""
    if url:
        return url.rstrip("/")
    found = discovered_studio(settings)
    if found is not None:
        return found.url
    host = "127.0.0.1" if settings.host in ("", "0.0.0.0") else "::1" if settings.host == "::" else settings.host
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"


def discovered_studio(settings: "Settings") -> "Discovery | None":
    """The studio running in the studio home, or None; a discovery file that is garbage is named in a warning."""
    from studio.instance import running_studio

    try:
        return running_studio(settings.home)
    except ValueError as exc:
        if not state.warned_discovery:
            state.warned_discovery = True
            typer.echo(f"warning: {exc}; ignored (a new `ggstudio serve` replaces it)", err=True)
        return None


def call_studio(
    method: str, url: str | None, path: str, *, body: dict[str, Any] | None = None, timeout: float | None = 30
) -> dict[str, Any]:
    """Call a running studio and return its JSON answer; errors become ``CommandError`` with an exit code."""
    import httpx

    base, headers = _studio_base(url)
    with _reaching(base, path):
        resp = httpx.request(method, base + path, json=body, headers=headers, timeout=httpx.Timeout(timeout, connect=5))
    if resp.status_code >= 400:
        raise answered_error(resp.status_code, resp.content, base)
    try:
        return resp.json()
    except ValueError:
        raise CommandError(f"{base} answered {path} with something that is not JSON: is it a GGUF Studio?") from None


def stream_studio_events(url: str | None, path: str) -> Iterator[dict[str, Any]]:
    """Yield the server-sent events of a running studio's ``path`` as JSON objects, until it ends the stream."""
    import json

    import httpx

    base, headers = _studio_base(url)
    with (
        _reaching(base, path),
        httpx.stream("GET", base + path, headers=headers, timeout=httpx.Timeout(None, connect=5)) as resp,
    ):
        if resp.status_code >= 400:
            raise answered_error(resp.status_code, resp.read(), base)
        for line in resp.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[6:])


def _studio_base(url: str | None) -> tuple[str, dict[str, str]]:
    """The running studio's address (``--url``, its discovery file, the config) and the headers its API takes."""
    settings = studio_settings()
    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    return studio_url(url, settings), headers


@contextmanager
def _reaching(base: str, path: str) -> Iterator[None]:
    """Turn a failure to reach the studio at ``base`` (or to hear its answer to ``path``) into a ``CommandError``."""
    import httpx

    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise CommandError(
            f"no GGUF Studio is running at {base} (start one with `ggstudio serve`, or pass --url)"
        ) from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise CommandError(f"the studio at {base} did not answer {path}: {exc or type(exc).__name__}") from exc


def answered_error(status: int, content: bytes, base: str) -> AnsweredError:
    """A running studio's error answer; its exit code follows from its code or status (``studio.error_table``)."""
    error = AnsweredError.from_body(status, content, server=base)
    if error.type is None:
        error.hint = "is it a GGUF Studio?"
    elif status == 401:
        error.hint = "set GGUF_STUDIO_API_TOKEN to the studio's token"
    return error
