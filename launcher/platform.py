"""The operating-system specific parts of running a child process, in one place.

Linux: the child gets its own process group (so stopping it stops everything it
spawned) and PR_SET_PDEATHSIG, so it is killed if the studio dies without a
chance to clean up. macOS and Windows get their variants here, not elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def child_popen_kwargs() -> dict[str, Any]:
    """Return the ``subprocess.Popen`` keyword arguments for a supervised child.

    Note: the parent-death signal fires when the *thread* that started the child
    exits, so start children from a long-lived thread (the main or event-loop one).
    """
    if sys.platform == "win32":  # pragma: no cover - not tested here
        import subprocess

        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    kwargs: dict[str, Any] = {"start_new_session": True}
    if sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _die_with_parent
    return kwargs


#: Signals that end a CLI session cleanly (see ``main_thread_receives``).
TERMINATION_SIGNALS = frozenset({signal.SIGTERM, signal.SIGHUP})


@contextlib.contextmanager
def main_thread_receives(signals: frozenset[int]) -> Iterator[Callable[[], None]]:
    """Make ``signals`` reach the main thread only; yields ``ready()`` to call once worker threads are started.

    A signal sent to the process may be delivered to any thread that does not
    block it. Python runs the handler in the main thread either way, but a main
    thread blocked in ``input()`` only wakes up when *it* is interrupted: a
    SIGTERM that lands on a worker thread leaves the prompt hanging. Threads
    started inside this block inherit the blocked mask; ``ready()`` unblocks the
    signals in the main thread alone.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)

    def ready() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)

    try:
        yield ready
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The mask survives exec: a child spawned by a thread that blocks SIGTERM would ignore our stop.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid``; return False if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def terminate_group(pid: int) -> bool:
    """Ask the child's whole process group to exit (SIGTERM)."""
    return signal_group(pid, signal.SIGTERM)


def kill_group(pid: int) -> bool:
    """Force the child's whole process group to exit (SIGKILL)."""
    return signal_group(pid, signal.SIGKILL)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed) while in the block.

    Two builds into the same cache dir (two terminals, a test run during a build)
    would corrupt each other; the second waits for the first instead.
    """
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
