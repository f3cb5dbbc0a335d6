"""``ggstudio run``: load a model and chat with it in the terminal (``studio.cli.terminal_chat``)."""

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from studio.cli.common import (
    RpcOption,
    app,
    chosen_rpc_workers,
    discovered_studio,
    exit_code,
    graceful_termination,
    model_manager,
    state,
    studio_settings,
)
from studio.cli.service import serve_studio
from studio.errors import CommandError, Exit

if TYPE_CHECKING:  # the service's modules load only in the commands that need them
    import httpx

    from studio.cli.terminal_chat import LocalStudio
    from studio.residency.manager import ModelManager
    from studio.settings import Settings


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
    max_tokens: Annotated[
        int | None, typer.Option(help="Most tokens per answer (default: the model's max_tokens, else 4096).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Sampling seed, for an answer that repeats (default: random).")
    ] = None,
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

        ggstudio run SmolLM2-135M-Instruct.Q4_1

        ggstudio run ./model.gguf --ctx 8192 --once "Name three primes."

        ggstudio run ./model.gguf --serve-only --port 8081
    """
    if serve_only:
        if once is not None or max_tokens is not None or seed is not None:
            raise typer.BadParameter(
                "--once, --max-tokens and --seed are for a chat, not --serve-only", param_hint="--serve-only"
            )
        serve_studio(model, host=host, port=port, ctx=ctx, rpc=rpc)
        return
    if host is not None or port is not None:
        raise typer.BadParameter("--host and --port go with --serve-only", param_hint="--host/--port")
    options = {k: v for k, v in (("max_tokens", max_tokens), ("seed", seed)) if v is not None}
    settings = studio_settings()
    running = discovered_studio(settings)
    if running is not None:  # this home's studio holds the memory: chat through it rather than beside it
        _chat_in(running.url, settings, model=model, ctx=ctx, once=once, options=options, force=force)
        return
    from studio.cli.terminal_chat import LocalStudio
    from studio.instance import HomeLock
    from studio.logs import configure_logging, log_file

    workers = chosen_rpc_workers(rpc, settings)
    with HomeLock.acquire(settings.home, "run"), graceful_termination() as threads_started:
        import logging

        # the chat owns the terminal: only warnings and errors may interleave with it; the file gets it all
        console = logging.INFO if state.debug else logging.WARNING
        configure_logging(json_lines=settings.log_json, level=console, file=log_file(settings.home))
        manager, _ = model_manager(settings, workers)
        with LocalStudio(manager) as studio:
            threads_started()
            _chat(studio, manager, model=model, ctx=ctx, once=once, options=options, force=force)


def _chat(
    studio: "LocalStudio",
    manager: "ModelManager",
    *,
    model: str,
    ctx: int | None,
    once: str | None,
    options: dict[str, int],
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
        loaded = studio.load(request.replace(force=force), progress=sys.stderr if sys.stderr.isatty() else None)
    except gguf_error as exc:
        if exit_code(exc) == Exit.NOT_FOUND:
            raise
        raise CommandError(f"cannot load {model}: {exc}", exit=Exit.LLAMA_FAILED) from exc
    with studio.client() as client:
        _tell_if_base_model(client, loaded.name)
        if once is not None:
            answer_once(client, once, options=options)
        else:
            chat_loop(client, model=loaded.name, options=options)


def _chat_in(
    url: str,
    settings: "Settings",
    *,
    model: str,
    ctx: int | None,
    once: str | None,
    options: dict[str, int],
    force: bool,
) -> None:
    """Load ``model`` in the studio running at ``url``, then answer ``once`` or chat until the user ends it."""
    import httpx

    from studio.cli.models import load_in_studio
    from studio.cli.terminal_chat import answer_once, chat_loop

    typer.echo(f"using the studio running at {url}", err=True)
    status = load_in_studio(url, model, {"model": model, "n_ctx": ctx}, force=force)
    name = str(status.get("model") or model)
    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    with httpx.Client(base_url=url, timeout=httpx.Timeout(None, connect=5), headers=headers) as client:
        _tell_if_base_model(client, name)
        if once is not None:
            answer_once(client, once, options=options, model=name)
        else:
            chat_loop(client, model=name, options=options, request_model=name)


def _tell_if_base_model(client: "httpx.Client", model: str) -> None:
    from studio.cli.terminal_chat import base_model_notice

    notice = base_model_notice(client, model)
    if notice:
        typer.echo(notice, err=True)


def _gguf_error_type() -> type[Exception]:
    from gguf.errors import GGUFError

    return GGUFError
