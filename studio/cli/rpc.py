"""``ggstudio rpc-worker``: lend this machine's devices to a studio elsewhere over llama.cpp's RPC."""

from typing import Annotated

import typer

from launcher.units import format_mib
from studio.cli.common import (
    app,
    graceful_termination,
    studio_settings,
)
from studio.errors import CommandError, Exit


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
    """Lend this machine's devices to a studio elsewhere.

    Runs a llama.cpp RPC worker (ggml-rpc-server). The worker is supervised: Ctrl-C or SIGTERM stops it, and it
    dies with this command. On the main machine, list it in rpc_workers (config file) or pass --rpc HOST:PORT to
    serve, run or plan. Examples:

        ggstudio rpc-worker --port 50052

        ggstudio rpc-worker --host 192.168.1.20 --allow-remote
    """
    from launcher.backends import choose_backend, detect_machine
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
    settings = studio_settings()
    found = find_rpc_server(
        home=settings.home,
        explicit=settings.rpc_server_path,
        llama_server=settings.llama_server_path,
        llama_cpp_dir=settings.llama_cpp_dir,
        backends=choose_backend(detect_machine()).run_order,
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
    with graceful_termination() as threads_started:
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
