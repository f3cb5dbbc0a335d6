"""A chat template override: one of llama.cpp's built-in templates by name, or Jinja text.

``--chat-template`` takes either. llama-server renders a built-in name only on its legacy
(non-Jinja) path: with ``--jinja`` (its default) every name but ``chatml`` would be read as a
Jinja template whose whole text is the name, and every prompt would become that word. So the
command builder passes a name with ``--no-jinja`` (``chatml`` keeps Jinja: llama.cpp swaps in
its own ChatML source), and text without a single Jinja tag that is no built-in name is refused
before anything starts.
"""

from __future__ import annotations

__all__ = ["BUILTIN_CHAT_TEMPLATES", "check_chat_template", "is_builtin_template", "renders_with_jinja"]

#: The names of the pinned llama.cpp's (b11434) built-in templates: ``LLM_CHAT_TEMPLATES`` in
#: ``src/llama-chat.cpp``, which ``--help`` lists under ``--chat-template``.
BUILTIN_CHAT_TEMPLATES = frozenset(
    {
        "bailing",
        "bailing-think",
        "bailing2",
        "chatglm3",
        "chatglm4",
        "chatml",
        "command-r",
        "deepseek",
        "deepseek-ocr",
        "deepseek2",
        "deepseek3",
        "exaone-moe",
        "exaone3",
        "exaone4",
        "falcon3",
        "gemma",
        "gigachat",
        "glmedge",
        "gpt-oss",
        "granite",
        "granite-4.0",
        "granite-4.1",
        "grok-2",
        "hunyuan-dense",
        "hunyuan-moe",
        "hunyuan-vl",
        "kimi-k2",
        "llama2",
        "llama2-sys",
        "llama2-sys-bos",
        "llama2-sys-strip",
        "llama3",
        "llama4",
        "megrez",
        "minicpm",
        "mistral-v1",
        "mistral-v3",
        "mistral-v3-tekken",
        "mistral-v7",
        "mistral-v7-tekken",
        "monarch",
        "openchat",
        "orion",
        "pangu-embedded",
        "phi3",
        "phi4",
        "rwkv-world",
        "seed_oss",
        "smolvlm",
        "solar-open",
        "vicuna",
        "vicuna-orca",
        "yandex",
        "zephyr",
    }
)


def is_builtin_template(template: str) -> bool:
    """Whether ``template`` names one of llama.cpp's built-in templates rather than being Jinja text."""
    return template in BUILTIN_CHAT_TEMPLATES


def renders_with_jinja(template: str | None) -> bool:
    """Whether llama-server must run with ``--jinja`` to render ``template`` (None: the model's own)."""
    return template is None or template == "chatml" or not is_builtin_template(template)


def check_chat_template(template: str) -> str | None:
    """What is wrong with ``template`` as an override, or None when llama-server can take it."""
    if is_builtin_template(template) or "{{" in template or "{%" in template:
        return None
    shown = template if len(template) <= 40 else template[:37] + "..."
    return (
        f"the chat template {shown!r} is neither Jinja text nor one of llama.cpp's built-in templates "
        f"({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})"
    )
