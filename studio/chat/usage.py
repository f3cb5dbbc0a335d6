"""Usage and timings of a chat: llama-server's per-call figures, summed over every model call of a tool loop.

The final ``done`` event of ``/api/chat`` carries them, with tokens/s and the
speculative acceptance rate computed from the sums (not averaged per call).
"""

from __future__ import annotations

from typing import Any

_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
#: Timings that add up across calls; the rates are recomputed from them.
_TIMINGS = ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")


class UsageTotals:
    """Running sums of ``usage`` and ``timings`` over a chat's model calls."""

    def __init__(self) -> None:
        self.usage: dict[str, int] | None = None
        self.timings: dict[str, float] | None = None
        self.calls = 0
        self._only: dict[str, Any] | None = None  # one call's timings as llama-server gave them

    def add(self, usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> None:
        """Add one call's figures (either may be missing)."""
        self.calls += 1
        if isinstance(usage, dict):
            self.usage = self.usage or dict.fromkeys(_USAGE, 0)
            for key in _USAGE:
                self.usage[key] += int(usage.get(key) or 0)
        if isinstance(timings, dict):
            self._only = dict(timings) if self.timings is None else None
            self.timings = self.timings or {}
            for key in _TIMINGS:
                if key in timings:
                    self.timings[key] = self.timings.get(key, 0) + timings[key]
            for rate, n, ms in (
                ("prompt_per_second", "prompt_n", "prompt_ms"),
                ("predicted_per_second", "predicted_n", "predicted_ms"),
            ):
                if self.timings.get(ms):
                    self.timings[rate] = self.timings.get(n, 0) / self.timings[ms] * 1000.0

    def done(self, finish_reason: str | None, **extra: Any) -> dict[str, Any]:
        """The ``done`` event: summed usage and timings, tokens/s, draft acceptance, and ``extra``."""
        t = self._only or self.timings or {}
        drafted = t.get("draft_n") or 0
        return {
            "type": "done",
            "finish_reason": finish_reason,
            "usage": self.usage,
            "timings": self._only or self.timings,
            "tokens_per_second": t.get("predicted_per_second"),
            "draft_acceptance": (t.get("draft_n_accepted", 0) / drafted) if drafted else None,
            **extra,
        }
