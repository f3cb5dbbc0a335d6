"""The handshake a GUI relies on: ``serve --port 0 --ready-json --exit-with-parent``, as real processes.

A parent program starts the studio, reads its one ready line, chats, and dies; the studio and its
llama-servers must follow it. The example for GUI authors in docs/desktop.md is run as it is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from studio.instance import DISCOVERY_NAME
from tests.helpers import wait_for
from tests.support.home_studio import ROOT, home_env, read_ready, serving, start_serve, stderr_of, stop
from tests.test_cli import CLI, assert_no_llama_server, llama_servers

pytestmark = pytest.mark.slow

#: A GUI in a dozen lines: start the studio, wait for ready, load, chat, say what runs, then wait to be killed.
PARENT = r"""
import json, subprocess, sys, time
import httpx

stdin = subprocess.DEVNULL if sys.argv[1] == "devnull" else subprocess.PIPE
studio = subprocess.Popen(sys.argv[2:], stdin=stdin, stdout=subprocess.PIPE, text=True)
ready = json.loads(studio.stdout.readline())
api = httpx.Client(base_url=ready["url"], timeout=120)
loaded = api.post("/api/load", json={"model": sys.argv[sys.argv.index("--model") + 1], "n_ctx": 512}).json()
chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
reply = api.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
print(json.dumps({"studio": studio.pid, "llama_server": loaded["pid"], "reply": reply}), flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie waiting for init to reap it has ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("stdin", ["pipe", "devnull"])  # the pipe's end, or the studio handed to another parent
def test_a_parent_killed_with_sigkill_takes_the_studio_and_its_llama_servers_with_it_within_5_s(
    smollm_model, llama_server_bin, tmp_path, stdin
):
    env = home_env(tmp_path / "home", llama_server_bin)
    argv = [CLI, "serve", "--port", "0", "--ready-json", "--exit-with-parent", "--model", str(smollm_model)]
    argv += ["--ctx", "512"]
    with (tmp_path / "studio.err").open("w") as err:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, stdin, *argv], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, f"the parent ended ({parent.wait(30)}):\n{(tmp_path / 'studio.err').read_text()}"
        running = json.loads(line)
        assert running["reply"].strip()
        assert [p.pid for p in llama_servers(env)] == [running["llama_server"]]
        os.kill(parent.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert parent.wait(10) == -signal.SIGKILL
        wait_for(lambda: gone(running["studio"]), timeout=5, what="the studio to follow its parent")
        wait_for(lambda: gone(running["llama_server"]), timeout=max(0.1, 5 - (time.monotonic() - killed)))
        assert time.monotonic() - killed < 5
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        parent.stdout.close()  # type: ignore[union-attr]
    assert not llama_servers(env)
    assert not (tmp_path / "home" / DISCOVERY_NAME).exists()  # it stopped cleanly: its file went with it
    assert "Traceback" not in (tmp_path / "studio.err").read_text()


def test_ready_json_is_the_one_line_on_stdout_and_closing_stdin_stops_the_studio(zoo_dir, llama_server_bin, tmp_path):
    home = tmp_path / "home"
    env = home_env(home, llama_server_bin, GGUF_STUDIO_API_TOKEN="chosen-by-me")
    process = start_serve(env, zoo_dir / "llama-dense.gguf", "--exit-with-parent")
    try:
        ready = read_ready(process, env)
        assert set(ready) == {"url", "pid", "version", "token"}
        assert ready["pid"] == process.pid and re.fullmatch(r"http://127\.0\.0\.1:\d+", ready["url"])
        assert ready["token"] is None  # configured, not generated for this run: not repeated
        auth = {"Authorization": "Bearer chosen-by-me"}
        assert httpx.get(f"{ready['url']}/api/status", timeout=10).status_code == 401
        assert httpx.get(f"{ready['url']}/api/status", headers=auth, timeout=10).status_code == 200
        assert json.loads((home / DISCOVERY_NAME).read_text())["token_required"] is True
        wait_for(lambda: llama_servers(env), timeout=60, what="the model's llama-server")
        assert process.stdin is not None
        process.stdin.close()  # the lifeline ends
        assert process.wait(30) == 0
        assert process.stdout is not None and process.stdout.read() == ""  # nothing after the ready line
    finally:
        stop(process)
    assert_no_llama_server(env)
    assert not (home / DISCOVERY_NAME).exists()
    err = stderr_of(env)
    assert "GGUF Studio at http://127.0.0.1:" in err and "stopped" in err  # the banner went to stderr
    logged = [json.loads(line) for line in (home / "studio.log").read_text().splitlines()]
    assert {"event", "level", "timestamp"} <= set(logged[0]) and any(e["event"] == "parent_gone" for e in logged)
    assert "chosen-by-me" not in err + (home / "studio.log").read_text()


def test_port_0_beyond_loopback_generates_a_token_that_only_the_ready_line_carries(zoo_dir, llama_server_bin, tmp_path):
    home = tmp_path / "home"
    env = home_env(home, llama_server_bin)
    with serving(env, zoo_dir / "llama-dense.gguf", "--host", "0.0.0.0") as (_, ready):
        token = ready["token"]
        assert isinstance(token, str) and len(token) >= 32
        assert ready["url"].startswith("http://127.0.0.1:")  # where a client on this machine reaches it
        assert httpx.get(f"{ready['url']}/api/status", timeout=10).status_code == 401
        assert httpx.get(f"{ready['url']}/api/status", headers={"x-api-key": token}, timeout=10).status_code == 200
        discovery = (home / DISCOVERY_NAME).read_text()
        assert json.loads(discovery)["token_required"] is True and token not in discovery
    assert token not in stderr_of(env) and token not in (home / "studio.log").read_text()


def test_the_docs_example_for_gui_authors_runs_as_written(smollm_model, llama_server_bin, tmp_path):
    page = (ROOT / "docs" / "desktop.md").read_text()
    section = page[page.index("## The handshake") :]
    start = section.index("```python\n") + len("```python\n")
    example = section[start : section.index("```\n", start)]
    assert len(example.strip().splitlines()) <= 16
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)  # the default model, as `make setup` leaves it, without a copy
    (home / "models" / smollm_model.name).symlink_to(smollm_model)
    shutil.copy(smollm_model.with_suffix(".gguf.ok"), home / "models")
    env = home_env(home, llama_server_bin, PATH=f"{Path(CLI).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()  # the model's answer
    assert_no_llama_server(env)
    assert not (home / DISCOVERY_NAME).exists()
