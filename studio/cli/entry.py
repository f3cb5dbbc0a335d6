"""``ggstudio``'s console script: the top-level help from its cached text, everything else through the CLI.

The top-level help is what a person runs first and most often, and rendering it
imports typer, click and every command group (most of its ~180 ms; ``scripts/bench_cli.py``).
Its text changes only with the command modules, the installed packages, the
program's name and the terminal's width, so the last text rendered is kept in
the studio home's cache beside those (``help_key``) and printed as it is while
they hold; when any differs the CLI renders it again and the cache is renewed.
A cache that cannot be read or written costs only the time.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys

from studio import __version__
from studio.cli.help_options import HELP_OPTIONS
from studio.home import studio_home

__all__ = ["help_key", "main"]

#: The cached help, its first line the key it was rendered under.
CACHE_NAME = "cli-help.txt"


def main() -> None:
    """Run the CLI; the top-level help (``ggstudio``, ``-h``, ``--help``) is served from the cache when it holds."""
    if sys.argv[1:] not in ([], *([h] for h in HELP_OPTIONS)):
        _run()
        return
    path = os.path.join(studio_home(), "cache", CACHE_NAME)
    key = help_key()
    text = _cached(path, key)
    if text is None:
        text = _rendered()
        _store(path, key, text)
    sys.stdout.write(text)
    sys.stdout.flush()


def help_key() -> str:
    """What the help text depends on: the version, the CLI's modules, the installed packages, name and width.

    Modules and packages by modification time: an edit of a command's docstring or
    a ``pip install`` (which changes its site-packages folder) renders it anew.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    with os.scandir(here) as entries:
        modules = sorted(f"{e.name}:{e.stat().st_mtime_ns}" for e in entries if e.name.endswith(".py"))
    folders = [f"{p}:{os.stat(p).st_mtime_ns}" for p in sys.path if p and os.path.isdir(p)]
    program = os.path.basename(sys.argv[0])
    width = shutil.get_terminal_size().columns  # what click sizes its help to
    return "|".join([__version__, program, str(width), *modules, *folders]).replace("\n", " ")


def _run() -> None:
    from studio.cli.app import main as run_cli

    run_cli()


def _rendered() -> str:
    """The help as the CLI prints it, captured."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            _run()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
    return out.getvalue()


def _cached(path: str, key: str) -> str | None:
    """The cached text, if it was rendered under ``key``."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
            return f.read() if first == key + "\n" else None
    except (OSError, UnicodeDecodeError):
        return None


def _store(path: str, key: str, text: str) -> None:
    """Keep ``text`` for the next ``--help``; a studio home that cannot be written keeps nothing."""
    from pathlib import Path

    from gguf.files import write_atomically  # whole or not at all, also when two run at once

    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomically(Path(path), key + "\n" + text)
