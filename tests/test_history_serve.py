"""A real ``ggstudio serve`` with the real llama-server and SmolLM2, killed with SIGKILL mid-answer, then started again.

The answer streamed so far must be in the history after the restart, marked cut: the store's
periodic saves are committed (WAL) before the kill, and nothing in the studio gets a chance to
run at a ``kill -9``. The studio's llama-server dies with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from studio.library.default_model import ensure_default_model
from tests.helpers import free_port, wait_for
from tests.test_cli import CLI, assert_no_llama_server, tagged_env

pytestmark = pytest.mark.slow

#: This checkout, first on the serve process' path: the ``ggstudio`` script imports whichever ``studio`` is
#: installed, which may be another checkout's.
ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def serve(model: Path, port: int, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """``ggstudio serve --model model`` on ``port``, once its model is ready; killed on exit if still running."""
    with subprocess.Popen(
        [CLI, "serve", "--model", str(model), "--port", str(port), "--ctx", "2048"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as process:
        try:
            line = process.stdout.readline()  # type: ignore[union-attr]
            assert f"127.0.0.1:{port}" in line, line + (process.stderr.read() if process.poll() is not None else "")  # type: ignore[union-attr]
            wait_for(
                lambda: httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=10).json()["state"] == "ready",
                timeout=180,
                what="the model to load",
            )
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(30)


@pytest.fixture(scope="module")
def smollm2(settings) -> Path:
    """The default chat model (SmolLM2 135M Instruct): the smallest real one, loaded twice here."""
    return ensure_default_model(settings.models_dir)


def test_kill_9_of_the_studio_mid_answer_then_a_restart_keeps_the_partial_answer_marked_cut(
    smollm2, llama_server_bin, tmp_path
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = tagged_env(
        GGUF_STUDIO_HOME=str(tmp_path / "home"), LLAMA_SERVER_PATH=str(llama_server_bin), PYTHONPATH=str(ROOT)
    )
    question = "Write a long story about a dragon who learns to fly."
    with serve(smollm2, port, env) as process:
        created = httpx.post(f"{url}/api/conversations", json={}, timeout=10)
        assert created.status_code == 201, created.text
        cid = created.json()["id"]
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 1500,
            "temperature": 0,
            "conversation_id": cid,
        }
        streamed = ""

        def saved() -> str:
            messages = httpx.get(f"{url}/api/conversations/{cid}", timeout=10).json()["messages"]
            return str(messages[-1]["content"]) if len(messages) == 2 else ""

        with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            started = time.monotonic()
            for line in lines:
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    assert event["type"] in ("content", "reasoning"), event
                    streamed += event.get("text", "")
                if len(streamed) > 200 and time.monotonic() - started > 1.5 and len(saved()) > 100:
                    break
            else:
                pytest.fail(f"the answer ended before the studio could be killed: {streamed!r}")
            os.kill(process.pid, signal.SIGKILL)  # mid-answer: the studio gets no chance to save anything more
            assert process.wait(10) == -signal.SIGKILL
            with pytest.raises(httpx.RemoteProtocolError):  # the connection drops with the studio
                for line in lines:  # the rest that was on its way
                    if line.startswith("data:"):
                        streamed += json.loads(line[5:]).get("text", "")
    assert_no_llama_server(env)  # it died with the studio

    with serve(smollm2, port, env) as process:
        conversation = httpx.get(f"{url}/api/conversations/{cid}", timeout=10).json()
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    user, answer = conversation["messages"]
    assert (user["role"], user["content"], user["cut"]) == ("user", question, False)
    assert answer["role"] == "assistant" and answer["cut"] is True and answer["usage"] is None
    assert len(answer["content"]) > 100 and streamed.startswith(answer["content"])
    assert conversation["title"] == "Write a long story about a dragon who"
    assert_no_llama_server(env)
