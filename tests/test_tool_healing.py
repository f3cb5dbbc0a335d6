"""Healing: tool-call markup a model wrote as text comes back as OpenAI ``tool_calls``.

The studio's real proxy (uvicorn, ``AheadRoutes``, the pooled upstream transport) runs
against ``tests.replay_upstream``, which replays leaked outputs users reported; each
form is streamed split at every offset of its markup, and the SSE bytes themselves are
cut at every offset in-process.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from studio.chat.tool_markup import OPENERS, MarkupScanner
from studio.chat.tool_stream import HealingRelay
from studio.http.app import create_app
from tests.helpers import serving
from tests.replay_upstream import LEAK_CALLS, LEAKS, WEATHER_TOOL, Answer, ReplayUpstream
from tests.standin_manager import StandInManager, StandInModel

SCHEMAS = {"get_weather": WEATHER_TOOL["function"]["parameters"]}
ASK = {"model": "replay", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]}


@pytest.fixture(scope="module")
def manager(replay):
    return StandInManager(StandInModel(name="replay", url=replay.url))


@pytest.fixture(scope="module")
def studio(manager):
    with serving(create_app(manager)) as base:
        yield base


@pytest.fixture
def http(studio):
    with httpx.Client(base_url=studio, timeout=30) as client:
        yield client


def calls_of(tool_calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def has_markup(text: str) -> bool:
    return any(tag in text for tag in (*OPENERS, "</tool_call>", "</function>", "<parameter=", "[ARGS]"))


def streamed(http: httpx.Client, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, whole tool calls (deltas merged by index) and finish_reason of a stream through the proxy."""
    content, calls, finish = [], {}, None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    whole = calls.setdefault(
                        call["index"], {"id": call.get("id"), "function": {"name": "", "arguments": ""}}
                    )
                    whole["function"]["name"] += call.get("function", {}).get("name") or ""
                    whole["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("form", sorted(LEAKS))
def test_each_leaked_form_heals_in_a_plain_answer(replay, http, form):
    replay.script(Answer.text(LEAKS[form]))
    choice = http.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert calls_of(choice["message"]["tool_calls"]) == LEAK_CALLS[form]
    assert not has_markup(choice["message"]["content"])
    assert choice["finish_reason"] == "tool_calls"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in choice["message"]["tool_calls"])


@pytest.mark.parametrize("form", sorted(LEAKS))
def test_each_leaked_form_heals_in_a_stream_split_at_every_offset(replay, http, form):
    text = LEAKS[form]
    start = min(i for i in (text.find(o) for o in OPENERS) if i != -1)
    splits = [[text[:k], text[k:]] for k in range(start + 1, len(text))] + [list(text)]
    replay.script(*(Answer(content=pieces) for pieces in splits))
    for pieces in splits:
        content, calls, finish = streamed(http, ASK)
        assert calls_of(calls) == LEAK_CALLS[form], pieces
        assert not has_markup(content), pieces
        assert content.strip() == text[:start].strip(), pieces
        assert finish == "tool_calls"


@pytest.mark.parametrize("form", sorted(LEAKS))
def test_healing_survives_sse_bytes_cut_at_every_offset(form):
    """The relay's own framing: upstream bytes may break anywhere, even inside an event."""
    with ReplayUpstream() as upstream:
        upstream.script(Answer(content=[LEAKS[form]]))
        raw = httpx.post(f"{upstream.url}/v1/chat/completions", json={**ASK, "stream": True}).content
    for k in range(1, len(raw)):
        relay = HealingRelay(SCHEMAS)
        out = relay.feed(raw[:k]) + relay.feed(raw[k:]) + relay.close()
        chunks = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line.startswith("data: {")]
        calls = [c for chunk in chunks for ch in chunk["choices"] for c in ch["delta"].get("tool_calls") or ()]
        assert calls_of(calls) == LEAK_CALLS[form], k
        assert out.endswith(b"data: [DONE]\n\n")


def test_plain_text_is_not_held_back(replay, http):
    """Ordinary text goes out chunk by chunk; only a possible opener's prefix waits."""
    scanner = MarkupScanner(SCHEMAS)
    assert scanner.feed("Hello world") == ["Hello world"]
    assert scanner.feed(" a <") == [" a "]  # "<" could begin <tool_call>
    assert scanner.feed("b") == ["<b"]
    assert scanner.feed(" [TOOL") == [" "]
    assert scanner.feed("S] x") == ["[TOOLS] x"]
    replay.script(Answer(content=["It is", " sunny", " in Paris."]))
    content, calls, finish = streamed(http, ASK)
    assert (content, calls, finish) == ("It is sunny in Paris.", [], "stop")


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>I cannot call tools</tool_call> sorry",
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not an offered tool
        "Use <function=get_weather> like this",
        "[TOOL_CALLS] none today",
    ],
)
def test_markup_that_does_not_parse_stays_text(replay, http, text):
    replay.script(Answer.text(text), Answer(content=list(text)))
    plain = http.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert plain["message"]["content"] == text and "tool_calls" not in plain["message"]
    assert streamed(http, ASK) == (text, [], "stop")


def test_without_tools_the_stream_passes_through_byte_for_byte(replay, http):
    replay.script(Answer.text(LEAKS["hermes"]), Answer.text(LEAKS["hermes"]))
    with httpx.Client() as raw:
        direct = raw.post(f"{replay.url}/v1/chat/completions", json={"stream": True, "messages": []}).content
    body = {k: v for k, v in ASK.items() if k != "tools"}
    through = http.post("/v1/chat/completions", json={**body, "stream": True}).content

    def strip_created(b: bytes) -> bytes:
        return b"\n".join(line.split(b'"created"')[0] for line in b.split(b"\n"))

    assert strip_created(through) == strip_created(direct)
    assert b"<tool_call>" in through


def test_tool_choice_none_is_not_healed(replay, http):
    replay.script(Answer.text(LEAKS["hermes"]))
    choice = http.post("/v1/chat/completions", json={**ASK, "tool_choice": "none"}).json()["choices"][0]
    assert choice["message"]["content"] == LEAKS["hermes"] and choice["finish_reason"] == "stop"


def test_calls_llama_server_parsed_pass_through_unchanged(replay, http):
    """Structured deltas from llama-server keep their bytes; a healed call takes the next index."""
    rome = Answer(tool_calls=[("get_weather", '{"city": "Rome"}')])
    replay.script(rome, rome)
    with httpx.Client() as raw:
        direct = raw.post(f"{replay.url}/v1/chat/completions", json={"stream": True}).text
    through = http.post("/v1/chat/completions", json={**ASK, "stream": True}).text

    def events(text: str) -> list[str]:
        return [event.split('"created"')[0] for event in text.split("\n\n") if event]

    assert events(through) == events(direct) and '"tool_calls"' in through
    replay.script(Answer(content=[LEAKS["hermes"]], tool_calls=[("get_weather", '{"city": "Rome"}')]))
    content, calls, finish = streamed(http, ASK)
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert finish == "tool_calls" and not has_markup(content)


def test_openai_client_sees_healed_calls(replay, studio):
    with openai.OpenAI(base_url=f"{studio}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        replay.script(Answer.text(LEAKS["qwen3_coder"]))
        reply = client.chat.completions.create(model="replay", messages=ASK["messages"], tools=[WEATHER_TOOL])
        call = reply.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather",
            {"city": "Paris", "days": 3},
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        replay.script(Answer(content=list(LEAKS["mistral"])))
        stream = client.chat.completions.create(
            model="replay", messages=ASK["messages"], tools=[WEATHER_TOOL], stream=True
        )
        deltas = [c.choices[0] for c in stream if c.choices]
        calls = [t for d in deltas for t in d.delta.tool_calls or ()]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert deltas[-1].finish_reason == "tool_calls"
