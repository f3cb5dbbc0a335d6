"""The tool loop engine with a scripted model and real tools: the stand-in MCP server and the python tool.

The model is a script of turns (what a model would answer); the tools are real: a
child process speaking MCP through the official SDK (``tests.mcp_standin_server``)
and the sandboxed python tool, so every failure below is a real one.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from studio.chat.model_turn import Turn, TurnError
from studio.chat.tool_loop import NUDGE_ACT, NUDGE_FINAL, LoopLimits, announces_action, run_tool_loop
from studio.chat.toolbox import Toolbox
from studio.settings import MCPServerConfig, PythonToolConfig, ToolSettings
from tests.helpers import LoopThread, assert_no_children

pytestmark = pytest.mark.shared_processes  # one MCP server child serves the module; checked when it is done

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def standin_server(name: str = "standin") -> MCPServerConfig:
    return MCPServerConfig(
        name=name,
        command=sys.executable,
        args=("-m", "tests.mcp_standin_server"),
        env={"PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def toolbox(loop, tmp_path_factory):
    settings = ToolSettings(
        mcp_servers={"standin": standin_server()}, python=PythonToolConfig(enabled=True, timeout=10, memory_mb=256)
    )
    box = Toolbox(settings, scratch_dir=tmp_path_factory.mktemp("scratch"), logs_dir=tmp_path_factory.mktemp("logs"))
    loop.run(box.start())
    assert box.status()["mcp_servers"]["standin"]["state"] == "ready", box.status()
    yield box
    loop.run(box.aclose())
    assert_no_children()


def call(name: str, arguments: dict[str, Any], id: str = "c1") -> dict[str, Any]:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def turn(content: str = "", *calls: dict[str, Any], prompt: int = 100, completion: int = 10) -> Turn:
    return Turn(
        content=content,
        tool_calls=list(calls),
        finish_reason="tool_calls" if calls else "stop",
        usage={"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        timings={"prompt_n": prompt, "prompt_ms": 100.0, "predicted_n": completion, "predicted_ms": 200.0},
    )


class Script:
    """A model that answers with the next scripted turn; it records what each call was sent."""

    def __init__(self, *turns: Turn | Exception) -> None:
        self.turns = list(turns)
        self.sent: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []

    async def __call__(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> AsyncIterator[dict[str, Any] | Turn]:
        self.sent.append((copy.deepcopy(messages), tools))
        step = self.turns[min(len(self.sent), len(self.turns)) - 1]
        if isinstance(step, Exception):
            raise step
        if step.content:
            yield {"type": "content", "text": step.content}
        for i, c in enumerate(step.tool_calls):
            yield {"index": i, **c, "type": "tool_call"}
        yield step


def run(loop: LoopThread, toolbox: Toolbox, script: Script, names: list[str], **limits: Any) -> list[dict[str, Any]]:
    async def collect() -> list[dict[str, Any]]:
        return [e async for e in run_tool_loop(QUESTION, toolbox.select(names), script, LoopLimits(**limits))]

    return loop.run(collect())


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] + (f":{e['reason']}" if e["type"] == "status" else "") for e in events]


def tool_results(script: Script, call_index: int) -> list[str]:
    return [m["content"] for m in script.sent[call_index][0] if m["role"] == "tool"]


def test_a_tool_call_then_an_answer_in_order_with_usage_summed(loop, toolbox):
    script = Script(turn("", call("standin__get_weather", {"city": "Paris"})), turn("Sunny in Paris.", prompt=150))
    events = run(loop, toolbox, script, ["standin__get_weather"])
    assert kinds(events) == ["tool_call", "tool_start", "tool_end", "content", "done"]
    start, end, done = events[1], events[2], events[-1]
    assert (start["name"], json.loads(start["arguments"])) == ("standin__get_weather", {"city": "Paris"})
    assert end["ok"] and end["result"] == "Sunny, 21 C in Paris" and end["id"] == start["id"] == "c1"
    assert tool_results(script, 1) == ["Sunny, 21 C in Paris"]
    assert [t["function"]["name"] for t in script.sent[0][1]] == ["standin__get_weather"]
    assert done["usage"] == {"prompt_tokens": 250, "completion_tokens": 20, "total_tokens": 270}
    assert done["timings"]["prompt_n"] == 250 and done["timings"]["predicted_ms"] == 400.0
    assert done["tokens_per_second"] == pytest.approx(20 / 0.4)
    assert (done["iterations"], done["stop_reason"], done["finish_reason"]) == (2, "answer", "stop")


def test_iteration_cap_then_one_nudge_without_tools(loop, toolbox):
    script = Script(
        *[turn("", call("standin__add", {"a": i, "b": 1}, id=f"c{i}")) for i in range(3)],
        turn("The sums were 1, 2 and 3."),
    )
    events = run(loop, toolbox, script, ["standin__add"], max_iterations=3)
    assert kinds(events).count("tool_start") == 3
    assert kinds(events)[-3:] == ["status:iteration_cap", "content", "done"]
    last_messages, last_tools = script.sent[-1]
    assert last_tools is None and last_messages[-1] == {"role": "user", "content": NUDGE_FINAL}
    assert events[-1]["stop_reason"] == "iteration_cap" and events[-1]["iterations"] == 4
    assert events[-1]["usage"]["prompt_tokens"] == 400


def test_a_repeated_call_is_told_once_then_stops(loop, toolbox):
    same = call("standin__get_weather", {"city": "Paris"})
    script = Script(turn("", same), turn("", {**same, "id": "c2"}), turn("", {**same, "id": "c3"}), turn("never"))
    events = run(loop, toolbox, script, ["standin__get_weather"])
    assert kinds(events) == [
        "tool_call",
        "tool_start",
        "tool_end",
        "tool_call",
        "status:repeated_call",
        "tool_call",
        "status:repeated_call",
        "done",
    ]
    assert "already called standin__get_weather" in tool_results(script, 2)[-1]
    assert len(script.sent) == 3 and events[-1]["stop_reason"] == "repeated_call"


def test_a_failed_call_may_be_retried_with_the_same_arguments(loop, toolbox):
    """Only a call that succeeded is blocked when repeated: a failure may pass the second time."""
    failing = call("standin__crash", {})
    script = Script(turn("", failing), turn("", {**failing, "id": "c2"}), turn("It keeps crashing."))
    events = run(loop, toolbox, script, ["standin__crash"])
    assert kinds(events).count("tool_start") == 2 and "status:repeated_call" not in kinds(events)
    assert [e["ok"] for e in events if e["type"] == "tool_end"] == [False, False]
    assert len(tool_results(script, 2)) == 2 and "already called" not in tool_results(script, 2)[-1]
    assert events[-1]["stop_reason"] == "answer"


def test_a_plan_without_action_is_re_prompted_at_most_twice(loop, toolbox):
    plan = "I'll check the weather in Paris for you using the tool."
    script = Script(turn(plan), turn(plan), turn(plan), turn("never asked"))
    events = run(loop, toolbox, script, ["standin__get_weather"])
    assert kinds(events) == ["content", "status:replan", "content", "status:replan", "content", "done"]
    assert script.sent[1][0][-1] == {"role": "user", "content": NUDGE_ACT}
    assert len(script.sent) == 3 and events[-1]["stop_reason"] == "answer"
    # and a re-prompted model that then acts goes on normally
    script = Script(turn(plan), turn("", call("standin__get_weather", {"city": "Paris"})), turn("Sunny."))
    assert kinds(run(loop, toolbox, script, ["standin__get_weather"]))[-4:] == [
        "tool_start",
        "tool_end",
        "content",
        "done",
    ]


@pytest.mark.parametrize(
    "text, plan",
    [
        ("Let me look up the current weather in Paris.", True),
        ("I will use the search tool to find it:", True),
        ("It is sunny in Paris today.", False),
        ("Should I check the weather for you?", False),
        ("", False),
    ],
)
def test_announces_action(text, plan):
    assert announces_action(text) is plan


def test_a_hanging_tool_times_out_and_the_model_sees_it(loop, toolbox):
    script = Script(turn("", call("standin__hang", {})), turn("The tool hung; sorry."))
    events = run(loop, toolbox, script, ["standin__hang"], tool_timeout=1.5)
    end = next(e for e in events if e["type"] == "tool_end")
    assert not end["ok"] and "did not answer within 1.5 s" in end["error"] and end["seconds"] < 10
    assert "did not answer within 1.5 s" in tool_results(script, 1)[0]
    assert events[-1]["stop_reason"] == "answer"
    # the server is still fine afterwards
    script = Script(turn("", call("standin__add", {"a": 2, "b": 3})), turn("5"))
    assert next(e for e in run(loop, toolbox, script, ["standin__add"]) if e["type"] == "tool_end")["result"] == "5"


def test_the_whole_loop_times_out(loop, toolbox):
    script = Script(turn("", call("standin__hang", {})), turn("never"))
    events = run(loop, toolbox, script, ["standin__hang"], tool_timeout=60, total_timeout=2)
    assert kinds(events)[-2:] == ["status:timeout", "done"] and events[-1]["stop_reason"] == "timeout"
    assert len(script.sent) == 1


def test_a_crashing_tool_and_megabytes_of_output_are_error_results(loop, toolbox):
    script = Script(
        turn("", call("standin__crash", {}, id="a"), call("standin__shout", {"n": 3_000_000}, id="b")),
        turn("Both went wrong."),
    )
    events = run(loop, toolbox, script, ["standin__crash", "standin__shout"], result_chars=1000)
    crash, shout = [e for e in events if e["type"] == "tool_end"]
    assert not crash["ok"] and "crash" in crash["error"]
    assert shout["ok"] and len(shout["result"]) < 400
    results = tool_results(script, 1)
    assert len(results[1]) < 1100 and "more characters cut" in results[1]
    assert events[-1]["stop_reason"] == "answer"


def test_unknown_tools_and_bad_arguments_never_run(loop, toolbox):
    bad = {"id": "b", "type": "function", "function": {"name": "standin__add", "arguments": "{not json"}}
    script = Script(
        turn("", call("standin__die", {}, id="a"), bad, call("python", {"code": "print(1)"}, id="c")), turn("ok")
    )
    events = run(loop, toolbox, script, ["standin__add"])
    ends = [e for e in events if e["type"] == "tool_end"]
    assert [e["ok"] for e in ends] == [False, False, False]
    assert "no tool named 'standin__die' is enabled" in ends[0]["error"]
    assert "not valid JSON" in ends[1]["error"] and "no tool named 'python'" in ends[2]["error"]
    assert toolbox.status()["mcp_servers"]["standin"]["state"] == "ready"  # die was not run


def test_the_python_tool_in_the_loop(loop, toolbox):
    script = Script(turn("", call("python", {"code": "print(sum(range(10)))"})), turn("45"))
    end = next(e for e in run(loop, toolbox, script, ["python"]) if e["type"] == "tool_end")
    assert end["ok"] and end["result"].strip() == "45"


def test_a_model_error_ends_the_loop_with_an_error_event(loop, toolbox):
    script = Script(
        turn("", call("standin__add", {"a": 1, "b": 1})),
        TurnError(400, {"message": "context full", "type": "exceed_context_size_error"}),
    )
    events = run(loop, toolbox, script, ["standin__add"])
    assert kinds(events)[-1] == "error" and events[-1]["status"] == 400


def test_an_mcp_server_that_dies_mid_call(loop, tmp_path):
    box = Toolbox(
        ToolSettings(mcp_servers={"mortal": standin_server("mortal")}), scratch_dir=tmp_path, logs_dir=tmp_path / "logs"
    )
    loop.run(box.start())
    try:
        script = Script(
            turn("", call("mortal__die", {}), call("mortal__add", {"a": 1, "b": 2}, id="c2")), turn("The server died.")
        )
        events = run(loop, box, script, ["mortal__die", "mortal__add"])
        ends = [e for e in events if e["type"] == "tool_end"]
        assert not ends[0]["ok"] and "went away" in ends[0]["error"]
        assert not ends[1]["ok"] and "not available" in ends[1]["error"]
        assert "status:tool_unavailable" in kinds(events)
        assert events[-1]["type"] == "done" and events[-1]["stop_reason"] == "answer"
        status = box.status()["mcp_servers"]["mortal"]
        assert status["state"] == "failed" and status["error"] and status["tools"] == []
        with pytest.raises(Exception, match="no enabled tool is named 'mortal__add'"):
            box.select(["mortal__add"])
    finally:
        loop.run(box.aclose())


def test_a_server_that_cannot_start_is_reported_not_fatal(loop, tmp_path):
    box = Toolbox(
        ToolSettings(
            mcp_servers={"ghost": MCPServerConfig(name="ghost", command="/nonexistent/mcp")},
            python=PythonToolConfig(enabled=True),
        ),
        scratch_dir=tmp_path,
    )
    loop.run(box.start())
    try:
        status = box.status()
        assert status["mcp_servers"]["ghost"]["state"] == "failed" and status["mcp_servers"]["ghost"]["error"]
        assert [t["name"] for t in status["tools"]] == ["python"]
    finally:
        loop.run(box.aclose())
