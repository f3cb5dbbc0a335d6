"""The real pinned llama-server on the real Gemma model: start, chat, stop, no leftovers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from launcher.errors import LoadError, PortInUseError
from launcher.process import LlamaServer
from tests.helpers import free_port, server_argv, wait_for

pytestmark = pytest.mark.slow


def _server(binary: Path, model: Path, tmp_path: Path, port: int | None = None) -> LlamaServer:
    port = port or free_port()
    argv = server_argv(binary, model, host="127.0.0.1", port=port, n_ctx=2048)
    return LlamaServer(argv, host="127.0.0.1", port=port, log_path=tmp_path / "llama-server.log")


def test_gemma_serves_a_chat_completion_and_leaves_nothing(llama_server_bin, gemma_model, tmp_path):
    server = _server(llama_server_bin, gemma_model, tmp_path)
    server.start()
    pid = server.pid
    try:
        server.wait_ready(timeout=120)
        # Before ready it either refused connections (0) or said "loading" (503); never anything else.
        assert server.health_history[-1] == 200
        assert set(server.health_history[:-1]) <= {0, 503}
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": "Say hello in one word."}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content.strip()
        assert reply.usage.completion_tokens >= 1
    finally:
        server.stop()
    assert server.returncode is not None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert server.log_path.stat().st_size > 0


def test_health_says_loading_before_ready(llama_server_bin, gemma_model, tmp_path):
    # llama-server opens its port before loading weights; /health must answer 503 then.
    server = _server(llama_server_bin, gemma_model, tmp_path)
    with server:
        server.wait_ready(timeout=120, poll_interval=0.002)
        assert 503 in server.health_history, server.health_history[:20]


def test_taken_port_is_reported_by_number(llama_server_bin, gemma_model, tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = _server(llama_server_bin, gemma_model, tmp_path, port=port)
        with pytest.raises(PortInUseError) as info:
            server.start()
    assert str(port) in str(info.value) and "--port" in str(info.value)
    assert server.pid is None


def test_non_gguf_model_fails_with_the_servers_reason(llama_server_bin, tmp_path):
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"this is not a gguf file" * 100)
    server = _server(llama_server_bin, bogus, tmp_path)
    server.start()
    with pytest.raises(LoadError) as info:
        server.wait_ready(timeout=60)
    server.stop()
    assert info.value.exit_code not in (None, 0)
    assert "gguf" in info.value.log_tail.lower()


def test_stop_is_idempotent(llama_server_bin, gemma_model, tmp_path):
    server = _server(llama_server_bin, gemma_model, tmp_path)
    server.start()
    server.wait_ready(timeout=120)
    first = server.stop()
    assert server.stop() == first


def test_ggstudio_serve_answers_chat_and_stops_on_ctrl_c(gemma_model, llama_server_bin, tmp_path, settings):
    """What `make run` does: the studio service with the default model loaded, until Ctrl-C."""
    port = free_port()
    cli = Path(sys.executable).parent / "ggstudio"
    log = tmp_path / "serve.log"  # read on a failure: a pipe nobody reads would block the studio's logging
    with (
        log.open("w") as err,
        subprocess.Popen(
            [str(cli), "serve", "--port", str(port), "--ctx", "2048"], stdout=subprocess.PIPE, stderr=err, text=True
        ) as proc,
    ):
        try:
            line = proc.stdout.readline()
            assert f"http://127.0.0.1:{port}" in line, line + log.read_text()
            # A request without `model` waits for the start-up load instead of failing.
            try:
                reply = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                    timeout=120,
                )
            except httpx.TimeoutException:
                pytest.fail(f"the first chat did not answer in 120 s; the studio logged:\n{log.read_text()[-6000:]}")
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] is not None
            status = httpx.get(f"http://127.0.0.1:{port}/api/status").json()
            assert status["state"] == "ready" and status["effective_context"] == 2048
            children = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "llama-server"]
            assert len(children) == 1
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    for child in children:
        wait_for(
            lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
            timeout=10,
            what=f"llama-server {child.pid} to exit",
        )


def test_ggstudio_serve_names_a_taken_port(gemma_model, llama_server_bin):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        cli = Path(sys.executable).parent / "ggstudio"
        out = subprocess.run([str(cli), "serve", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"port {port}" in out.stderr and "--port" in out.stderr
    assert "Traceback" not in out.stderr
