"""The built-in ``python`` tool: run a model's program in a child process with limits.

Off unless ``[tools.python] enabled = true``. Each call gets a fresh scratch
folder (removed afterwards) as its working directory and runs ``python -I`` there
with ``resource.setrlimit`` limits set in the child before it executes: CPU
seconds, address space (memory), the size of any file it writes, no core dumps
(``launcher.platform.limit_resources``). The child leads its own process group;
``launcher.platform.ProcessTree`` counts the processes it starts and stops them
all past ``max_processes``. However a call ends (the program's own exit, a limit,
the wall-clock timeout, the client leaving), the whole group is killed, and what
left it but was seen: nothing the program started in the background outlives the
call. Output beyond the limit is cut off and the child stopped. On Linux the
child runs in a new network namespace (``unshare --net``, with ``--map-root-user``
when not root), so it cannot reach any network, loopback included; where that is
not possible (another OS, no ``unshare``, user namespaces forbidden) it runs with
the network, and the tool's description and ``status`` say so.

This is a limit on accidents, not a security boundary against a hostile program:
the child sees the same file system as the studio.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import structlog

from launcher.platform import ProcessTree, limit_resources
from studio.blocking import run_blocking
from studio.chat.tool import ToolResult, ToolSpec
from studio.settings import PythonToolConfig

log = structlog.get_logger(__name__)

PARAMETERS = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "A complete Python 3 program; print what you need."}},
    "required": ["code"],
}


@cache
def network_isolation() -> tuple[tuple[str, ...], str | None]:
    """The argv prefix that cuts a child off the network here, and a note when there is none."""
    if not sys.platform.startswith("linux"):
        return (), f"no network isolation on {sys.platform}: the python tool can reach the network"
    unshare = shutil.which("unshare")
    if unshare is None:
        return (
            (),
            "no network isolation: `unshare` (util-linux) is not installed; the python tool can reach the network",
        )
    tried = []
    for prefix in ((unshare, "--net"), (unshare, "--net", "--map-root-user")):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(str(exc))
            continue
        if done.returncode == 0:
            return prefix, None
        tried.append(done.stderr.decode(errors="replace").strip())
    return (), f"no network isolation: unshare failed ({'; '.join(tried)}); the python tool can reach the network"


class PythonTool:
    """The ``python`` tool; see the module docstring."""

    def __init__(self, config: PythonToolConfig, scratch_dir: Path) -> None:
        self.config = config
        self.scratch_dir = scratch_dir
        prefix, note = network_isolation()
        self._prefix = prefix
        self.note = note
        if note:
            log.warning("python tool runs without network isolation", reason=note)
        description = (
            f"Run a Python 3 program and return what it prints (stdout and stderr). Limits: "
            f"{config.timeout:g} s wall clock, {config.cpu_seconds} s CPU, {config.memory_mb} MiB memory, "
            f"{config.max_output_kb} KiB of output, {config.max_processes} processes; "
            "a fresh empty working folder each call; " + ("no network." if not note else "the network is reachable.")
        )
        self.spec = ToolSpec("python", description, PARAMETERS, "builtin")

    def status(self) -> dict[str, Any]:
        c = self.config
        return {
            "enabled": True,
            "network_isolated": self.note is None,
            "note": self.note,
            "timeout": c.timeout,
            "cpu_seconds": c.cpu_seconds,
            "memory_mb": c.memory_mb,
            "max_output_kb": c.max_output_kb,
            "max_processes": c.max_processes,
        }

    async def call(self, arguments: dict[str, Any], *, timeout: float) -> ToolResult:
        """Run ``arguments["code"]``; the output, or an error result saying which limit stopped it."""
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResult("the python tool needs a `code` argument: a Python program as a string", True)
        self.scratch_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="python-", dir=self.scratch_dir) as scratch:
            (Path(scratch) / "main.py").write_text(code)
            return await self._run(Path(scratch), min(timeout, self.config.timeout))

    async def _run(self, scratch: Path, timeout: float) -> ToolResult:
        limit = self.config.max_output_kb * 1024
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(scratch),
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        # The output pipe is ours, not asyncio's: Python 3.11's ``Process.wait()`` also waits for the pipes it
        # made to close, which never happened when output went on arriving after the program was stopped (the
        # reader's full buffer had paused reading, so the pipe's end was never seen; a call hung in CI). Closing
        # our end instead also stops anything the program left running that still writes to it.
        read_end, write_end = os.pipe()
        try:
            child = await asyncio.create_subprocess_exec(
                *self._prefix,
                sys.executable,
                "-I",
                "main.py",
                cwd=scratch,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_end,
                stderr=write_end,
                start_new_session=True,
                preexec_fn=limit_resources(
                    cpu_seconds=self.config.cpu_seconds,
                    memory_bytes=self.config.memory_mb * 1024 * 1024,
                    file_bytes=self.config.max_output_kb * 1024 * 16,
                ),
            )
        except OSError as exc:
            os.close(read_end)
            return ToolResult(f"the python tool could not start: {exc}", True)
        finally:
            os.close(write_end)
        output = bytearray()
        cut = timed_out = False
        reader, pipe = await _read_pipe(read_end)
        loop = asyncio.get_running_loop()
        processes = ProcessTree(  # past the limit it kills them all; closing the pipe ends the read below
            child.pid, max_processes=self.config.max_processes, on_limit=lambda: loop.call_soon_threadsafe(pipe.close)
        )
        try:
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(64 * 1024):
                    output += chunk
                    if len(output) > limit:
                        cut = True
                        break
        except TimeoutError:
            timed_out = True
        finally:  # however it ended, the client leaving too: nothing the program started outlives the call
            await run_blocking(processes.kill, timeout=None, what="stopping the python tool's processes")
            pipe.close()
            status = await child.wait()
        text = output[:limit].decode(errors="replace")
        if processes.over_limit:
            return ToolResult(_with(text, f"[stopped: more than {self.config.max_processes} processes at once]"), True)
        if timed_out:
            return ToolResult(_with(text, f"[stopped: the program ran longer than {timeout:g} s]"), True)
        if cut:
            return ToolResult(
                _with(text, f"[stopped: output beyond {self.config.max_output_kb} KiB was cut off]"), True
            )
        if status != 0 and "MemoryError" in text:
            return ToolResult(_with(text, f"[stopped: memory limit of {self.config.memory_mb} MiB]"), True)
        if status in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft, then the hard CPU limit
            return ToolResult(_with(text, f"[stopped: CPU time limit of {self.config.cpu_seconds} s]"), True)
        if status != 0:
            return ToolResult(_with(text, f"[exit status {status}]"), True)
        return ToolResult(text or "(the program printed nothing)")


async def _read_pipe(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """A stream reading the pipe end ``fd``, and its transport (closing it closes ``fd``)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader, pipe


def _with(text: str, note: str) -> str:
    return f"{text.rstrip()}\n{note}" if text.strip() else note
