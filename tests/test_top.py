"""``ggstudio top`` in a terminal (a pty): it shows a request while it runs, then its record with its phases."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from studio.settings import ModelDefaults
from tests.helpers import wait_for
from tests.support.studio import running_studio

pytestmark = pytest.mark.slow

_ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")
_RUN_CLI = "import sys; from studio.cli.entry import main; sys.argv = ['ggstudio', *sys.argv[1:]]; main()"


class Terminal:
    """A program in a pty of its own, 200 columns wide; what it printed so far, without escape codes."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        os.set_blocking(master, True)
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.master = master
        self.output = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output += data

    def text(self) -> str:
        return _ANSI.sub(b"", bytes(self.output)).decode("utf-8", "replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        os.close(self.master)


def test_top_shows_a_request_as_it_runs_and_then_its_phases(tmp_path: Path, llama_server_bin, smollm_model):
    defaults = {"smollm": ModelDefaults(n_ctx=2048, spec="off")}
    with running_studio(tmp_path, llama_server_bin, {"smollm": smollm_model}, defaults=defaults) as s:
        env = {
            **os.environ,
            "COLUMNS": "200",
            "LINES": "60",
            "TERM": "xterm-256color",
            "GGUF_STUDIO_HOME": str(tmp_path),
        }
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
        term = Terminal([sys.executable, "-c", _RUN_CLI, "top", "--url", s.url, "--every", "0.3"], env)
        try:
            wait_for(lambda: "In flight" in term.text(), timeout=60, what="top's first screen")
            body = {
                "model": "smollm",
                "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
                "max_tokens": 80,
                "stream": True,
            }
            streaming = threading.Thread(
                target=lambda: httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=300).read()
            )
            streaming.start()
            running = re.compile(r"smollm\W+/v1/chat/completions\W+(queued|loading|prefill|decode)\W")
            try:
                wait_for(lambda: running.search(term.text()), timeout=120, what="the request in flight on top's screen")
            except AssertionError:
                raise AssertionError(term.text()[-3000:]) from None
            streaming.join(300)
            done = re.compile(r"request\W+smollm\W+/v1/chat/completions\W.*\W(finished|length)\W")
            wait_for(lambda: done.search(term.text()), timeout=60, what="the finished request on top's screen")
        finally:
            term.close()
        assert term.proc.returncode == 0, term.text()[-2000:]
