"""Per-request reasoning controls, spelled the way a model's chat template reads them.

Clients send OpenAI-style ``reasoning_effort`` or the common ``enable_thinking``
/ ``preserve_thinking`` flags; templates read different kwargs (see
``gguf.templates.ReasoningStyle``). This maps one to the other.
"""

from __future__ import annotations

from typing import Any

from gguf.templates import ReasoningStyle


def reasoning_template_kwargs(style: ReasoningStyle, controls: dict[str, Any]) -> dict[str, Any]:
    """Return ``chat_template_kwargs`` for ``controls`` under a template of ``style``."""
    effort = controls.get("reasoning_effort")
    on = controls.get("enable_thinking")
    if on is None and effort is not None:
        on = effort not in ("none", "minimal")
    kwargs: dict[str, Any] = {}
    if on is not None:
        if style == "enable_thinking":
            kwargs["enable_thinking"] = bool(on)
        elif style == "thinking":
            kwargs["thinking"] = bool(on)
        elif style == "thinking_mode":
            kwargs["thinking_mode"] = "enabled" if on else "disabled"
        elif style == "thinking_budget" and not on:
            kwargs["thinking_budget"] = 0
    if style == "reasoning_effort" and effort is not None:
        kwargs["reasoning_effort"] = effort
    if "preserve_thinking" in controls:
        kwargs["preserve_thinking"] = bool(controls["preserve_thinking"])
    return kwargs
