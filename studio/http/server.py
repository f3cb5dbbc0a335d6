"""Run the studio app under uvicorn and announce it only once it really listens."""

from __future__ import annotations

from collections.abc import Callable

import uvicorn
from fastapi import FastAPI


class _AnnouncingServer(uvicorn.Server):
    """uvicorn binds its socket after the app's start-up; say "ready" after that, not before."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[], None]) -> None:
        super().__init__(config)
        self._announce = announce

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._announce()


def run_service(app: FastAPI, *, host: str, port: int, announce: Callable[[], None]) -> None:
    """Serve ``app`` until Ctrl-C or SIGTERM (uvicorn's handlers; the app's shutdown stops llama-server)."""
    _AnnouncingServer(uvicorn.Config(app, host=host, port=port, log_level="warning"), announce).run()
