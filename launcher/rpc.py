"""llama.cpp's RPC link to other machines: worker endpoints, their devices, and which worker failed.

A worker is a ``ggml-rpc-server`` exposing one host's devices over TCP. llama-server's
``--rpc host:port,...`` adds each worker's devices as ``RPC0, RPC1, ...`` in that order,
ahead of the local GPUs, and names the buffers it allocates there ``RPC<i>[host:port]``,
``i`` being the device's index on its own worker (pinned b11434: ``ggml-rpc.cpp``
``ggml_backend_rpc_buffer_type``, ``src/llama.cpp`` ``llama_prepare_model_devices``).

Facts of the pinned worker that shape this module:

- The link has no authentication and no encryption (``LINK_WARNING``).
- A worker serves one client at a time: its accept loop is serial, so while a
  llama-server uses it a second connection waits in the backlog, unanswered.
- ``llama-server --rpc`` aborts at start when a worker refuses the connection, and
  hangs in ``connect`` or the handshake when one is unreachable or busy: only workers
  that answered a query just before a launch are passed to it.
- Mid-generation, a worker that dies makes llama-server abort with
  ``Remote RPC server crashed or returned malformed response``, naming no worker;
  ``explain_failure`` names it by probing which workers still accept a connection.
- A CPU worker reports its whole RAM as free (``ggml_backend_cpu_device_get_memory``).

Workers are queried with three messages of the RPC protocol itself (HELLO,
DEVICE_COUNT, GET_DEVICE_MEMORY), not ``llama-server --rpc EP --list-devices``:
only the protocol tells a busy worker (it accepts, then does not answer HELLO)
from a dead one (it refuses) or one of another llama.cpp release (HELLO answers
another protocol version, which llama-server would refuse too), where the
subprocess only times out or aborts; and on loopback the query takes 0.3 ms a
worker against 17 ms (medians of 20 and 10 runs on the pinned build).
"""

from __future__ import annotations

import re
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from launcher.errors import LauncherError

#: The pinned llama.cpp's RPC protocol (ggml/include/ggml-rpc.h): a client accepts the same major and a minor
#: no newer than its own, as ``negotiate_hello`` does.
PROTOCOL_VERSION = (7, 0, 0)
_CMD_GET_DEVICE_MEMORY = 11
_CMD_HELLO = 14  # ggml-rpc.cpp: "RPC_CMD_HELLO must be always 14"
_CMD_DEVICE_COUNT = 15
_CONN_CAPS = 24  # transport.h RPC_CONN_CAPS_SIZE; all zero: plain TCP, no RDMA upgrade
#: llama-server's lines when the link fails (ggml-rpc.cpp, b11434).
_NAMED_FAILURE = re.compile(r"Failed to connect to (\S+)|RPC handshake failed for (\S+)|Cannot resolve host '([^']+)'")
_LINK_FAILURE = re.compile(r"Remote RPC server crashed or returned malformed response|RPC server version mismatch")

DEFAULT_PORT = 50052  # ggml-rpc-server's own default
QUERY_TIMEOUT_S = 2.0

LINK_WARNING = (
    "the RPC link is unauthenticated and unencrypted: anyone who can reach a worker's port can use its devices "
    "and memory, and weights, activations and outputs cross the network in the clear (llama.cpp: never run the "
    "RPC server on an open network); use loopback or a trusted private network only"
)


class RpcWorkerError(LauncherError, ConnectionError):
    """A worker did not answer a query; ``reason`` says how.

    ``busy``: it accepted the connection but did not answer. ``silent``: it did
    not refuse (busy, or a connection that timed out: a busy worker's one-place
    backlog fills with the first waiting client, and later connections time out).
    """

    def __init__(self, endpoint: str, reason: str, *, busy: bool = False, silent: bool = False) -> None:
        super().__init__(f"RPC worker {endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason
        self.busy = busy
        self.silent = silent or busy


def normalize_endpoint(text: str) -> str:
    """``host:port`` as llama-server's ``--rpc`` takes it; ``ValueError`` saying what is wrong otherwise.

    llama.cpp splits an endpoint at its first colon and connects over IPv4 only,
    so an IPv6 address cannot be used.
    """
    value = text.strip()
    host, sep, port = value.partition(":")
    if not sep or not host:
        raise ValueError(f"RPC worker {text!r} must be host:port, e.g. 192.168.1.20:{DEFAULT_PORT}")
    if ":" in port or host.startswith("["):
        raise ValueError(
            f"RPC worker {text!r}: llama.cpp's RPC backend speaks IPv4 only; use an IPv4 address or a host name"
        )
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"RPC worker {text!r}: the port must be a number from 1 to 65535")
    return f"{host}:{int(port)}"


def parse_endpoints(values: str | Iterable[str]) -> tuple[str, ...]:
    """Endpoints from ``a:1,b:2`` or a list, normalized, duplicates dropped (order kept)."""
    items = values.split(",") if isinstance(values, str) else list(values)
    return tuple(dict.fromkeys(normalize_endpoint(v) for v in items if v.strip()))


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.partition(":")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine (an address in 127/8, or ``localhost``)."""
    return host == "localhost" or host.startswith("127.")


@dataclass(frozen=True)
class WorkerDevice:
    """One device of a worker, as its worker reports it."""

    endpoint: str
    index: int  # the device's index on its worker (``i`` of the buffer name ``RPC<i>[endpoint]``)
    free_bytes: int
    total_bytes: int

    @property
    def buffer_name(self) -> str:
        """The name llama-server gives this device's buffers in its log."""
        return f"RPC{self.index}[{self.endpoint}]"

    @property
    def reports_total_as_free(self) -> bool:
        """A CPU worker does: ggml does not measure free RAM and says all of it is free."""
        return self.free_bytes == self.total_bytes


@dataclass(frozen=True)
class WorkerReport:
    """What one worker answered, or why it is left out."""

    endpoint: str
    devices: tuple[WorkerDevice, ...] = ()
    problem: str | None = None  # why it did not answer; None when it did (or ``stale`` devices stand in)
    busy: bool = False  # it did not answer and did not refuse: serving another client (or gone silent)
    stale_since: float | None = None  # busy, and ``devices`` are its answer from this time (time.time())

    @property
    def usable(self) -> bool:
        return bool(self.devices)


def query_worker(endpoint: str, *, timeout: float = QUERY_TIMEOUT_S) -> tuple[WorkerDevice, ...]:
    """Return the worker's devices with their memory.

    Raises:
        RpcWorkerError: refused, unreachable, busy (``busy``), or another protocol version.
    """
    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise RpcWorkerError(
            endpoint, "connection refused: nothing listens there (is `ggstudio rpc-worker` running on that host?)"
        ) from None
    except TimeoutError:
        raise RpcWorkerError(
            endpoint,
            f"no connection within {timeout:g} s: the host is down or cut off, or the "
            "worker is busy and its one-place backlog is full",
            silent=True,
        ) from None
    except OSError as exc:
        raise RpcWorkerError(endpoint, f"cannot connect: {exc.strerror or exc}") from None
    with sock:
        try:
            major, minor, patch = _hello(sock, deadline)
        except TimeoutError:
            raise RpcWorkerError(
                endpoint,
                f"it accepted the connection but did not answer within {timeout:g} s: a "
                "worker serves one client at a time, so another llama-server is using it",
                busy=True,
            ) from None
        except (OSError, _Malformed) as exc:
            raise RpcWorkerError(endpoint, f"it broke off the handshake ({exc}); is it a ggml-rpc-server?") from None
        ours = PROTOCOL_VERSION
        if major != ours[0] or minor > ours[1]:
            raise RpcWorkerError(
                endpoint,
                f"it speaks RPC protocol {major}.{minor}.{patch}, the pinned llama-server "
                f"{'.'.join(map(str, ours))}: run a ggml-rpc-server of the same llama.cpp "
                "release there (`ggstudio rpc-worker`)",
            )
        try:
            (count,) = struct.unpack("<I", _call(sock, _CMD_DEVICE_COUNT, b"", 4, deadline))
            devices = []
            for index in range(count):
                free, total = struct.unpack(
                    "<QQ", _call(sock, _CMD_GET_DEVICE_MEMORY, struct.pack("<I", index), 16, deadline)
                )
                devices.append(WorkerDevice(endpoint, index, free, total))
        except TimeoutError:
            raise RpcWorkerError(endpoint, f"it stopped answering within {timeout:g} s") from None
        except (OSError, _Malformed) as exc:
            raise RpcWorkerError(endpoint, f"it broke off the device query ({exc})") from None
    return tuple(devices)


class _Malformed(Exception):
    """The worker's answer does not have the protocol's shape."""


def _hello(sock: socket.socket, deadline: float) -> tuple[int, int, int]:
    answer = _call(sock, _CMD_HELLO, bytes(_CONN_CAPS), 4 + _CONN_CAPS, deadline)
    return answer[0], answer[1], answer[2]


def _call(sock: socket.socket, cmd: int, payload: bytes, answer_size: int, deadline: float) -> bytes:
    """Send ``| cmd: u8 | size: u64 | payload |``, read ``| size: u64 | answer |``."""
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _read(sock, 8, deadline))
    if size != answer_size:
        raise _Malformed(f"an answer of {size} bytes where {answer_size} were expected")
    return _read(sock, size, deadline)


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise _Malformed("the connection closed")
        data += chunk
    return data


@dataclass
class RpcWorkers:
    """The configured workers, queried together; remembers each one's last answer.

    A worker that is busy (most often serving this studio's own llama-server, while
    the next load is planned or a plan previewed) stands in with its last answer,
    marked stale, instead of dropping out of the plan.
    """

    endpoints: tuple[str, ...]
    timeout: float = QUERY_TIMEOUT_S
    _last: dict[str, tuple[float, tuple[WorkerDevice, ...]]] = field(default_factory=dict, repr=False)

    def query(self) -> tuple[WorkerReport, ...]:
        """One report per endpoint, in the configured order; workers are asked in parallel."""
        if not self.endpoints:
            return ()
        with ThreadPoolExecutor(max_workers=min(len(self.endpoints), 16), thread_name_prefix="rpc-query") as pool:
            return tuple(pool.map(self._report, self.endpoints))

    def _report(self, endpoint: str) -> WorkerReport:
        try:
            devices = query_worker(endpoint, timeout=self.timeout)
        except RpcWorkerError as exc:
            last = self._last.get(endpoint)
            if exc.silent and last is not None:
                return WorkerReport(endpoint, last[1], busy=True, stale_since=last[0])
            return WorkerReport(endpoint, problem=exc.reason, busy=exc.busy)
        if not devices:
            return WorkerReport(endpoint, problem="it reports no device")
        self._last[endpoint] = (time.time(), devices)
        return WorkerReport(endpoint, devices)


def report_warnings(reports: Sequence[WorkerReport]) -> list[str]:
    """What a user should know about the workers: the ones left out, stale answers, memory they overstate."""
    out = []
    for r in reports:
        if r.problem is not None:
            out.append(f"RPC worker {r.endpoint} left out: {r.problem}")
        elif r.stale_since is not None:
            when = time.strftime("%H:%M:%S", time.localtime(r.stale_since))
            out.append(
                f"RPC worker {r.endpoint} did not answer, but answered before: busy, probably serving the "
                f"loaded model's llama-server (a worker serves one client at a time); planning with its "
                f"devices as it reported them at {when}"
            )
        if any(d.reports_total_as_free for d in r.devices):
            out.append(
                f"RPC worker {r.endpoint} reports all its memory as free (a CPU worker: ggml does not "
                "measure free RAM); its budget assumes nothing else runs there"
            )
    hosts: dict[str, list[str]] = {}
    for r in reports:
        if r.usable:
            host = split_endpoint(r.endpoint)[0]
            hosts.setdefault("this machine" if is_loopback(host) else host, []).append(r.endpoint)
    for host, shared in hosts.items():
        if len(shared) > 1 or (host == "this machine"):
            who = ", ".join(shared)
            with_ = " and the local CPU" if host == "this machine" else ""
            out.append(f"RPC workers {who}{with_} run on {host} and share its memory, which each reports in full")
    return out


@dataclass(frozen=True)
class WorkerFailure:
    """Which workers failed a launch or a running llama-server, and how."""

    workers: tuple[str, ...]
    reasons: tuple[str, ...]  # one per worker, same order

    @property
    def message(self) -> str:
        if not self.workers:
            return (
                "an RPC worker crashed or sent a malformed answer, yet every worker still accepts connections "
                "(restarted already, or a network fault?)"
            )
        return "; ".join(f"RPC worker {w} failed ({r})" for w, r in zip(self.workers, self.reasons, strict=False))


def unreachable(endpoints: Sequence[str], *, timeout: float = 1.0) -> dict[str, str]:
    """The workers that no longer accept a TCP connection, with why (a live one accepts even while busy)."""

    def probe(endpoint: str) -> str | None:
        try:
            socket.create_connection(split_endpoint(endpoint), timeout=timeout).close()
        except ConnectionRefusedError:
            return "connection refused: the worker is gone"
        except TimeoutError:
            return f"no connection within {timeout:g} s: the host is down or cut off"
        except OSError as exc:
            return f"cannot connect: {exc.strerror or exc}"
        return None

    if not endpoints:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(endpoints), 16), thread_name_prefix="rpc-probe") as pool:
        found = dict(zip(endpoints, pool.map(probe, endpoints), strict=False))
    return {e: why for e, why in found.items() if why is not None}


def explain_failure(
    log_lines: Sequence[str], endpoints: Sequence[str], *, timeout: float = 1.0
) -> WorkerFailure | None:
    """Name the workers behind a llama-server failure, or None when its log shows no RPC failure.

    llama-server names a worker it cannot connect to at start; mid-generation it only
    says a "Remote RPC server crashed", so the workers are probed: the ones that no
    longer accept a connection are the ones that failed.
    """
    named = []
    link_failed = False
    for line in log_lines:
        if m := _NAMED_FAILURE.search(line):
            target = next(g for g in m.groups() if g)
            named += [e for e in endpoints if e == target or split_endpoint(e)[0] == target]
        elif _LINK_FAILURE.search(line):
            link_failed = True
    if named:
        gone = unreachable(list(dict.fromkeys(named)), timeout=timeout)
        workers = tuple(dict.fromkeys(named))
        return WorkerFailure(workers, tuple(gone.get(w, "llama-server could not connect to it") for w in workers))
    if not link_failed:
        return None
    gone = unreachable(endpoints, timeout=timeout)
    if not gone:
        return WorkerFailure((), ())
    return WorkerFailure(tuple(gone), tuple(gone.values()))


def with_worker_indices(reports: Sequence[WorkerReport]) -> list[tuple[int, WorkerDevice]]:
    """Each usable worker's devices with llama-server's ordinal (``RPC<n>``) for the ``--rpc`` list of them."""
    out: list[tuple[int, WorkerDevice]] = []
    for r in reports:
        for d in r.devices:
            out.append((len(out), d))
    return out


__all__ = [
    "DEFAULT_PORT",
    "LINK_WARNING",
    "PROTOCOL_VERSION",
    "RpcWorkerError",
    "RpcWorkers",
    "WorkerDevice",
    "WorkerFailure",
    "WorkerReport",
    "explain_failure",
    "is_loopback",
    "normalize_endpoint",
    "parse_endpoints",
    "query_worker",
    "report_warnings",
    "split_endpoint",
    "unreachable",
    "with_worker_indices",
]
