"""``ggstudio serve``: the studio service in the foreground, with its models, until Ctrl-C."""

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
    serve_studio(model, host=host, port=port, ctx=ctx, rpc=rpc, no_auth=no_auth, ollama_port=ollama_port)


def serve_studio(
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

    settings = studio_settings()
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
    host = host or settings.host
    port = port or settings.port
    ollama_port = ollama_port or settings.ollama_port
    ensure_port_free(host, port)
    if ollama_port is not None:
        ensure_port_free(host, ollama_port)
    workers = chosen_rpc_workers(rpc, settings)
    token, generated = _api_token(settings, host, no_auth=no_auth)
    access = AccessPolicy.create(
        bind_host=host, allowed_hosts=settings.allowed_hosts, allowed_origins=settings.allowed_origins
    )
    # the model named here is the user's choice: API clients may reload it by its path too
    paths = PathPolicy.for_catalog(catalog, home=settings.home, files=named, allow_any=settings.allow_any_path)
    manager, found = model_manager(settings, workers)
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
