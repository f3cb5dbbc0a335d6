"""Chat-template capabilities, checked against every template in the pinned llama.cpp tree.

EXPECTED is the reviewed ground truth: each row was written by reading that template,
not by running ``template_capabilities``. Columns, in order:
supports_reasoning, reasoning_style, always_thinks, preserves_thinking, supports_tools,
reasoning_default, effort_off (None when left out).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gguf.templates import TemplateCapabilities, template_capabilities
from launcher.build import layout_for, load_pin
from studio.settings import Settings

C = TemplateCapabilities
PLAIN = C(False, "none", False, False, False, None)
TOOLS_ONLY = C(False, "none", False, False, True, None)

EXPECTED: dict[str, TemplateCapabilities] = {
    # History keeps Apertus-only `thoughts` content blocks, never reasoning_content: not counted.
    "Apertus-8B-Instruct.jinja": C(True, "enable_thinking", False, False, True, False),
    "Apriel-1.6-15b-Thinker-fixed.jinja": C(True, "always", True, False, True, None),
    "Bielik-11B-v3.0-Instruct.jinja": C(True, "enable_thinking", False, True, True, False),
    "ByteDance-Seed-OSS.jinja": C(True, "thinking_budget", False, True, True, None),
    # Main switch is a `reasoning` kwarg; reasoning_effort "none" also turns it off.
    "Cohere2MoE.jinja": C(True, "reasoning_effort", False, True, True, None, "none"),
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": TOOLS_ONLY,
    # reasoning_content is kept on every tool-call turn (plain replies never show it).
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": C(True, "enable_thinking", False, True, True, False),
    "GLM-4.6.jinja": C(True, "enable_thinking", False, False, True, True),
    "GLM-4.7-Flash.jinja": C(True, "enable_thinking", False, True, True, True),
    "GigaChat3-10B-A1.8B.jinja": TOOLS_ONLY,
    "GigaChat3.1-10B-A1.8B.jinja": TOOLS_ONLY,
    "HuggingFaceTB-SmolLM3-3B.jinja": C(True, "enable_thinking", False, False, False, True),
    "Kimi-K2-Instruct.jinja": TOOLS_ONLY,
    # Drops reasoning up to the first plain reply (its "last" scan keeps the first index).
    "Kimi-K2-Thinking.jinja": C(True, "none", False, False, True, None),
    "Kimi-K3.jinja": C(True, "thinking", False, True, True, None),
    "LFM2-8B-A1B.jinja": TOOLS_ONLY,
    "LFM2.5-8B-A1B.jinja": C(True, "none", False, True, True, None),
    # Only strips a leaked `...</think>` from past replies; no reasoning field or switch.
    "LFM2.5-Instruct.jinja": TOOLS_ONLY,
    "MiMo-VL.jinja": TOOLS_ONLY,
    "MiniMax-M1.jinja": TOOLS_ONLY,
    "MiniMax-M2.jinja": C(True, "always", True, False, True, None),
    "MiniMax-M3.jinja": C(True, "thinking_mode", False, True, True, None),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": TOOLS_ONLY,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": C(True, "enable_thinking", False, True, True, True),
    # `ns.enable_thinking` is set from /think and /no_think in the messages, not a kwarg.
    "NVIDIA-Nemotron-Nano-v2.jinja": C(True, "prompt_flag", False, False, True, None),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": TOOLS_ONLY,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": TOOLS_ONLY,
    # llama.cpp's copy closes the think block on `not enable_thinking`, so absent means off.
    "Qwen-QwQ-32B.jinja": C(True, "enable_thinking", False, False, True, False),
    "Qwen-Qwen2.5-7B-Instruct.jinja": TOOLS_ONLY,
    "Qwen-Qwen3-0.6B.jinja": C(True, "enable_thinking", False, False, True, True),
    "Qwen3-Coder.jinja": TOOLS_ONLY,
    "Qwen3.5-4B.jinja": C(True, "enable_thinking", False, False, True, True),
    "Reka-Edge.jinja": C(True, "enable_thinking", False, False, True, False),
    "Spark2.5.jinja": C(True, "enable_thinking", False, True, True, True),
    "StepFun3.5-Flash.jinja": C(True, "always", True, False, True, None),
    # Renders assistant tool_calls but never a `tools` list.
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": C(True, "always", True, False, True, None),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": C(True, "enable_thinking", False, False, True, False),
    "deepseek-ai-DeepSeek-V3.1.jinja": C(True, "enable_thinking", False, False, True, False),
    "deepseek-ai-DeepSeek-V3.2.jinja": C(True, "enable_thinking", False, False, True, False),
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": C(True, "enable_thinking", False, True, True, False),
    "deepseek-ai-DeepSeek-V4.jinja": C(True, "enable_thinking", False, True, True, False),
    # Tool definitions come in a `functions` string; tool calls are rendered.
    "fireworks-ai-llama-3-firefunction-v2.jinja": TOOLS_ONLY,
    "google-gemma-2-2b-it.jinja": PLAIN,
    "google-gemma-4-31B-it-interleaved.jinja": C(True, "enable_thinking", False, False, True, False),
    "google-gemma-4-31B-it.jinja": C(True, "enable_thinking", False, False, True, False),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": C(True, "thinking", False, False, True, None),
    "ibm-granite-granite-4.0.jinja": TOOLS_ONLY,
    "ibm-granite-granite-4.1.jinja": TOOLS_ONLY,
    "inclusionai-ling-3.0-flash.jinja": C(True, "enable_thinking", False, True, True, True),
    "llama-cpp-deepseek-r1.jinja": C(True, "always", True, False, True, None),
    "llama-cpp-rwkv-world.jinja": C(True, "enable_thinking", False, False, False, None),
    "llm-jp-llm-jp-4.1-8b-thinking.jinja": C(True, "reasoning_effort", True, False, True, None),
    "meetkai-functionary-medium-v3.1.jinja": TOOLS_ONLY,
    "meetkai-functionary-medium-v3.2.jinja": TOOLS_ONLY,
    "meta-llama-Llama-3.1-8B-Instruct.jinja": TOOLS_ONLY,
    "meta-llama-Llama-3.2-3B-Instruct.jinja": TOOLS_ONLY,
    "meta-llama-Llama-3.3-70B-Instruct.jinja": TOOLS_ONLY,
    "microsoft-Phi-3.5-mini-instruct.jinja": PLAIN,
    # Thinking content blocks of every turn (llama.cpp turns reasoning_content into them).
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": C(True, "none", False, True, True, None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": TOOLS_ONLY,
    "moonshotai-Kimi-K2.jinja": TOOLS_ONLY,
    # Reads reasoning_strength, which llama-server sets from reasoning_effort.
    "muse-glimmer.jinja": C(True, "reasoning_effort", True, True, True, None),
    "openai-gpt-oss-120b.jinja": C(True, "reasoning_effort", True, False, True, None),
    # Absent enable_thinking adds no think tag at all, unlike true or false.
    "openbmb-MiniCPM5-1B.jinja": C(True, "enable_thinking", False, False, True, None),
    "poolside-Laguna-S-2.1.jinja": C(True, "enable_thinking", False, True, True, True),
    "poolside-Laguna-XS-2.1.jinja": C(True, "enable_thinking", False, True, True, False),
    "poolside-Laguna-XS.2.jinja": C(True, "enable_thinking", False, True, True, False),
    # preserved_thinking is a kwarg that defaults on only when tools are given.
    # Its levels are no_think/low/high; anything else raises in the template.
    "tencent-Hy3.jinja": C(True, "reasoning_effort", False, False, True, None, "no_think"),
    "unsloth-Apriel-1.5.jinja": C(True, "always", True, False, True, None),
    "unsloth-mistral-Devstral-Small-2507.jinja": TOOLS_ONLY,
    # "low" and "minimal" both open and close an empty think block.
    "upstage-Solar-Open-100B.jinja": C(True, "reasoning_effort", False, False, True, None, "minimal"),
}


def templates_dir(settings: Settings) -> Path:
    """The pinned tree's templates; a missing tree fails the test, it never skips it."""
    path = layout_for(settings.home, load_pin()).source_dir / "models" / "templates"
    if not path.is_dir():
        pytest.fail(
            f"{path} is missing: run `make test` or `ggstudio build-llama` first to extract the pinned llama.cpp tree"
        )
    return path


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_template_matches_reviewed_table(settings: Settings, name: str):
    source = (templates_dir(settings) / name).read_text(encoding="utf-8")
    assert template_capabilities(source) == EXPECTED[name]


def test_table_covers_exactly_the_pinned_templates(settings: Settings):
    # A template added or removed by a new pin must be reviewed and written into EXPECTED.
    assert {p.name for p in templates_dir(settings).glob("*.jinja")} == set(EXPECTED)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        pytest.param(
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}",
            C(True, "enable_thinking", False, False, False, True),
            id="enable_thinking-off-only-when-false",
        ),
        pytest.param(
            "{{ enable_thinking | default(false) }}{% for m in messages %}{{ m.reasoning_content }}{% endfor %}",
            C(True, "enable_thinking", False, True, False, False),
            id="enable_thinking-default-false-keeps-history",
        ),
        pytest.param(
            "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"
            "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}",
            C(True, "enable_thinking", False, False, False, None),
            id="enable_thinking-absent-is-a-third-state",
        ),
        pytest.param(
            "{% if tools %}{{ tools | tojson }}{% endif %}Reasoning: {{ reasoning_effort }}",
            C(True, "reasoning_effort", True, False, True, None),
            id="reasoning_effort-cannot-turn-off",
        ),
        pytest.param(
            "{% if reasoning_effort == 'none' %}<think></think>{% endif %}",
            C(True, "reasoning_effort", False, False, False, None, "none"),
            id="reasoning_effort-none-turns-off",
        ),
        pytest.param(
            "{% for m in messages %}{% if loop.index0 > ns.last_user_index %}{{ m.reasoning_content }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}",
            C(True, "always", True, False, False, None),
            id="always-opens-think",
        ),
        pytest.param(
            "{% if thinking %}<think>{% endif %}",
            C(True, "thinking", False, False, False, None),
            id="thinking-kwarg",
        ),
        pytest.param(
            "{% if thinking_mode is defined and thinking_mode == 'disabled' %}</think>{% endif %}",
            C(True, "thinking_mode", False, False, False, None),
            id="thinking_mode-kwarg",
        ),
        pytest.param(
            "{% if thinking_budget == 0 %}no thinking{% endif %}",
            C(True, "thinking_budget", False, False, False, None),
            id="thinking_budget-kwarg",
        ),
        pytest.param(
            "{% set ns = namespace(enable_thinking=true) %}{% if '/no_think' in m.content %}{% endif %}<think>",
            C(True, "prompt_flag", False, False, False, None),
            id="prompt-flag-is-not-the-kwarg",
        ),
        pytest.param(
            "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
            PLAIN,
            id="plain-chat",
        ),
        pytest.param(
            "You may use tools.{% for m in messages %}{{ m.content }}{% endfor %}{# enable_thinking <think> #}",
            PLAIN,
            id="prose-and-comments-do-not-count",
        ),
    ],
)
def test_inline_templates(template: str, expected: TemplateCapabilities):
    assert template_capabilities(template) == expected


@pytest.mark.parametrize(
    "template",
    [
        pytest.param("", id="empty"),
        pytest.param(bytes(random.Random(0).randrange(256) for _ in range(65536)).decode("latin-1"), id="binary"),
        pytest.param("\ud800\x00{%\n", id="lone-surrogate-nul-unclosed-tag"),
        pytest.param("{% if enable_thinking %}<think>{% endif %}" * 200_000, id="huge"),
        pytest.param("{{" * 300_000 + "{%" * 300_000 + "{#" * 300_000, id="unclosed-delimiters"),
        pytest.param("add_generation_prompt" + ("<think>" + " " * 1000) * 1000, id="long-whitespace"),
        pytest.param("elif " + "a" * 1_000_000 + " enable_thinking" + " " * 1_000_000, id="long-words"),
    ],
)
def test_hostile_input_never_raises(template: str):
    assert isinstance(template_capabilities(template), TemplateCapabilities)


def test_empty_template_has_no_capabilities():
    assert template_capabilities("") == PLAIN


def _r1_distill_as_shipped(settings: Settings) -> str:
    """The DeepSeek-R1-Distill template as the distills' GGUFs carry it: llama.cpp's copy opens ``<think>``
    in the generation prompt, the original ends with a bare ``<｜Assistant｜>``."""
    source = templates_dir(settings) / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    fixed = "{{'<｜Assistant｜><think>\\n'}}{% if not enable_thinking %}{{- '</think>' -}}{% endif %}"
    text = source.read_text()
    assert fixed in text
    return text.replace(fixed, "{{'<｜Assistant｜>'}}")


def test_r1_distill_template_that_strips_past_thinking_is_reported_as_always_reasoning(settings: Settings):
    caps = template_capabilities(_r1_distill_as_shipped(settings))
    assert caps.supports_reasoning and caps.reasoning_style == "always" and caps.always_thinks
    assert not caps.preserves_thinking


def test_a_history_strip_with_a_keep_switch_is_not_a_reasoning_template():
    """LFM2.5-Instruct's shape: past ``...</think>`` dropped unless ``keep_past_thinking``; an instruct model."""
    src = (
        "{% for m in messages %}{% set content = m.content %}{% if not keep_past_thinking %}"
        "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{% endif %}"
        "{{ content }}{% endfor %}"
    )
    assert template_capabilities(src) == PLAIN
