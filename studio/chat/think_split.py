"""Separates a ``<think>...</think>`` block that opens an answer's content into reasoning.

llama-server extracts reasoning only for templates whose thinking markers it can
find. A DeepSeek-R1-distill template never names them (it only cuts past replies
at ``</think>``), while the model opens every answer with ``<think>``; the thinking
then arrives as content. For such always-thinking templates ``/api/chat`` passes
the content through this splitter. Only a block at the very start counts; text
that could still be the start of ``<think>`` or the end ``</think>`` is held back.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Streamed content in, ``(reasoning, content)`` pieces out."""

    def __init__(self) -> None:
        self._state = "start"  # start: nothing but whitespace yet; thinking; answer
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content to release for the next piece of content."""
        if self._state == "answer":
            return "", text
        self._buf += text
        if self._state == "start":
            head = self._buf.lstrip()
            if OPEN.startswith(head):
                return "", ""  # whitespace, or the start of <think>: wait
            if not head.startswith(OPEN):
                self._state, out, self._buf = "answer", self._buf, ""
                return "", out
            self._state, self._buf = "thinking", head[len(OPEN) :].lstrip("\n")
        end = self._buf.find(CLOSE)
        if end != -1:
            reasoning, rest = self._buf[:end], self._buf[end + len(CLOSE) :].lstrip("\n")
            self._state, self._buf = "answer", ""
            return reasoning, rest
        keep = next(
            (k for k in range(min(len(self._buf), len(CLOSE) - 1), 0, -1) if CLOSE.startswith(self._buf[-k:])), 0
        )
        out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """What is held when the answer ends: unfinished thinking stays reasoning."""
        held, self._buf = self._buf, ""
        return (held, "") if self._state == "thinking" else ("", held)
