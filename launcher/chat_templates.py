"""A chat template override: one of llama.cpp's built-in templates by name, or Jinja text.

``--chat-template`` takes either. llama-server renders a built-in name only on its legacy
(non-Jinja) path: with ``--jinja`` (its default) every name but ``chatml`` would be read as a
Jinja template whose whole text is the name, and every prompt would become that word. So the
command builder passes a name with ``--no-jinja`` (``chatml`` keeps Jinja: llama.cpp swaps in
its own ChatML source), and text without a single Jinja tag that is no built-in name is refused
before anything starts.
"""

from __future__ import annotations

from gguf.template_names import BUILTIN_CHAT_TEMPLATES

__all__ = ["BUILTIN_CHAT_TEMPLATES", "check_chat_template", "is_builtin_template", "renders_with_jinja", "uses_jinja"]


def is_builtin_template(template: str) -> bool:
    """Whether ``template`` names one of llama.cpp's built-in templates rather than being Jinja text."""
    return template in BUILTIN_CHAT_TEMPLATES


def renders_with_jinja(template: str | None) -> bool:
    """Whether llama-server must run with ``--jinja`` to render ``template`` (None: the model's own)."""
    return template is None or template == "chatml" or not is_builtin_template(template)


def uses_jinja(template: str | None, jinja: bool | None) -> bool:
    """Whether llama-server runs with ``--jinja``: as the load's ``jinja`` says, else as ``template`` needs."""
    return jinja if jinja is not None else renders_with_jinja(template)


def check_chat_template(template: str) -> str | None:
    """What is wrong with ``template`` as an override, or None when llama-server can take it."""
    if is_builtin_template(template) or "{{" in template or "{%" in template:
        return None
    shown = template if len(template) <= 40 else template[:37] + "..."
    return (
        f"the chat template {shown!r} is neither Jinja text nor one of llama.cpp's built-in templates "
        f"({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})"
    )
