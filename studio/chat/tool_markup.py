"""Finds tool calls that a model wrote as text, in the markup families llama-server's parser missed.

Small and quantised models often write a call in the right family but not in
the exact shape their template's parser expects (llama.cpp #24807, QwenPaw
#3560, Ollama #12557 and #5796), and the call then reaches the client as
prose. The forms read here:

* Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (``"parameters"`` for ``"arguments"``, arguments as a JSON string, several
  objects or a list in one block);
* Qwen3-Coder: ``<function=NAME><parameter=K>V</parameter>...</function>``,
  alone or inside ``<tool_call>``, and Llama 3.1's ``<function=NAME>{json}</function>``;
* Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`` and the newer
  ``[TOOL_CALLS]NAME[ARGS]{json}`` (optionally with ``[CALL_ID]id``);

each also with its closing tag missing at the end of the answer.

``MarkupScanner`` reads an answer piece by piece and gives back text and calls in
order. It holds back only what could still begin markup (a prefix of an opener)
or markup that is not complete yet; a block that does not parse, or names a tool
the request did not offer, goes out as text, so nothing is lost. A whole answer
is one ``feed`` and a ``finish``, so streamed and non-streamed answers are read by
the same code.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
MISTRAL_OPEN = "[TOOL_CALLS]"
OPENERS = (TOOL_CALL_OPEN, FUNCTION_OPEN, MISTRAL_OPEN)
#: Closing tags that may dangle after a call whose opening wrapper was left out.
_STRAY_CLOSERS = (TOOL_CALL_CLOSE, FUNCTION_CLOSE)

_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.:-]+)(?:\[CALL_ID\]([A-Za-z0-9_-]+))?\[ARGS\]")
_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One healed call, in OpenAI's terms: ``arguments`` is JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict[str, Any]:
        """The call as a message's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = str | ParsedCall


class _NeedMore(Exception):
    """The block is not complete yet; wait for more text."""


class _NotACall(Exception):
    """The text is not a call the request allows; it stays text (``args[0]``: how much of it, when known)."""


class MarkupScanner:
    """Splits an answer's text into plain text and calls; see the module docstring.

    Args:
        tools: the function names the request offered, each with its parameter schema
            (used to keep string parameters strings). Calls to other names stay text.
    """

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self._tools = tools
        self._buf = ""
        self._after_call = False  # whitespace and a dangling closer right after a call are dropped
        self.found = 0  # calls found so far

    def feed(self, text: str) -> list[Piece]:
        """Take the next piece of the answer; return what can be released now."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        """The answer ended: parse what is held (closing tags may be missing) and release the rest."""
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self._buf:
            if self._after_call and not self._skip_after_call(final):
                break
            start = _first_opener(self._buf)
            if start == -1:
                keep = 0 if final else _opener_prefix_len(self._buf)
                _text(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            _text(out, self._buf[:start])
            self._buf = self._buf[start:]
            try:
                calls, used = self._block(final)
            except _NeedMore:
                break
            except _NotACall as exc:
                used = int(exc.args[0])
                _text(out, self._buf[:used])
                self._buf = self._buf[used:]
                continue
            out += calls
            self.found += len(calls)
            self._buf = self._buf[used:]
            self._after_call = True
        return out

    def _skip_after_call(self, final: bool) -> bool:
        """Drop whitespace and a stray closing tag after a call; False while that is undecided."""
        rest = self._buf.lstrip()
        for closer in _STRAY_CLOSERS:
            if rest.startswith(closer):
                rest = rest[len(closer) :].lstrip()
                break
            if not final and closer.startswith(rest):
                self._buf = rest
                return False  # empty, or the start of a closer: wait
        self._buf = rest
        if rest:
            self._after_call = False
        return bool(rest)

    def _block(self, final: bool) -> tuple[list[ParsedCall], int]:
        """The calls of the markup block at the start of the buffer, and its length."""
        buf = self._buf
        if buf.startswith(TOOL_CALL_OPEN):
            inner, used, closed = _until(buf, len(TOOL_CALL_OPEN), TOOL_CALL_CLOSE, final)
            try:
                calls, rest = self._tool_call_body(inner)
            except _NotACall:
                raise _NotACall(used) from None
            if closed and rest.strip():
                raise _NotACall(used)
            return calls, used if closed else used - len(rest)
        if buf.startswith(FUNCTION_OPEN):
            block, used, _ = _until(buf, 0, FUNCTION_CLOSE, final)
            try:
                calls, rest = self._functions(block)
            except _NotACall:
                raise _NotACall(used) from None
            if rest.strip():
                raise _NotACall(used)
            return calls, used
        if not final:
            raise _NeedMore  # a Mistral list has no closing tag: it runs to the end of the answer
        try:
            calls, rest = self._mistral(buf[len(MISTRAL_OPEN) :])
        except _NotACall:
            raise _NotACall(len(buf)) from None
        return calls, len(buf) - len(rest)

    # -- the three families ----------------------------------------------------------------
    def _tool_call_body(self, inner: str) -> tuple[list[ParsedCall], str]:
        """JSON objects (or a list) or ``<function=`` blocks; the unparsed tail (a suffix) is returned."""
        body = inner.lstrip()
        if body.startswith(FUNCTION_OPEN):
            return self._functions(body)
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ","):
                pos += 1
            if body.startswith(TOOL_CALL_OPEN, pos):  # a second block whose first was never closed
                pos += len(TOOL_CALL_OPEN)
                continue
            if pos >= len(body) or body[pos] not in "[{":
                break
            try:
                value, pos = _JSON.raw_decode(body, pos)
            except ValueError:
                break
            calls += [self._json_call(item) for item in (value if isinstance(value, list) else [value])]
        if not calls:
            raise _NotACall
        return calls, body[pos:]

    def _functions(self, text: str) -> tuple[list[ParsedCall], str]:
        """Consecutive ``<function=NAME>...</function>`` blocks at the start of ``text``; the tail after them."""
        calls: list[ParsedCall] = []
        rest = text.lstrip()
        while rest.startswith(FUNCTION_OPEN):
            head_end = rest.find(">", len(FUNCTION_OPEN))
            if head_end == -1:
                raise _NotACall
            name = rest[len(FUNCTION_OPEN) : head_end].strip()
            end = rest.find(FUNCTION_CLOSE, head_end)
            body = rest[head_end + 1 : end if end != -1 else len(rest)]
            rest = rest[end + len(FUNCTION_CLOSE) :].lstrip() if end != -1 else ""
            calls.append(self._function_call(name, body))
        if not calls:
            raise _NotACall
        return calls, rest

    def _function_call(self, name: str, body: str) -> ParsedCall:
        self._known(name)
        stripped = body.strip()
        if stripped.startswith("{"):  # Llama 3.1: <function=NAME>{json}</function>
            try:
                arguments, end = _JSON.raw_decode(stripped)
            except ValueError:
                raise _NotACall from None
            if stripped[end:].strip() or not isinstance(arguments, dict):
                raise _NotACall
            return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
        schema = (self._tools.get(name) or {}).get("properties") or {}
        params: dict[str, Any] = {}
        rest = stripped
        while rest:
            if rest.startswith(PARAMETER_CLOSE):  # a doubled closing tag (llama.cpp #24807)
                rest = rest[len(PARAMETER_CLOSE) :].lstrip()
                continue
            if not rest.startswith(PARAMETER_OPEN):
                raise _NotACall
            head_end = rest.find(">", len(PARAMETER_OPEN))
            if head_end == -1:
                raise _NotACall
            key = rest[len(PARAMETER_OPEN) : head_end].strip()
            end = rest.find(PARAMETER_CLOSE, head_end)
            raw = rest[head_end + 1 : end if end != -1 else len(rest)]
            rest = rest[end + len(PARAMETER_CLOSE) :].lstrip() if end != -1 else ""
            params[key] = _parameter_value(raw, schema.get(key) or {})
        return ParsedCall(name, json.dumps(params, ensure_ascii=False))

    def _mistral(self, text: str) -> tuple[list[ParsedCall], str]:
        """A JSON list, or ``NAME[ARGS]{json}`` calls each after its own ``[TOOL_CALLS]``; the tail after them."""
        body = text.lstrip()
        if body.startswith("["):
            for candidate in (body, body + "]"):  # the list's closing bracket may be missing
                try:
                    value, end = _JSON.raw_decode(candidate)
                except ValueError:
                    continue
                items = value if isinstance(value, list) else [value]
                return [self._json_call(item) for item in items], candidate[end:]
            raise _NotACall
        calls: list[ParsedCall] = []
        while match := _MISTRAL_NAMED.match(body):
            self._known(match.group(1))
            try:
                arguments, end = _JSON.raw_decode(body, match.end())
            except ValueError:
                raise _NotACall from None
            if not isinstance(arguments, dict):
                raise _NotACall
            calls.append(ParsedCall(match.group(1), json.dumps(arguments, ensure_ascii=False)))
            body = body[end:].lstrip()
            body = body[len(MISTRAL_OPEN) :] if body.startswith(MISTRAL_OPEN) else body
        if not calls:
            raise _NotACall
        return calls, body

    def _json_call(self, item: Any) -> ParsedCall:
        """``{"name", "arguments"}`` (or ``"parameters"``, or OpenAI's ``{"function": {...}}``) as a call."""
        if isinstance(item, dict) and isinstance(item.get("function"), dict):
            item = item["function"]
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _NotACall
        self._known(item["name"])
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise _NotACall from None
        if not isinstance(arguments, dict):
            raise _NotACall
        return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))

    def _known(self, name: str) -> None:
        if name not in self._tools:
            raise _NotACall


def _until(buf: str, start: int, closer: str, final: bool) -> tuple[str, int, bool]:
    """The text from ``start`` to ``closer``, the length used, and whether the closer was there."""
    end = buf.find(closer, start)
    if end == -1:
        if not final:
            raise _NeedMore
        return buf[start:], len(buf), False
    if closer == FUNCTION_CLOSE:  # the block keeps its own tags: _functions reads them
        return buf[start : end + len(closer)], end + len(closer), True
    return buf[start:end], end + len(closer), True


def _parameter_value(raw: str, schema: dict[str, Any]) -> Any:
    """A ``<parameter>`` value: a string where the schema says so, else JSON when it reads as JSON."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _first_opener(text: str) -> int:
    found = [i for i in (text.find(opener) for opener in OPENERS) if i != -1]
    return min(found) if found else -1


def _opener_prefix_len(text: str) -> int:
    """Length of the longest tail of ``text`` that an opener could still grow out of."""
    for k in range(min(len(text), max(map(len, OPENERS)) - 1), 0, -1):
        tail = text[-k:]
        if any(opener.startswith(tail) for opener in OPENERS):
            return k
    return 0


def _text(out: list[Piece], text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], str):
        out[-1] += text
    else:
        out.append(text)
