"""llama-server itself: ``build-llama`` builds it, ``doctor`` checks it, ``bench-spec`` measures it."""

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from launcher.units import GIB, format_gib
from studio.cli.common import (
    JsonOption,
    RpcOption,
    app,
    as_json,
    catalog_of,
    chosen_rpc_workers,
    discovered_studio,
    find_binary,
    find_build,
    studio_settings,
)

if TYPE_CHECKING:  # the service's modules load only in the commands that need them
    from launcher.build import ProgressFn
    from studio.settings import Settings


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
    backend: Annotated[
        str | None,
        typer.Option(help="cpu, cuda, rocm, vulkan or metal (default: what this machine's GPUs and toolkits allow)."),
    ] = None,
    jobs: Annotated[int | None, typer.Option(help="Parallel compile jobs (default: all cores).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a finished build is cached.")] = False,
) -> None:
    """Build the pinned llama-server into the studio home.

    A no-op when a finished build is cached. With no --backend, the machine decides: an NVIDIA GPU with
    the CUDA toolkit gets CUDA, an AMD one with ROCm/HIP gets ROCm, Apple silicon Metal, another GPU with a
    Vulkan driver Vulkan, anything else the CPU; a GPU whose toolkit is missing gets one line saying what
    to install. The studio then runs that build. Extra CMake arguments can be passed through the
    CMAKE_ARGS environment variable.
    """
    from launcher.backends import choose_backend, detect_machine
    from launcher.build import ensure_built

    settings = studio_settings()
    extra = tuple(shlex.split(settings.cmake_args))
    choice = choose_backend(detect_machine())
    if backend is None:
        backend = choice.backend
        typer.echo(f"build-llama: the {backend} build: {choice.why}", err=True)
        if choice.install:
            typer.echo(f"build-llama: {choice.install}", err=True)
    if backend == choice.backend:  # the toolkit found here (nvcc's path...), which CMake might not find alone
        extra = (*choice.cmake_args, *extra)
    result = ensure_built(
        settings.home,
        backend=backend,
        extra_cmake_args=extra,
        jobs=jobs,
        force=force,
        progress=_progress_printer(),
    )
    state = "built" if result.built_now else "already built"
    typer.echo(f"llama-server {state}: {result.llama_server}")


@app.command()
def doctor(
    rpc: RpcOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Check this machine's llama-server and devices.

    Shows the llama-server in use (where it was found, version, capabilities), the devices (RPC workers'
    too), and a verdict per check.
    """
    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.rpc import RpcWorkers
    from studio.views.plan import doctor_json, render_doctor

    settings = studio_settings()
    found, build = find_build(settings)
    workers = RpcWorkers(chosen_rpc_workers(rpc, settings))
    info = doctor_json(
        found, probe(found.path, cache_dir=settings.home / "cache"), discover(llama_server=found.path, workers=workers)
    )
    info["backend"] = build
    info["checks"] = _doctor_checks(info, settings)
    from studio.logs import log_file

    info["studio_log"] = str(log_file(settings.home))
    if json_output:
        typer.echo(as_json(info))
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
    backend = info["backend"]
    check(
        "backend",
        backend["install"] is None,
        f"{backend['backend'] or 'not built by the studio'}: {backend['why']}",
        backend["install"],
    )
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
    from studio.logs import log_file

    studio_log = log_file(home)
    check(
        "studio log",
        True,
        f"{studio_log}" + ("" if studio_log.exists() else " (written once `ggstudio serve` or `run` runs)"),
    )
    running = discovered_studio(settings)
    check(
        "studio",
        True,
        f"running at {running.url} (pid {running.pid})" if running is not None else f"none running in {home}",
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
    """Measure which speculative mode is fastest here.

    Measures tokens/s per speculative mode for a model on this machine; `auto` then takes the fastest.
    The result is stored per model file, device set and llama-server build: `plan`, `serve` and `run`
    resolve `auto` to the measured winner until the binary or the devices change.
    """
    import tempfile

    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.planner import PlanRequest, load_model, plan
    from studio.spec_bench import PROMPTS, measure_and_store
    from studio.views.plan import measured_json

    settings = studio_settings()
    found = find_binary(settings)
    caps = probe(found.path, cache_dir=settings.home / "cache")
    entry = catalog_of(settings).resolve(model)
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
            as_json(
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
