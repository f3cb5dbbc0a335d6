"""``ggstudio --help`` from its cached text (``studio.cli.entry``): the same text, without importing typer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: Runs the console script's ``main`` as ``ggstudio``, saying at exit whether typer was imported.
PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('TYPER' if 'typer' in sys.modules else 'LEAN', file=sys.stderr))\n"
    "sys.argv = ['ggstudio', *sys.argv[1:]]\n"
    "from studio.cli.entry import main\n"
    "main()\n"
)


def _help(home: Path, *argv: str, columns: int = 100) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GGUF_STUDIO_HOME": str(home), "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-c", PROBE, *(argv or ["--help"])], capture_output=True, text=True, env=env, timeout=60
    )


def test_the_second_help_is_the_first_text_without_importing_typer(tmp_path):
    first, second = _help(tmp_path), _help(tmp_path)
    assert first.returncode == second.returncode == 0
    assert first.stderr.strip().splitlines()[-1] == "TYPER"  # rendered by the CLI itself
    assert "Usage: ggstudio [OPTIONS] COMMAND" in first.stdout and "serve" in first.stdout
    assert second.stdout == first.stdout
    assert second.stderr.strip().splitlines()[-1] == "LEAN"


def test_a_cache_rendered_under_another_key_is_rendered_again(tmp_path):
    """An edited command module, an upgrade or another width changes the key: stale text is never shown."""
    cache = tmp_path / "cache" / "cli-help.txt"
    cache.parent.mkdir()
    cache.write_text("an older key\nstale help\n", encoding="utf-8")
    out = _help(tmp_path)
    assert out.returncode == 0 and "stale help" not in out.stdout and "Usage: ggstudio" in out.stdout
    assert cache.read_text(encoding="utf-8").split("\n", 1)[1] == out.stdout


def test_a_width_change_renders_the_help_again(tmp_path):
    _help(tmp_path)
    key = (tmp_path / "cache" / "cli-help.txt").read_text(encoding="utf-8").split("\n", 1)[0]
    out = _help(tmp_path, columns=60)
    assert out.stderr.strip().splitlines()[-1] == "TYPER"
    assert (tmp_path / "cache" / "cli-help.txt").read_text(encoding="utf-8").split("\n", 1)[0] != key


def test_a_studio_home_that_cannot_be_written_still_gets_the_help(tmp_path):
    home = tmp_path / "home"
    home.write_text("a file where the studio home should be")
    out = _help(home)
    assert out.returncode == 0 and "Usage: ggstudio" in out.stdout


def test_other_command_lines_go_to_the_cli(tmp_path):
    out = _help(tmp_path, "serve", "--help")
    assert out.returncode == 0 and "Usage: ggstudio serve" in out.stdout
    assert not (tmp_path / "cache" / "cli-help.txt").exists()
