"""Captures on demand: the bodies of a model's failed requests (``failed``), or of all its requests (``all``).

Off by default: a record holds no prompt text. A capture is switched on for every model (``default``) or
per model, and keeps the request's body as it came and the answer's bytes the studio saw: a whole answer,
or a stream's last bytes (the relay keeps only those; its error event when it failed). Each body is cut at
``MAX_BODY`` bytes, and all captures together are bounded by the retention's ``capture_bytes``: the oldest
go first (``studio.activity.store.prune``). They are kept beside the records, in the history database
(``activity_captures``), and deleted with them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from studio.activity.store import Capture
from studio.activity.trace import RequestTrace

#: What a capture keeps: nothing, the failed requests' bodies, or every request's.
Mode = Literal["off", "failed", "all"]
#: Bytes of one body kept at most (a longer one is cut, and says so).
MAX_BODY = 256 << 10
_CUT = b"\n[cut by the capture at 256 KiB]"


@dataclass
class CaptureSwitch:
    """The capture modes now: ``default`` for every model, ``models`` for the ones set apart."""

    default: Mode = "off"
    models: dict[str, Mode] = field(default_factory=dict)

    def mode(self, model: str | None) -> Mode:
        return self.models.get(model, self.default) if model is not None else self.default

    def wants(self, model: str | None) -> bool:
        """Whether a request for ``model`` should keep its body until it ends (it may be captured)."""
        return (self.default != "off" or bool(self.models)) and self.mode(model) != "off"

    def take(self, trace: RequestTrace) -> Capture | None:
        """The capture of a request that just ended, if its model's mode keeps it; its body let go either way."""
        body, trace.request_body = trace.request_body, None
        if body is None:
            return None
        mode = self.mode(trace.model) if trace.model in self.models else self.mode(trace.asked)
        if mode == "off" or (mode == "failed" and trace.outcome != "error"):
            return None
        answer = trace.tail
        if not answer and trace.error is not None:
            answer = trace.error["message"].encode()
        kept = Capture(trace.id, trace.model or trace.asked, time.time(), _cut(body), _cut(answer))
        trace.captured = len(kept.request) + len(kept.answer)
        return kept

    def to_json(self) -> dict[str, Any]:
        return {"default": self.default, "models": dict(self.models), "max_body": MAX_BODY}


def _cut(data: bytes) -> bytes:
    return data if len(data) <= MAX_BODY else data[:MAX_BODY] + _CUT
