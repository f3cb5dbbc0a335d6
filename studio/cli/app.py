"""``ggstudio``: the command line's entry point. Errors become one clean message and an exit code.

The commands live one group per module beside this one (``service``, ``models``, ``library``,
``chat``, ``build``, ``rpc``) and their shared helpers in ``studio.cli.common``; importing a group
registers its commands on the one ``app``. Start-up is kept short (``scripts/bench_cli.py``): the
service's modules load only in the commands that need them.
"""

import sys
from typing import Annotated

import typer

from studio.cli import build, chat, library, models, rpc, service, top  # noqa: F401  (each registers its commands)
from studio.cli.common import app, error_lines, exit_code, state, studio_settings
from studio.cli.help_options import HELP_OPTIONS
from studio.errors import Exit

__all__ = ["app", "exit_code", "main"]


def _version_text() -> str:
    from launcher.build import load_pin

    pin = load_pin()
    from studio import __version__

    return f"ggstudio {__version__} (llama.cpp {pin.tag}, pinned as {pin.requirement})"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(_version_text())
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print versions and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and llama-server output on errors.")] = False,
) -> None:
    """GGUF Studio command line.

    Exit codes: 0 ok, 1 error, 2 usage, 3 not found, 4 does not fit, 5 llama-server failed,
    6 another studio already runs in this studio home, 130 Ctrl-C.
    """
    state.debug = debug
    if ctx.invoked_subcommand is None:  # bare `ggstudio` (or only root options): what there is to run
        typer.echo(ctx.get_help())
        raise typer.Exit()
    if _asks_for_help(sys.argv[1:]):  # a subcommand's --help runs after this callback and logs nothing
        return
    from studio.logs import configure_logging  # structlog (and rich): ~0.3 s, only when a command runs

    configure_logging(json_lines=studio_settings().log_json)


def _asks_for_help(args: list[str]) -> bool:
    """Whether the command line asks for a help text (before any ``--`` that ends the options)."""
    options = args[: args.index("--")] if "--" in args else args
    return any(a in HELP_OPTIONS for a in options)


def main() -> None:
    """Console-script entry point: run the CLI, turning errors into one clean message and an exit code."""
    try:
        code = app(standalone_mode=False)  # typer turns Ctrl-C into exit code 130 itself
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(Exit.INTERRUPTED)
    except typer.TyperException as exc:  # click's usage errors (typer carries its own click)
        exc.show()  # type: ignore[attr-defined]
        sys.exit(getattr(exc, "exit_code", Exit.USAGE))
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(Exit.INTERRUPTED)
    except Exception as exc:  # every error: one line (and a hint), the traceback only with --debug
        if state.debug:
            import traceback

            traceback.print_exc()
        for line in error_lines(exc):
            typer.echo(line, err=True)
        sys.exit(exit_code(exc))
    sys.exit(code if isinstance(code, int) else 0)
