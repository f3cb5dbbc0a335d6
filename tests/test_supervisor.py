"""The supervisor with the real llama-server: crashes, bad files, storms, and no orphans."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from launcher.errors import LoadError, StartAbortedError
from launcher.registry import ChildRegistry
from launcher.supervisor import TRANSITIONS, LaunchSpec, State, Supervisor, owner_token
from tests.helpers import server_argv, wait_for

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def spec_for(binary: Path, model: Path, n_ctx: int = 1024) -> LaunchSpec:
    return LaunchSpec(
        make_argv=lambda port: server_argv(binary, model, host="127.0.0.1", port=port, n_ctx=n_ctx),
        binary=str(binary),
        model_bytes=model.stat().st_size,
        start_timeout=120,
    )


@pytest.fixture
def supervisor(tmp_path):
    sup = Supervisor(logs_dir=tmp_path / "logs", registry=ChildRegistry(tmp_path / "run", owner_token()))
    yield sup
    sup.close()


def llama_children() -> list[psutil.Process]:
    """Live (non-zombie) llama-server processes below this test process."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "llama-server" and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_transition_table_is_closed():
    assert set(TRANSITIONS) == set(State)
    assert all(targets <= set(State) for targets in TRANSITIONS.values())
    assert State.READY not in TRANSITIONS[State.IDLE]  # nothing becomes ready without starting


def test_start_reports_phases_then_stop_leaves_nothing(supervisor, llama_server_bin, gemma_model):
    seen_while_loading = []
    stop_watching = threading.Event()

    def watch():
        while not stop_watching.is_set():
            st = supervisor.status()
            if st.state == State.STARTING and st.progress:
                seen_while_loading.append((st.progress.phase, st.progress.bytes_loaded))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        status = supervisor.start(spec_for(llama_server_bin, gemma_model))
    finally:
        stop_watching.set()
        watcher.join()
    assert status.state == State.READY and status.url
    phases = status.progress.phases_seen
    assert phases[0] == "spawning" and phases[-1] == "ready" and len(phases) >= 3, phases
    assert {p for p, _ in seen_while_loading} - {"ready"}, seen_while_loading
    assert status.progress.bytes_loaded == gemma_model.stat().st_size
    assert httpx.get(f"{status.url}/health").status_code == 200
    pid = status.pid
    assert supervisor.registry.records()[0].pid == pid
    stopped = supervisor.stop()
    assert stopped.state == State.IDLE and gone(pid)
    assert supervisor.registry.records() == []
    assert supervisor.stop().state == State.IDLE  # idempotent


def test_killed_child_while_idle_is_detected_within_a_second(supervisor, llama_server_bin, gemma_model):
    pid = supervisor.start(spec_for(llama_server_bin, gemma_model)).pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    status = supervisor.wait_for({State.CRASHED}, timeout=1.0)
    assert time.monotonic() - t0 < 1.0
    assert status.exit_code == -signal.SIGKILL and "exited unexpectedly" in status.cause
    assert supervisor.registry.records() == []


def test_killed_child_while_streaming_is_detected_within_a_second(supervisor, llama_server_bin, gemma_model):
    status = supervisor.start(spec_for(llama_server_bin, gemma_model))
    first_chunk = threading.Event()
    outcome = {}

    def stream():
        try:
            with httpx.stream(
                "POST",
                f"{status.url}/v1/chat/completions",
                timeout=30,
                json={
                    "messages": [{"role": "user", "content": "Count to one thousand."}],
                    "max_tokens": 2000,
                    "stream": True,
                },
            ) as resp:
                for _ in resp.iter_lines():
                    first_chunk.set()
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(30)
    os.kill(status.pid, signal.SIGKILL)
    t0 = time.monotonic()
    crashed = supervisor.wait_for({State.CRASHED}, timeout=1.0)
    assert time.monotonic() - t0 < 1.0 and crashed.exit_code == -signal.SIGKILL
    reader.join(10)
    assert "error" in outcome  # the client saw the stream break, it did not hang


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("truncated", "not within the file bounds"),
        ("not gguf", "invalid magic characters"),
    ],
)
def test_bad_model_fails_fast_with_the_servers_reason(
    supervisor, llama_server_bin, gemma_model, tmp_path, kind, reason
):
    bad = tmp_path / "bad.gguf"
    if kind == "truncated":
        with gemma_model.open("rb") as src:
            bad.write_bytes(src.read(100_000_000))
    else:
        bad.write_text("this is a text file, not a model\n" * 50)
    t0 = time.monotonic()
    with pytest.raises(LoadError) as info:
        supervisor.start(spec_for(llama_server_bin, bad))
    assert time.monotonic() - t0 < 5
    assert reason in str(info.value) and info.value.cause == "invalid_gguf"
    assert info.value.hint and info.value.log_tail
    status = supervisor.status()
    assert status.state == State.FAILED and reason in status.cause and status.pid is None


def test_stop_during_start_aborts_the_start(supervisor, llama_server_bin, gemma_model):
    errors = []

    def start():
        try:
            supervisor.start(spec_for(llama_server_bin, gemma_model))
        except StartAbortedError as exc:
            errors.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    wait_for(lambda: supervisor.status().state == State.STARTING and supervisor.status().pid, timeout=10)
    t0 = time.monotonic()
    assert supervisor.stop().state == State.IDLE
    starter.join(10)
    assert time.monotonic() - t0 < 3
    assert len(errors) == 1 and not llama_children()


def test_start_stop_storm_never_runs_two_children(supervisor, llama_server_bin, zoo_dir):
    model = zoo_dir / "llama-dense.gguf"
    spec = spec_for(llama_server_bin, model, n_ctx=256)
    most_alive = [0]
    done = threading.Event()

    def monitor():
        while not done.is_set():
            most_alive[0] = max(most_alive[0], len(llama_children()))
            time.sleep(0.005)

    def worker(seed: int):
        rng = random.Random(seed)
        for _ in range(25):
            op = rng.choice(["start", "start", "stop", "restart", "status"])
            try:
                if op == "start":
                    supervisor.start(spec)
                elif op == "stop":
                    supervisor.stop()
                elif op == "restart":
                    supervisor.restart(spec)
                else:
                    supervisor.status()
            except StartAbortedError:
                pass

    watcher = threading.Thread(target=monitor)
    watcher.start()
    workers = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    done.set()
    watcher.join()
    assert most_alive[0] <= 1
    final = supervisor.status()
    assert final.state in (State.IDLE, State.READY)
    assert len(llama_children()) == (1 if final.state == State.READY else 0)
    assert len(supervisor.registry.records()) == len(llama_children())


OWNER = """
import sys, time
from pathlib import Path
from launcher.registry import ChildRegistry
from tests.helpers import server_argv
from launcher.supervisor import LaunchSpec, Supervisor, owner_token
from studio.logs import configure_logging
configure_logging()  # logs to stderr; stdout carries only the pid
binary, model, home = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
sup = Supervisor(logs_dir=home / "logs", registry=ChildRegistry(home / "run", owner_token()))
status = sup.start(LaunchSpec(binary=str(binary),
    make_argv=lambda port: server_argv(binary, model, host="127.0.0.1", port=port, n_ctx=512)))
print(status.pid, flush=True)
time.sleep(600)
"""


def test_kill_9_of_the_owner_leaves_no_llama_server(llama_server_bin, gemma_model, tmp_path):
    for trial in range(10):
        with subprocess.Popen(
            [sys.executable, "-c", OWNER, str(llama_server_bin), str(gemma_model), str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        ) as owner:
            pid = int(owner.stdout.readline())
            assert psutil.Process(pid).name() == "llama-server"
            owner.kill()
            owner.wait()
            t0 = time.monotonic()
            wait_for(lambda: gone(pid), timeout=2, what=f"llama-server {pid} to die with its owner (trial {trial})")
            assert time.monotonic() - t0 < 2


def test_registry_reaps_only_our_orphans(tmp_path):
    """Records for a dead studio's child, a live foreign studio's child and a recycled pid."""
    run = tmp_path / "run"
    ours = ChildRegistry(run, owner_token())
    with (
        subprocess.Popen(["sleep", "300"], start_new_session=True) as orphan,
        subprocess.Popen(["sleep", "300"], start_new_session=True) as foreign,
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]) as other_studio,
    ):
        try:
            dead_studio = subprocess.Popen(["true"])
            dead_studio.wait()
            rec = ChildRegistry(run, "studio-dead").add(orphan.pid, "llama-server")
            (run / f"llama-server-{orphan.pid}.json").write_text(
                (run / f"llama-server-{orphan.pid}.json")
                .read_text()
                .replace(f'"studio_pid": {os.getpid()}', f'"studio_pid": {dead_studio.pid}')
            )
            foreign_rec = ChildRegistry(run, "studio-other").add(foreign.pid, "llama-server")
            (run / f"llama-server-{foreign.pid}.json").write_text(
                (run / f"llama-server-{foreign.pid}.json")
                .read_text()
                .replace(f'"studio_pid": {os.getpid()}', f'"studio_pid": {other_studio.pid}')
                .replace(str(foreign_rec.studio_create_time), str(psutil.Process(other_studio.pid).create_time()))
            )
            (run / "llama-server-999999.json").write_text(
                '{"pid": 999999, "create_time": 1.0, "binary": "x", "owner": "o", "studio_pid": 1, '
                '"studio_create_time": 1.0}'
            )
            assert rec.pid == orphan.pid

            assert ours.reap_orphans(grace=2) == [orphan.pid]
            assert orphan.wait(5) is not None
            assert foreign.poll() is None  # another live studio's child is left alone
            assert [r.pid for r in ours.records()] == [foreign.pid]
        finally:
            for p in (orphan, foreign, other_studio):
                if p.poll() is None:
                    p.kill()


def test_after_stop_runs_once_the_child_is_reaped(supervisor, llama_server_bin, zoo_dir):
    seen = []
    spec = spec_for(llama_server_bin, zoo_dir / "llama-dense.gguf", n_ctx=256)
    spec = LaunchSpec(
        make_argv=spec.make_argv,
        binary=spec.binary,
        model_bytes=spec.model_bytes,
        after_stop=lambda: seen.append(supervisor_pid[0] is not None and gone(supervisor_pid[0])),
    )
    supervisor_pid = [supervisor.start(spec).pid]
    supervisor.stop()
    assert seen == [True]  # called once, after the process was gone


def test_a_crash_is_reported_at_once_and_left_to_the_owner(llama_server_bin, zoo_dir, tmp_path):
    """The supervisor restarted on its own, on a new port its owner never learnt; now it reports and reaps."""
    seen: list[State] = []
    sup = Supervisor(
        logs_dir=tmp_path / "logs",
        registry=ChildRegistry(tmp_path / "run", owner_token()),
        health_interval=60,
        on_change=lambda status: seen.append(status.state),
    )
    try:
        first = sup.start(spec_for(llama_server_bin, zoo_dir / "llama-dense.gguf", n_ctx=256)).pid
        assert sup.url is not None
        t0 = time.monotonic()
        os.kill(first, signal.SIGKILL)
        status = sup.wait_for({State.CRASHED}, timeout=5)
        assert time.monotonic() - t0 < 2  # noticed from the child's exit, not at the next health check (60 s)
        assert status.pid is None and sup.url is None and "code -9" in status.cause
        assert seen[-1] == State.CRASHED and State.STARTING not in seen[seen.index(State.READY) :]
        assert gone(first)
    finally:
        sup.close()
