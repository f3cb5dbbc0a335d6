"""Run one llama-server as a child process: start, wait until healthy, stop.

The child runs in its own process group and dies with its parent (see
``launcher.platform``). Its output goes to a log file and a ring buffer whose
tail is attached to every error. ``stop`` is idempotent and bounded in time:
SIGTERM to the group, wait, SIGKILL, reap.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from launcher import platform
from launcher.errors import LoadError, PortInUseError, StartTimeoutError


def ensure_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if something already listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(host, port) from exc


class LlamaServer:
    """One llama-server child, from start to reaped."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        host: str,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.host = host
        self.port = port
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tail: deque[str] = deque(maxlen=200)
        self._reader: threading.Thread | None = None
        #: Every /health answer seen while waiting: an HTTP status, or 0 for "no answer yet".
        self.health_history: list[int] = []

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8081``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the child has exited, else None."""
        return self._proc.poll() if self._proc else None

    def log_tail(self, lines: int = 30) -> str:
        """Return the last ``lines`` lines the child printed."""
        return "\n".join(list(self._tail)[-lines:])

    def start(self) -> None:
        """Start the child; returns at once (use ``wait_ready`` to wait)."""
        if self._proc is not None:
            raise RuntimeError("this LlamaServer was already started")
        ensure_port_free(self.host, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            **platform.child_popen_kwargs(),
        )
        self._reader = threading.Thread(target=self._pump_output, name=f"llama-server-{self._proc.pid}", daemon=True)
        self._reader.start()

    def _pump_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self._proc.stdout as pipe, self.log_path.open("ab") as log:
            for raw in pipe:
                log.write(raw)
                log.flush()
                self._tail.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def wait_ready(self, timeout: float = 120.0, poll_interval: float = 0.02) -> None:
        """Return once ``/health`` answers 200.

        Raises:
            LoadError: the child exited first (its log tail says why).
            StartTimeoutError: no 200 before ``timeout`` seconds.
        """
        assert self._proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    self._join_reader()
                    raise LoadError(
                        f"llama-server exited with code {code} while loading; last output:\n{self.log_tail()}",
                        pid=self._proc.pid, exit_code=code, log_tail=self.log_tail(),
                    )
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.TransportError:
                    status = 0
                self.health_history.append(status)
                if status == 200:
                    return
                if time.monotonic() >= deadline:
                    raise StartTimeoutError(
                        f"llama-server did not become healthy within {timeout:.0f} s; last output:\n{self.log_tail()}",
                        pid=self._proc.pid, log_tail=self.log_tail(),
                    )
                time.sleep(poll_interval)

    def stop(self, grace: float = 10.0) -> int | None:
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

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
