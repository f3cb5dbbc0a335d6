"""The operating-system specific parts of running a child process, in one place.

Linux: the child gets its own process group (so stopping it stops everything it
spawned) and PR_SET_PDEATHSIG, so it is killed if the studio dies without a
chance to clean up. macOS and Windows get their variants here, not elsewhere.
A child that runs someone else's program (the python tool) also gets resource
limits (``limit_resources``) and a watch on how many processes it starts
(``ProcessTree``). The studio itself uses two more: the lock that keeps one studio per studio
home (``try_lock``; flock, released by the kernel however the holder ends) and the watch on the
program that started it (``watch_parent``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil


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


def limit_resources(*, cpu_seconds: int, memory_bytes: int, file_bytes: int) -> Callable[[], None]:
    """Return a ``preexec_fn`` that gives a child its own limits before it executes (what it runs inherits them).

    CPU seconds (SIGXCPU, then SIGKILL a second later), address space, the size of any file it
    writes, no core dumps. Not the number of processes: see ``ProcessTree``.
    """
    import resource

    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return preexec


class ProcessTree:
    """A child that leads its own process group, and every process it starts: counted while it runs, killed together.

    Members: the group (``start_new_session``), and every process whose parent is a member, kept once
    seen, so one that left the group (``setsid``) is killed at the end too. One that leaves the group
    and whose parent ends between two looks is not found; the group kill does not reach it either.

    A thread looks every ``interval`` seconds (one pass over the process table: ~2 ms for 90
    processes); with more than ``max_processes`` members alive it kills them all and calls
    ``on_limit`` (from that thread). ``RLIMIT_NPROC`` cannot say "N processes for this child": it
    counts every process of the real uid (a desktop user's browser too) and root is exempt from it.
    Measured here: as root, 30 forks under a limit of 5 all succeed; as a user with 6 other
    processes, not one does. A fork bomb is stopped within one interval, not before its first forks.
    """

    def __init__(self, pid: int, *, max_processes: int, on_limit: Callable[[], object], interval: float = 0.1) -> None:
        self.pid = pid
        self.max_processes = max_processes
        self.over_limit = False
        self._on_limit = on_limit
        self._interval = interval
        self._seen: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"process tree {pid}", daemon=True)
        self._thread.start()

    def kill(self) -> None:
        """Stop watching and SIGKILL every member (blocking: one look at the process table)."""
        self._stop.set()
        self._thread.join()
        self._kill()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._look() > self.max_processes:
                self.over_limit = True
                self._kill()
                self._on_limit()
                return
            self._stop.wait(self._interval)

    def _look(self) -> int:
        """Find the members alive now (those seen before included); return how many there are."""
        import psutil  # here, not at the top: build and GPU-check scripts import this module in a bare Python

        alive: dict[int, psutil.Process] = {}
        children: dict[int, list[int]] = {}
        members = []
        for proc in psutil.process_iter(["ppid"]):
            try:
                in_group = os.getpgid(proc.pid) == self.pid
            except OSError:  # it ended meanwhile
                continue
            alive[proc.pid] = proc
            children.setdefault(proc.info["ppid"], []).append(proc.pid)
            seen = self._seen.get(proc.pid)
            if in_group or (seen is not None and seen == proc):  # the same process, not a reused pid
                members.append(proc.pid)
        found: dict[int, psutil.Process] = {}
        while members:
            pid = members.pop()
            if pid not in found:
                found[pid] = alive[pid]
                members.extend(children.get(pid, ()))
        self._seen = found
        return len(found)

    def _kill(self) -> None:
        import psutil

        self._look()
        kill_group(self.pid)
        for proc in self._seen.values():  # those that left the group
            with contextlib.suppress(psutil.Error):
                proc.kill()  # psutil refuses a pid that now names another process


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


def try_lock(path: Path) -> int | None:
    """Take an exclusive advisory lock on ``path`` (created, mode 0600) without waiting; return its descriptor.

    None when another process holds it. The lock lasts until the descriptor is closed or the
    process ends, however it ends (``kill -9`` included): the kernel releases it, so a lock
    file left behind never locks anyone out. Raises ``OSError`` when the file cannot be opened
    (a read-only folder).
    """
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def watch_parent(
    on_gone: Callable[[], object], *, parent: int | None = None, interval: float = 0.5
) -> threading.Thread:
    """Call ``on_gone`` (once, from a daemon thread) when this process's parent is gone; return the thread.

    Gone means: standard input, when it is a pipe or a socket, reaches its end (the parent closed
    it or died, SIGKILL included: the kernel closes its end), or this process was handed to
    another parent (an init or a subreaper adopted it). Standard input that is a terminal or
    ``/dev/null`` is not watched (it would end at once); the parent's pid still is. ``parent`` is the
    pid the process started under (taken as early as it can be: one that died before the watch began
    is seen too); default: the parent now.
    """
    import select
    import stat

    parent = os.getppid() if parent is None else parent
    try:
        mode = os.fstat(0).st_mode
        pipe = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except OSError:  # no standard input at all
        pipe = False

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                break
            if not pipe:
                time.sleep(interval)
                continue
            ready, _, _ = select.select([0], [], [], interval)
            if ready:
                try:
                    data = os.read(0, 4096)
                except OSError:
                    break
                if not data:  # end of file: the parent's end is closed
                    break
        on_gone()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def peak_rss_bytes() -> int:
    """This process image's peak resident memory.

    Linux's ``getrusage`` ``ru_maxrss`` carries over the high-water mark of the process that exec'd
    this one (a ``subprocess`` child of a 1 GiB pytest reports 1 GiB), so on Linux the image's own
    ``VmHWM`` is read instead; elsewhere ``ru_maxrss`` (KiB on most systems, bytes on macOS).
    """
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed since boot (``/proc/vmstat``
    ``oom_kill``, Linux 4.13+, every cgroup's included); None where it cannot be read."""
    try:
        with open("/proc/vmstat") as stats:
            for line in stats:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
