"""``studio.dialects.anthropic_stop``: a stop at a stop sequence says "stop_sequence", every other byte as it came.

The stream is b11434's Messages stream (``to_json_anthropic_stream``: an ``event:`` line a data), fed whole
and in pieces of every size, as arrivals cut it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from studio.dialects.anthropic_stop import StopSequenceStream, mended_answer
from studio.http.app import create_app
from tests.helpers import serving
from tests.replay_upstream import Answer
from tests.standin_manager import StandInManager, StandInModel


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def stream(stop_reason: str, stop_sequence: str | None) -> list[bytes]:
    delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    return [
        _event("message_start", {"type": "message_start", "message": {"id": "m", "content": [], "role": "assistant"}}),
        _event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}),
        _event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"text": "The sea"}}),
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event("message_delta", {"type": "message_delta", "delta": delta, "usage": {"output_tokens": 3}}),
        _event("message_stop", {"type": "message_stop"}),
    ]


def relayed(events: list[bytes], size: int | None) -> bytes:
    reshape = StopSequenceStream()
    whole = b"".join(events)
    pieces = events if size is None else [whole[i : i + size] for i in range(0, len(whole), size)]
    return b"".join(reshape.feed(piece) for piece in pieces) + reshape.finish()


@pytest.mark.parametrize("size", [None, 1, 7, 100])
def test_a_stop_at_a_stop_sequence_says_stop_sequence_in_the_stream(size):
    sent = stream("end_turn", "</answer>")
    got = relayed(sent, size)
    assert got == b"".join(sent).replace(b'"stop_reason":"end_turn"', b'"stop_reason":"stop_sequence"')


@pytest.mark.parametrize("size", [None, 1, 7, 100])
@pytest.mark.parametrize(("reason", "sequence"), [("end_turn", None), ("max_tokens", None), ("tool_use", None)])
def test_other_stops_pass_byte_for_byte(size, reason, sequence):
    sent = stream(reason, sequence)
    assert relayed(sent, size) == b"".join(sent)


def test_whole_events_go_on_as_they_arrive_and_a_cut_one_waits_for_its_end():
    reshape = StopSequenceStream()
    first, second = stream("end_turn", None)[:2]
    assert reshape.feed(first) == first  # no wait for anything after it
    assert reshape.feed(second[:10]) == b""
    assert reshape.feed(second[10:]) == second


def test_a_broken_off_stream_gives_back_what_it_held():
    reshape = StopSequenceStream()
    assert reshape.feed(b"event: message_delta\ndata: {") == b""
    assert reshape.close() == b"event: message_delta\ndata: {"


def test_a_whole_answer_ended_by_a_stop_sequence_says_so_and_others_are_untouched():
    answer = {"type": "message", "content": [{"type": "text", "text": "x"}], "stop_reason": "end_turn"}
    matched = json.dumps({**answer, "stop_sequence": "END"}, separators=(",", ":")).encode()
    assert json.loads(mended_answer(matched))["stop_reason"] == "stop_sequence"
    for untouched in (
        json.dumps({**answer, "stop_sequence": None}, separators=(",", ":")).encode(),
        json.dumps({**answer, "stop_reason": "max_tokens", "stop_sequence": None}, separators=(",", ":")).encode(),
        b'{"stop_sequence":"broken',
    ):
        assert mended_answer(untouched) == untouched


#: The stop word b11434 names in ``stop_sequence`` when a stream stops at it.
WORD = "</answer>"


def stopped_at_a_word() -> Answer:
    """llama-server's ``/v1/messages`` answer to a request that stopped at a stop word it names: the stream (an
    ``event:`` line a data, one chunk an event) or the whole answer, with ``stop_reason`` "end_turn". A template's
    own end marker matches so too, with no ``stop_sequences`` in the request (imitated: no real model stops on a
    marker of the studio's choosing)."""
    whole = {
        "id": "m",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "The sea"}],
        "stop_reason": "end_turn",
        "stop_sequence": WORD,
        "usage": {"input_tokens": 3, "output_tokens": 3},
    }
    return Answer(events=stream("end_turn", WORD), whole=json.dumps(whole, separators=(",", ":")).encode())


@pytest.mark.parametrize("streamed", [True, False])
def test_only_a_stop_at_one_of_the_request_s_own_stop_sequences_says_stop_sequence(replay, streamed):
    """A stop word the request did not ask for (a template's end marker) is the end of the turn, as b11434 says;
    such an answer, and any answer to a request without ``stop_sequences``, comes byte for byte as it was sent."""
    replay.script(stopped_at_a_word(), stopped_at_a_word())
    app = create_app(StandInManager(StandInModel(name="m", url=replay.url)))
    with serving(app) as base, httpx.Client(base_url=base, timeout=30) as client:
        ask = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "stream": streamed}
        plain = client.post("/v1/messages", json=ask)
        own = client.post("/v1/messages", json={**ask, "stop_sequences": [WORD]})
    assert plain.status_code == own.status_code == 200
    assert b'"stop_reason":"end_turn","stop_sequence":"</answer>"' in plain.content
    assert b'"stop_reason":"stop_sequence"' in own.content and b'"end_turn"' not in own.content
    if streamed:
        assert plain.content == b"".join(stream("end_turn", WORD))
