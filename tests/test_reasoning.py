"""Reasoning controls on the request path, each gap pinned by a test named after it.

The proxy's real request path runs against ``tests.replay_upstream``, so each test sees
what would have reached llama-server; the templates are the pinned tree's.
"""

from __future__ import annotations

import io
import json

import httpx
import pytest

from gguf.templates import template_capabilities
from studio.chat.reasoning import NO_THINK, THINK, reasoning_request, with_prompt_flag
from studio.chat.think_split import ThinkSplitter
from studio.cli.terminal_chat import answer_once, chat_loop
from studio.http.app import create_app
from studio.settings import Settings
from tests.helpers import serving
from tests.replay_upstream import Answer, ReplayUpstream
from tests.standin_manager import StandInManager, StandInModel
from tests.test_templates import _r1_distill_as_shipped, templates_dir


def caps(settings: Settings, name: str):
    return template_capabilities((templates_dir(settings) / name).read_text())


@pytest.fixture(scope="module")
def settings():
    return Settings.from_env()


def studio_for(replay: ReplayUpstream, template):
    return serving(create_app(StandInManager(StandInModel(name="replay", url=replay.url, template=template))))


def test_enable_thinking_on_a_reasoning_effort_template_is_mapped_not_dropped(settings, replay):
    gpt_oss = caps(settings, "openai-gpt-oss-120b.jinja")
    with studio_for(replay, gpt_oss) as base:
        replay.script(Answer.text("ok"))
        httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "enable_thinking": False},
            timeout=30,
        )
    sent = replay.requests[-1]
    assert sent["reasoning_effort"] == "low" and sent["chat_template_kwargs"]["reasoning_effort"] == "low"
    assert "enable_thinking" not in sent
    # a template with its own off level gets that level, in its own words (Hy3 raises on anything else)
    assert (
        reasoning_request(caps(settings, "tencent-Hy3.jinja"), {"enable_thinking": False}).reasoning_effort
        == "no_think"
    )
    assert reasoning_request(caps(settings, "Cohere2MoE.jinja"), {"enable_thinking": False}).reasoning_effort == "none"
    assert reasoning_request(gpt_oss, {"enable_thinking": True}).template_kwargs == {}  # its default thinks


def test_prompt_flag_style_is_applied_to_the_last_user_message(settings, replay):
    nemotron = caps(settings, "NVIDIA-Nemotron-Nano-v2.jinja")
    assert nemotron.reasoning_style == "prompt_flag"
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    with studio_for(replay, nemotron) as base:
        replay.script(Answer.text("ok"), Answer.text("ok"))
        for on in (False, True):
            httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "enable_thinking": on}, timeout=30)
    off, on = replay.requests[-2:]
    assert off["messages"][-1]["content"] == f"Why is the sky blue? {NO_THINK}"
    assert on["messages"][-1]["content"] == f"Why is the sky blue? {THINK}"
    assert off["messages"][0]["content"] == "first" and "chat_template_kwargs" not in off
    parts = with_prompt_flag([{"role": "user", "content": [{"type": "text", "text": "x"}]}], NO_THINK)
    assert parts[0]["content"][-1] == {"type": "text", "text": NO_THINK}


def test_an_all_reasoning_answer_is_shown_and_kept_as_the_answer(replay):
    """A reply that is only reasoning said "(the model only reasoned ...)" and was dropped; the reference
    backend shows the reasoning as the answer. An empty reply is still not kept."""
    start = len(replay.requests)  # the replay upstream serves the whole session
    with studio_for(replay, None) as base, httpx.Client(base_url=base, timeout=30) as client:
        replay.script(Answer(reasoning=["Paris, surely."]), Answer.text(""), Answer.text("Yes."))
        prompts = iter(["Capital of France?", "Again?", "And now?"])

        def read(_: str) -> str:
            try:
                return next(prompts)
            except StopIteration:
                raise EOFError from None

        out = io.StringIO()
        chat_loop(client, model="replay", options={}, read=read, out=out)
        once = io.StringIO()
        replay.script(Answer(reasoning=["Thinking only."]))
        answer_once(client, "Capital?", options={}, out=once, err=io.StringIO())
    second, third = (r["messages"] for r in replay.requests[start + 1 : start + 3])
    assert second[1] == {"role": "assistant", "content": "Paris, surely."}
    assert [m["role"] for m in third] == ["user", "assistant", "user"]  # the empty reply left no turn
    assert "only reasoned" not in out.getvalue() and "Paris, surely.\n" in out.getvalue()
    assert once.getvalue() == "Thinking only.\n"  # on stdout, where a script reads the answer


def test_r1_distill_thinking_in_content_reaches_api_chat_as_reasoning(settings, replay):
    distill = template_capabilities(_r1_distill_as_shipped(settings))
    with studio_for(replay, distill) as base:
        replay.script(Answer(content=["<th", "ink>\nThe user wants", " a number.</th", "ink>\n\n", "42"]))
        with httpx.stream(
            "POST", f"{base}/api/chat", json={"messages": [{"role": "user", "content": "n?"}]}, timeout=30
        ) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    reasoning = "".join(e["text"] for e in events if e["type"] == "reasoning")
    content = "".join(e["text"] for e in events if e["type"] == "content")
    assert (reasoning, content) == ("The user wants a number.", "42")


@pytest.mark.parametrize(
    "pieces, expected",
    [
        (["<think>a</think>b"], ("a", "b")),
        (["  <thi", "nk>a", "</thi", "nk>b"], ("a", "b")),
        (["Hello <think>"], ("", "Hello <think>")),  # only a block that opens the answer counts
        (["<think>cut off"], ("cut off", "")),
        (["<"], ("", "<")),
    ],
)
def test_think_splitter(pieces, expected):
    splitter = ThinkSplitter()
    outs = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == expected
