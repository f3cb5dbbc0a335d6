"""``ggstudio serve --model M``: the model's llama-server starts while the web stack is still importing.

On b5a9904 the first answer came 2.8x later than from llama-server started by hand: the studio imported
FastAPI, uvicorn and its routes (most of a start's imports) and listened, and only then began the load
(``scripts/bench_cli.py --first-token`` prints the figures).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import free_port
from tests.test_cli import CLI, assert_no_llama_server, llama_servers, tagged_env


def test_what_serve_starts_a_model_with_imports_no_web_stack():
    """Before its first llama-server starts, ``serve`` imports only what the start needs: on b5a9904 the manager's
    modules alone imported httpx (through the error table and the slot cache), ~30 ms before every start."""
    probe = (
        "import sys\n"
        "import studio.cli.service, studio.cli.common, studio.residency.manager, studio.library.default_model\n"
        "print(sorted(m for m in ('httpx', 'fastapi', 'uvicorn', 'pydantic', 'starlette') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def first_of(serve: subprocess.Popen[str], env: dict[str, str], port: int, timeout: float = 60) -> str:
    """Which comes first after launch: "llama-server" (its process exists) or "listens" (the studio's port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if llama_servers(env):
            return "llama-server"
        if listens(port):
            return "listens"
        assert serve.poll() is None, serve.stderr.read() if serve.stderr else serve.returncode
        time.sleep(0.002)
    raise AssertionError("neither llama-server nor the studio's port came up")


def serve_process(model: str, port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [CLI, "serve", "--model", model, "--ctx", "1024", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_serve_starts_the_model_before_the_web_stack_listens(smollm_model, llama_server_bin):
    """On b5a9904 the load began in the app's start-up, once FastAPI and uvicorn were imported: the port
    listened first, and the model's start waited for the whole web stack."""
    port, env = free_port(), tagged_env()
    with serve_process(smollm_model.name.removesuffix(".gguf"), port, env) as serve:
        try:
            assert first_of(serve, env, port) == "llama-server"
            deadline = time.monotonic() + 60
            while not listens(port):
                assert time.monotonic() < deadline and serve.poll() is None, "the studio never listened"
                time.sleep(0.01)
            # the first request, sent as soon as it listens, waits for the load and is answered
            answer = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
            status = httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=10).json()
            assert len(llama_servers(env)) == 1, status  # one resident: the service did not start it again
        finally:
            serve.send_signal(signal.SIGINT)
            serve.wait(30)
    assert serve.returncode == 0, serve.stderr.read() if serve.stderr else ""
    assert_no_llama_server(env)


@pytest.mark.slow
def test_ctrl_c_while_the_web_stack_imports_leaves_no_llama_server(smollm_model, llama_server_bin):
    """Ctrl-C in the new window (the model started, the service not yet listening) stops cleanly: exit 0,
    "stopped", and the llama-server begun for the model stopped with it."""
    port, env = free_port(), tagged_env()
    with serve_process(smollm_model.name.removesuffix(".gguf"), port, env) as serve:
        try:
            assert first_of(serve, env, port) == "llama-server"
            serve.send_signal(signal.SIGINT)
            _, err = serve.communicate(timeout=30)
        finally:
            if serve.poll() is None:
                serve.kill()
    assert serve.returncode == 0, err
    assert "Traceback" not in err and err.rstrip().endswith("stopped"), err
    assert_no_llama_server(env)
