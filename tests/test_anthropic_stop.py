"""``studio.dialects.anthropic_stop``: a stop at a stop sequence says "stop_sequence", every other byte as it came.

The stream is b11434's Messages stream (``to_json_anthropic_stream``: an ``event:`` line a data), fed whole
and in pieces of every size, as arrivals cut it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from studio.dialects.anthropic_stop import StopSequenceStream, mended_answer
from studio.http.app import create_app
from tests.helpers import serving
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


class _MessagesStandIn:
    """llama-server's ``/v1/messages`` as b11434 answers one that stopped at a stop word it names: the stream (an
    ``event:`` line a data, one chunk an event) or the whole answer, with ``stop_reason`` "end_turn". A template's
    own end marker matches so too, with no ``stop_sequences`` in the request (imitated: no real model stops on a
    marker of the studio's choosing)."""

    WORD = "</answer>"

    def __enter__(self) -> str:
        events = stream("end_turn", self.WORD)
        whole = json.dumps(
            {
                "id": "m",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": "The sea"}],
                "stop_reason": "end_turn",
                "stop_sequence": self.WORD,
                "usage": {"input_tokens": 3, "output_tokens": 3},
            },
            separators=(",", ":"),
        ).encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                if not body.get("stream"):
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(whole)))
                    self.end_headers()
                    self.wfile.write(whole)
                    return
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in events:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.mark.parametrize("streamed", [True, False])
def test_only_a_stop_at_one_of_the_request_s_own_stop_sequences_says_stop_sequence(streamed):
    """A stop word the request did not ask for (a template's end marker) is the end of the turn, as b11434 says;
    such an answer, and any answer to a request without ``stop_sequences``, comes byte for byte as it was sent."""
    with _MessagesStandIn() as upstream:
        app = create_app(StandInManager(StandInModel(name="m", url=upstream)))
        with serving(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            ask = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "stream": streamed}
            plain = client.post("/v1/messages", json=ask)
            own = client.post("/v1/messages", json={**ask, "stop_sequences": [_MessagesStandIn.WORD]})
    assert plain.status_code == own.status_code == 200
    assert b'"stop_reason":"end_turn","stop_sequence":"</answer>"' in plain.content
    assert b'"stop_reason":"stop_sequence"' in own.content and b'"end_turn"' not in own.content
    if streamed:
        assert plain.content == b"".join(stream("end_turn", _MessagesStandIn.WORD))
