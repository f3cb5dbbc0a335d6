"""One studio per studio home (``studio.instance``): the lock, the discovery file, and the clients that use it.

The real-process tests start ``ggstudio serve`` in a home of their own with the tiny zoo model
(a llama-server in about a second); the others drive ``HomeLock`` and the CLI's client commands
without any llama-server.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import httpx
import pytest

from studio.errors import AlreadyRunningError, StudioHomeError
from studio.instance import DISCOVERY_NAME, Discovery, HomeLock, read_discovery, running_studio
from tests.helpers import wait_for
from tests.support.home_studio import cli_in, home_env, read_ready, serving, start_serve, stderr_of, stop
from tests.test_cli import CLI, assert_no_llama_server, llama_servers

# --- real processes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_serve_on_one_home_is_refused_naming_the_first_which_is_left_untouched(
    zoo_dir, llama_server_bin, tmp_path
):
    env = home_env(tmp_path / "home", llama_server_bin)
    model = zoo_dir / "llama-dense.gguf"
    with serving(env, model) as (first, ready):
        wait_for(lambda: httpx.get(f"{ready['url']}/api/status", timeout=10).json()["state"] == "ready", timeout=60)
        before = (tmp_path / "home" / DISCOVERY_NAME).read_text()
        second = start_serve(env, model)
        assert second.wait(timeout=60) == 6
        assert second.stdout is not None and second.stdout.read() == ""  # no ready line, nothing on stdout
        stop(second)
        err = stderr_of(env, 1)
        assert err.startswith(f"error: a studio already runs in {tmp_path / 'home'}: `ggstudio serve`"), err
        assert f"pid {ready['pid']}" in err and ready["url"] in err and "hint: " in err and "Traceback" not in err
        # the first one: still serving, its model still there, its discovery file as it was
        assert first.poll() is None
        status = httpx.get(f"{ready['url']}/api/status", timeout=10).json()
        assert status["state"] == "ready" and len(status["models"]) == 1
        assert (tmp_path / "home" / DISCOVERY_NAME).read_text() == before
        assert len(llama_servers(env)) == 1  # the refused one started none
    assert not (tmp_path / "home" / DISCOVERY_NAME).exists()  # removed on a clean stop


@pytest.mark.slow
def test_after_kill_9_of_a_serve_a_new_one_starts_and_replaces_the_stale_discovery_file(
    zoo_dir, llama_server_bin, tmp_path
):
    home = tmp_path / "home"
    env = home_env(home, llama_server_bin)
    model = zoo_dir / "llama-dense.gguf"
    killed = start_serve(env, model)
    try:
        old = read_ready(killed, env)
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(10) == -signal.SIGKILL
    finally:
        stop(killed)
    assert_no_llama_server(env)  # its llama-server died with it (parent-death signal)
    stale = read_discovery(home)
    assert stale is not None and stale.pid == old["pid"]  # nothing ran to remove it ...
    assert running_studio(home) is None  # ... and it counts for nothing
    out = cli_in(env, "ps")  # the client falls back to the configured port, where nobody listens
    assert out.returncode == 1 and out.stderr.startswith("error: no GGUF Studio is running at http://127.0.0.1:")
    assert old["url"] not in out.stderr

    with serving(env, model) as (_, ready):
        assert ready["pid"] != old["pid"]
        found = running_studio(home)
        assert found is not None and (found.url, found.pid) == (ready["url"], ready["pid"])


@pytest.mark.slow
def test_ps_finds_a_studio_on_a_random_port_through_its_discovery_file_and_logs_prints_its_models_log(
    zoo_dir, llama_server_bin, tmp_path
):
    env = home_env(tmp_path / "home", llama_server_bin)
    with serving(env, zoo_dir / "llama-dense.gguf") as (_, ready):
        assert ready["url"].startswith("http://127.0.0.1:") and not ready["url"].endswith(env["GGUF_STUDIO_PORT"])

        def ps() -> dict:
            out = cli_in(env, "ps", "--json")
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        status = wait_for(lambda: (s := ps())["state"] == "ready" and s, timeout=60, what="the model to load")
        assert status["model"] == "llama-dense"
        out = cli_in(env, "logs")
        assert out.returncode == 0, out.stderr
        assert "server is listening" in out.stdout or "listening on" in out.stdout, out.stdout[-2000:]
        missing = cli_in(env, "logs", "no-such-model")
        assert missing.returncode == 3 and "not resident" in missing.stderr
        assert cli_in(env, "unload").returncode == 0  # unload finds it too
        assert ps()["state"] == "unloaded"


@pytest.mark.slow
def test_run_in_a_home_whose_studio_runs_chats_through_it_and_a_running_chat_holds_the_home(
    smollm_model, llama_server_bin, tmp_path
):
    env = home_env(tmp_path / "home", llama_server_bin)
    with serving(env, smollm_model, ctx=512) as (_, ready):
        out = cli_in(env, "run", str(smollm_model), "--ctx", "512", "--max-tokens", "4", "--once", "Hi")
        assert out.returncode == 0, out.stderr
        assert f"using the studio running at {ready['url']}" in out.stderr and out.stdout.strip()
        assert len(llama_servers(env)) == 1  # the studio's own: run started none beside it
    # with no studio there, a chat takes the home itself: a serve meanwhile is refused
    chat = subprocess.Popen(
        [CLI, "run", str(smollm_model), "--ctx", "512"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert chat.stdout is not None
        assert "chatting with" in chat.stdout.readline()
        refused = cli_in(env, "serve", "--port", "0")
        assert refused.returncode == 6, refused.stderr
        assert f"`ggstudio run` (pid {chat.pid})" in refused.stderr
    finally:
        assert chat.stdin is not None
        chat.stdin.close()  # end of input ends the chat
        assert chat.wait(60) == 0
        chat.stdout.close()
        chat.stderr.close()  # type: ignore[union-attr]
    assert_no_llama_server(env)


# --- the lock and the file, in-process -----------------------------------------------------------


def test_a_home_lock_is_exclusive_and_the_refusal_names_the_holder(tmp_path):
    with HomeLock.acquire(tmp_path, "serve") as held:
        with pytest.raises(AlreadyRunningError) as starting:  # locked, not yet published: the lock file says who
            HomeLock.acquire(tmp_path)
        assert starting.value.pid == os.getpid() and starting.value.url is None
        assert "still starting" in str(starting.value)
        held.publish("http://127.0.0.1:1234/", token_required=True, version="9.9")
        with pytest.raises(AlreadyRunningError) as refused:
            HomeLock.acquire(tmp_path)
        assert (refused.value.pid, refused.value.url) == (os.getpid(), "http://127.0.0.1:1234")
        assert str(refused.value).endswith(f"`ggstudio serve` (pid {os.getpid()}) at http://127.0.0.1:1234")
    assert not (tmp_path / DISCOVERY_NAME).exists()
    HomeLock.acquire(tmp_path).release()  # free again


def test_the_discovery_file_is_0600_and_says_whether_a_token_is_required_never_what_it_is(tmp_path):
    with HomeLock.acquire(tmp_path) as held:
        held.publish("http://127.0.0.1:1234", token_required=True, version="9.9")
        path = tmp_path / DISCOVERY_NAME
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        data = json.loads(path.read_text())
        assert set(data) == {"url", "pid", "version", "token_required", "command", "started"}
        assert data["token_required"] is True
        assert running_studio(tmp_path) == Discovery.from_json(data, path=path)


def test_a_stale_discovery_file_of_a_dead_process_counts_for_nothing_and_is_replaced(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"url": "http://127.0.0.1:9", "pid": int(dead.stdout), "version": "0", "token_required": False}
    (tmp_path / DISCOVERY_NAME).write_text(json.dumps(stale))
    assert read_discovery(tmp_path) is not None and running_studio(tmp_path) is None
    with HomeLock.acquire(tmp_path) as held:  # the lock is free: the file is someone's leftover
        held.publish("http://127.0.0.1:1234", token_required=False, version="9.9")
        found = running_studio(tmp_path)
        assert found is not None and found.pid == os.getpid()


def test_a_discovery_file_naming_a_reused_pid_counts_for_nothing(tmp_path):
    """A pid that lives, but started long after the studio that wrote the file: not that studio."""
    other = {"url": "http://127.0.0.1:9", "pid": os.getpid(), "version": "0", "token_required": False, "started": 1.0}
    (tmp_path / DISCOVERY_NAME).write_text(json.dumps(other))
    assert running_studio(tmp_path) is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        '{"url": 5, "pid": 1, "version": "1", "token_required": false}',
        '{"url": "ftp://x", "pid": 1, "version": "1", "token_required": false}',
        '{"url": "http://x", "pid": true, "version": "1", "token_required": false}',
        '{"url": "http://x", "pid": -3, "version": "1", "token_required": false}',
        '{"url": "http://x", "pid": 1, "version": "1"}',
    ],
)
def test_a_garbage_discovery_file_is_refused_by_name(tmp_path, text):
    (tmp_path / DISCOVERY_NAME).write_text(text)
    with pytest.raises(ValueError, match=str(tmp_path / DISCOVERY_NAME)):
        running_studio(tmp_path)


def test_a_garbage_discovery_file_is_named_in_a_warning_and_the_client_falls_back_to_the_configured_port(
    tmp_path, llama_server_bin
):
    home = tmp_path / "home"
    home.mkdir()
    (home / DISCOVERY_NAME).write_bytes(b"\x00\xffgarbage")
    env = home_env(home, llama_server_bin)
    out = cli_in(env, "ps")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    warning, error = out.stderr.splitlines()
    assert warning.startswith(f"warning: {home / DISCOVERY_NAME}") and "ignored" in warning
    assert error == (
        f"error: no GGUF Studio is running at http://127.0.0.1:{env['GGUF_STUDIO_PORT']} "
        "(start one with `ggstudio serve`, or pass --url)"
    )
    assert (home / DISCOVERY_NAME).read_bytes() == b"\x00\xffgarbage"  # a client deletes nothing


def test_a_home_that_cannot_hold_the_lock_is_one_clear_error(tmp_path, llama_server_bin):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(StudioHomeError, match="cannot lock the studio home"):
        HomeLock.acquire(not_a_folder)
    home = tmp_path / "home"
    (home / "studio.lock").mkdir(parents=True)  # a lock file that cannot be opened for writing
    out = cli_in(home_env(home, llama_server_bin), "serve", "--port", "0")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"error: cannot lock the studio home {home}: ")
    assert "GGUF_STUDIO_HOME" in out.stderr and "Traceback" not in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_a_read_only_home_is_one_clear_error(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o500)
    try:
        with pytest.raises(StudioHomeError, match="cannot lock the studio home"):
            HomeLock.acquire(home)
    finally:
        home.chmod(0o700)


def test_the_studio_log_is_json_lines_rotated_at_its_size_bound(tmp_path):
    """Run in a child: structlog's configuration is process-wide."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "import structlog\n"
        "from studio import logs\n"
        "logs.LOG_FILE_BYTES = 4000\n"
        "assert logs.configure_logging(file=Path(sys.argv[1]))\n"
        "for i in range(300):\n"
        "    structlog.get_logger().info('an event', n=i)\n"
    )
    path = tmp_path / "home" / "studio.log"
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "an event" in out.stderr  # the console still gets every line
    files = sorted(tmp_path.joinpath("home").glob("studio.log*"))
    assert [f.name for f in files] == ["studio.log", "studio.log.1", "studio.log.2", "studio.log.3"]
    assert all(f.stat().st_size <= 4000 for f in files)
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["event"] == "an event" and last["n"] == 299 and last["level"] == "info"


def test_a_home_that_cannot_hold_the_log_file_logs_to_the_console_only(tmp_path):
    script = (
        "import sys\nfrom pathlib import Path\nimport structlog\nfrom studio import logs\n"
        "print(logs.configure_logging(file=Path(sys.argv[1]) / 'studio.log'))\n"
        "structlog.get_logger().info('still here')\n"
    )
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    out = subprocess.run([sys.executable, "-c", script, str(not_a_folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False" and "still here" in out.stderr


@pytest.mark.slow
def test_doctor_says_where_the_studio_log_is_and_which_studio_runs_in_the_home(zoo_dir, llama_server_bin, tmp_path):
    home = tmp_path / "home"
    env = home_env(home, llama_server_bin)

    def doctor() -> dict:
        out = cli_in(env, "doctor", "--json")
        assert out.returncode in (0, 1), out.stderr
        return json.loads(out.stdout)

    info = doctor()
    checks = {c["check"]: c for c in info["checks"]}
    assert info["studio_log"] == str(home / "studio.log") and str(home / "studio.log") in checks["studio log"]["detail"]
    assert checks["studio"]["detail"] == f"none running in {home}"
    with serving(env, zoo_dir / "llama-dense.gguf") as (_, ready):
        running = {c["check"]: c for c in doctor()["checks"]}["studio"]["detail"]
        assert running == f"running at {ready['url']} (pid {ready['pid']})"
        follow = subprocess.Popen(
            [CLI, "logs", "-f"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            assert follow.stdout is not None and follow.stdout.readline()  # the log, as it goes on
            assert follow.poll() is None  # still following
        finally:
            follow.send_signal(signal.SIGINT)
            follow.wait(30)
            follow.stdout.close()  # type: ignore[union-attr]
            follow.stderr.close()  # type: ignore[union-attr]
    assert (home / "studio.log").stat().st_size > 0
