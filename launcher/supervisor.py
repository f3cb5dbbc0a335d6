"""A supervised llama-server: one owner thread, explicit states, nothing leaks.

The supervisor owns at most one child. A single owner thread alone spawns,
watches and stops it; ``start``/``stop``/``restart`` post commands to that
thread and wait for the answer, so callers never "check, then act". A stop
also sets an abort flag first, so it cancels a start in progress at once
(``StartAbortedError``) instead of queueing behind it. Every state change goes
through ``TRANSITIONS``, wakes every waiter and is handed to ``on_change``.

The supervisor reports a crash; whether to restart is its owner's decision (a
resident model restarts with back-off, reading the new address from here).
Idle costs next to nothing: the owner thread sleeps until a command, the child's
exit (its output thread says so) or the next health check, which is one raw
request on loopback.

Never leaking rests on three layers: the child dies with the owner thread's
process (PR_SET_PDEATHSIG, even on SIGKILL), every child is written to a
``ChildRegistry`` so a later studio reaps our orphans, and ``close`` runs at
interpreter exit.

The pinned llama-server only watches its stdin for a parent's death in router
child mode, so no stdin lifeline is used; stdin is /dev/null.
"""

from __future__ import annotations

import atexit
import enum
import os
import queue
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
import structlog

from launcher.allocations import parse_allocations
from launcher.bill import MemoryBill
from launcher.errors import LoadError, PortInUseError, ProcessError, StartAbortedError
from launcher.process import LlamaServer, free_port
from launcher.registry import ChildRegistry

log = structlog.get_logger(__name__)


class State(enum.Enum):
    """Where the supervised child is in its life."""

    IDLE = "idle"  # no child process
    STARTING = "starting"  # spawned, not yet answering /health with 200
    READY = "ready"  # healthy and serving
    STOPPING = "stopping"  # SIGTERM sent, waiting for the exit
    CRASHED = "crashed"  # died or hung after it was ready
    FAILED = "failed"  # the last start failed (see ``cause``)


#: Every allowed state change; anything else is a bug and raises.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.IDLE: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.READY, State.FAILED, State.STOPPING}),
    State.READY: frozenset({State.STOPPING, State.CRASHED}),
    State.STOPPING: frozenset({State.IDLE}),
    State.CRASHED: frozenset({State.STARTING, State.STOPPING}),
    State.FAILED: frozenset({State.STARTING, State.STOPPING}),
}

Phase = Literal["spawning", "reading weights", "allocating", "warming", "ready"]

# Log lines of the pinned llama-server that open each load phase.
_PHASE_LINES: tuple[tuple[re.Pattern[str], Phase], ...] = (
    (
        re.compile(r"load_model: loading model|llama_model_loader: loaded meta data|load_tensors: loading"),
        "reading weights",
    ),
    (re.compile(r"llama_context: constructing|llama_kv_cache|sched_reserve: reserving"), "allocating"),
    (re.compile(r"warming up the model"), "warming"),
)
_PHASE_ORDER: tuple[Phase, ...] = ("spawning", "reading weights", "allocating", "warming", "ready")


@dataclass(frozen=True)
class LaunchSpec:
    """What to run. ``make_argv(port)`` returns the full argv for a given port."""

    make_argv: Callable[[int], Sequence[str]]
    binary: str
    env: Mapping[str, str] | None = field(default=None, repr=False)  # may hold the API key
    api_key: str | None = field(default=None, repr=False)
    model_bytes: int = 0  # total bytes of the model's shards, for load progress
    host: str = "127.0.0.1"
    start_timeout: float = 600.0
    #: Called once the child is reaped, e.g. to wait until the GPU driver has released its memory.
    after_stop: Callable[[], object] | None = None
    #: Called with the child's last log lines when it failed or crashed: a cause its log alone does not name.
    explain_exit: Callable[[Sequence[str]], ExitExplanation | None] | None = None
    #: Called right before each spawn; raises a ProcessError when the child cannot start now (an RPC worker that
    #: is busy or gone: llama-server would hang on the one and abort on the other).
    before_start: Callable[[], None] | None = None


@dataclass(frozen=True)
class ExitExplanation:
    """Why the child failed, found beyond its own log (e.g. which RPC worker went away)."""

    reason: str
    failed_workers: tuple[str, ...] = ()  # RPC workers (host:port) behind the failure


@dataclass(frozen=True)
class LoadProgress:
    """How far a load has come: the phase, and bytes of weights touched so far."""

    phase: Phase
    bytes_loaded: int
    bytes_total: int
    phases_seen: tuple[Phase, ...]


@dataclass(frozen=True)
class Status:
    """A snapshot of the supervisor, safe to hand to any thread."""

    state: State
    pid: int | None
    url: str | None
    progress: LoadProgress | None
    cause: str | None  # why it failed or crashed, in llama-server's words where possible
    exit_code: int | None
    log_path: Path | None
    allocations: MemoryBill | None = None  # what llama-server reported allocating (needs ``-lv 4``)
    failed_workers: tuple[str, ...] = ()  # RPC workers that took the last failed or crashed child down


@dataclass
class _Child:
    server: LlamaServer
    spec: LaunchSpec
    phases: list[Phase] = field(default_factory=lambda: ["spawning"])
    allocations: MemoryBill | None = None


class Supervisor:
    """Owns at most one llama-server child; see the module docstring."""

    def __init__(
        self,
        *,
        logs_dir: Path,
        registry: ChildRegistry,
        stop_grace: float = 5.0,
        health_interval: float = 5.0,
        health_failures_for_hang: int = 3,
        keep_logs: int = 20,
        on_change: Callable[[Status], None] | None = None,
    ) -> None:
        self.logs_dir = logs_dir
        self.registry = registry
        self.stop_grace = stop_grace
        self.health_interval = health_interval
        self.health_failures_for_hang = health_failures_for_hang
        self.keep_logs = keep_logs
        self.on_change = on_change  # called on the owner thread after every state change
        self._commands: queue.Queue[tuple[str, Any, Future[Any], threading.Event]] = queue.Queue()
        # Abort flags of starts not yet finished; any later command sets them all.
        self._start_aborts: set[threading.Event] = set()
        self._changed = threading.Condition()
        self._last_health = 0.0
        self._health_failures = 0
        self._state = State.IDLE
        self._child: _Child | None = None
        self._cause: str | None = None
        self._exit_code: int | None = None
        self._failed_workers: tuple[str, ...] = ()
        self._last_spec: LaunchSpec | None = None
        self._closed = False
        self._owner = threading.Thread(target=self._run, name="llama-supervisor", daemon=True)
        self._owner.start()
        _live.add(self)

    # -- public API: post a command, wait for its answer ----------------------
    def start(self, spec: LaunchSpec) -> Status:
        """Start (or replace) the child and return once it is ready.

        Raises:
            LoadError: llama-server exited while loading; ``cause``/``hint`` say why.
            StartTimeoutError: it never became healthy.
            StartAbortedError: a stop or another start cancelled this one.
        """
        return self._call("start", spec)

    def stop(self) -> Status:
        """Stop the child (idempotent, bounded by ``stop_grace`` + a kill)."""
        return self._call("stop", None)

    def restart(self, spec: LaunchSpec | None = None) -> Status:
        """Stop, then start ``spec`` (or the last one)."""
        return self._call("restart", spec)

    @property
    def url(self) -> str | None:
        """The ready child's address, read live (cheap: no /proc): a restarted child has a new port."""
        child = self._child
        return child.server.url if child is not None and self._state == State.READY else None

    @property
    def state(self) -> State:
        """The current state alone: cheap enough for every proxied request (``status`` reads /proc)."""
        return self._state

    def status(self) -> Status:
        """A snapshot of the state, pid, URL, load progress and last cause."""
        with self._changed:
            return self._snapshot()

    def wait_for(self, states: set[State], timeout: float) -> Status:
        """Block until the state is one of ``states``; raise TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._state not in states:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"state is still {self._state.value}, not {sorted(s.value for s in states)}")
                self._changed.wait(left)
            return self._snapshot()

    def close(self) -> None:
        """Stop the child and end the owner thread. Safe to call more than once."""
        if self._closed:
            return
        self.stop()
        self._closed = True
        self._commands.put(("close", None, Future(), threading.Event()))
        self._owner.join(timeout=self.stop_grace + 5)
        _live.discard(self)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- command plumbing ------------------------------------------------------
    def _call(self, name: str, arg: Any) -> Status:
        if self._closed:
            raise ProcessError("this supervisor is closed")
        abort = threading.Event()
        with self._changed:
            for pending in self._start_aborts:  # a later command cancels earlier starts at once
                pending.set()
            if name != "stop":
                self._start_aborts.add(abort)
        done: Future[Status] = Future()
        self._commands.put((name, arg, done, abort))
        try:
            return done.result()
        finally:
            with self._changed:
                self._start_aborts.discard(abort)

    def _run(self) -> None:
        while True:
            try:
                name, arg, done, abort = self._commands.get(timeout=self._next_watch())
            except queue.Empty:
                self._watch()
                continue
            if name == "close":
                done.set_result(None)
                return
            if name == "exited":  # the child's output ended: look now rather than at the next health check
                self._watch()
                continue
            try:
                if name == "stop":
                    self._do_stop()
                elif name == "start":
                    self._do_start(arg, abort)
                else:
                    spec = arg or self._last_spec
                    self._do_stop()
                    if spec is None:
                        raise ProcessError("nothing to restart: no model was started before")
                    self._do_start(spec, abort)
            except BaseException as exc:  # handed to the caller, never lost
                done.set_exception(exc)
            else:
                done.set_result(self.status())

    def _next_watch(self) -> float | None:
        """Seconds until the watchdog's next look: none without a ready child (its exit is posted)."""
        if self._child is None or self._state != State.READY:
            return None
        return max(0.0, self._last_health + self.health_interval - time.monotonic())

    # -- state ---------------------------------------------------------------
    def _set_state(
        self,
        new: State,
        *,
        cause: str | None = None,
        exit_code: int | None = None,
        failed_workers: tuple[str, ...] = (),
    ) -> None:
        with self._changed:
            if new not in TRANSITIONS[self._state]:
                raise RuntimeError(f"illegal supervisor transition {self._state.value} -> {new.value}")
            log.info("llama-server state", old=self._state.value, new=new.value, cause=cause)
            self._state = new
            if new in (State.FAILED, State.CRASHED):
                self._cause, self._exit_code, self._failed_workers = cause, exit_code, failed_workers
            elif new == State.STARTING:
                self._cause, self._exit_code, self._failed_workers = None, None, ()
            self._changed.notify_all()
            snapshot = self._snapshot()
        if self.on_change is not None:
            self.on_change(snapshot)

    def _snapshot(self) -> Status:
        child = self._child
        server = child.server if child else None
        return Status(
            state=self._state,
            pid=server.pid if server else None,
            url=server.url if server and self._state == State.READY else None,
            progress=self._progress(child) if child else None,
            cause=self._cause,
            exit_code=self._exit_code,
            log_path=server.log_path if server else None,
            allocations=child.allocations if child else None,
            failed_workers=self._failed_workers,
        )

    def _progress(self, child: _Child) -> LoadProgress:
        phase = "ready" if self._state == State.READY else child.phases[-1]
        loaded = 0
        pid = child.server.pid
        if pid is not None and child.server.returncode is None:
            try:
                # mmap'd weights show up as resident pages, read() ones as rchar.
                proc = psutil.Process(pid)
                loaded = max(proc.memory_info().rss, getattr(proc.io_counters(), "read_chars", 0))
            except (psutil.Error, OSError):
                loaded = 0
        total = child.spec.model_bytes
        if total:
            loaded = total if phase in ("warming", "ready") else min(loaded, total)
        phases = tuple(child.phases) + (("ready",) if phase == "ready" else ())
        return LoadProgress(phase=phase, bytes_loaded=loaded, bytes_total=total, phases_seen=phases)

    # -- start -----------------------------------------------------------------
    def _do_start(self, spec: LaunchSpec, abort: threading.Event) -> None:
        if self._child is not None or self._state in (State.FAILED, State.CRASHED):
            self._do_stop()
        if abort.is_set():
            raise StartAbortedError("the start was cancelled by a later stop or start")
        self._last_spec = spec
        self._set_state(State.STARTING)
        for attempt in range(3):
            port = free_port(spec.host)
            child = _Child(server=self._new_server(spec, port), spec=spec)
            with self._changed:
                self._child = child
            try:
                if spec.before_start is not None:
                    spec.before_start()
                self.registry.add(child.server.start(), spec.binary)
                child.server.wait_ready(timeout=spec.start_timeout, abort=abort)
            except (PortInUseError, LoadError) as exc:
                self._reap(child)
                retry = isinstance(exc, PortInUseError) or exc.cause == "port_in_use"
                if retry and attempt < 2:
                    log.info("port taken before llama-server could bind it; retrying", port=port)
                    continue
                explained = self._explain(child)
                if explained is not None and isinstance(exc, LoadError):
                    error = LoadError(
                        f"{exc}; {explained.reason}",
                        pid=exc.pid,
                        exit_code=exc.exit_code,
                        log_tail=exc.log_tail,
                        cause=exc.cause,
                        hint=exc.hint,
                        failed_workers=explained.failed_workers,
                    )
                    self._fail(error)
                    raise error from exc
                self._fail(exc)
                raise
            except StartAbortedError:
                self._reap(child)
                with self._changed:
                    self._child = None
                self._set_state(State.STOPPING)
                self._set_state(State.IDLE)
                raise
            except BaseException as exc:
                self._reap(child)
                self._fail(exc)
                raise
            child.allocations = _read_allocations(child.server.log_path)
            self._set_state(State.READY)
            self._last_health = time.monotonic()
            self._health_failures = 0
            return

    def _new_server(self, spec: LaunchSpec, port: int) -> LlamaServer:
        self._prune_logs()
        log_path = self.logs_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.log"
        server = LlamaServer(
            list(spec.make_argv(port)),
            host=spec.host,
            port=port,
            log_path=log_path,
            env=spec.env,
            api_key=spec.api_key,
        )
        server.on_line = lambda line, s=server: self._on_line(s, line)
        server.on_exit = lambda: self._commands.put(("exited", None, Future(), threading.Event()))
        return server

    def _on_line(self, server: LlamaServer, line: str) -> None:
        child = self._child
        if child is None or child.server is not server:
            return
        for pattern, phase in _PHASE_LINES:
            if pattern.search(line):
                current = child.phases[-1]
                if _PHASE_ORDER.index(phase) > _PHASE_ORDER.index(current):
                    with self._changed:
                        child.phases.append(phase)
                        self._changed.notify_all()
                return

    def _fail(self, exc: BaseException) -> None:
        with self._changed:
            self._child = None
        self._set_state(
            State.FAILED,
            cause=str(exc),
            exit_code=getattr(exc, "exit_code", None),
            failed_workers=getattr(exc, "failed_workers", ()),
        )

    def _explain(self, child: _Child) -> ExitExplanation | None:
        """The spec's explanation of a reaped child's exit (its whole output is read by now)."""
        if child.spec.explain_exit is None:
            return None
        try:
            return child.spec.explain_exit(child.server.log_lines())
        except Exception:  # an explanation must never hide the failure itself
            log.exception("explaining llama-server's exit failed")
            return None

    def _prune_logs(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        logs = sorted(self.logs_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)
        for old in logs[: max(0, len(logs) - self.keep_logs + 1)]:
            old.unlink(missing_ok=True)

    # -- stop ------------------------------------------------------------------
    def _do_stop(self) -> None:
        child = self._child
        if child is None:
            if self._state in (State.FAILED, State.CRASHED):
                self._set_state(State.STOPPING)
                self._set_state(State.IDLE)
            return
        self._set_state(State.STOPPING)
        self._reap(child)
        with self._changed:
            self._child = None
        self._set_state(State.IDLE)

    def _reap(self, child: _Child) -> None:
        child.server.stop(grace=self.stop_grace)
        if child.server.pid is not None:
            self.registry.remove(child.server.pid)
            if child.spec.after_stop is not None:
                child.spec.after_stop()

    # -- watchdog --------------------------------------------------------------
    def _watch(self) -> None:
        """Called between commands while a child exists: notice exits and hangs."""
        child = self._child
        if child is None or self._state != State.READY:
            return
        code = child.server.returncode
        if code is None and child.server.output_closed:  # it closed its output: exiting, give it a moment
            code = child.server.wait_exit(timeout=1.0)
        if code is not None:
            death = child.server.death(code)
            why = f": {death.reason}" if death else ""
            self._crashed(child, f"llama-server exited unexpectedly with code {code}{why}", code)
            return
        if time.monotonic() - self._last_health < self.health_interval:
            return
        self._last_health = time.monotonic()
        ok = child.server.probe_health(timeout=self.health_interval) == 200
        self._health_failures = 0 if ok else self._health_failures + 1
        if self._health_failures >= self.health_failures_for_hang:
            self._crashed(
                child, f"llama-server stopped answering /health ({self._health_failures} checks in a row)", None
            )

    def _crashed(self, child: _Child, reason: str, code: int | None) -> None:
        self._reap(child)
        with self._changed:
            self._child = None
        tail = child.server.log_tail(5)
        explained = self._explain(child)
        if explained is not None:
            reason = f"{reason}: {explained.reason}"
        self._set_state(
            State.CRASHED,
            cause=f"{reason}; last output:\n{tail}",
            exit_code=code,
            failed_workers=explained.failed_workers if explained else (),
        )
        log.error("llama-server crashed", reason=reason, exit_code=code)


def _read_allocations(log_path: Path) -> MemoryBill | None:
    """What the child logged allocating, or None when its log has no buffer lines (no ``-lv 4``)."""
    try:
        return parse_allocations(log_path.read_text(errors="replace"))
    except (OSError, ValueError):
        return None


#: Supervisors still open; stopped at interpreter exit (the PDEATHSIG covers SIGKILL).
_live: weakref.WeakSet[Supervisor] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for sup in list(_live):
        sup.close()


def owner_token() -> str:
    """A token identifying supervisors of this process, for the child registry."""
    return f"studio-{os.getpid()}-{secrets.token_hex(4)}"
