"""The names of llama.cpp's built-in chat templates, which ``--chat-template`` takes beside Jinja text.

They are named after the model families whose turn format they write, so they live here with the
other architecture-aware knowledge; ``launcher.chat_templates`` decides how a name is passed.
"""

from __future__ import annotations

__all__ = ["BUILTIN_CHAT_TEMPLATES"]

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
