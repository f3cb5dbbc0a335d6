"""A chat's tool fields and messages on the way to llama-server: passed through as sent, or refused with a 400
naming the field, before any load.

Runs the real proxy against ``tests.replay_upstream`` so the test sees exactly what
would have reached llama-server (and that a refused request reached nothing).
"""

from __future__ import annotations

import copy

import httpx
import pytest

from studio.http.app import create_app
from tests.helpers import serving
from tests.replay_upstream import WEATHER_TOOL, Answer
from tests.standin_manager import StandInManager, StandInModel

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def manager(replay):
    return StandInManager(StandInModel(name="replay", url=replay.url))


@pytest.fixture(scope="module")
def http(manager):
    with serving(create_app(manager)) as base:
        with httpx.Client(base_url=base, timeout=30) as client:
            yield client


def test_tool_fields_reach_llama_server_unchanged(replay, http):
    body = {"messages": MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    replay.script(Answer.text("ok"))
    assert http.post("/v1/chat/completions", json=copy.deepcopy(body)).status_code == 200
    sent = replay.requests[-1]
    assert {k: sent[k] for k in body} == body


def test_a_forced_function_becomes_that_tool_alone_and_required(replay, http):
    """llama-server reads tool_choice as a string only; OpenAI's object form must not turn into "auto"."""
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    replay.script(Answer.text("ok"))
    http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "tools": [other, WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    sent = replay.requests[-1]
    assert sent["tool_choice"] == "required" and sent["tools"] == [WEATHER_TOOL]


@pytest.mark.parametrize(
    "tools, param",
    [
        ({"type": "function"}, "tools"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([WEATHER_TOOL, {"type": "function", "function": {"name": ""}}], "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "city: str"}}], "tools[0].function.parameters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tools[0].function.parameters.type",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
            "tools[0].function.parameters.properties",
        ),
        ([{"type": "retrieval"}], "tools[0].type"),
        (["get_weather"], "tools[0]"),
        ([WEATHER_TOOL, WEATHER_TOOL], "tools[1].function.name"),
    ],
)
def test_malformed_tools_are_refused_before_llama_server_sees_them(replay, http, tools, param):
    seen = len(replay.requests)
    resp = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]
    assert len(replay.requests) == seen


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_malformed_tool_choice_is_refused(replay, http, extra, param):
    seen = len(replay.requests)
    resp = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER_TOOL], **extra})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert len(replay.requests) == seen


def test_api_chat_refuses_malformed_tools_too(replay, http):
    seen = len(replay.requests)
    resp = http.post("/api/chat", json={"messages": MESSAGES, "tools": [{"type": "function", "function": {}}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools[0].function.name"
    assert len(replay.requests) == seen


# -- messages ------------------------------------------------------------------------------------------


def test_anthropic_messages_missing_is_a_400_where_llama_server_answers_500(replay, manager, http):
    seen, acquired = len(replay.requests), manager.acquired
    resp = http.post("/v1/messages", json={"model": "replay", "max_tokens": 8})
    assert resp.status_code == 400
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "`messages` is missing" in body["error"]["message"]
    assert (len(replay.requests), manager.acquired) == (seen, acquired)  # no load, nothing sent


@pytest.mark.parametrize("messages", [None, "hi", {"role": "user", "content": "hi"}])
def test_chat_messages_missing_or_no_list_is_refused_before_any_load(replay, manager, http, messages):
    seen, acquired = len(replay.requests), manager.acquired
    body = {"model": "replay"} if messages is None else {"model": "replay", "messages": messages}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert (len(replay.requests), manager.acquired) == (seen, acquired)


def test_an_empty_messages_list_goes_on_as_llama_server_takes_it(replay, http):
    replay.script(Answer.text("ok"))
    resp = http.post("/v1/chat/completions", json={"model": "replay", "messages": []})
    assert resp.status_code == 200
    assert replay.requests[-1]["messages"] == []
