"""``ggstudio serve --ollama-port``: two listeners in one process, one model manager, one Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess

import httpx
import ollama
import pytest

from tests.helpers import free_port, wait_for
from tests.test_cli import CLI, assert_no_llama_server, tagged_env

pytestmark = pytest.mark.slow


def test_serve_answers_ollama_clients_on_their_port_from_the_same_model(gemma_model, llama_server_bin):
    port, ollama_port = free_port(), free_port()
    studio, ollama_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ollama_port}"
    env = tagged_env()
    with subprocess.Popen(
        [
            CLI,
            "serve",
            "--model",
            str(gemma_model),
            "--ctx",
            "1024",
            "--port",
            str(port),
            "--ollama-port",
            str(ollama_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as serve:
        try:
            line = serve.stdout.readline()
            assert studio in line and f"Ollama API: {ollama_url}" in line, line + (
                serve.stderr.read() if serve.poll() is not None else ""
            )
            assert httpx.get(ollama_url, timeout=10).text == "Ollama is running"
            misdirected = httpx.get(f"{studio}/api/tags", timeout=10)  # an Ollama client given the main port
            assert misdirected.status_code == 404
            assert f"point Ollama clients at {ollama_url}" in misdirected.json()["error"]["message"]
            status = wait_for(
                lambda: (s := httpx.get(f"{studio}/api/status", timeout=10).json())["state"] == "ready" and s,
                timeout=120,
                what="the start-up load",
            )
            with ollama.Client(host=ollama_url, timeout=120) as client:
                assert "gemma-3-270m-Q4_K_M" in {m.model for m in client.list().models}
                reply = client.generate(model="gemma-3-270m-Q4_K_M", prompt="Hi", raw=True, options={"num_predict": 2})
                assert reply.eval_count == 2
            assert httpx.get(f"{studio}/api/status", timeout=10).json()["pid"] == status["pid"]  # no reload
            serve.send_signal(signal.SIGINT)
            assert serve.wait(timeout=30) == 0
        finally:
            if serve.poll() is None:
                serve.kill()
    for url in (studio, ollama_url):
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=5)
    assert_no_llama_server(env)


def test_a_taken_ollama_port_is_one_clear_error(gemma_model):
    with socket.create_server(("127.0.0.1", 0)) as other_program:
        taken = other_program.getsockname()[1]
        out = subprocess.run(
            [CLI, "serve", "--model", str(gemma_model), "--port", str(free_port()), "--ollama-port", str(taken)],
            capture_output=True,
            text=True,
            timeout=60,
            env=tagged_env(),
        )
    assert out.returncode != 0 and f"port {taken}" in out.stderr and "Traceback" not in out.stderr
