"""Blocking work (header reads, plans, device discovery, process starts) off the event loop, bounded in time.

The event loop serves every chat of every client; a hostile model file or a slow
device tool must not stall it. ``asyncio.to_thread`` would do the first half, but
its executor's threads are joined when the loop closes and at interpreter exit, so
a runaway worker would hold up Ctrl-C and SIGTERM. Here each call gets a daemon
thread: the caller stops waiting at the deadline, and nothing waits for the thread
at shutdown.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from studio.errors import WorkTimeoutError

T = TypeVar("T")


async def run_blocking(fn: Callable[..., T], *args: object, timeout: float | None, what: str) -> T:
    """Return ``fn(*args)`` computed on a daemon thread; raise ``WorkTimeoutError`` after ``timeout`` seconds.

    ``what`` names the work for the error ("planning model.gguf"). Exceptions from ``fn``
    are raised here unchanged.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: object) -> None:
        if not future.done():
            if ok:
                future.set_result(value)  # type: ignore[arg-type]
            else:
                future.set_exception(value)  # type: ignore[arg-type]

    def work() -> None:
        try:
            outcome: tuple[bool, object] = (True, fn(*args))
        except BaseException as exc:  # handed to the caller, never lost
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this any more
            pass

    threading.Thread(target=work, name=f"studio: {what}"[:60], daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except TimeoutError:
        raise WorkTimeoutError(
            f"{what} took longer than {timeout:g} s and was given up; the file or the device tools may be broken"
        ) from None
