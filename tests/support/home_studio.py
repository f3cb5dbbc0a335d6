"""``ggstudio serve`` as a real process in a studio home of its own, started the way a GUI starts it."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.helpers import free_port
from tests.test_cli import CLI, assert_no_llama_server, tagged_env

#: This checkout, first on the studio's path: the ``ggstudio`` script imports whichever ``studio`` is
#: installed, which may be another checkout's.
ROOT = Path(__file__).resolve().parent.parent.parent


def home_env(home: Path, llama_server_bin: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI launch in ``home``: this checkout, the pinned llama-server, a configured port
    nobody listens on (so a fallback to it is seen to fail), and a tag for its llama-servers."""
    return tagged_env(
        GGUF_STUDIO_HOME=str(home),
        LLAMA_SERVER_PATH=str(llama_server_bin),
        PYTHONPATH=str(ROOT),
        GGUF_STUDIO_PORT=str(free_port()),
        **extra,
    )


def cli_in(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``ggstudio args`` under ``env``, stdin closed."""
    return subprocess.run(
        [CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


def start_serve(env: dict[str, str], model: Path, *flags: str, ctx: int = 256) -> subprocess.Popen[str]:
    """``serve --port 0 --ready-json`` with ``model``; stdin a pipe, stderr into ``<home>.serve-<n>.err``."""
    home = Path(env["GGUF_STUDIO_HOME"])
    n = len(list(home.parent.glob(f"{home.name}.serve-*.err")))
    err = (home.parent / f"{home.name}.serve-{n}.err").open("w")
    argv = [CLI, "serve", "--port", "0", "--ready-json", "--model", str(model), "--ctx", str(ctx), *flags]
    with err:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)


def stderr_of(env: dict[str, str], n: int = 0) -> str:
    home = Path(env["GGUF_STUDIO_HOME"])
    return (home.parent / f"{home.name}.serve-{n}.err").read_text()


def read_ready(process: subprocess.Popen[str], env: dict[str, str], n: int = 0) -> dict[str, Any]:
    """The ready line of a serve started by ``start_serve``; fails with its stderr when there is none."""
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"serve exited ({process.wait(30)}) without a ready line:\n{stderr_of(env, n)}"
    return json.loads(line)


def stop(process: subprocess.Popen[str], timeout: float = 60) -> int:
    """Stop a serve with Ctrl-C (killed if it does not stop in ``timeout``); return its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()
    assert process.returncode is not None
    return process.returncode


@contextmanager
def serving(
    env: dict[str, str], model: Path, *flags: str, ctx: int = 256
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """A serve started by ``start_serve``, with its ready line; stopped (and its llama-servers gone) after."""
    process = start_serve(env, model, *flags, ctx=ctx)
    try:
        yield process, read_ready(process, env)
    finally:
        stop(process)
        assert_no_llama_server(env)
