"""Anthropic answers that ended at one of the request's ``stop_sequences`` say so: ``stop_reason`` "stop_sequence".

b11434 gives a stop at a stop sequence the ``stop_reason`` "end_turn", as a stop at the end of the turn
(``to_json_anthropic`` and ``to_json_anthropic_stream`` in ``tools/server/server-task.cpp`` take a word
stop and the end-of-generation token alike), though it names the sequence in ``stop_sequence``.
Anthropic's API answers "stop_sequence" then, and a client that stops the model on a marker of its own
tells the two apart by it. Only that field changes, in the whole answer and in a stream's
``message_delta``; every other byte goes on as it came.
"""

from __future__ import annotations

from typing import Any

from studio import json_codec
from studio.chat.sse import EventReshape, rewrite_data

#: In llama-server's compact JSON only when a sequence was matched (``"stop_sequence":null`` otherwise).
_MATCHED = b'"stop_sequence":"'


def _mend(fields: Any) -> bool:
    """Say "stop_sequence" where ``fields`` (an answer, or a ``message_delta``'s delta) names a matched one."""
    if isinstance(fields, dict) and fields.get("stop_sequence") and fields.get("stop_reason") == "end_turn":
        fields["stop_reason"] = "stop_sequence"
        return True
    return False


def mended_answer(content: bytes) -> bytes:
    """A whole Messages answer, its ``stop_reason`` "stop_sequence" where a stop sequence ended it."""
    if _MATCHED not in content:
        return content
    try:
        answer = json_codec.loads(content)
    except ValueError:
        return content
    return json_codec.dumps(answer) if _mend(answer) else content


class StopSequenceStream(EventReshape):
    """A ``studio.http.wire.relay.Reshape`` for a Messages stream: its ``message_delta`` mended as ``mended_answer``.

    Arrivals that are whole events without a matched sequence (all but the last, nearly always) go on as
    they are; only an event that is cut across arrivals waits for its end.
    """

    def feed(self, data: bytes) -> bytes:
        """The whole events ``data`` completes, as they came but for the ``message_delta``."""
        if not self._split.holding() and data.endswith(b"\n\n") and _MATCHED not in data:
            return data
        return super().feed(data)

    def rewrite(self, event: bytes) -> bytes:
        return rewrite_data(event, _mended_delta) if _MATCHED in event else event


def _mended_delta(payload: Any) -> bool:
    """Mend a ``message_delta`` event's delta (``_mend``); whether it did."""
    return isinstance(payload, dict) and payload.get("type") == "message_delta" and _mend(payload.get("delta"))
