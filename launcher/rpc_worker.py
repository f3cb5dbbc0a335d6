"""Run a ``ggml-rpc-server`` (an RPC worker) as a supervised child, like llama-server.

The child gets the same process group and parent-death signal as llama-server
(``launcher.process.ChildProcess``), so it never outlives the command that runs
it. Facts of the pinned worker (``tools/rpc/rpc-server.cpp``, ``ggml-rpc.cpp``,
``transport.cpp``):

- ``-H`` takes an IPv4 address only (``inet_addr``; ``localhost`` is refused).
- A port it cannot bind makes it print ``Failed to create server socket`` and
  exit with code 0, so the port is checked first (``ChildProcess.start``) and
  that line is read after, for the race.
- It prints a banner and its devices, then listens; it is ready once its pid
  holds the port in LISTEN. Its stdout is a pipe here and it flushes only when a
  client connects, so the banner arrives late: what it exposes is asked over the
  protocol instead (``launcher.rpc.query_worker``).
- Its link has no authentication and no encryption (``launcher.rpc.LINK_WARNING``):
  binding anything but loopback needs ``allow_remote``.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from launcher.errors import LauncherError, LoadError, PortInUseError, StartAbortedError, StartTimeoutError
from launcher.process import ChildProcess

_BIND_FAILED = "Failed to create server socket"


class RemoteBindError(LauncherError, ValueError):
    """A worker was asked to listen beyond loopback without the explicit permission."""

    def __init__(self, host: str) -> None:
        super().__init__(
            f"refusing to bind the RPC worker to {host}: the RPC protocol has no authentication and no encryption, "
            "so anyone who can reach the port could use this machine's devices and memory and read what crosses "
            "the link; llama.cpp says never to expose it on an open network. On a trusted private network, pass "
            "--allow-remote to bind it anyway"
        )
        self.host = host


def check_bind(host: str, *, allow_remote: bool) -> None:
    """Refuse what the worker cannot bind, and anything beyond loopback without ``allow_remote``.

    Raises:
        ValueError: ``host`` is not an IPv4 address (the worker binds IPv4 literals only).
        RemoteBindError: not loopback, and ``allow_remote`` is False.
    """
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(
            f"--host {host!r}: ggml-rpc-server binds an IPv4 address only (127.0.0.1 for this machine, "
            "or one of its LAN addresses)"
        ) from None
    if not address.is_loopback and not allow_remote:
        raise RemoteBindError(host)


def worker_argv(binary: Path, *, host: str, port: int, threads: int | None = None, cache: bool = False) -> list[str]:
    """The ggml-rpc-server command line."""
    argv = [str(binary), "--host", host, "--port", str(port)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if cache:
        argv.append("--cache")
    return argv


class RpcWorker(ChildProcess):
    """One ggml-rpc-server child: ready once it listens on its port."""

    def __init__(
        self,
        binary: Path,
        *,
        host: str,
        port: int,
        log_path: Path,
        threads: int | None = None,
        cache: bool = False,
        env: Mapping[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(
            worker_argv(binary, host=host, port=port, threads=threads, cache=cache),
            host=host,
            port=port,
            log_path=log_path,
            env=env,
            on_line=on_line,
        )

    @property
    def endpoint(self) -> str:
        """Where a client on this machine reaches the worker."""
        return f"{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{self.port}"

    def listening(self) -> bool:
        """Whether the worker's own process holds its port in LISTEN."""
        if self.pid is None:
            return False
        try:
            conns = psutil.Process(self.pid).net_connections(kind="tcp4")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port for c in conns)

    def wait_ready(
        self, timeout: float = 30.0, poll_interval: float = 0.05, *, abort: threading.Event | None = None
    ) -> None:
        """Return once the worker listens.

        Raises:
            PortInUseError: another program took the port first.
            LoadError: the worker exited (with its own last line).
            StartTimeoutError: it did not listen within ``timeout``.
            StartAbortedError: ``abort`` was set.
        """
        deadline = time.monotonic() + timeout
        while True:
            code = self.returncode
            if code is not None:
                self._join_reader()
                if any(_BIND_FAILED in line for line in self.log_lines()):
                    raise PortInUseError(self.host, self.port)
                last = next((line.strip() for line in reversed(self.log_lines()) if line.strip()), "no output")
                raise LoadError(
                    f"ggml-rpc-server exited with code {code} before listening: {last}",
                    pid=self.pid,
                    exit_code=code,
                    log_tail=self.log_tail(),
                )
            if self.listening():
                return
            if abort is not None and abort.is_set():
                raise StartAbortedError("the worker's start was cancelled", pid=self.pid)
            if time.monotonic() >= deadline:
                raise StartTimeoutError(
                    f"ggml-rpc-server did not listen on {self.host}:{self.port} within "
                    f"{timeout:.0f} s; last output:\n{self.log_tail()}",
                    pid=self.pid,
                    log_tail=self.log_tail(),
                )
            time.sleep(poll_interval)

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the worker exits (or ``timeout``); return its exit status, None if still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
        self._join_reader()
        return self.returncode
