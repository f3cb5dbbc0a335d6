"""``ggstudio serve``: the studio service in the foreground, with its models, until Ctrl-C."""

import errno
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from studio.cli.common import (
    RpcOption,
    app,
    catalog_of,
    chosen_rpc_workers,
    model_manager,
    studio_settings,
)

if TYPE_CHECKING:  # the service's modules load only in the commands that need them
    import asyncio
    from collections.abc import Callable, Sequence
    from typing import TextIO

    from studio.http.server import Listeners
    from studio.instance import HomeLock
    from studio.residency.manager import ModelManager
    from studio.residency.requests import LoadRequest
    from studio.settings import Settings


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
            help="Address to listen on (default 127.0.0.1); loopback ones may be a comma-separated list "
            "(127.0.0.1,::1). Beyond loopback an API token is required; without GGUF_STUDIO_API_TOKEN one is "
            "generated and printed."
        ),
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Port to listen on (default 8080); 0: a free one (see --ready-json).")
    ] = None,
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
    ready_json: Annotated[
        bool,
        typer.Option(
            "--ready-json",
            help='For a program that starts the studio: once it answers, print one JSON line {"url", "pid", '
            '"version", "token"} on stdout (the token only when generated for this run) and nothing else there.',
        ),
    ] = False,
    exit_with_parent: Annotated[
        bool,
        typer.Option(
            "--exit-with-parent",
            help="Unload the models and exit when the program that started this one ends (its end of a stdin pipe "
            "closes, or this process is handed to another parent), SIGKILL included.",
        ),
    ] = False,
) -> None:
    """Run the studio: its page and APIs, with a model loaded.

    Serves the GUI, the OpenAI and Anthropic APIs (and optionally Ollama's) until Ctrl-C. One studio runs per
    studio home: a second `serve` says where the first one is and exits with code 6.
    """
    serve_studio(
        model,
        host=host,
        port=port,
        ctx=ctx,
        rpc=rpc,
        no_auth=no_auth,
        ollama_port=ollama_port,
        ready_json=ready_json,
        exit_with_parent=exit_with_parent,
    )


def serve_studio(
    model: str | None,
    *,
    host: str | None,
    port: int | None,
    ctx: int | None,
    rpc: str | None,
    no_auth: bool = False,
    ollama_port: int | None = None,
    ready_json: bool = False,
    exit_with_parent: bool = False,
) -> None:
    """Serve until Ctrl-C, SIGTERM or (``exit_with_parent``) the parent's end, holding the studio home's lock."""
    import os

    from studio.instance import HomeLock

    parent = os.getppid()  # now: a parent that dies while the models resolve is still seen to have gone
    settings = studio_settings()
    # first of all: a second studio on this home stops here, before it resolves or loads anything
    with HomeLock.acquire(settings.home, "serve") as held:
        from studio.logs import configure_logging, log_file

        configure_logging(json_lines=settings.log_json, file=log_file(settings.home))  # the home is ours now
        _serve_holding(
            held,
            settings,
            model,
            host=host,
            port=port,
            ctx=ctx,
            rpc=rpc,
            no_auth=no_auth,
            ollama_port=ollama_port,
            ready_json=ready_json,
            parent=parent if exit_with_parent else None,
        )
    typer.echo("stopped", err=True)


def _serve_holding(
    held: "HomeLock",
    settings: "Settings",
    model: str | None,
    *,
    host: str | None,
    port: int | None,
    ctx: int | None,
    rpc: str | None,
    no_auth: bool,
    ollama_port: int | None,
    ready_json: bool,
    parent: int | None,
) -> None:
    """Start the first model, then build and run the service while it loads.

    What a model's start needs (the catalog, the manager, its plan) is imported first; the web stack (FastAPI,
    uvicorn, the app's routes: most of a start's imports) is imported and built in a thread while llama-server
    loads (``_serve_while_loading``), so the first answer waits for the longer of the two, not their sum.
    """
    from launcher.errors import PortInUseError
    from launcher.process import ensure_port_free
    from studio.library.default_model import ensure_default_model
    from studio.residency.requests import LoadRequest

    ready_out = _claim_stdout() if ready_json else None
    catalog = catalog_of(settings)
    preload = list(settings.residency.preload)
    for name in preload:
        catalog.resolve(name)  # a name that is nowhere fails now, not in the log
    named: list[Path] = []
    if model is not None:
        named = [catalog.resolve(model).path]
        preload = [model, *(p for p in preload if p != model)]
    elif not preload:
        preload = [str(ensure_default_model(settings.models_dir))]
    hosts = listen_hosts(host or settings.host)
    host = hosts[0]  # the address the studio is announced at; the token and the Host check go by it
    port = port if port is not None else settings.port
    ollama_port = ollama_port or settings.ollama_port
    sockets = []
    if port == 0 or len(hosts) > 1:  # bound now, so the port is known before the service starts and nobody takes it
        from launcher.process import listening_socket

        for address in hosts:
            try:
                sockets.append(listening_socket(address, port))
            except OSError as exc:
                for bound in sockets:
                    bound.close()
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(address, port) from exc
                raise
            port = sockets[0].getsockname()[1]  # port 0: the others take the one the first was given
    else:
        ensure_port_free(host, port)
    if ollama_port is not None:
        ensure_port_free(host, ollama_port)
    workers = chosen_rpc_workers(rpc, settings)
    token, generated = _api_token(settings, host, no_auth=no_auth)
    manager, found = model_manager(settings, workers)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    typer.echo(f"loading {', '.join(preload)} with llama-server ({found.source}: {found.path}) ...", err=True)
    requests = [LoadRequest(model=name, n_ctx=ctx if i == 0 else None) for i, name in enumerate(preload)]
    ollama_line = f", Ollama API: {url.rsplit(':', 1)[0]}:{ollama_port}" if ollama_port is not None else ""

    def announce() -> None:
        from studio import __version__

        found = held.publish(client_url(host, port), token_required=token is not None, version=__version__)
        typer.echo(
            f"GGUF Studio at {url}/  (open it in a browser; OpenAI API: {url}/v1, Anthropic API: {url}, "
            f"GUI API: {url}/api{ollama_line}, metrics: {url}/metrics, docs: {url}/docs; Ctrl-C stops)",
            err=ready_out is not None,
        )
        if ready_out is not None:  # the one line on stdout; the token only when it was made for this run
            import json

            line = {"url": found.url, "pid": found.pid, "version": found.version, "token": token if generated else None}
            ready_out.write(json.dumps(line) + "\n")
            ready_out.flush()
        elif generated:  # printed once, here, and nowhere else: it is not logged
            typer.echo(
                f"API token for this run: {token}  (send `Authorization: Bearer <token>` or "
                "`x-api-key: <token>`; set GGUF_STUDIO_API_TOKEN to choose your own)"
            )

    def listeners() -> "Listeners":
        """The service around ``manager``: imported and built while the first model loads."""
        from studio.activity.store import Retention
        from studio.chat.toolbox import Toolbox
        from studio.history.service import History
        from studio.http.app import create_app
        from studio.http.clients.ollama_app import create_ollama_app, main_port_hint
        from studio.http.guards.access import AccessPolicy
        from studio.http.server import Listeners
        from studio.library.hub_headers import header_cache
        from studio.library.paths import PathPolicy

        access = AccessPolicy.create(
            bind_host=host, allowed_hosts=settings.allowed_hosts, allowed_origins=settings.allowed_origins
        )
        # the model named here is the user's choice: API clients may reload it by its path too
        paths = PathPolicy.for_catalog(catalog, home=settings.home, files=named, allow_any=settings.allow_any_path)
        app = create_app(
            manager,
            api_token=token,
            access=access,
            paths=paths,
            toolbox=Toolbox(settings.tools, scratch_dir=settings.home / "scratch", logs_dir=settings.logs_dir),
            max_body_bytes=settings.max_body_bytes,
            downloads=manager.downloads,
            history=History(settings.history_dir),
            hub_headers=header_cache(settings.home),
            not_found_hint=functools.partial(main_port_hint, ollama_port=ollama_port),
            activity_kept=Retention(settings.activity_days * 86400, settings.activity_records)
            if settings.activity_days > 0
            else None,
        )
        ollama_app = create_ollama_app(app, api_token=token, access=access) if ollama_port is not None else None
        return Listeners(
            app,
            host=host,
            port=port,
            ollama_app=ollama_app,
            ollama_port=ollama_port,
            announce=announce,
            sockets=sockets,
        )

    try:
        _serve_while_loading(manager, requests, listeners, parent)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after a clean shutdown: that is a normal stop
        pass
    finally:
        manager.close_now()  # the app's shutdown did it, unless uvicorn never started
        for sock in sockets:
            sock.close()


def _serve_while_loading(
    manager: "ModelManager",
    requests: "Sequence[LoadRequest]",
    build: "Callable[[], Listeners]",
    parent: int | None,
) -> None:
    """Run the service on one event loop in this (the main) thread: begin ``requests``' loads on it, then
    ``build`` the listeners in a thread while llama-server loads, then serve.

    The manager owns the loads from the start, as it does every other: the app's shutdown (or
    ``close_now``) stops them. The loop is uvicorn's ``auto`` one: uvloop where it is installed.
    """
    import asyncio

    async def serve() -> None:
        preloading = manager.start_preload(
            requests
        )  # llama-server starts now, not once uvicorn is imported and started
        if preloading is not None:
            await _first_start_begun(manager, preloading)
        listeners = await asyncio.to_thread(build)
        if parent is not None:
            _stop_with_parent(listeners, parent)
        await listeners.serve()

    try:
        import uvloop

        new_loop: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # no uvloop (Windows): asyncio's own loop
        new_loop = None
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(serve())


#: Seconds ``serve`` waits for its first model's llama-server to be started before it imports the web stack
#: anyway: a plan that waits (for a download, for a slow device query) must not keep the service from listening.
FIRST_START_WAIT = 0.5
FIRST_START_POLL = 0.002


async def _first_start_begun(manager: "ModelManager", preloading: "asyncio.Task[None]") -> None:
    """Return once a model is resident (its llama-server being started), the preload ended, or after
    ``FIRST_START_WAIT`` s: until then the web stack's imports would take the interpreter from the plan and the
    start (one thread runs Python at a time), ~45 ms of work that took ~65 ms beside them (traced).

    It looks every ``FIRST_START_POLL`` s: a new resident is announced (``manager.changed``) only once it is ready.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + FIRST_START_WAIT
    while not manager.residents and not preloading.done() and loop.time() < deadline:
        await asyncio.sleep(FIRST_START_POLL)


def listen_hosts(text: str) -> list[str]:
    """The addresses ``--host`` names: one, or a comma-separated list of loopback ones (``127.0.0.1,::1``).

    A list beyond loopback is refused: the API token and the Host check are decided for one address.

    Raises:
        typer.BadParameter: an empty list, or a list with an address beyond loopback.
    """
    from studio.http.guards.access import is_loopback

    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise typer.BadParameter(f"{text!r} names no address", param_hint="--host")
    if len(hosts) > 1 and not all(is_loopback(h) for h in hosts):
        raise typer.BadParameter(
            f"{text!r}: several addresses are taken only when all are loopback ones (127.0.0.1,::1); beyond "
            "loopback listen on one address, or on all of them (0.0.0.0 or ::)",
            param_hint="--host",
        )
    return hosts


def client_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a studio listening on ``host:port`` at (any address: loopback)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _claim_stdout() -> "TextIO":
    """Keep stdout for the ready line alone: return it as a stream, and point file descriptor 1 at stderr, so
    nothing else (a library, a child) writes there."""
    import os
    import sys

    sys.stdout.flush()
    ready = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return ready


#: Seconds the studio waits for its connections to close after its parent ended, before it cuts them.
PARENT_GONE_GRACE = 2.0


def _stop_with_parent(listeners: "Listeners", parent: int) -> None:
    """Stop the service when the parent is gone: at once, then without waiting for connections after a grace."""
    import threading

    import structlog

    from launcher.platform import watch_parent

    def gone() -> None:
        structlog.get_logger("studio").info("parent_gone", action="stopping")
        listeners.stop()
        cut = threading.Timer(PARENT_GONE_GRACE, lambda: listeners.stop(force=True))
        cut.daemon = True
        cut.start()

    watch_parent(gone, parent=parent)


def _api_token(settings: "Settings", host: str, *, no_auth: bool) -> tuple[str | None, bool]:
    """The token the service requires and whether it was generated now: beyond loopback there always is one,
    unless ``--no-auth`` says otherwise."""
    import secrets

    from studio.http.guards.access import is_loopback

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
