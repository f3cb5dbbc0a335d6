"""The models of a running studio (``ps``, ``load``, ``unload``, ``logs``) and how one would be launched (``plan``)."""

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from launcher.units import format_size
from studio.cli.common import (
    JsonOption,
    RpcOption,
    UrlOption,
    app,
    as_json,
    call_studio,
    chosen_rpc_workers,
    exit_code,
    model_entry,
    model_manager,
    stream_studio_events,
    studio_settings,
    with_load_options,
)
from studio.errors import AnsweredError, CommandError, Exit, StudioError


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
        elif m.get("last_exit"):
            notes.append(f"{m['model']}: restarted {m.get('restarts', 0)}x; last: {m['last_exit']}")
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    lines = ["  ".join(k.ljust(widths[k]) for k in rows[0]).rstrip()]
    lines += ["  ".join(v.ljust(widths[k]) for k, v in r.items()).rstrip() for r in rows]
    return "\n".join(lines + notes + (["* the default model (requests without `model`)"] if len(rows) > 1 else []))


@app.command()
def ps(url: UrlOption = None, json_output: JsonOption = False) -> None:
    """Show the models a running studio holds.

    Each one's state, context, memory, pid, requests, idle time and TTL:

    ggstudio ps --url http://127.0.0.1:8081 --json
    """
    status = call_studio("GET", url, "/api/status")
    typer.echo(as_json(status) if json_output else _status_text(status))


@app.command()
@with_load_options()
def load(
    model: Annotated[str, typer.Argument(help="A model name in the studio's models dir, or a .gguf path.")],
    force: Annotated[
        bool, typer.Option("--force", help="Load even when the plan says the model does not fit in memory.")
    ] = False,
    url: UrlOption = None,
    json_output: JsonOption = False,
    options: dict[str, Any] | None = None,
) -> None:
    """Load a model into a running studio.

    Idle models are evicted if it needs their memory:

    ggstudio load gemma-3-270m-Q4_K_M --ctx 4096 --threads 2 --chat-template chatml
    """
    body: dict[str, Any] = {"model": model, **(options or {})}
    status = load_in_studio(url, model, body, force=force)
    if json_output:
        typer.echo(as_json(status))
    else:
        context = status.get("effective_context")
        typer.echo(
            f"loaded {status.get('model')}"
            + (f" (context {context:,} tokens, pid {status.get('pid')})" if context else "")
        )


def load_in_studio(url: str | None, model: str, body: dict[str, Any], *, force: bool) -> dict[str, Any]:
    """Plan, then load ``body`` in a running studio (with a progress line on a terminal); return its status.

    Raises:
        CommandError: the plan does not fit there and ``force`` is not given (exit 4).
    """
    plan = call_studio("POST", url, "/api/plan", body=body, timeout=120)
    if not plan.get("fits", True) and not force:
        raise CommandError(
            f"{model} does not fit there: " + ("; ".join(plan.get("warnings") or ()) or "over the memory budget"),
            exit=Exit.DOES_NOT_FIT,
            hint="try a smaller --ctx, or --force to load it anyway",
        )
    if plan.get("evicts"):
        typer.echo(f"evicting {', '.join(plan['evicts'])} (idle) to make room", err=True)
    body = {**body, "force": force}
    return _with_load_progress(lambda: call_studio("POST", url, "/api/load", body=body, timeout=None), url, model)


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
            p = call_studio("GET", url, "/api/status", timeout=5).get("progress") or {}
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
    """Unload one model of a running studio, or all of them.

    A load in progress is cancelled.
    """
    try:
        status = call_studio("POST", url, "/api/unload", body={"model": model} if model else {}, timeout=120)
    except AnsweredError as exc:
        if exit_code(exc) != Exit.NOT_FOUND:
            raise
        typer.echo(f"{exc}; nothing to do", err=True)
        return
    typer.echo(as_json(status) if json_output else f"unloaded {model or 'every model'}")


# -- plan, doctor, models ------------------------------------------------------------------------


@app.command("plan")
@with_load_options()
def plan_command(
    model: Annotated[str, typer.Argument(help="A model name, or a .gguf file (any shard of a split model).")],
    rpc: RpcOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    url: Annotated[
        str | None,
        typer.Option(
            help="Ask a running studio instead: its plan counts what its resident models hold, and names the "
            "models the load would evict."
        ),
    ] = None,
    options: dict[str, Any] | None = None,
) -> None:
    """Show how a model would be launched here, and why.

    The GPUs, RPC workers, layers, context, speculative flags, memory, and the llama-server command a
    load runs. Settings left out come from the model's ``[models.NAME]`` table in the config file, as for a load.
    """
    if model.endswith(".gguf") and Path(model).is_file():
        import gguf

        # a header the facts refuse is answered before the slower imports (read once: cached)
        _ = gguf.read(model).facts
    import asyncio

    from studio.residency.requests import LoadRequest
    from studio.views.plan import plan_json, render_plan

    options = options or {}
    if url is not None:  # a running studio plans it against what its resident models hold
        info = call_studio("POST", url, "/api/plan", body={"model": model, **options}, timeout=120)
        typer.echo(as_json(info) if json_output else render_plan(info))
        return
    settings = studio_settings()
    # the manager a `serve` or a `run` would load it with: its defaults, placement, files and slot folder
    manager, found = model_manager(settings, chosen_rpc_workers(rpc, settings), reap_orphans=False)
    entry, remote = model_entry(settings, model)
    # a Hub variant not downloaded: its kept header
    asked = LoadRequest.asking(model if remote is None else str(entry.path), options)
    placed = asyncio.run(manager.preview(asked))
    with manager.launch_command(placed) as command:
        argv = command.shown_argv()
    info = plan_json(placed.plan, argv, found)
    if remote is not None:  # planned on the kept header: the file is not here yet
        info["model"]["path"] = f"{model} (not downloaded)"
        info["hub"] = {"model": model, "downloaded": False, "bytes_read": remote.bytes_read, "cached": remote.cached}
    typer.echo(as_json(info) if json_output else render_plan(info))


@app.command()
def logs(
    model: Annotated[
        str | None, typer.Argument(help="The resident model whose log to show (default: the default model).")
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")] = False,
    url: UrlOption = None,
) -> None:
    """Print a resident model's llama-server log.

    From a running studio: the last 100 lines (-f: then new ones).
    """
    from urllib.parse import urlencode

    query = {"follow": str(follow).lower(), **({"model": model} if model else {})}
    for event in stream_studio_events(url, "/api/logs?" + urlencode(query)):
        typer.echo(event.get("line", ""))
