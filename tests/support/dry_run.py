"""Load a model in llama-server just long enough to read its report, then stop it.

The model facts and the memory estimator are measured against what the real
server prints at ``-lv 4`` (``print_info``, buffer sizes, KV and recurrent
lines). This runs it on a free loopback port with ``-fit off --no-warmup``,
reads its output until a marker line, and kills its process group.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from launcher import platform
from launcher.process import free_port

#: After this line llama-server has printed everything it allocates.
LISTENING = "listening on"


def load_report(
    binary: Path,
    model: Path,
    args: Sequence[str] = (),
    *,
    until: Sequence[str] = (LISTENING,),
    timeout: float = 60.0,
    attempts: int = 3,
    then: Callable[[int, int], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, int | None]:
    """Return (llama-server's output up to the first ``until`` line or its exit, its exit code if it exited).

    ``then`` is called with the server's pid and port once an ``until`` line is read, before the server stops
    (to send it a request, to read its memory); the log then goes on to what the server printed meanwhile. A
    port another process grabbed between choosing and binding it is retried. ``env`` is the server's whole
    environment (default: this process's).
    """
    log, code = "", None
    for _ in range(attempts):
        log, code = _once(binary, model, args, until, timeout, then, env)
        if "couldn't bind" not in log:
            break
    return log, code


def _once(
    binary: Path,
    model: Path,
    args: Sequence[str],
    until: Sequence[str],
    timeout: float,
    then: Callable[[int, int], None] | None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, int | None]:
    port = free_port()
    argv = [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-fit",
        "off",
        "--no-warmup",
        "-lv",
        "4",
        *args,
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
        **platform.child_popen_kwargs(),
    )
    timer = threading.Timer(timeout, platform.kill_group, args=(proc.pid,))
    timer.start()
    lines: list[str] = []
    reached = False
    drain: threading.Thread | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if any(marker in line for marker in until):
                reached = True
                break
        if reached and then is not None:
            # -lv 4 logs every request: keep reading, or a full pipe stops the server mid-request
            drain = threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True)
            drain.start()
            then(proc.pid, port)
    finally:
        timer.cancel()
        platform.kill_group(proc.pid)
        if drain is not None:
            drain.join()
        proc.communicate()
    return "".join(lines), None if reached else proc.returncode
