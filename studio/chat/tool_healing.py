"""Turns tool-call markup left in an answer's ``content`` into OpenAI ``tool_calls``.

Only for requests that offered ``tools``: the markup is found by
``studio.chat.tool_markup.MarkupScanner``, removed from ``content`` and added as
calls after any llama-server parsed itself; ``finish_reason`` becomes
``tool_calls``. ``heal_completion`` does a whole answer, ``ChunkHealer`` a
stream, one parsed chunk at a time: a chunk it need not change is reported as
unchanged so the relay can send the original bytes.
"""

from __future__ import annotations

from typing import Any

from studio.chat.tool_markup import MarkupScanner, ParsedCall, Piece

#: Top-level fields of a chunk that describe one chunk's place in the stream, copied to chunks made from it.
_ENVELOPE = ("id", "object", "created", "model", "system_fingerprint")


def heal_completion(answer: dict[str, Any], tools: dict[str, dict[str, Any]]) -> bool:
    """Heal every choice of a non-streamed chat completion in place; return whether anything changed."""
    changed = False
    for choice in answer.get("choices") or ():
        message = choice.get("message")
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            continue
        scanner = MarkupScanner(tools)
        pieces = scanner.feed(message["content"]) + scanner.finish()
        calls = [p for p in pieces if isinstance(p, ParsedCall)]
        if not calls:
            continue
        message["content"] = "".join(p for p in pieces if isinstance(p, str)).strip()
        message["tool_calls"] = list(message.get("tool_calls") or ()) + [c.as_openai() for c in calls]
        choice["finish_reason"] = "tool_calls"
        changed = True
    return changed


class ChunkHealer:
    """Heals one streamed answer, chunk by chunk (see the module docstring).

    Args:
        tools: the offered function names with their parameter schemas.
    """

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self._tools = tools
        self._choices: dict[int, _Choice] = {}
        self._envelope: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The chunks to send in place of ``chunk``, or ``None`` to send it unchanged."""
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return None
        self._envelope = {k: chunk[k] for k in _ENVELOPE if k in chunk}
        out: list[dict[str, Any]] = []
        changed = False
        for choice in choices:
            index = choice.get("index", 0)
            state = self._choices.setdefault(index, _Choice(self._tools, index))
            made = state.feed(choice)
            if made is None:
                out.append({**self._envelope, "choices": [choice]})
            else:
                changed = True
                out += [{**self._envelope, "choices": [c]} for c in made]
        if not changed:
            return None
        extras = {k: v for k, v in chunk.items() if k not in _ENVELOPE and k != "choices"}
        if out:
            out[-1].update(extras)  # timings and usage stay on the last chunk
        elif extras:
            out.append({**self._envelope, "choices": [], **extras})
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Chunks for what is still held when the stream ends without a finish chunk (upstream broke off)."""
        out = []
        for state in self._choices.values():
            out += [{**self._envelope, "choices": [c]} for c in state.close()]
        return out


class _Choice:
    """The healing state of one choice of a streamed answer."""

    def __init__(self, tools: dict[str, dict[str, Any]], index: int) -> None:
        self.scanner = MarkupScanner(tools)
        self.index = index
        self.next_index = 0  # the next free tool_calls index, healed and llama-server's alike
        self.upstream_index: dict[int, int] = {}  # llama-server's index of a call -> the index sent
        self.finished = False

    def feed(self, choice: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Choices to send for ``choice`` (a ``delta`` each), or ``None`` when it goes unchanged."""
        if self.finished:
            return None
        delta = choice.get("delta") or {}
        moved = self._reindex(delta)
        if moved:
            delta = {**delta, "tool_calls": moved}
        content = delta.get("content")
        finish = choice.get("finish_reason")
        if not isinstance(content, str) and finish is None:
            return [{**choice, "delta": delta}] if moved else None
        pieces = self.scanner.feed(content) if isinstance(content, str) else []
        if finish is not None:
            pieces += self.scanner.finish()
            self.finished = True
        if not moved and pieces == ([content] if content else []) and (finish is None or not self.scanner.found):
            return None
        rest = {k: v for k, v in delta.items() if k != "content"}
        made = self._choices(self.index, pieces, rest)
        if finish is not None:
            made = made or [{"index": self.index, "delta": {}}]
            made[-1]["finish_reason"] = "tool_calls" if self.scanner.found else finish
            for k, v in choice.items():
                if k not in ("index", "delta", "finish_reason"):
                    made[-1][k] = v
        return made

    def _reindex(self, delta: dict[str, Any]) -> list[dict[str, Any]] | None:
        """llama-server's own calls, renumbered after healed ones when a healed call took their index."""
        calls = delta.get("tool_calls")
        if not isinstance(calls, list):
            return None
        out, moved = [], False
        for call in calls:
            index = call.get("index") if isinstance(call, dict) else None
            if not isinstance(index, int):
                out.append(call)
                continue
            if index not in self.upstream_index:
                self.upstream_index[index] = self.next_index
                self.next_index += 1
            ours = self.upstream_index[index]
            moved = moved or ours != index
            out.append({**call, "index": ours})
        return out if moved else None

    def close(self) -> list[dict[str, Any]]:
        if self.finished:
            return []
        self.finished = True
        return self._choices(self.index, self.scanner.finish(), {})

    def _choices(self, index: int, pieces: list[Piece], rest: dict[str, Any]) -> list[dict[str, Any]]:
        """One choice per run of text or of calls, in order; ``rest`` (role, reasoning) rides on the first."""
        made: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, str):
                made.append({"index": index, "delta": {"content": piece}, "finish_reason": None})
                continue
            call = {"index": self.next_index, **piece.as_openai()}
            self.next_index += 1
            if made and "tool_calls" in made[-1]["delta"]:
                made[-1]["delta"]["tool_calls"].append(call)
            else:
                made.append({"index": index, "delta": {"tool_calls": [call]}, "finish_reason": None})
        if rest:
            if made:
                made[0]["delta"] = {**rest, **made[0]["delta"]}
            else:
                made.append({"index": index, "delta": rest, "finish_reason": None})
        return made
