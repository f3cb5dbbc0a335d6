"""Per-request reasoning controls, spelled the way a model's chat template reads them.

Clients send OpenAI-style ``reasoning_effort`` or the common ``enable_thinking``
/ ``preserve_thinking`` flags; templates read different kwargs (see
``gguf.templates.ReasoningStyle``), or a ``/think`` / ``/no_think`` flag written into
the conversation. ``reasoning_request`` maps one to the other.

A template that reads ``reasoning_effort`` gets ``enable_thinking: false`` as its
own "off" level (``TemplateCapabilities.effort_off``), or its lowest, "low", when
it has none (gpt-oss cannot stop thinking); ``enable_thinking: true`` leaves its
default, which thinks. Asking a prompt-flag template for a switch appends the flag
to the last user message, where such templates look for it (the last flag wins).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gguf.templates import TemplateCapabilities
from launcher.thinking import switch_kwargs

THINK, NO_THINK = "/think", "/no_think"


@dataclass(frozen=True)
class ReasoningRequest:
    """What a request must carry for its reasoning controls under one template."""

    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None  # the request's top-level field (llama-server reads it too)
    prompt_flag: str | None = None  # THINK or NO_THINK, for the last user message


def reasoning_request(template: TemplateCapabilities | None, controls: dict[str, Any]) -> ReasoningRequest:
    """The kwargs, effort and prompt flag that carry ``controls`` to a template like ``template``."""
    style = template.reasoning_style if template else "none"
    effort = controls.get("reasoning_effort")
    on = controls.get("enable_thinking")
    if on is None and effort is not None:
        on = effort not in ("none", "minimal")
    kwargs: dict[str, Any] = {}
    flag = None
    if on is not None:
        kwargs.update(switch_kwargs(style, bool(on)))  # the same switch a load passes (launcher.thinking)
        if style == "thinking_budget" and not on:
            kwargs["thinking_budget"] = 0
        elif style == "prompt_flag":
            flag = THINK if on else NO_THINK
    if style == "reasoning_effort" and effort is None and on is False:
        effort = (template.effort_off if template else None) or "low"
    if style == "reasoning_effort" and effort is not None:
        kwargs["reasoning_effort"] = effort
    if "preserve_thinking" in controls:
        kwargs["preserve_thinking"] = bool(controls["preserve_thinking"])
    return ReasoningRequest(kwargs, effort, flag)


def with_prompt_flag(messages: list[Any], flag: str) -> list[Any]:
    """``messages`` with ``flag`` appended to the last user message (a copy; the caller's list is untouched)."""
    out = list(messages)
    for i in range(len(out) - 1, -1, -1):
        message = out[i]
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            out[i] = {**message, "content": f"{content.rstrip()} {flag}" if content.strip() else flag}
        elif isinstance(content, list):
            out[i] = {**message, "content": [*content, {"type": "text", "text": flag}]}
        break
    return out
