"""Small helpers shared by tests: free ports, deadline-bounded waits, a model file of its own."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil

from studio.library.default_model import CHATML
from studio.settings import ModelDefaults

T = TypeVar("T")


def leave_mid_answer(
    open_stream: Callable[[], contextlib.AbstractContextManager[Iterator[Any]]],
    generating: Callable[[], bool],
    *,
    reads: int,
    attempts: int = 3,
) -> None:
    """Open a stream, read ``reads`` items and leave it (closing it) while the model is still generating.

    Base Gemma sometimes ends "Write a long story." within its first events, even greedy: then
    the slot is idle before the client leaves and a check of what leaving does would prove
    nothing, so the stream is opened again.
    """
    for _ in range(attempts):
        with open_stream() as items:
            for i, _ in enumerate(items):
                if i == reads:
                    break
            if generating():
                return
    raise AssertionError(f"the model finished its answer before the client could leave, {attempts} times")


def copy_of(model: Path, folder: Path, name: str) -> Path:
    """A file of its own holding ``model``'s bytes, for a test that needs two models of the same weights: two
    names of one file (links to it) are one model (``studio.library.catalog``)."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / f"{name}.gguf"
    if not copy.exists():
        shutil.copyfile(model, copy)
    return copy


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that the OS says is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Return the first truthy value of ``predicate()``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def assert_no_children() -> None:
    """Wait (bounded) until this process has no child processes left; fail otherwise."""
    me = psutil.Process()
    wait_for(lambda: not me.children(recursive=True), timeout=10, what="child processes to exit")


def server_argv(
    binary: Path, model: Path, *, host: str, port: int, n_ctx: int | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """A minimal llama-server argv without a plan: for tests of the process layers under the planner."""
    argv = [str(binary), "-m", str(model), "--host", host, "--port", str(port), "--jinja"]
    if n_ctx is not None:
        argv += ["-c", str(n_ctx)]
    return argv + list(extra)


@contextlib.contextmanager
def serving(app: object) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port in a thread; yield its base URL.

    The server's ``send`` is in each request's scope, as ``ggstudio serve`` puts it (``with_server_send``): a
    stream goes the way it goes there (written on the client's connection, passed through framed).
    """
    import uvicorn  # only the tests that serve an app pay for it

    from studio.http.wire.relay import with_server_send

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(with_server_send(app), host="127.0.0.1", port=port, log_level="warning")  # type: ignore[arg-type]
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout=30, what="uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


class LoopThread:
    """An asyncio event loop in a daemon thread, for objects that live on one loop across tests."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: object, timeout: float = 120) -> Any:
        """Run ``coro`` on the loop and return its result."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def chatting_as_before(model: str) -> dict[str, ModelDefaults]:
    """``model``, a base model, with ChatML set as its chat template: its chats render as llama-server's fallback
    renders them, without the stops the studio adds for a borrowed template, so it rambles on as tests of long
    answers (a client leaving mid-stream, a stream cut) need."""
    return {model: ModelDefaults(chat_template=CHATML)}


def stop_studio(serve: subprocess.Popen[Any], sig: int = signal.SIGINT, *, timeout: float = 60) -> None:
    """Stop a ``ggstudio serve`` process as a person or a service manager does (Ctrl-C, SIGTERM), killed after
    ``timeout`` seconds if it has not ended by then."""
    serve.send_signal(sig)
    try:
        serve.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        serve.kill()
