"""What a GGUF chat template can do, read statically from its Jinja source.

The studio needs to know, before it sends a request, whether a model's template
has a thinking section, how a caller switches it, and whether it renders tools.
The template is never executed: it is untrusted text from a model file, and the
answers below come from the markers and variables that templates use for these
features (the same kind of markers llama.cpp keys its own chat handling on).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

ReasoningStyle = Literal[
    "none",  # no switch: no reasoning, or the model decides on its own
    "enable_thinking",  # boolean `enable_thinking` kwarg (llama-server always passes it)
    "reasoning_effort",  # `reasoning_effort` level (llama-server also sets `reasoning_strength`)
    "thinking",  # boolean `thinking` kwarg, passed via chat_template_kwargs
    "thinking_mode",  # "enabled" / "disabled" / "adaptive" `thinking_mode` kwarg
    "thinking_budget",  # token budget `thinking_budget` kwarg; 0 turns thinking off
    "prompt_flag",  # `/think` or `/no_think` written into a system or user message
    "always",  # the template always starts or demands reasoning; no way to stop it
]


@dataclass(frozen=True)
class TemplateCapabilities:
    """Static answers about one chat template.

    ``always_thinks`` means no switch turns reasoning off: the template forces it (style
    "always") or offers only an effort scale without an "off" level (gpt-oss low/medium/high).
    ``preserves_thinking`` means reasoning attached to assistant turns before the latest
    user message is still rendered, with llama-server's preserve switches on (its default).
    ``reasoning_default`` is what an absent ``enable_thinking`` behaves like: True or False,
    or None when the template does not read it or treats "absent" as a third state.
    ``effort_off`` is the ``reasoning_effort`` level that switches reasoning off, in the
    template's own words ("none", "no_think", "minimal"), when it has one.
    """

    supports_reasoning: bool
    reasoning_style: ReasoningStyle
    always_thinks: bool
    preserves_thinking: bool
    supports_tools: bool
    reasoning_default: bool | None
    effort_off: str | None = None


# Reading a kwarg, not a namespace attribute (`ns.enable_thinking`) or an assignment to one.
_ENABLE_THINKING = re.compile(r"(?<![\w.])enable_thinking\b(?!\s*=(?!=))")
_EFFORT = re.compile(r"(?<![\w.])reasoning_(?:effort|strength)\b(?!\s*=(?!=))")
_THINKING_KWARG = re.compile(r"\b(?:el)?if\s+thinking\b(?!\s*[.(=])")
_THINKING_MODE = re.compile(r"\bthinking_mode\s+is\s+(?:not\s+)?defined")
_THINKING_BUDGET = re.compile(r"\bthinking_budget\b")
_PROMPT_FLAG = re.compile(r"/no_?think\b")
# An effort level that switches reasoning off (otherwise effort only tunes how long it runs), most explicit first.
_EFFORT_OFF_LEVELS = ("none", "no_think", "minimal")
_EFFORT_OFF = re.compile(r"""['"](none|no_think|minimal)['"]""")
# DeepSeek-R1 and its distills: every past reply loses everything up to `</think>`, with no switch to keep
# it, because the model opens every answer with its thinking (the template itself never mentions it).
_STRIPS_PAST_THINK = re.compile(r"""\.split\(\s*['"]</think>['"]\s*\)\s*\[\s*-1\s*\]""")
_KEEP_THINK_SWITCH = re.compile(r"\b(?:keep|preserve)_\w*think")

# Where a template reads reasoning: the OpenAI-style field, vendor fields, thinking blocks.
_REASONING_FIELD = re.compile(
    r"reasoning_content|\.(?:thinking|reasoning)\b|\[\s*['\"](?:thinking|reasoning)['\"]\s*\]"
)
_OPEN_THINK = re.compile(r"<think>(?!(?:\s|\\n)*</think>)")
# Apriel's templates always ask for reasoning ahead of this answer marker.
_APRIEL = re.compile(r"\[BEGIN FINAL RESPONSE\]")

# Reasoning shown only after the last user turn (or only on the final message).
_CURRENT_TURN_ONLY = re.compile(
    r"\blast_(?:user|query|non_tool_call)|and\s+loop\.last\b|loop\.last\s+and\s+not\s+add_generation_prompt"
)
# The switches llama-server sets to keep history reasoning, or a hard-wired "keep it".
_PRESERVE_SWITCH = re.compile(r"\b(?:preserve|clear|truncate_history|drop)_thinking\b")
_PRESERVED_CONST = re.compile(r"set\s+preserved_thinking\s*=\s*true\b")
_PRESERVED_KWARG = re.compile(r"preserved_thinking\s+is\s+defined")

_TOOLS = re.compile(r"\btool_calls\b|\btools\b")

# How an absent `enable_thinking` resolves, most explicit first.
_DEFAULT_RULES = (
    re.compile(r"enable_thinking\s*\|\s*default\(\s*(\w+)"),
    re.compile(r"enable_thinking\s+if\s+enable_thinking\s+is\s+defined\s+else\s+(\w+)"),
    re.compile(r"(?:enable_thinking|elif\s+\w+)\s+is\s+not\s+defined\s*-?%\}\s*\{%-?\s*set\s+\w+\s*=\s*['\"]?(\w+)"),
)
_ON_WHEN_DEFINED = re.compile(
    r"enable_thinking\s+is\s+defined\s+and\s+enable_thinking\b(?!\s+is\s+false)|enable_thinking\s+is\s+true"
)
_OFF_WHEN_DEFINED = re.compile(
    r"enable_thinking\s+is\s+false|enable_thinking\s+is\s+defined\s+and\s+not\s+enable_thinking"
)


def template_capabilities(template: str) -> TemplateCapabilities:
    """Classify a chat template; any text is accepted and nothing is executed."""
    src = "".join(_outside(template, "{#", "#}"))
    style = _style(src)
    reasoning = style != "none" or bool(_REASONING_FIELD.search(src))
    offs = set(_EFFORT_OFF.findall(src)) if style == "reasoning_effort" else set()
    return TemplateCapabilities(
        supports_reasoning=reasoning,
        reasoning_style=style,
        always_thinks=style == "always" or (style == "reasoning_effort" and not offs),
        preserves_thinking=_preserves(src),
        supports_tools=any(_TOOLS.search(code) for code in _code(src)),
        reasoning_default=_default(src) if style == "enable_thinking" else None,
        effort_off=next((level for level in _EFFORT_OFF_LEVELS if level in offs), None),
    )


def _style(src: str) -> ReasoningStyle:
    """The switch a caller uses; the kwarg llama-server fills in wins over vendor ones."""
    if _ENABLE_THINKING.search(src):
        return "enable_thinking"
    if _EFFORT.search(src):
        return "reasoning_effort"
    if _THINKING_KWARG.search(src):
        return "thinking"
    if _THINKING_MODE.search(src):
        return "thinking_mode"
    if _THINKING_BUDGET.search(src):
        return "thinking_budget"
    if _PROMPT_FLAG.search(src):
        return "prompt_flag"
    # No switch: forced when the generation prompt (the template's tail) opens a think block.
    tail = src[src.rfind("add_generation_prompt") :] if "add_generation_prompt" in src else ""
    if _OPEN_THINK.search(tail) or _APRIEL.search(src):
        return "always"
    if _STRIPS_PAST_THINK.search(src) and not _KEEP_THINK_SWITCH.search(src):
        return "always"
    return "none"


def _preserves(src: str) -> bool:
    """History reasoning survives unless the template keeps only the current turn's."""
    if not _REASONING_FIELD.search(src):
        return False
    if _PRESERVE_SWITCH.search(src):
        return True
    if _PRESERVED_CONST.search(src) and not _PRESERVED_KWARG.search(src):
        return True
    return not _CURRENT_TURN_ONLY.search(src)


def _default(src: str) -> bool | None:
    """An explicit fallback wins; else which explicit tests exist (undefined is falsy)."""
    for rule in _DEFAULT_RULES:
        if match := rule.search(src):
            return match.group(1).lower() in ("true", "on")
    on, off = bool(_ON_WHEN_DEFINED.search(src)), bool(_OFF_WHEN_DEFINED.search(src))
    if on and off:
        return None
    return off


def _code(src: str) -> Iterator[str]:
    """Jinja statements and expressions, so prose in the prompt text does not count."""
    for opener, closer in (("{%", "%}"), ("{{", "}}")):
        yield from _inside(src, opener, closer)


def _outside(text: str, opener: str, closer: str) -> Iterator[str]:
    """Text between delimited spans, scanned with str.find to stay linear on hostile input."""
    pos = 0
    while (start := text.find(opener, pos)) != -1:
        yield text[pos:start]
        end = text.find(closer, start + len(opener))
        if end == -1:
            return
        pos = end + len(closer)
    yield text[pos:]


def _inside(text: str, opener: str, closer: str) -> Iterator[str]:
    """The delimited spans themselves; an unclosed span runs to the end."""
    pos = 0
    while (start := text.find(opener, pos)) != -1:
        end = text.find(closer, start + len(opener))
        if end == -1:
            yield text[start:]
            return
        yield text[start:end]
        pos = end + len(closer)
