"""An Anthropic Messages or OpenAI Responses body as the chat-completions body llama-server templates.

llama-server b11434 turns both into a chat-completions body before it renders the prompt
(``server_chat_convert_anthropic_to_oai`` and ``server_chat_convert_responses_to_chatcmpl`` in
``tools/server/server-chat.cpp``). The studio needs the same rendering for one thing: to find the
saved slot a conversation continues (``studio.residency.slot_cache`` renders ``messages`` through
``/apply-template``). So only what reaches the template is converted: messages, tools, tool choice.

A part this does not convert (images, files, anything unknown) gives ``None``: no slot is looked
for, and the request runs as it would have. A conversion that differs from llama-server's only
shortens the shared prefix, and a restored slot only ever serves its matching prefix, so a
mismatch costs speed, never a wrong answer. Pure functions, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class _Unconvertible(Exception):
    """A part of the body this module does not render; no slot is looked for."""


def chat_body(upstream: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chat-completions fields that a request to ``upstream`` renders from, or ``None``."""
    try:
        if upstream == "/v1/messages":
            return _from_anthropic(body)
        if upstream == "/v1/responses":
            return _from_responses(body)
    except (_Unconvertible, TypeError, KeyError, AttributeError):
        return None
    return None


def _dumped(value: Any) -> str:
    """JSON as llama-server's nlohmann::json ``dump()`` writes it: keys sorted, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _text_blocks(blocks: list[Any]) -> str:
    if any(b.get("type") != "text" for b in blocks):
        raise _Unconvertible("a block that is not text")
    return "".join(b.get("text", "") for b in blocks)


def _from_anthropic(body: Mapping[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list):
        messages.append(
            {"role": "system", "content": "".join(b.get("text", "") for b in system if b.get("type") == "text")}
        )
    for msg in body["messages"]:
        content = msg.get("content")
        if not isinstance(content, list):
            if content is not None or msg.get("role") != "assistant":
                messages.append(dict(msg))
            continue
        text: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        reasoning = ""
        for block in content:
            kind = block.get("type")
            if kind == "text":
                text.append(block)
            elif kind == "thinking":
                reasoning += block.get("thinking", "")
            elif kind == "tool_use":
                function = {"name": block.get("name", ""), "arguments": _dumped(block.get("input", {}))}
                calls.append({"id": block.get("id", ""), "type": "function", "function": function})
            elif kind == "tool_result":
                result = block.get("content")
                output = result if isinstance(result, str) else _text_blocks(result) if isinstance(result, list) else ""
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": output})
            else:
                raise _Unconvertible(f"a {kind} block")
        if text or calls or reasoning:
            converted: dict[str, Any] = {"role": msg.get("role"), "content": text or ""}
            if calls:
                converted["tool_calls"] = calls
            if reasoning:
                converted["reasoning_content"] = reasoning
            messages.append(converted)
        messages += results
    out: dict[str, Any] = {"messages": messages}
    if isinstance(body.get("tools"), list):
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name", ""),
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
            for t in body["tools"]
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") in ("auto", "any", "tool"):
        out["tool_choice"] = "auto" if choice["type"] == "auto" else "required"
    if "chat_template_kwargs" in body:
        out["chat_template_kwargs"] = body["chat_template_kwargs"]
    return out


def _from_responses(body: Mapping[str, Any]) -> dict[str, Any]:
    if body.get("previous_response_id"):
        raise _Unconvertible("previous_response_id")  # llama-server refuses it anyway
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": body.get("instructions") or ""})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        items = []
    for item in items:
        after_assistant = bool(messages) and messages[-1].get("role") == "assistant"
        role, kind, content = item.get("role"), item.get("type"), item.get("content")
        if isinstance(content, str):
            content = [{"type": "input_text" if role != "assistant" else "output_text", "text": content}]
        if role in ("user", "system", "developer") and isinstance(content, list):
            if any(c.get("type") != "input_text" for c in content):
                raise _Unconvertible("an input part that is not text")
            parts = [{"text": c["text"], "type": "text"} for c in content]
            messages.append({**_without(item, "type", "status"), "content": parts})
        elif role == "assistant" and kind == "message":
            if any(c.get("type") not in ("output_text", "input_text") for c in content or []):
                raise _Unconvertible("an output part that is not text")
            parts = [{"text": c["text"], "type": "text"} for c in content or []]
            if after_assistant:
                previous = messages[-1]
                if not isinstance(previous.get("content"), list):
                    previous["content"] = []
                previous["content"] += parts
            else:
                messages.append({**_without(item, "type", "status"), "content": parts})
        elif kind == "function_call":
            call = {
                "function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"],
                "type": "function",
            }
            if after_assistant:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("output"), str):
            messages.append({"content": item["output"], "role": "tool", "tool_call_id": item["call_id"]})
        else:
            raise _Unconvertible(f"an input item of type {kind}")
    out: dict[str, Any] = {"messages": messages}
    given = body.get("tools") or []
    if tools := [
        {"type": "function", "function": {"strict": True, **_without(t, "type")}}
        for t in given
        if t.get("type") == "function"
    ]:
        out["tools"] = tools  # llama-server skips the other kinds of tool
    for key in ("tool_choice", "chat_template_kwargs"):
        if key in body:
            out[key] = body[key]
    return out


def _without(item: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in keys}
