"""Run one llama-server (or another of llama.cpp's servers) as a child process: start, wait until ready, stop.

The child runs in its own process group and dies with its parent (see
``launcher.platform``). Its output goes to a log file and a ring buffer whose
tail is attached to every error, and each line can be handed to a callback
(the supervisor turns lines into load phases). ``stop`` is idempotent and
bounded in time: SIGTERM to the group, wait, SIGKILL, reap. ``ChildProcess`` is
that life; ``LlamaServer`` adds readiness through ``/health``
(``launcher.rpc_worker`` adds a worker's own).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from launcher import platform
from launcher.diagnosis import Diagnosis, diagnose, exit_by_signal
from launcher.errors import LoadError, PortInUseError, StartAbortedError, StartTimeoutError

#: Lines of output kept in memory and attached to errors.
TAIL_LINES = 300
#: Seconds between two ``/health`` asks while llama-server loads: the time a ready server waits to be seen, half of
#: it on average (it was 50 ms, on the path of every first answer).
READY_POLL = 0.01


def ensure_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if something already listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(host, port) from exc


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port on ``host`` that the OS says is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def listening_socket(host: str, port: int) -> socket.socket:
    """Return a TCP socket bound to ``host:port`` (port 0: one the OS picks), for a listener that must know its
    port before it starts; bound here, it cannot be taken between choosing and listening.

    Here, not beside the service that listens on it: ``serve`` binds it before it starts its first model, and
    imports the web stack only then.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock


class ChildProcess:
    """One server child bound to ``host:port``, from start to reaped."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        host: str,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.host = host
        self.port = port
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.on_line = on_line
        self.on_exit = on_exit  # called from the output thread once the child closed its output (it exited)
        self._proc: subprocess.Popen[bytes] | None = None
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._reader: threading.Thread | None = None
        self._oom_kills_at_start: int | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the child has exited, else None."""
        return self._proc.poll() if self._proc else None

    @property
    def output_closed(self) -> bool:
        """Whether the child has closed its output, which llama-server does only by exiting."""
        return self._reader is not None and not self._reader.is_alive()

    def wait_exit(self, timeout: float) -> int | None:
        """Return the exit status once the child is gone, or None if it is still running after ``timeout``."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def death(self, code: int) -> Diagnosis | None:
        """Why it died, when a signal ended it (``code`` < 0): killed, by the OOM killer likely, or a crash."""
        now = platform.oom_kills()
        oom = now is not None and self._oom_kills_at_start is not None and now > self._oom_kills_at_start
        return exit_by_signal(code, oom_killed=oom, log_lines=list(self._tail))

    def log_tail(self, lines: int = 50) -> str:
        """Return the last ``lines`` lines the child printed."""
        return "\n".join(list(self._tail)[-lines:])

    def log_lines(self) -> list[str]:
        """The last ``TAIL_LINES`` lines the child printed, oldest first."""
        return list(self._tail)

    def start(self) -> int:
        """Start the child and return its pid at once (use ``wait_ready`` to wait)."""
        if self._proc is not None:
            raise RuntimeError(f"this {type(self).__name__} was already started")
        ensure_port_free(self.host, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._oom_kills_at_start = platform.oom_kills()
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            **platform.child_popen_kwargs(),
        )
        name = f"{Path(self.argv[0]).name}-{self._proc.pid}"
        self._reader = threading.Thread(target=self._pump_output, name=name, daemon=True)
        self._reader.start()
        return self._proc.pid

    def _pump_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self._proc.stdout as pipe, self.log_path.open("ab") as log:
            for raw in pipe:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self._tail.append(line)
                if self.on_line is not None:
                    self.on_line(line)
        if self.on_exit is not None:
            self.on_exit()

    def stop(self, grace: float = 5.0) -> int | None:
        """Stop the child and its group; return its exit status. Safe to call twice."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            platform.terminate_group(proc.pid)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                platform.kill_group(proc.pid)
                proc.wait()
        # The child is reaped; anything it spawned in its group goes too.
        platform.kill_group(proc.pid)
        self._join_reader()
        return proc.returncode

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def __enter__(self) -> ChildProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LlamaServer(ChildProcess):
    """One llama-server child: ready once ``/health`` answers 200."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        host: str,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        api_key: str | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(argv, host=host, port=port, log_path=log_path, env=env, on_line=on_line)
        self.api_key = api_key
        #: Every /health answer seen while waiting: an HTTP status, or 0 for "no answer yet".
        self.health_history: list[int] = []

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8081``."""
        return f"http://{self.host}:{self.port}"

    def probe_health(self, timeout: float) -> int:
        """Return the HTTP status of ``/health`` over a plain socket, or 0 when nothing answers in time.

        The watchdog asks every few seconds for as long as a model is resident, and ``wait_ready`` every
        ``READY_POLL`` s while it loads: a raw request costs tens of microseconds, an ``httpx`` client about a
        millisecond a request and 30 ms or more to make (its TLS context).
        """
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        request = f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{auth}Connection: close\r\n\r\n"
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
                sock.sendall(request.encode())
                head = sock.recv(64)
        except OSError:
            return 0
        parts = head.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and head.startswith(b"HTTP/") and parts[1].isdigit() else 0

    def wait_ready(
        self,
        timeout: float = 120.0,
        poll_interval: float = READY_POLL,
        *,
        abort: threading.Event | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        """Return once ``/health`` answers 200.

        Raises:
            LoadError: the child exited first (with llama-server's own reason).
            StartTimeoutError: no 200 before ``timeout`` seconds.
            StartAbortedError: ``abort`` was set.
        """
        assert self._proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                self._join_reader()
                raise self._load_error(code)
            if abort is not None and abort.is_set():
                raise StartAbortedError("the start was cancelled by a stop", pid=self._proc.pid)
            status = self.probe_health(timeout=2.0)
            self.health_history.append(status)
            if status == 200:
                return
            if on_tick is not None:
                on_tick()
            if time.monotonic() >= deadline:
                raise StartTimeoutError(
                    f"llama-server did not become healthy within {timeout:.0f} s; last output:\n{self.log_tail()}",
                    pid=self._proc.pid,
                    log_tail=self.log_tail(),
                )
            if abort is not None:
                abort.wait(poll_interval)
            else:
                time.sleep(poll_interval)

    def _load_error(self, code: int) -> LoadError:
        found = self.death(code) or diagnose(list(self._tail))
        hint = f" ({found.hint})" if found.hint else ""
        how = "stopped" if code < 0 else f"exited with code {code}"
        return LoadError(
            f"llama-server {how} while loading: {found.reason}{hint}",
            pid=self.pid,
            exit_code=code,
            log_tail=self.log_tail(),
            cause=found.cause,
            hint=found.hint,
        )
