"""``/api/chat`` running tools end to end: real uvicorn, the real proxy path, the replay upstream as the model.

The studio's tools are real: the python tool, and the stand-in MCP server as a child
process over streamable HTTP (its URL in the config, as a user would give it). The
model's answers are replayed (``tests.replay_upstream``), including a call it leaked as
markup, which must be healed before the loop runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.chat.toolbox import Toolbox
from studio.http.app import create_app
from studio.settings import MCPServerConfig, PythonToolConfig, ToolSettings
from tests.helpers import assert_no_children, free_port, serving, wait_for
from tests.replay_upstream import Answer
from tests.standin_manager import StandInManager, StandInModel

pytestmark = pytest.mark.shared_processes  # the MCP server child serves the module; checked at its end

ROOT = Path(__file__).resolve().parent.parent
ASK = [{"role": "user", "content": "What is six times seven?"}]


@pytest.fixture(scope="module")
def mcp_url():
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.mcp_standin_server", "--http", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _listening(port) or child.poll() is not None, timeout=60, what="the MCP server to listen")
        assert child.poll() is None
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        child.terminate()
        child.wait(10)
    assert_no_children()


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
        return True
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def studio(replay, mcp_url, tmp_path_factory):
    settings = ToolSettings(
        mcp_servers={"web": MCPServerConfig(name="web", url=mcp_url)}, python=PythonToolConfig(enabled=True, timeout=10)
    )
    toolbox = Toolbox(settings, scratch_dir=tmp_path_factory.mktemp("scratch"))
    app = create_app(StandInManager(StandInModel(name="replay", url=replay.url)), toolbox=toolbox)
    with serving(app) as base:
        wait_for(
            lambda: httpx.get(f"{base}/api/tools").json()["mcp_servers"]["web"]["state"] != "starting",
            timeout=60,
            what="the MCP server to be listed",
        )
        yield base


def chat(base: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


def test_api_tools_lists_what_use_tools_may_name(studio):
    status = httpx.get(f"{studio}/api/tools").json()
    names = {t["name"] for t in status["tools"]}
    assert {"python", "web__get_weather", "web__hang"} <= names
    assert status["mcp_servers"]["web"]["state"] == "ready" and status["mcp_servers"]["web"]["transport"] == "http"
    assert status["python"]["enabled"] is True


def test_a_leaked_call_is_healed_run_and_answered(studio, replay):
    leak = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    replay.script(
        Answer(content=["Let me compute.\n", leak[:20], leak[20:]], prompt_tokens=40),
        Answer(content=["It is ", "42."], prompt_tokens=60),
    )
    seen = len(replay.requests)
    events = chat(studio, {"messages": ASK, "use_tools": ["python"]})
    kinds = [e["type"] for e in events]
    assert kinds == ["content", "tool_call", "tool_start", "tool_end", "content", "content", "done"]
    assert "<tool_call>" not in "".join(e.get("text", "") for e in events)
    end, done = events[3], events[-1]
    assert end["ok"] and end["result"].strip() == "42" and end["name"] == "python"
    first, second = replay.requests[seen:]
    assert [t["function"]["name"] for t in first["tools"]] == ["python"]
    assert second["messages"][-1]["role"] == "tool" and second["messages"][-1]["content"].strip() == "42"
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == "python"
    assert done["usage"]["prompt_tokens"] == 100 and done["iterations"] == 2 and done["stop_reason"] == "answer"


def test_mcp_tools_over_streamable_http(studio, replay):
    replay.script(Answer(tool_calls=[("web__get_weather", '{"city": "Oslo"}')]), Answer.text("Sunny."))
    events = chat(studio, {"messages": ASK, "use_tools": ["web__get_weather"]})
    end = next(e for e in events if e["type"] == "tool_end")
    assert end["ok"] and end["result"] == "Sunny, 21 C in Oslo"
    assert events[-1]["type"] == "done"


def test_a_hanging_mcp_tool_times_out_and_the_chat_goes_on(studio, replay):
    replay.script(Answer(tool_calls=[("web__hang", "{}")]), Answer.text("It hung."))
    events = chat(studio, {"messages": ASK, "use_tools": ["web__hang"], "tool_limits": {"tool_timeout": 1}})
    end = next(e for e in events if e["type"] == "tool_end")
    assert not end["ok"] and "did not answer within 1 s" in end["error"]
    assert events[-1]["type"] == "done" and events[-1]["stop_reason"] == "answer"


def test_a_model_error_mid_loop_is_an_error_event(studio, replay):
    replay.script(
        Answer(tool_calls=[("python", '{"code": "print(1)"}')]),
        Answer(
            status=400,
            error={"code": 400, "message": "the context is full", "type": "exceed_context_size_error", "n_ctx": 512},
        ),
    )
    events = chat(studio, {"messages": ASK, "use_tools": ["python"]})
    assert [e["type"] for e in events][-3:] == ["tool_start", "tool_end", "error"]
    assert events[-1]["status"] == 400 and events[-1]["error"]["type"] == "exceed_context_size_error"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"use_tools": ["rm_rf"]}, "use_tools"),
        ({"use_tools": ["python"], "tools": [{"type": "function", "function": {"name": "f"}}]}, "use_tools"),
        ({"use_tools": ["python"], "tool_limits": {"max_iterations": 0}}, "tool_limits.max_iterations"),
    ],
)
def test_tools_the_studio_cannot_run_are_refused(studio, replay, body, param):
    seen = len(replay.requests)
    resp = httpx.post(f"{studio}/api/chat", json={"messages": ASK, **body}, timeout=30)
    assert resp.status_code in (400, 422) and resp.json()["error"]["param"] == param
    assert len(replay.requests) == seen


def test_without_use_tools_calls_come_back_for_the_gui(studio, replay):
    """The GUI's own tools: the studio runs nothing, heals the leak, and reports the call."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    replay.script(Answer.text('[TOOL_CALLS][{"name": "lookup", "arguments": {"q": "x"}}]'))
    events = chat(studio, {"messages": ASK, "tools": [tool]})
    assert [e["type"] for e in events] == ["tool_call", "done"]
    assert events[0]["function"]["name"] == "lookup" and events[-1]["finish_reason"] == "tool_calls"
