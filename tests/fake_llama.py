"""A stand-in for ``launcher.supervisor.Supervisor`` that runs no process: fast enough for thousands of loads.

It imitates what the model manager sees of a real llama-server through its supervisor, no more:

- ``start`` blocks for a short load time (``load_seconds``), then answers a ready ``Status`` whose URL
  is a real HTTP server answering ``/props`` with the slot size, as llama-server does;
- a ``stop`` from another thread during a start aborts it with ``StartAbortedError``, as the real
  supervisor does when an unload cancels a load;
- ``crash`` reports a crash through ``on_change``, as the real watchdog does when the child dies;
- every stop of a child runs the spec's ``after_stop`` once it is "reaped", as the real one does;
- a start of a model named in ``FakeChildren.failing`` fails with ``LoadError``, as a bad model does;
- a start of a model named in ``FakeChildren.killed`` dies by SIGKILL while loading (``LoadError`` with exit
  code -9), as a llama-server the out-of-memory killer takes does.

``FakeChildren`` is the process table: which fake llama-servers run, per model, so a test can
check that none runs twice and none outlives its resident.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from launcher.errors import LoadError, StartAbortedError
from launcher.supervisor import LaunchSpec, State, Status


class FakeChildren:
    """The fake llama-servers alive now, and the ``/props`` server they all answer through."""

    def __init__(self, url: str, *, load_seconds: float = 0.01) -> None:
        self.url = url
        self.load_seconds = load_seconds
        self.failing: set[str] = set()  # model file names whose start fails
        self.killed: set[str] = set()  # model file names whose start is killed by a signal
        self.starts: dict[str, int] = {}  # model file name -> children started for it
        self.on_reap: Callable[[int], None] = lambda pid: None  # e.g. a fake GPU driver freeing memory late
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}  # fake pid -> model file name
        self._next_pid = 1000
        self.supervisors: list[FakeSupervisor] = []

    def spawn(self, model: str) -> int:
        with self._lock:
            self._next_pid += 1
            self._running[self._next_pid] = model
            self.starts[model] = self.starts.get(model, 0) + 1
            return self._next_pid

    def reap(self, pid: int) -> None:
        with self._lock:
            self._running.pop(pid, None)
        self.on_reap(pid)

    def running(self) -> dict[int, str]:
        with self._lock:
            return dict(self._running)

    def factory(self) -> Callable[[Callable[[Status], None]], FakeSupervisor]:
        """A ``SupervisorFactory`` for ``ModelManager``."""

        def make(on_change: Callable[[Status], None]) -> FakeSupervisor:
            sup = FakeSupervisor(self, on_change)
            self.supervisors.append(sup)
            return sup

        return make


def _model_of(spec: LaunchSpec) -> str:
    argv = list(spec.make_argv(0))
    return argv[argv.index("-m") + 1].rsplit("/", 1)[-1] if "-m" in argv else "?"


class FakeSupervisor:
    """One resident's supervisor; see the module docstring."""

    def __init__(self, children: FakeChildren, on_change: Callable[[Status], None]) -> None:
        self.children = children
        self.on_change = on_change
        self._state = State.IDLE
        self._pid: int | None = None
        self._spec: LaunchSpec | None = None
        self._abort = threading.Event()
        self._lock = threading.Lock()
        self.closed = False

    @property
    def url(self) -> str | None:
        return self.children.url if self._state is State.READY else None

    @property
    def state(self) -> State:
        return self._state

    def status(self) -> Status:
        return Status(self._state, self._pid, self.url, None, None, None, None)

    def start(self, spec: LaunchSpec) -> Status:
        model = _model_of(spec)
        with self._lock:
            self._abort.clear()
            self._spec = spec
            self._pid = self.children.spawn(model)
            self._state = State.STARTING
        if self._abort.wait(self.children.load_seconds):
            self._reap()
            raise StartAbortedError("the start was cancelled by a stop")
        if model in self.children.failing:
            self._reap(State.FAILED)
            raise LoadError(f"llama-server exited while loading {model}: injected failure")
        if model in self.children.killed:
            self._reap(State.FAILED)
            raise LoadError(f"llama-server was killed by SIGKILL while loading {model}", exit_code=-9)
        with self._lock:
            if self._abort.is_set() or self._pid is None:
                raise StartAbortedError("the start was cancelled by a stop")
            self._state = State.READY
        return self.status()

    def stop(self) -> Status:
        self._abort.set()
        self._reap()
        return self.status()

    def close(self) -> None:
        self.stop()
        self.closed = True

    def crash(self) -> bool:
        """The child dies: reaped, and the crash reported as the watchdog would. False when none was ready."""
        with self._lock:
            if self._state is not State.READY:
                return False
        self._reap(State.CRASHED)
        self.on_change(Status(State.CRASHED, None, None, None, "llama-server died: injected crash", -9, None))
        return True

    def _reap(self, state: State = State.IDLE) -> None:
        with self._lock:
            pid, spec, self._pid = self._pid, self._spec, None
            self._state = state
        if pid is not None:
            self.children.reap(pid)
            if spec is not None and spec.after_stop is not None:
                spec.after_stop()


class _Props(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"default_generation_settings": {"n_ctx": 256}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def fake_children(*, load_seconds: float = 0.01) -> Iterator[FakeChildren]:
    """Fake llama-servers whose ``/props`` is a real local HTTP server, for the test's duration."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Props)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield FakeChildren(f"http://127.0.0.1:{server.server_address[1]}", load_seconds=load_seconds)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
