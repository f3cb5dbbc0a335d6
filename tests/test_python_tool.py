"""The built-in python tool: a real child process under its limits, in a scratch folder, without network."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from studio.chat.python_tool import PythonTool, network_isolation
from studio.settings import PythonToolConfig


@pytest.fixture
def tool(tmp_path):
    return PythonTool(
        PythonToolConfig(enabled=True, timeout=3, cpu_seconds=2, memory_mb=200, max_output_kb=8, max_processes=16),
        tmp_path / "scratch",
    )


def run(tool: PythonTool, code: str, timeout: float = 30):
    return asyncio.run(tool.call({"code": code}, timeout=timeout))


def test_a_program_prints_its_result(tool, tmp_path):
    result = run(tool, "import os\nprint(6 * 7, os.listdir('.'))")
    assert not result.is_error and result.text.strip() == "42 ['main.py']"
    assert list((tmp_path / "scratch").iterdir()) == []  # the scratch folder is gone afterwards


def test_a_program_that_runs_too_long_is_stopped(tool):
    result = run(tool, "import time\ntime.sleep(60)")
    assert result.is_error and "ran longer than 3 s" in result.text


def test_the_memory_limit_stops_a_program(tool):
    result = run(tool, "block = bytearray(400 * 1024 * 1024)\nprint('allocated')")
    assert result.is_error and "memory limit of 200 MiB" in result.text and "allocated" not in result.text


def test_megabytes_of_output_are_cut_off(tool):
    result = run(tool, "import sys\nwhile True: sys.stdout.write('y' * 65536)")
    assert result.is_error and "output beyond 8 KiB was cut off" in result.text and len(result.text) < 9000


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_output_that_goes_on_after_the_kill_does_not_hang_the_call(tool):
    """CI hung in ``test_megabytes_of_output_are_cut_off``: output that went on arriving after the stop filled
    the reader's buffer, which paused reading the pipe, so its end was never seen, and Python 3.11's
    ``Process.wait()`` waits for the pipes to close. A process that left the group (and so outlives the kill)
    makes that certain: it must not hang the call, nor go on writing."""
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    sys.stdout.write(f'escaped {os.getpid()}\\n')\n"
        "    while True:\n"
        "        sys.stdout.write('y' * 65536)\n"
        "time.sleep(60)\n"
    )
    result = asyncio.run(asyncio.wait_for(tool.call({"code": code}, timeout=30), 10))
    assert result.is_error and "output beyond 8 KiB was cut off" in result.text
    escaped = int(result.text.split()[1])
    deadline = time.monotonic() + 5
    while _running(escaped) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(escaped)  # the pipe it wrote to was closed: it died on the next write


def _gone(pids: list[int], within: float = 2) -> bool:
    """Whether every pid has ended (a zombie counts: init here does not reap) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_running(pid) for pid in pids)


def test_python_tool_kills_detached_child_at_end_of_call(tool):
    """The process group was killed only when the output was cut or the time ran out: a program that ended
    normally left what it started in the background running after the call, a `sleep 60` for a minute."""
    code = (
        "import subprocess, time\n"
        "quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "stayed = subprocess.Popen(['sleep', '60'], **quiet)\n"
        "left = subprocess.Popen(['sleep', '60'], start_new_session=True, **quiet)  # out of the group\n"
        "time.sleep(0.5)  # the tool looks for new processes every 0.1 s\n"
        "print(stayed.pid, left.pid)\n"
    )
    began = time.monotonic()
    result = run(tool, code)
    assert not result.is_error, result.text
    assert time.monotonic() - began < 2.5  # it ended on its own, not at the 3 s timeout
    pids = [int(pid) for pid in result.text.split()]
    assert _gone(pids), [pid for pid in pids if _running(pid)]


def test_python_tool_limits_processes(tool):
    """Nothing limited how many processes a program started: a fork loop could fill the process table."""
    code = (
        "import os, time\n"
        "for _ in range(1000):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    print(pid, flush=True)\n"
        "    time.sleep(0.01)  # 100 a second: the count stops it well before the end\n"
        "print('all started')\n"
    )
    began = time.monotonic()
    result = run(tool, code)
    assert result.is_error and "[stopped: more than 16 processes at once]" in result.text, result.text
    assert time.monotonic() - began < 2.5  # stopped by the count, not by the 3 s timeout
    forked = [int(line) for line in result.text.splitlines() if line.isdigit()]
    assert 16 <= len(forked) < 100 and "all started" not in result.text and _gone(forked)


def test_a_failing_program_shows_its_traceback(tool):
    result = run(tool, "raise ValueError('bad input')")
    assert result.is_error and "ValueError: bad input" in result.text and "[exit status 1]" in result.text


def test_no_network_not_even_loopback(tool):
    prefix, note = network_isolation()
    if note:
        pytest.skip(note)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        result = run(tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\nprint('connected')")
    finally:
        server.close()
    assert result.is_error and "connected" not in result.text and not accepted
    assert "Network is unreachable" in result.text or "Connection refused" in result.text
    assert tool.status()["network_isolated"] is True


def test_a_call_without_code_is_an_error_result(tool):
    assert asyncio.run(tool.call({}, timeout=5)).is_error


def test_a_cancelled_call_kills_the_program(tool, tmp_path):
    marker = tmp_path / "still-running"

    async def cancel_midway() -> None:
        task = asyncio.create_task(
            tool.call({"code": f"import time\ntime.sleep(1.5)\nopen({str(marker)!r}, 'w').write('x')"}, timeout=30)
        )
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(2.5)

    asyncio.run(cancel_midway())
    assert not marker.exists()
