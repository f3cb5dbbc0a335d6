"""The tool loop of the studio chat: call the model, run the tools it calls, feed the results back, repeat.

``run_tool_loop`` is an engine: it takes a ``CallModel`` (an async-generator
function that streams one model turn as GUI events and ends with a
``studio.chat.model_turn.Turn``) and the tools the caller enabled, and yields the
events ``/api/chat`` sends:

* ``content``, ``reasoning``, ``tool_call``: the model's stream, as it comes;
* ``tool_start`` (``id``, ``name``, ``arguments``) and ``tool_end`` (``id``, ``name``,
  ``ok``, a short ``result`` or ``error``, ``seconds``) around each call it runs;
* ``status`` (``reason``, ``message``): a re-prompt, a repeated call, the cap, a dead server;
* ``error`` when a model call fails, and last ``done`` with usage and timings summed
  over every model call, ``iterations`` and ``stop_reason``.

It stops at a final answer (``stop_reason: "answer"``); after ``max_iterations``
model calls that all asked for tools, with one more call without tools that is
told to answer now (``"iteration_cap"``); at a repeat of a call that succeeded,
with the same arguments, which is not run but answered "you already did this"
once and ends the loop the second time (``"repeated_call"``; a call that failed
may be retried as it was, as the reference backend allows: a timeout or a
flaky server can pass the second time); or when ``total_timeout`` runs out
(``"timeout"``). When the model announces that it will use a tool but calls none,
it is told to go ahead, at most ``max_replans`` times.

A tool never runs unless it is among ``tools``; a call to anything else, with
arguments that are not a JSON object, or that fails, hangs (``tool_timeout``) or
prints too much, becomes an error result the model reads, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from studio.chat.model_turn import Turn, TurnError
from studio.chat.tool import Tool, ToolResult
from studio.chat.usage import UsageTotals

#: ``(messages, tools)`` -> one model turn: GUI events, then the ``Turn``. ``tools`` None: offer none.
CallModel = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], AsyncIterator[dict[str, Any] | Turn]]

NUDGE_FINAL = (
    "You have used every tool call this chat allows. Do not call any tool now; answer the user's "
    "question with what you have found."
)
NUDGE_ACT = (
    "You said you would use a tool but did not call one. If a tool is needed, call it now; otherwise "
    "give the final answer."
)
REPEATED = (
    "You already called {name} with exactly these arguments; its result is above. Do not repeat the "
    "call: use that result, try something different, or answer."
)

# "I'll check…", "Let me look up…", "I am going to call…": an announced action, not an answer.
_INTENT = re.compile(
    r"\b(?:let me|allow me to|i(?:'ll| will| shall| am going to|'m going to| need to| should)|next,? i)\b"
    r"[^.?!\n]{0,80}?\b(?:call|use|run|check|search|look|fetch|find|get|query|calculate|compute|execute|open|"
    r"read|try|browse|lookup)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class LoopLimits:
    """How far one chat's tool loop may go."""

    max_iterations: int = 25  # model calls that may use tools, before the final nudge
    tool_timeout: float = 60.0  # seconds per tool call
    total_timeout: float = 600.0  # seconds for the whole loop
    max_replans: int = 2  # re-prompts for an announced but missing tool call
    result_chars: int = 16_000  # of a tool's result the model reads
    preview_chars: int = 300  # of a tool's result the GUI's tool_end shows


def announces_action(text: str) -> bool:
    """Whether ``text`` reads like a plan to use a tool rather than an answer."""
    tail = text.strip()[-400:]
    return bool(tail) and not tail.endswith("?") and bool(_INTENT.search(tail))


async def run_tool_loop(
    messages: list[dict[str, Any]], tools: Sequence[Tool], call_model: CallModel, limits: LoopLimits = LoopLimits()
) -> AsyncIterator[dict[str, Any]]:
    """The loop's events for a chat that starts with ``messages``; see the module docstring."""
    conversation = list(messages)
    by_name = {tool.spec.name: tool for tool in tools}
    offered = [tool.spec.as_openai() for tool in tools]
    totals = UsageTotals()
    deadline = time.monotonic() + limits.total_timeout
    seen: set[tuple[str, str]] = set()
    warned_repeat = False
    replans = 0
    finish: str | None = None
    iteration = 0

    def done(stop_reason: str) -> dict[str, Any]:
        return totals.done(finish, iterations=totals.calls, stop_reason=stop_reason)

    while True:
        if time.monotonic() >= deadline:  # a model that answers without waiting would never hit the timeout
            yield _status("timeout", f"the chat ran past its {limits.total_timeout:g} s limit")
            yield done("timeout")
            return
        final_nudge = iteration >= limits.max_iterations
        if final_nudge:
            yield _status("iteration_cap", f"{limits.max_iterations} tool rounds used; asking for a final answer")
            conversation.append({"role": "user", "content": NUDGE_FINAL})
        iteration += 1
        turn: Turn | None = None
        try:
            async for item in _before(deadline, call_model(conversation, None if final_nudge else offered)):
                if isinstance(item, Turn):
                    turn = item
                else:
                    yield item
        except TimeoutError:
            yield _status("timeout", f"the chat ran past its {limits.total_timeout:g} s limit")
            yield done("timeout")
            return
        except TurnError as exc:
            yield {"type": "error", "status": exc.status, "error": exc.error}
            return
        assert turn is not None, "a CallModel must end with its Turn"
        totals.add(turn.usage, turn.timings)
        finish = turn.finish_reason
        if final_nudge:
            yield done("iteration_cap")
            return
        if not turn.tool_calls:
            if offered and replans < limits.max_replans and announces_action(turn.content):
                replans += 1
                yield _status("replan", "the model announced a tool call but made none; asking it to go ahead")
                conversation += [turn.as_message(), {"role": "user", "content": NUDGE_ACT}]
                continue
            yield done("answer")
            return
        conversation.append(turn.as_message())
        for call in turn.tool_calls:
            name = (call.get("function") or {}).get("name") or ""
            raw = (call.get("function") or {}).get("arguments") or "{}"
            key = (name, _canonical(raw))
            if key in seen:
                if warned_repeat:
                    yield _status("repeated_call", f"the model repeated {name} with the same arguments again; stopping")
                    yield done("repeated_call")
                    return
                warned_repeat = True
                yield _status("repeated_call", f"the model repeated {name} with the same arguments; telling it so")
                conversation.append(_tool_message(call, REPEATED.format(name=name)))
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                yield _status("timeout", f"the chat ran past its {limits.total_timeout:g} s limit")
                yield done("timeout")
                return
            yield {"type": "tool_start", "id": call.get("id"), "name": name, "arguments": raw}
            started = time.monotonic()
            result = await _run(by_name.get(name), name, raw, min(limits.tool_timeout, remaining))
            text = _clip(result.text, limits.result_chars)
            yield {
                "type": "tool_end",
                "id": call.get("id"),
                "name": name,
                "ok": not result.is_error,
                "result": None if result.is_error else _clip(result.text, limits.preview_chars),
                "error": _clip(result.text, limits.preview_chars) if result.is_error else None,
                "seconds": round(time.monotonic() - started, 3),
            }
            if result.notice:
                yield _status("tool_unavailable", result.notice)
            if not result.is_error:
                seen.add(key)
            conversation.append(_tool_message(call, text))


async def _before(deadline: float, turn: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``turn``'s items, each awaited within ``deadline`` (TimeoutError after it; the turn is closed)."""
    try:
        while True:
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    item = await anext(turn)
            except StopAsyncIteration:
                return
            yield item
    finally:
        await turn.aclose()  # type: ignore[attr-defined]


def _loop_time(deadline: float) -> float:
    """``deadline`` (``time.monotonic``) on the event loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


async def _run(tool: Tool | None, name: str, raw: str, timeout: float) -> ToolResult:
    """One call's result; every failure is a result, never an exception."""
    if tool is None:
        return ToolResult(f"no tool named {name!r} is enabled for this chat", True)
    try:
        arguments = json.loads(raw or "{}")
    except ValueError as exc:
        return ToolResult(f"the arguments for {name} are not valid JSON ({exc}); send a JSON object", True)
    if not isinstance(arguments, dict):
        return ToolResult(f"the arguments for {name} must be a JSON object", True)
    try:
        async with asyncio.timeout(timeout + 1.0):  # the tool keeps its own timeout; this is the backstop
            return await tool.call(arguments, timeout=timeout)
    except TimeoutError:
        return ToolResult(f"{name} did not finish within {timeout:g} s", True)
    except Exception as exc:  # a tool's bug must not end the chat
        return ToolResult(f"{name} failed: {exc}", True)


def _tool_message(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.get("id") or "", "content": text}


def _canonical(raw: str) -> str:
    try:
        return json.dumps(json.loads(raw or "{}"), sort_keys=True)
    except ValueError:
        return raw


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}\n[... {len(text) - limit} more characters cut]"


def _status(reason: str, message: str) -> dict[str, Any]:
    return {"type": "status", "reason": reason, "message": message}
