"""Whether a model starts with thinking on or off, as its chat template's switch is passed at load.

llama-server hands every template its own ``enable_thinking`` unless told otherwise, so the
command builder passes one (``--chat-template-kwargs``). By default it is the template's own
default. Some architectures' small models start with thinking off instead
(``gguf.arch_traits.ArchTraits.thinking_from_params``: Qwen3.5/3.6 under 9B, as the reference
backend has it), decided by the parameter count read from the GGUF, never by the file's name.
A model's config (``thinking = true|false``) sets it either way. A request still decides for
itself: llama-server lays a request's ``chat_template_kwargs`` over the server's, and the studio
spells a request's ``enable_thinking`` / ``reasoning_effort`` in them (``studio.chat.reasoning``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf.facts import ModelFacts
from gguf.templates import ReasoningStyle, TemplateCapabilities, template_capabilities
from launcher.chat_templates import is_builtin_template


@dataclass(frozen=True)
class LoadThinking:
    """The thinking switch a load passes, and why."""

    on: bool | None  # None: the template's own default (or the template has no switch)
    reason: str | None = None


def switch_kwargs(style: ReasoningStyle, on: bool) -> dict[str, Any]:
    """The template kwargs that turn thinking ``on`` or off for a template read as ``style`` ({} for none)."""
    if style == "enable_thinking":
        return {"enable_thinking": on}
    if style == "thinking":
        return {"thinking": on}
    if style == "thinking_mode":
        return {"thinking_mode": "enabled" if on else "disabled"}
    return {}


def template_of(template: str | None) -> TemplateCapabilities | None:
    """What ``template`` (Jinja text) can do; None for no template or a llama.cpp built-in's name."""
    return None if not template or is_builtin_template(template) else template_capabilities(template)


def load_thinking(facts: ModelFacts, template: str | None, asked: bool | None) -> LoadThinking:
    """How the model of ``facts`` starts under ``template``: as ``asked`` (its config), else by its size."""
    found = template_of(template)
    has_switch = found is not None and bool(switch_kwargs(found.reasoning_style, True))
    if asked is not None:
        state = "on" if asked else "off"
        if not has_switch:
            return LoadThinking(None, f"thinking = {str(asked).lower()} ignored: the chat template has no switch")
        return LoadThinking(asked, f"thinking {state} at load, as the model's config says (a request may still ask)")
    line = facts.traits.thinking_from_params
    if found is None or not has_switch or not line or facts.parameter_count >= line or found.reasoning_default is False:
        return LoadThinking(None)  # the template's own default: nothing to change, nothing to say
    return LoadThinking(
        False,
        f"thinking off at load: a {facts.architecture} model of {facts.parameter_count / 1e9:.1f}B parameters, "
        "where the reference backend starts thinking only from the 9B size; thinking = true in the model's "
        "config, or enable_thinking: true in a request, turns it on",
    )
