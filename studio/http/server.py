"""Run the studio app under uvicorn: announce it once it really listens, and cost nothing while idle."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

#: Seconds between two looks at the exit flag when nothing wakes the loop: uvicorn's own 0.1 s tick cost an
#: idle studio 0.25 % of a core (scripts/bench_idle.py); a signal wakes it at once.
TICK = 1.0


class StudioServer(uvicorn.Server):
    """uvicorn with a quiet main loop, and an ``announce`` callback once its sockets listen."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._announce = announce
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._announce is not None:
            self._announce()

    async def main_loop(self) -> None:
        """uvicorn's loop, waking once a second (or at once on a signal) instead of ten times."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0  # on_tick counts 0.1 s ticks: every call now refreshes the Date header
        while not await self.on_tick(counter):
            try:
                await asyncio.wait_for(self._wake.wait(), TICK)
            except TimeoutError:
                pass
            counter = (counter + 10) % 864000

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.wake()

    def wake(self) -> None:
        """Have the main loop look at ``should_exit`` now; safe from any thread."""
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop is closed: it is done anyway
                pass


def run_service(app: FastAPI, *, host: str, port: int, announce: Callable[[], None]) -> None:
    """Serve ``app`` until Ctrl-C or SIGTERM (uvicorn's handlers; the app's shutdown stops llama-server)."""
    StudioServer(uvicorn.Config(app, host=host, port=port, log_level="warning"), announce).run()
