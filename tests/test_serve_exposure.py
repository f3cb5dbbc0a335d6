"""`ggstudio serve` beyond loopback, as a real process: a token is generated, printed once and required.

The studio listens on every interface here, but every request goes to
127.0.0.1: only the ``Host`` header names another address.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.helpers import free_port
from tests.test_cli import CLI, assert_no_llama_server, tagged_env


@contextmanager
def serving(zoo_dir, *flags: str, env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``ggstudio serve --host 0.0.0.0`` with the tiny zoo model; yields its loopback URL and the process."""
    port = free_port()
    argv = [
        CLI,
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--model",
        str(zoo_dir / "llama-dense.gguf"),
        "--ctx",
        "256",
        *flags,
    ]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as serve:
        try:
            yield f"http://127.0.0.1:{port}", serve
        finally:
            if serve.poll() is None:
                serve.send_signal(signal.SIGINT)
                try:
                    serve.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    serve.kill()
    assert_no_llama_server(env)


def test_listening_beyond_loopback_without_a_token_prints_one_and_requires_it(zoo_dir, llama_server_bin):
    env = tagged_env()
    with serving(zoo_dir, env=env) as (url, serve):
        announced = serve.stdout.readline()
        assert "GGUF Studio at http://0.0.0.0:" in announced, announced + (serve.stderr.read() if serve.poll() else "")
        line = serve.stdout.readline()
        assert line.startswith("API token for this run: "), line
        token = line.split()[5]
        assert len(token) >= 32
        assert httpx.get(f"{url}/api/status", timeout=10).status_code == 401
        assert (
            httpx.get(f"{url}/api/status", headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200
        )
        assert httpx.get(f"{url}/v1/models", headers={"x-api-key": token}, timeout=10).status_code == 200
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        # on every interface a client may name any address of the machine, but no foreign name
        lan = httpx.get(f"{url}/api/status", headers={"Host": "10.20.30.40:1", "x-api-key": token}, timeout=10)
        assert lan.status_code == 200
        assert (
            httpx.get(f"{url}/api/status", headers={"Host": "evil.example", "x-api-key": token}, timeout=10).status_code
            == 403
        )
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0
        rest = serve.stdout.read()
        errors = serve.stderr.read()
    assert token not in errors and token not in rest  # printed once, logged nowhere


def test_no_auth_serves_beyond_loopback_with_a_warning(zoo_dir, llama_server_bin):
    env = tagged_env()
    with serving(zoo_dir, "--no-auth", env=env) as (url, serve):
        announced = serve.stdout.readline()
        assert "GGUF Studio at http://0.0.0.0:" in announced, announced
        assert httpx.get(f"{url}/api/status", timeout=10).status_code == 200
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0
        assert "API token" not in serve.stdout.read()
        assert "warning: --no-auth: listening on 0.0.0.0 with no API token" in serve.stderr.read()


def test_a_configured_token_is_required_and_not_printed(zoo_dir, llama_server_bin):
    env = tagged_env(GGUF_STUDIO_API_TOKEN="chosen-by-me")
    with serving(zoo_dir, env=env) as (url, serve):
        announced = serve.stdout.readline()
        # an empty line: serve ended before its banner (seen once in a full run); its stderr says why
        assert "GGUF Studio at" in announced, announced or serve.stderr.read()
        assert httpx.get(f"{url}/api/status", timeout=10).status_code == 401
        assert httpx.get(f"{url}/api/status", headers={"x-api-key": "chosen-by-me"}, timeout=10).status_code == 200
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0
        assert "chosen-by-me" not in serve.stdout.read() + serve.stderr.read()
