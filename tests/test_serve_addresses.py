"""`ggstudio serve --host 127.0.0.1,::1`, as a real process: one studio on both loopback addresses.

llama-server takes a comma-separated ``--host`` (b11434); a list beyond loopback is refused, since the API
token and the Host check are decided for one address.
"""

from __future__ import annotations

import signal
import socket
import subprocess

import httpx
import pytest

from tests.helpers import free_port
from tests.test_cli import CLI, assert_no_llama_server, tagged_env


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="IPv6 loopback is unavailable")
def test_serve_listens_on_every_loopback_address_of_a_host_list(zoo_dir, llama_server_bin):
    env = tagged_env()
    port = free_port()
    argv = [CLI, "serve", "--host", "127.0.0.1,::1", "--port", str(port), "--model", str(zoo_dir / "llama-dense.gguf")]
    with subprocess.Popen(
        [*argv, "--ctx", "256"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as serve:
        try:
            announced = serve.stdout.readline()
            assert f"GGUF Studio at http://127.0.0.1:{port}/" in announced, announced + (
                serve.stderr.read() if serve.poll() is not None else ""
            )
            for base in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
                assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
                reply = httpx.post(
                    f"{base}/v1/completions",
                    json={"model": str(zoo_dir / "llama-dense.gguf"), "prompt": "Hi", "max_tokens": 2},
                    timeout=120,
                )
                assert reply.status_code == 200, reply.text  # loopback only: no token asked for
        finally:
            serve.send_signal(signal.SIGINT)
            assert serve.wait(timeout=60) == 0
    assert_no_llama_server(env)


def test_a_host_list_beyond_loopback_is_refused_before_anything_starts(zoo_dir, llama_server_bin):
    env = tagged_env()
    argv = [CLI, "serve", "--host", "127.0.0.1,0.0.0.0", "--port", str(free_port())]
    done = subprocess.run(
        [*argv, "--model", str(zoo_dir / "llama-dense.gguf")], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "several addresses are taken only when all are loopback ones" in " ".join(done.stderr.split())
    assert_no_llama_server(env)
