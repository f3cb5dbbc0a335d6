"""One resident model: its own supervised llama-server, its state, its requests in flight.

A single task (the owner, started by ``start``) alone changes the state, through
``studio.residency.lifecycle.TRANSITIONS``. Everything else sends it a command
(unload, a crash report from the supervisor's thread, a TTL expiry) and waits for
a state. Requests enter synchronously, on the event loop, only while the model is
ready: the owner's move to ``draining`` is the one place new requests are turned
away, so an unload never races a request that just checked the state.

The model's address is read from its live supervisor each time it becomes ready:
a restart after a crash listens on a new port, and the next request goes there.
Restarts are bounded, back off, and an unload interrupts the back-off at once. Each is checked first
(``before_restart``: the manager plans it again against the memory free now); a model whose room another
program took fails with that check's error instead of being restarted into the same death.

Should the owner itself die of a bug, it still stops llama-server and walks the
table to ``unloaded``, so that no waiter waits for ever.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http.client import HTTPConnection, HTTPException
from typing import Any
from urllib.parse import urlsplit

import structlog

from gguf.facts import ModelFacts
from gguf.templates import TemplateCapabilities
from launcher.command import LaunchCommand
from launcher.errors import LauncherError, StartAbortedError
from launcher.memory import MemoryBill
from launcher.planner import LaunchPlan
from launcher.supervisor import LaunchSpec, Status, Supervisor
from studio.blocking import run_blocking
from studio.errors import ModelUnloadedError, NotReadyError, StudioError, UpstreamError
from studio.residency.lifecycle import (
    COMING_UP,
    SUPERVISOR_MOVES,
    TRANSITIONS,
    Admission,
    AdmissionGate,
    ResidentState,
)
from studio.residency.requests import LoadSettings

log = structlog.get_logger(__name__)

#: Seconds before the n-th automatic restart: 0.5, 1, 2, ... at most 30.
BACKOFF_BASE, BACKOFF_MAX = 0.5, 30.0
#: Seconds up after which a death is a new incident: the restarts (and their back-off) count from zero again,
#: so a model the OOM killer takes now and then is restarted each time, one that dies on every start is not.
STABLE_AFTER = 10.0


@dataclass(frozen=True)
class LoadedModel:
    """A ready model as a request uses it: where to reach it (this incarnation) and what it can do."""

    name: str
    settings: LoadSettings
    url: str
    api_key: str = field(repr=False)
    n_ctx: int  # the effective context per request (llama-server's slot size)
    facts: ModelFacts
    template: TemplateCapabilities | None
    plan: LaunchPlan  # what was decided and why; its bill is shown beside the actual allocations
    command: LaunchCommand = field(repr=False)

    @property
    def auth_headers(self) -> dict[str, str]:
        return self.command.auth_headers


class Lease:
    """One request's hold on a resident model; awaiting it releases the hold (once)."""

    __slots__ = ("_crashes", "_resident", "_released")

    def __init__(self, resident: ResidentModel) -> None:
        self._resident = resident
        self._released = False
        self._crashes = resident.crashes  # its llama-server's deaths so far: one more is a death under this request

    async def __call__(self) -> None:
        if not self._released:
            self._released = True
            self._resident._leave()

    @property
    def interruption(self) -> ModelUnloadedError | None:
        """Why the model went away under this request, when it did: the error to give its client."""
        reason = self._resident.cut_reason
        return ModelUnloadedError(reason) if reason else None

    async def died(self, within: float) -> str | None:
        """Why the model's llama-server died under this request, once its owner has seen the death (it hears of
        an exit at once; ``within`` seconds bound the wait); None: it did not die, the failure was another."""
        resident = self._resident
        deadline = resident._loop.time() + within
        while resident.crashes == self._crashes:
            left = deadline - resident._loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(resident._changed.wait(), left)
            except TimeoutError:
                return None
        return resident.last_exit or "llama-server died"


@dataclass
class _Unload:
    grace: float
    reason: str
    done: asyncio.Future[None]


@dataclass
class _Crashed:
    cause: str


class _Expire:
    pass


_Command = _Unload | _Crashed | _Expire


class ResidentModel:
    """One model kept resident by the manager; see the module docstring."""

    def __init__(
        self,
        *,
        name: str,
        settings: LoadSettings,
        plan: LaunchPlan,
        command: LaunchCommand,
        spec: LaunchSpec,
        facts: ModelFacts,
        template: TemplateCapabilities | None,
        make_supervisor: Callable[[Callable[[Status], None]], Supervisor],
        ttl: float = 0.0,
        pinned: bool = False,
        max_restarts: int = 2,
        on_change: Callable[[ResidentModel], None] = lambda resident: None,
        on_transition: Callable[[ResidentModel, ResidentState, ResidentState, float], None] = lambda *_: None,
        on_admission: Callable[[ResidentModel, Admission, Admission, str], None] = lambda *_: None,
        before_stop: Callable[[LoadedModel], Awaitable[object]] | None = None,
        before_stop_timeout: float = 15.0,
        before_restart: Callable[[], Awaitable[BaseException | None]] | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.plan = plan
        self.command = command
        self.spec = spec
        self.facts = facts
        self.template = template
        self.ttl = ttl
        self.pinned = pinned
        self.max_restarts = max_restarts
        self.on_change = on_change
        self.on_transition = on_transition  # told (old, new, seconds it was in old) of each change of state
        self.on_admission = on_admission  # told (old, new, reason) of each change of admission
        self.before_stop = before_stop  # awaited once requests are done, before an unload stops llama-server
        self.before_stop_timeout = before_stop_timeout
        # awaited before a crashed llama-server is restarted: an error (the memory it held is taken) fails the model
        self.before_restart = before_restart
        self.state = ResidentState.LOADING
        self.loaded: LoadedModel | None = None
        self.error: str | None = None  # why it failed or crashed
        self.failure: BaseException | None = None  # the exception of the last failed start, for its waiters
        self.cut_reason: str | None = None  # set when an unload ended requests still in flight
        self.in_flight = 0
        self.restarts = 0
        self._ready_since = 0.0  # when it last became ready (``STABLE_AFTER``)
        self.crashes = 0  # deaths of its llama-server once ready (``Lease.died`` counts on them)
        self.last_exit: str | None = None  # why its llama-server last died, kept past the restart
        self.created = self.last_used = self._entered = time.monotonic()
        self.why: str | None = None  # why the manager unloads it ("evicted", "restart"...); None: its TTL
        self.drained = False  # it drained: it was serving when its unload began
        self._loop = asyncio.get_running_loop()
        self._inbox: asyncio.Queue[_Command] = asyncio.Queue()
        self._changed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._admission = AdmissionGate(self._admission_moved)  # moved only by ``enter``, ``pause``, ``resume``
        self._expiry: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.supervisor = make_supervisor(self._on_supervisor_change)

    # -- for requests ------------------------------------------------------------------------
    def enter(self) -> tuple[LoadedModel, Lease]:
        """Hold the ready model for one request; raise ``NotReadyError`` when it is not ready or paused.

        The request counts against an open group (``pause(after=...)``); the group's last one closes it."""
        if self.state is not ResidentState.READY or self.loaded is None or not self._admission.admit():
            raise NotReadyError(self.state.value)
        self.in_flight += 1
        self.last_used = time.monotonic()
        self._idle.clear()
        self._cancel_expiry()
        return self.loaded, Lease(self)

    def pause(self, *, after: int = 0, reason: str = "a load waits for its memory") -> None:
        """Admit no new request once ``after`` more came in: a load waits for this busy model's memory, and would
        never get it while new requests kept it busy. The ``after`` requests still admitted run before the swap,
        together, instead of each waiting for a swap back; a later call never extends that count. Requests in
        flight go on; new ones wait for ``on_admission`` to tell of ``accepting`` again."""
        self._admission.pause(after, reason)

    def resume(self, reason: str = "the load it was paused for ended") -> None:
        """Admit new requests again."""
        self._admission.resume(reason)

    @property
    def admission(self) -> Admission:
        return self._admission.state

    @property
    def grouping(self) -> bool:
        """Whether a load waits for this model's memory and it still admits requests before that load."""
        return self._admission.state is Admission.GROUPING

    def _leave(self) -> None:
        self.in_flight -= 1
        self.last_used = time.monotonic()
        if self.in_flight == 0:
            self._idle.set()
            self._schedule_expiry()
            self.on_change(self)

    # -- commands ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the owner task, which starts llama-server; ``wait_until`` tells when it is ready."""
        self._task = asyncio.create_task(self._run(), name=f"resident {self.name}")

    async def unload(self, *, grace: float, reason: str, why: str = "unload") -> None:
        """Unload: wait up to ``grace`` s for requests in flight, end the rest with ``reason``; return once gone.

        ``why`` is the unload's cause its events carry (the first one given stands). A start in progress is
        aborted at once; a restart's back-off is cut short. Idempotent.
        """
        if self.state is ResidentState.UNLOADED:
            return
        self.why = self.why or why
        done: asyncio.Future[None] = self._loop.create_future()
        self._inbox.put_nowait(_Unload(grace, reason, done))
        if self.state is ResidentState.LOADING:
            # The owner is waiting on the supervisor's start: a stop aborts it (StartAbortedError) at once.
            threading.Thread(target=self.supervisor.stop, name=f"abort start {self.name}", daemon=True).start()
        await self.wait_until({ResidentState.UNLOADED})

    def set_ttl(self, ttl: float) -> None:
        """Idle seconds before the model unloads itself (0: never); counts from its last request."""
        self.ttl = ttl
        self._cancel_expiry()
        self._schedule_expiry()

    def set_pinned(self, pinned: bool) -> None:
        """A pinned model is never evicted and never unloads for idleness."""
        self.pinned = pinned
        self._cancel_expiry()
        self._schedule_expiry()

    async def wait_until(
        self, states: set[ResidentState] | frozenset[ResidentState], timeout: float | None = None
    ) -> ResidentState:
        """Return the state once it is one of ``states``; ``TimeoutError`` after ``timeout``."""
        async with asyncio.timeout(timeout):
            while self.state not in states:
                await self._changed.wait()
        return self.state

    async def wait_settled(self) -> ResidentState:
        """Return the state once the model is neither loading nor waiting out a restart's back-off."""
        while self.state in COMING_UP:
            await self._changed.wait()
        return self.state

    # -- memory, for placement -------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return self.in_flight == 0

    @property
    def actual(self) -> MemoryBill | None:
        """What llama-server reported allocating, once it is up."""
        return self.supervisor.status().allocations if self.state is ResidentState.READY else None

    # -- the owner ---------------------------------------------------------------------------
    def _set(self, new: ResidentState, *, error: str | None = None) -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"illegal resident transition {self.state.value} -> {new.value} ({self.name})")
        log.info("resident model", model=self.name, old=self.state.value, new=new.value, error=error)
        old, now = self.state, time.monotonic()
        self.state, self.drained = new, self.drained or new is ResidentState.DRAINING
        seconds, self._entered = now - self._entered, now
        if error is not None:
            self.error = error
        elif new in (ResidentState.LOADING, ResidentState.READY):
            self.error = None
        self._wake()
        self.on_transition(self, old, new, seconds)
        self.on_change(self)
        if new is not ResidentState.READY:  # admission is a sub-state of ready: a pause ends with it
            self._admission.resume(f"{self.name} is {new.value}")

    def _admission_moved(self, old: Admission, new: Admission, reason: str) -> None:
        log.info("resident admission", model=self.name, old=old.value, new=new.value, reason=reason)
        self._wake()
        self.on_admission(self, old, new, reason)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes every waiter; they look at the state again

    async def _run(self) -> None:
        try:
            await self._start_server()
            while self.state is not ResidentState.UNLOADED:
                await self._handle(await self._inbox.get())
        except Exception as exc:  # a bug in the owner: never leave waiters (or a llama-server) behind
            log.exception("resident owner failed", model=self.name)
            self.failure = StudioError(f"{self.name} stopped unexpectedly: {exc}", code="load_failed")
            self.cut_reason = self.cut_reason or f"{self.name} stopped unexpectedly"
            await self._abandon(str(exc))
        finally:
            self._cancel_expiry()
            if self.state is not ResidentState.UNLOADED:  # cancelled at shutdown: stop what runs, bounded
                await asyncio.shield(self._abandon("the studio is shutting down"))

    async def _abandon(self, why: str) -> None:
        """Stop llama-server (bounded) and walk the table to ``unloaded`` from wherever the owner stopped."""
        try:
            await run_blocking(self.supervisor.close, timeout=30, what=f"stopping {self.name}")
        finally:
            self.command.cleanup()
            self.loaded = None
            path = {
                ResidentState.READY: (ResidentState.DRAINING, ResidentState.UNLOADING),
                ResidentState.DRAINING: (ResidentState.UNLOADING,),
                ResidentState.UNLOADING: (),
            }.get(self.state, (ResidentState.UNLOADING,))
            for state in (*path, ResidentState.UNLOADED):
                if self.state is not ResidentState.UNLOADED:
                    self._set(state, error=why if state is ResidentState.UNLOADED else None)

    async def _handle(self, command: _Command) -> None:
        if isinstance(command, _Unload):
            await self._unload(command)
        elif isinstance(command, _Crashed):
            await self._crashed(command.cause)
        elif self._expired():
            log.info("idle model unloaded", model=self.name, ttl=self.ttl)
            await self._unload(
                _Unload(0.0, f"{self.name} was unloaded after {self.ttl:g} s idle", self._loop.create_future())
            )
        else:  # early (uvloop's timers run on the loop's cached clock) or used meanwhile: look again when due
            self._schedule_expiry()

    async def _start_server(self) -> None:
        try:
            status = await run_blocking(self.supervisor.start, self.spec, timeout=None, what=f"starting {self.name}")
            n_ctx = await self._effective_context(status)
        except StartAbortedError:
            return  # an unload aborted it; its command is in the inbox
        except Exception as exc:  # every failure stops what was started and leaves the state true
            await run_blocking(self.supervisor.stop, timeout=None, what=f"stopping {self.name}")
            self.failure = (
                exc
                if isinstance(exc, (LauncherError, StudioError))
                else StudioError(f"{self.name} failed to start: {exc}", code="load_failed")
            )
            self._set(ResidentState.FAILED, error=str(exc))
            return
        self.loaded = LoadedModel(
            name=self.name,
            settings=self.settings,
            url=self.supervisor.url or status.url or "",
            api_key=self.command.api_key,
            n_ctx=n_ctx,
            facts=self.facts,
            template=self.template,
            plan=self.plan,
            command=self.command,
        )
        self._ready_since = time.monotonic()
        self._set(ResidentState.READY)
        self._schedule_expiry()

    async def _effective_context(self, status: Status) -> int:
        """The slot size llama-server really gave each request (``/props``)."""
        what = f"reading {self.name}'s /props"
        try:
            props = await run_blocking(_props, status.url, self.command.auth_headers, timeout=10, what=what)
            return int(props["default_generation_settings"]["n_ctx"])
        except (OSError, HTTPException, ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"llama-server started but its /props could not be read: {exc}") from exc

    async def _unload(self, command: _Unload) -> None:
        if self.state is ResidentState.READY:
            self._set(ResidentState.DRAINING)
            try:
                async with asyncio.timeout(command.grace):
                    await self._idle.wait()
            except TimeoutError:
                self.cut_reason = command.reason
                log.info("unload ends requests in flight", model=self.name, in_flight=self.in_flight)
            else:
                await self._before_stop()
        if self.state is not ResidentState.UNLOADED:
            self._set(ResidentState.UNLOADING)
            await run_blocking(self.supervisor.close, timeout=None, what=f"stopping {self.name}")
            self.command.cleanup()  # the key file: only once its server is stopped
            self._set(ResidentState.UNLOADED)
        if not command.done.done():
            command.done.set_result(None)

    async def _before_stop(self) -> None:
        """Run ``before_stop`` on the idle, still-running server (the studio saves its slots), bounded."""
        if self.before_stop is None or self.loaded is None:
            return
        try:
            await asyncio.wait_for(self.before_stop(self.loaded), self.before_stop_timeout)
        except Exception as exc:  # a stop is never held up or failed by what comes before it
            log.warning("work before a stop failed", model=self.name, error=str(exc))

    async def _crashed(self, cause: str) -> None:
        if self.state is not ResidentState.READY:
            return  # draining or already down: the unload in progress stops it anyway
        self.loaded = None
        self._cancel_expiry()
        if time.monotonic() - self._ready_since >= STABLE_AFTER:
            self.restarts = 0
        self.crashes += 1
        self.last_exit = cause.split("; last output:", 1)[0]  # the supervisor's reason, without the log's tail
        self._set(ResidentState.CRASHED, error=cause)
        if self.restarts >= self.max_restarts:
            why = f"llama-server crashed {self.restarts + 1} times; not restarting it again. Last: {cause}"
            # what a request that waited for the restart gets: the death's cause (a 502), not a bare StudioError's 500;
            # not an UpstreamDiedError, which a request survives by loading the model again: this one gave up
            self.failure = UpstreamError(f"{self.name}: {why.split('; last output:', 1)[0]}", code="llama_server_died")
            await run_blocking(self.supervisor.stop, timeout=None, what=f"stopping {self.name}")
            self._set(ResidentState.FAILED, error=why)
            return
        delay = min(BACKOFF_MAX, BACKOFF_BASE * 2**self.restarts)
        self.restarts += 1
        deadline = self._loop.time() + delay
        while (left := deadline - self._loop.time()) > 0:
            try:
                command = await asyncio.wait_for(self._inbox.get(), left)
            except TimeoutError:
                break
            if isinstance(command, _Unload):
                await self._unload(command)
                return
        refusal = await self._restart_refusal()
        if refusal is not None:
            await run_blocking(self.supervisor.stop, timeout=None, what=f"stopping {self.name}")
            self.failure = refusal
            self._set(ResidentState.FAILED, error=str(refusal))
            return
        log.info("restarting crashed model", model=self.name, attempt=self.restarts)
        self._set(ResidentState.LOADING)
        await self._start_server()

    async def _restart_refusal(self) -> BaseException | None:
        """Why the crashed llama-server must not be restarted now (``before_restart``); None: restart it."""
        if self.before_restart is None:
            return None
        try:
            return await self.before_restart()
        except Exception as exc:  # a check that fails never keeps a model down: the restart says the rest
            log.warning("could not check the room for a restart", model=self.name, error=str(exc))
            return None

    def _on_supervisor_change(self, status: Status) -> None:
        """Called on the supervisor's thread: a change that moves the resident (a crash) becomes a command for
        the owner, which alone changes the state."""
        if SUPERVISOR_MOVES.get(status.state) is ResidentState.CRASHED:
            try:
                self._loop.call_soon_threadsafe(self._inbox.put_nowait, _Crashed(status.cause or "llama-server died"))
            except RuntimeError:  # the loop is closed: the studio is shutting down
                pass

    # -- idle TTL ----------------------------------------------------------------------------
    def _expired(self) -> bool:
        return (
            self.state is ResidentState.READY
            and self.idle
            and not self.pinned
            and self.ttl > 0
            and time.monotonic() - self.last_used >= self.ttl * 0.999
        )

    def _schedule_expiry(self) -> None:
        if (
            self._expiry is None
            and self.ttl > 0
            and not self.pinned
            and self.idle
            and self.state is ResidentState.READY
        ):
            self._expiry = self._loop.call_later(max(0.0, self.last_used + self.ttl - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self._inbox.put_nowait(_Expire())

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def status(self) -> dict[str, Any]:
        """Live numbers for the status view (``studio.views.residency``)."""
        idle_s = time.monotonic() - self.last_used if self.idle else 0.0
        ttl_left = max(0.0, self.ttl - idle_s) if self.ttl > 0 and not self.pinned and self.idle else None
        return {
            "in_flight": self.in_flight,
            # accepting; grouping or paused_for_load while a load waits for its memory (``lifecycle.Admission``)
            "admission": self.admission.value,
            "idle_s": round(idle_s, 1),
            "ttl": self.ttl,
            "ttl_left": round(ttl_left, 1) if ttl_left is not None else None,
            "pinned": self.pinned,
            "restarts": self.restarts,
        }


def _props(url: str, headers: Mapping[str, str]) -> Any:
    """llama-server's ``/props`` at ``url``, decoded; read on a thread with the standard library, as each start does
    once: an ``httpx`` client's first request cost 30-60 ms of it (its TLS context, its async backend)."""
    where = urlsplit(url)
    conn = HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=10)
    try:
        conn.request("GET", "/props", headers=dict(headers))
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()
