"""Anthropic and Responses bodies rendered as llama-server renders them, so a saved slot is found for them.

The shapes follow b11434's ``server_chat_convert_anthropic_to_oai`` and
``server_chat_convert_responses_to_chatcmpl`` (``tools/server/server-chat.cpp``).
"""

from __future__ import annotations

from studio.dialects.chat_shape import chat_body


def test_an_anthropic_conversation_with_a_tool_call_becomes_the_chat_llama_server_templates():
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"unit": "C", "city": "Oslo"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4 degrees"}]},
        ],
        "tools": [{"name": "weather", "description": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
    }
    chat = chat_body("/v1/messages", body)
    assert chat is not None
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Looking."}],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Oslo","unit":"C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "4 degrees"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "weather", "description": "w", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == "required"


def test_a_responses_input_with_a_function_call_merges_into_the_assistant_turn():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "4 degrees"},
        ],
        "tools": [{"type": "function", "name": "weather", "parameters": {}}, {"type": "web_search"}],
    }
    chat = chat_body("/v1/responses", body)
    assert chat is not None
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"text": "Weather?", "type": "text"}]},
        {
            "role": "assistant",
            "content": [{"text": "Looking.", "type": "text"}],
            "tool_calls": [{"function": {"arguments": "{}", "name": "weather"}, "id": "c1", "type": "function"}],
        },
        {"content": "4 degrees", "role": "tool", "tool_call_id": "c1"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"strict": True, "name": "weather", "parameters": {}}}]


def test_a_body_with_parts_it_does_not_render_looks_for_no_slot():
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    assert chat_body("/v1/messages", {"messages": [{"role": "user", "content": [image]}]}) is None
    assert chat_body("/v1/responses", {"input": [{"type": "reasoning", "summary": []}]}) is None
    assert chat_body("/v1/messages", {"messages": "not a list"}) is None
    assert chat_body("/v1/completions", {"prompt": "x"}) is None
