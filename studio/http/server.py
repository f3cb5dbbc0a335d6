"""Run the studio's listeners under uvicorn in one process and one event loop: announce them once they
really listen, and cost nothing while idle.

The main listener serves the studio app (the page, GUI API, OpenAI and Anthropic routes,
``/metrics``). An optional second one serves the Ollama API on its own port
(``studio.http.clients.ollama_app``), sharing the studio app's state: the same model manager, queue
and metrics. The main server owns the signals (Ctrl-C, SIGTERM) and the app's lifespan; the
second starts once the main one listens and stops before the main one's shutdown stops the
models, so Ollama requests in flight end the way the studio's do. "Ready" is announced only
once every listener listens.

uvicorn's ``auto`` loop and HTTP protocol take uvloop and httptools, both
dependencies: per relayed chunk they cost about a fifth less CPU than asyncio's
own loop and the pure-Python h11 (``scripts/bench_proxy.py --stand-in``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

import uvicorn
from fastapi import FastAPI

from studio.http.wire.relay import with_server_send

#: Seconds between two looks at the exit flag when nothing wakes the loop: uvicorn's own 0.1 s tick cost an
#: idle studio 0.25 % of a core (scripts/bench_idle.py); a signal wakes it at once.
TICK = 1.0


class StudioServer(uvicorn.Server):
    """uvicorn with a quiet main loop, and an ``announce`` callback once its sockets listen."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._announce = announce
        self._wake: asyncio.Future[None] | None = None  # the tick the main loop waits for
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._announce is not None:
            self._announce()

    async def main_loop(self) -> None:
        """uvicorn's loop, waking once a second (or at once on a signal) instead of ten times.

        Each tick is one future and one timer: ``asyncio.wait_for`` on an event took a task and twice the loop's
        turns, 0.32 against 0.17 ms of CPU a tick here (the idle studio's whole cost, ``scripts/bench_idle.py``).
        """
        loop = self._loop = asyncio.get_running_loop()
        counter = 0  # on_tick counts 0.1 s ticks: every call now refreshes the Date header
        while not await self.on_tick(counter):
            self._wake = tick = loop.create_future()
            timer = loop.call_later(TICK, _settle, tick)
            await tick
            timer.cancel()
            counter = (counter + 10) % 864000

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.wake()

    def wake(self) -> None:
        """Have the main loop look at ``should_exit`` now; safe from any thread."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._end_tick)
            except RuntimeError:  # the loop is closed: it is done anyway
                pass

    def _end_tick(self) -> None:
        """End the tick the main loop waits for (on the loop: the one it waits for when this runs)."""
        if self._wake is not None:
            _settle(self._wake)


def _settle(tick: asyncio.Future[None]) -> None:
    """End a tick's wait, unless something ended it first."""
    if not tick.done():
        tick.set_result(None)


#: Allocations of container objects, less deallocations, between two collections of the youngest generation.
YOUNG_COLLECTION_EVERY = 10_000


def settle_heap() -> None:
    """Put what start-up made (modules, the app, its routes and models) out of the cyclic garbage collector's
    reach, once it is all made, and collect the young objects less often.

    A full collection walks every object that has lived long; over the start-up heap it stopped the event loop
    for tens of milliseconds, and a fan-out of streams promotes enough objects to start one every few rounds:
    each was a stall of every stream (``scripts/bench_proxy.py``'s TTFT p90). Frozen, a full collection walks
    only what came after start-up. Garbage is collected first, so none of it is kept.

    A young collection walks the objects of the requests in flight, whatever its threshold, so at Python's 700
    the requests of a fan-out were walked again and again while they ran. A request's objects are freed by
    their counts and cycles are rare: collecting young objects every ``YOUNG_COLLECTION_EVERY`` does that work
    far less often, and keeps at most that many objects more in memory.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])


class _Companion(StudioServer):
    """A second listener: it leaves the signals to the main server, and its app has no lifespan."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _MainServer(StudioServer):
    """The main listener: once it listens it starts the companions, then says "ready"; it stops them first."""

    def __init__(self, config: uvicorn.Config, companions: list[_Companion], announce: Callable[[], None]) -> None:
        super().__init__(config)
        self.companions = companions
        self._running: list[asyncio.Task[None]] = []
        self._announce_all = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        for companion in self.companions:
            task = asyncio.create_task(companion.serve())
            self._running.append(task)
            while not companion.started and not task.done():
                await asyncio.sleep(0.01)
            if not companion.started:  # it could not listen (uvicorn has logged why): stop everything
                self.should_exit = True
                return
        settle_heap()
        self._announce_all()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for companion in self.companions:
            companion.should_exit = True
            companion.force_exit = self.force_exit
            companion.wake()
        await asyncio.gather(*self._running, return_exceptions=True)
        await super().shutdown(sockets)


class Listeners:
    """The studio app on ``host:port`` and, when given, the Ollama app on ``host:ollama_port``."""

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str,
        port: int,
        ollama_app: FastAPI | None = None,
        ollama_port: int | None = None,
        announce: Callable[[], None] = lambda: None,
        log_level: str = "warning",  # uvicorn's own; its access lines (INFO) are off: a logging call a request
        sockets: Sequence[socket.socket] = (),
    ) -> None:
        #: bound by the caller (``launcher.process.listening_socket``): their port is known before the service
        #: starts, and the studio listens on each (several addresses); none: uvicorn binds ``host:port``
        self._sockets = list(sockets)
        companions = []
        if ollama_app is not None and ollama_port is not None:
            companions.append(
                _Companion(
                    uvicorn.Config(
                        with_server_send(ollama_app),
                        host=host,
                        port=ollama_port,
                        log_level=log_level,
                        access_log=False,
                        lifespan="off",
                    )
                )
            )
        self._main = _MainServer(
            uvicorn.Config(with_server_send(app), host=host, port=port, log_level=log_level, access_log=False),
            companions,
            announce,
        )

    @property
    def started(self) -> bool:
        """Whether every listener listens (and the app's start-up has run)."""
        return self._main.started and all(c.started for c in self._main.companions)

    def run(self) -> None:
        """Serve until Ctrl-C or SIGTERM (from the main thread), or until ``stop``."""
        self._main.run(sockets=self._sockets or None)

    async def serve(self) -> None:
        """``run`` on a loop already running (in the main thread, for the signals): ``serve`` starts a model on it
        first, while this is built."""
        await self._main.serve(sockets=self._sockets or None)

    def stop(self, *, force: bool = False) -> None:
        """Ask every listener to finish its requests and stop (``force``: without waiting for open connections);
        ``run`` then returns. Safe from any thread."""
        self._main.should_exit = True
        if force:
            self._main.force_exit = True
        self._main.wake()


def run_service(
    app: FastAPI,
    *,
    host: str,
    port: int,
    announce: Callable[[], None],
    ollama_app: FastAPI | None = None,
    ollama_port: int | None = None,
) -> None:
    """Serve ``app`` (and ``ollama_app``) until Ctrl-C or SIGTERM; the app's shutdown stops llama-server."""
    Listeners(app, host=host, port=port, ollama_app=ollama_app, ollama_port=ollama_port, announce=announce).run()
