"""The ``openai`` client's tool API against the studio and the real llama-server with a real model.

SmolLM2-135M-Instruct's own template cannot render tools, and llama-server b11434
has no generic tool format for such templates: its autoparser builds a content-only
parser and no grammar when the template shows no tool calls
(``common/chat-auto-parser-generator.cpp``), so ``tool_choice: "required"`` changes
nothing there. SmolLM2 speaks ChatML, so it is served here with the pinned tree's
Qwen2.5 template (``<tool_call>`` JSON, native in llama-server's parser); with two
earlier calls in the conversation the 135M model writes a third, which llama-server
parses into ``tool_calls``, plain and streamed.
"""

from __future__ import annotations

import json

import openai
import pytest

import gguf
from gguf.templates import template_capabilities
from launcher.build import layout_for, load_pin
from launcher.capabilities import probe
from launcher.command import build_command
from launcher.devices import discover
from launcher.planner import ModelInfo, PlanRequest, plan
from launcher.registry import ChildRegistry
from launcher.supervisor import Supervisor, owner_token
from studio.http.app import create_app
from studio.library.default_model import ensure_default_model
from studio.load_options import OptionValues
from studio.residency.requests import LoadSettings
from studio.residency.resident import LoadedModel
from tests.helpers import assert_no_children, serving
from tests.replay_upstream import WEATHER_TOOL
from tests.standin_manager import StandInManager

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]


def past_call(city: str, id: str) -> list[dict]:
    return [
        {"role": "user", "content": city},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                }
            ],
        },
    ]


MESSAGES = [*past_call("London", "a"), *past_call("Rome", "b"), {"role": "user", "content": "Paris"}]


@pytest.fixture(scope="module")
def studio(llama_server_bin, settings, tmp_path_factory):
    """SmolLM2 under the supervisor with the Qwen2.5 template, behind the studio's real app."""
    root = tmp_path_factory.mktemp("real-tools")
    path = ensure_default_model(settings.models_dir)
    template = (
        layout_for(settings.home, load_pin()).source_dir / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    ).read_text()
    caps = probe(llama_server_bin, cache_dir=root / "cache")
    model = gguf.read(path)
    launch = plan(
        ModelInfo.from_gguf(model),
        discover(llama_server=llama_server_bin),
        caps,
        PlanRequest(n_ctx=2048, spec="off", alias="smollm2", chat_template=template),
    )
    command = build_command(launch, caps, binary=llama_server_bin, files_root=root / "run", threads=1)
    supervisor = Supervisor(logs_dir=root / "logs", registry=ChildRegistry(root / "reg", owner_token()))
    try:
        status = supervisor.start(command.launch_spec(start_timeout=120))
        loaded = LoadedModel(
            name="smollm2",
            settings=LoadSettings(path, OptionValues(n_ctx=2048, n_parallel=1)),
            url=status.url or "",
            api_key=command.api_key,
            n_ctx=launch.n_ctx,
            facts=model.facts,
            template=template_capabilities(template),
            plan=launch,
            command=command,
        )
        with serving(create_app(StandInManager(loaded))) as base:
            yield base
    finally:
        supervisor.close()
        command.cleanup()
    assert_no_children()


@pytest.fixture
def client(studio):
    with openai.OpenAI(base_url=f"{studio}/v1", api_key="unused", max_retries=0, timeout=180) as c:
        yield c


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_openai_client_gets_a_structured_call(client, choice):
    reply = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=40, temperature=0
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls"


def test_openai_client_gets_a_structured_call_streamed(client):
    stream = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        tools=[WEATHER_TOOL],
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert deltas and deltas[0].function.name == "get_weather" and deltas[0].id
    arguments = "".join(t.function.arguments or "" for t in deltas)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
