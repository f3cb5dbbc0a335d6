"""The indexes a Responses stream gets on its way through the studio, on b11434's own event sequence.

The events are the ones ``to_json_oaicompat_resp_stream`` (partial and final) in b11434's
``tools/server/server-task.cpp`` writes for an answer with reasoning, text and a tool call, in that
order and shape (``event:`` line, compact JSON, no indexes); the real server's stream through the
official SDK is in ``tests/test_dialects.py``.
"""

from __future__ import annotations

import json

import pytest

from studio.dialects.responses_stream import ResponsesIndexes

RS, MSG, FC = "rs_abc", "msg_def", "fc_ghi"


def _event(payload: dict) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + json.dumps(payload, separators=(",", ":")).encode()


B11434 = [
    {"type": "response.created", "response": {"id": "resp_1", "object": "response", "status": "in_progress"}},
    {"type": "response.in_progress", "response": {"id": "resp_1", "object": "response", "status": "in_progress"}},
    {
        "type": "response.output_item.added",
        "item": {"id": RS, "summary": [], "type": "reasoning", "status": "in_progress"},
    },
    {"type": "response.reasoning_text.delta", "item_id": RS, "delta": "hm"},
    {
        "type": "response.output_item.added",
        "item": {"content": [], "id": MSG, "role": "assistant", "status": "in_progress", "type": "message"},
    },
    {"type": "response.content_part.added", "item_id": MSG, "part": {"type": "output_text", "text": ""}},
    {"type": "response.output_text.delta", "item_id": MSG, "delta": "Hi"},
    {"type": "response.output_text.delta", "item_id": MSG, "delta": "!"},
    {
        "type": "response.output_item.added",
        "item": {"arguments": "", "call_id": "call_ghi", "name": "f", "type": "function_call", "id": FC},
    },
    {"type": "response.function_call_arguments.delta", "item_id": FC, "delta": "{}"},
    {"type": "response.output_item.done", "item": {"id": RS, "type": "reasoning", "summary": []}},
    {"type": "response.output_text.done", "item_id": MSG, "text": "Hi!"},
    {"type": "response.content_part.done", "item_id": MSG, "part": {"type": "output_text", "text": "Hi!"}},
    {"type": "response.output_item.done", "item": {"type": "message", "id": MSG, "role": "assistant"}},
    {"type": "response.output_item.done", "item": {"id": FC, "type": "function_call", "arguments": "{}"}},
    {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "output": []}},
]
STREAM = b"".join(_event(p) + b"\n\n" for p in B11434)


def _payloads(data: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("piece", [len(STREAM), 1, 7, 100])
def test_every_event_gets_the_indexes_openai_clients_read_however_the_bytes_arrive(piece):
    mender = ResponsesIndexes()
    out = b"".join(mender.feed(STREAM[i : i + piece]) for i in range(0, len(STREAM), piece)) + mender.finish()
    events = _payloads(out)
    assert [e["sequence_number"] for e in events] == list(range(len(B11434)))
    where = {e["type"] + ":" + (e.get("item_id") or e.get("item", {}).get("id", "")): e for e in events}
    assert "output_index" not in where["response.created:"] and "output_index" not in where["response.completed:"]
    assert where[f"response.output_item.added:{RS}"]["output_index"] == 0
    assert where[f"response.reasoning_text.delta:{RS}"] == {
        **B11434[3],
        "sequence_number": 3,
        "output_index": 0,
        "content_index": 0,
    }
    assert where[f"response.output_item.added:{MSG}"]["output_index"] == 1
    assert (
        where[f"response.content_part.added:{MSG}"]["output_index"],
        where[f"response.content_part.added:{MSG}"]["content_index"],
    ) == (1, 0)
    for kind in ("output_text.delta", "output_text.done", "content_part.done"):
        assert (where[f"response.{kind}:{MSG}"]["output_index"], where[f"response.{kind}:{MSG}"]["content_index"]) == (
            1,
            0,
        )
    assert where[f"response.function_call_arguments.delta:{FC}"]["output_index"] == 2
    assert "content_index" not in where[f"response.function_call_arguments.delta:{FC}"]
    assert [where[f"response.output_item.done:{i}"]["output_index"] for i in (RS, MSG, FC)] == [0, 1, 2]
    assert [line for line in out.split(b"\n") if line.startswith(b"event:")] == [
        line for line in STREAM.split(b"\n") if line.startswith(b"event:")
    ]


def test_what_llama_server_already_sends_and_what_is_no_response_event_pass_as_they_came():
    mender = ResponsesIndexes()
    given = (
        _event(
            {
                "type": "response.output_text.delta",
                "item_id": MSG,
                "delta": "x",
                "output_index": 5,
                "content_index": 2,
                "sequence_number": 40,
            }
        )
        + b"\n\n"
    )
    assert _payloads(mender.feed(given))[0] == json.loads(given.split(b"data: ")[1])
    for other in (b": loading SmolLM2 45%\n\n", b'data: {"error":{"message":"boom"}}\n\n', b"data: not json\n\n"):
        assert mender.feed(other) == other
    assert mender.feed(b'event: response.output_text.delta\ndata: {"type":"resp') == b""
    assert mender.close() == b'event: response.output_text.delta\ndata: {"type":"resp'  # broken off: as it came
