"""One request's trace: the times the forward path passes, and what the answer's last bytes say.

The forward path (``studio.http.clients.openai_proxy``) makes a ``RequestTrace`` when a request arrives and puts it
in a context variable (``CURRENT``), so the few places that know a moment (the model acquired, the request
sent upstream, the end) set it without being handed the trace, the load-wait task included (a task copies its
context). Outside a traced request ``current()`` is ``NO_TRACE``, which records nothing.

Before the request has its model, the residency manager tells the trace what it waits for
(``studio.residency.waits``): ``queued`` behind other requests, or a ``load`` of its model, each with its
beginning and end; ``phases`` adds them up. Once sent, the time llama-server kept the request before its slot
began is what its own ``timings`` do not account for: queued too (a model with its slots all busy).

Times are ``time.perf_counter()`` values (the relay's first-byte time is one); ``wall`` turns them into
epoch seconds against the pair taken at arrival. Nothing of the prompt is kept. What is read from the
request's headers (the client) and from the answer's last bytes (llama-server's ``timings``, the finish
reason) is read once, by ``finish``, after the request: in a batch, off the request's own path
(``studio.activity.recorder``), or when a reader wants the record first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

from studio import json_codec

#: How a request ended; ``in_flight`` until it has.
Outcome = Literal["in_flight", "finished", "length", "cancelled", "error"]

#: The fields of a trace a stored record keeps, in order (``state``, ``from_state``).
_STATE = (
    "id",
    "route",
    "dialect",
    "asked",
    "user_agent",
    "origin",
    "generates",
    "stream",
    "model",
    "wall0",
    "restored",
    "status",
    "outcome",
    "error",
    "retried_after",
    "timings",
)

#: The finish reasons that mean "stopped at its token limit", per dialect: OpenAI's chat and completions,
#: Anthropic's, llama-server's native completion, and a Responses answer cut short. Looked for as plain bytes:
#: a regular expression's alternation tried each of them at every byte of the tail.
_LENGTH = (
    b'"finish_reason":"length"',
    b'"stop_reason":"max_tokens"',
    b'"stop_type":"limit"',
    b'"reason":"max_output_tokens"',
)
_TIMINGS = b'"timings":'


@dataclass(eq=False, slots=True)
class RequestTrace:
    """A request as it goes: set by the forward path, turned into a record once it ends."""

    id: str
    route: str
    dialect: str
    asked: str | None  # the model the request named (None: the default)
    user_agent: str | None
    origin: str | None
    generates: bool
    arrived: float
    wall0: float  # epoch seconds at ``arrived``
    stream: bool = False
    model: str | None = None  # the resident that answered
    acquired: float | None = None
    sent: float | None = None
    first_byte: float | None = None
    ended: float | None = None
    restored: int = 0  # prompt tokens restored from a saved slot before the request ran
    status: int | None = None
    outcome: Outcome = "in_flight"
    error: dict[str, Any] | None = None
    retried_after: tuple[str, ...] = ()  # the cause of each attempt sent again
    timings: dict[str, float] | None = None  # llama-server's, once the answer's are read
    tail: bytes = b""  # the answer's last bytes, read at the end
    load: dict[str, Any] | None = None  # the load it waited for, once known
    probe: Callable[[], float | None] | None = None  # the response's first-byte time while it streams
    request_body: bytes | None = None  # only while a capture wants it (``studio.activity.captures``)
    captured: int | None = None  # bytes of its capture, when one was kept
    # each wait before it had its model: [what, began, ended (None: going on), model, load record id]; None: a
    # record stored before waits were recorded, whose phases are inferred from its load's start
    waits: tuple[list[Any], ...] | None = ()
    headers: Any = None  # the request's ASGI headers, until ``finish`` reads the client from them

    def first_byte_now(self) -> float | None:
        """When the answer's first bytes came, if they did yet (a stream in flight says so through ``probe``)."""
        if self.first_byte is not None or self.probe is None:
            return self.first_byte
        return self.probe()

    def wall(self, at: float | None) -> float | None:
        """``at`` (a ``perf_counter`` time) as epoch seconds."""
        return None if at is None else self.wall0 + (at - self.arrived)

    # -- the moments, set by the forward path -----------------------------------------------------

    def got_model(self, name: str) -> None:
        """The request has its model (again, when it is sent again after its llama-server died)."""
        if self.acquired is None:
            self.acquired = time.perf_counter()
        self.model = name

    def waiting(self, what: str, model: str) -> None:
        """The request begins to wait for ``what`` (``queued``, ``load``) on ``model``; the same wait again, as
        the manager looks once more after a change that was not the one it waits for, goes on as one."""
        waits = self.waits or ()
        last = waits[-1] if waits else None
        if last is not None and last[0] == what and last[3] == model:
            last[2] = None
        else:
            self.waits = (*waits, [what, time.perf_counter(), None, model, None])

    def waited(self) -> None:
        """The wait begun last ended."""
        if self.waits and self.waits[-1][2] is None:
            self.waits[-1][2] = time.perf_counter()

    def retrying(self, cause: str) -> None:
        """The attempt failed before any answer byte and will be sent again."""
        self.retried_after = (*self.retried_after, cause)
        self.sent = None

    def sending(self) -> None:
        self.sent = time.perf_counter()

    def answering(self, status: int) -> None:
        """The response goes out with ``status``."""
        self.status = status

    def asking(self, model: str | None, body: bytes | None) -> None:
        """The model the request names, and its body when a capture may keep it."""
        self.asked, self.request_body = model, body

    def restoring(self, tokens: int | None) -> None:
        """Tokens of a saved slot restored before the request runs (``None``, 0: none)."""
        self.restored = tokens or 0

    def streaming(self, probe: Callable[[], float | None] | None = None) -> None:
        """The answer is a stream; ``probe`` says when its first bytes came, while it runs (``None``: the
        first bytes are told with ``first_bytes``)."""
        self.stream, self.probe = True, probe

    def first_bytes(self) -> None:
        """The answer's first generated bytes go out now (an answer the studio parses, as the GUI's chat)."""
        if self.first_byte is None:
            self.first_byte = time.perf_counter()

    def concluded(self, timings: dict[str, Any] | None, finish_reason: str | None) -> None:
        """An answer the studio parsed is complete: llama-server's ``timings`` (summed over its model calls)
        and why it stopped, in place of the last bytes ``answered`` reads."""
        if timings:
            self.timings = {k: v for k, v in timings.items() if isinstance(v, int | float)}
        if self.outcome == "in_flight":
            self.outcome = "length" if finish_reason == "length" else "finished"

    def answered(self, first_at: float | None, tail: bytes) -> None:
        """The answer is complete: when its first bytes came (``None``: a whole answer) and its last bytes."""
        self.first_byte = first_at
        self.tail = tail
        if self.outcome == "in_flight":
            self.outcome = "finished"

    def failed(self, status: int | None, message: str, code: str | None = None) -> None:
        """The request failed (the first cause wins: a later one is its consequence)."""
        if self.error is None:
            self.error = {"status": status, "message": message, "code": code}
        self.outcome = "error"
        self.status = self.status or status

    def left(self) -> None:
        """The client went away before the answer was complete."""
        if self.outcome in ("in_flight", "finished"):
            self.outcome = "cancelled"

    # -- the end ----------------------------------------------------------------------------------

    def finish(self) -> None:
        """Read what the request left to read, once: its client from its headers, llama-server's ``timings`` and
        whether the answer hit its token limit from the answer's tail (let go once read)."""
        if self.ended is None:
            self.ended = time.perf_counter()
        if self.headers is not None:
            self._read_client()
        tail = self.tail
        if not tail:
            return
        self.tail = b""
        self.timings = timings_of(tail)
        if self.outcome == "finished" and _hit_limit(tail):
            self.outcome = "length"

    def _read_client(self) -> None:
        headers, self.headers = self.headers, None
        for name, value in headers if isinstance(headers, list) else headers.items():
            if name == b"user-agent":
                self.user_agent = value.decode("latin-1")[:200]
            elif name == b"origin":
                self.origin = value.decode("latin-1")[:200]

    def client(self) -> dict[str, str | None]:
        """Who sent it: the user agent and the origin its headers name."""
        if self.headers is not None:
            self._read_client()
        return {"user_agent": self.user_agent, "origin": self.origin}

    def phases(self) -> dict[str, float]:
        """Seconds in each phase: queued (behind other requests, in the studio or for a slot of llama-server),
        waiting for a load, prefill (to the first byte), decode."""
        arrived, end = self.arrived, self.ended if self.ended is not None else time.perf_counter()
        got = self.acquired if self.acquired is not None else end
        load_wait = self._load_wait(got)
        phases = {"queued": got - arrived - load_wait, "load_wait": load_wait, "prefill": 0.0, "decode": 0.0}
        if self.sent is None or self.ended is None:
            return phases
        t = self.timings or {}
        prompt, slot = t.get("prompt_ms"), 0.0
        if self.first_byte is not None:  # llama-server's first bytes come once its slot read the prompt
            upstream = self.first_byte - self.sent
            slot = 0.0 if prompt is None else max(0.0, upstream - prompt / 1000)
            phases["prefill"], phases["decode"] = upstream - slot, max(0.0, end - self.first_byte)
        elif prompt is not None:  # a whole answer: llama-server's own split of its time
            upstream = end - self.sent
            slot = max(0.0, upstream - (prompt + t.get("predicted_ms", 0.0)) / 1000)
            prefill = min(upstream - slot, prompt / 1000)
            phases["prefill"], phases["decode"] = prefill, upstream - slot - prefill
        else:
            phases["prefill"] = end - self.sent
        phases["queued"] += slot
        return phases

    def _load_wait(self, got: float) -> float:
        """Seconds it waited for a load before ``got``: the recorded waits', or for a trace stored before those
        were, the time from its load's start on."""
        arrived, waits = self.arrived, self.waits
        if waits is None:
            began = self.load.get("began_at") if self.load else None
            return 0.0 if began is None else got - min(got, max(arrived, began))
        return sum(
            max(0.0, min(got, w[2] if w[2] is not None else got) - max(arrived, w[1])) for w in waits if w[0] == "load"
        )

    def state(self) -> list[Any]:
        """The finished trace as a list of JSON values, for the database: not the record (which is built on
        reading), its times relative to the arrival, once ``finish`` read what it left to read (the batch's
        settling, on the event loop). ``from_state`` makes the trace again from its JSON."""
        at, load = self.arrived, self.load
        if load is not None:
            load = {**load, "began_at": load["began_at"] - at}
        acquired, sent, first, ended = self.acquired, self.sent, self.first_byte, self.ended
        return [  # in ``_STATE``'s order, then the times, the load and the waits
            self.id,
            self.route,
            self.dialect,
            self.asked,
            self.user_agent,
            self.origin,
            self.generates,
            self.stream,
            self.model,
            self.wall0,
            self.restored,
            self.status,
            self.outcome,
            self.error,
            self.retried_after,
            self.timings,
            [
                None if acquired is None else acquired - at,
                None if sent is None else sent - at,
                None if first is None else first - at,
                None if ended is None else ended - at,
            ],
            load,
            None
            if self.waits is None
            else [[w[0], w[1] - at, None if w[2] is None else w[2] - at, *w[3:]] for w in self.waits],
        ]

    @classmethod
    def from_state(cls, data: bytes | str) -> RequestTrace:
        """The trace whose ``state`` ``data`` is, as JSON (its times relative to an arrival at 0)."""
        values = json_codec.loads(data)
        fields = dict(zip(_STATE, values, strict=False))
        times, load = values[len(_STATE)], values[len(_STATE) + 1]
        waits = values[len(_STATE) + 2] if len(values) > len(_STATE) + 2 else None  # None: stored before waits
        trace = cls(
            **{k: fields[k] for k in _STATE[:6]}, generates=fields["generates"], arrived=0.0, wall0=fields["wall0"]
        )
        for name in _STATE[7:-2]:
            setattr(trace, name, fields[name])
        trace.retried_after, trace.timings = tuple(fields["retried_after"]), fields["timings"]
        trace.acquired, trace.sent, trace.first_byte, trace.ended = times
        trace.load = load
        trace.waits = None if waits is None else tuple(waits)
        return trace

    def filed_as(self) -> str:
        """The outcome a filter finds it by: ``retried`` for a request sent again that got its answer."""
        return "retried" if self.retried_after and self.outcome != "error" else self.outcome

    def retries(self) -> int:
        """Times the request was sent again: each death before an answer, but the last if it ended the request."""
        causes = self.retried_after
        last_ended_it = bool(causes) and self.outcome == "error" and (self.error or {}).get("message") == causes[-1]
        return len(causes) - last_ended_it

    def record(self) -> dict[str, Any]:
        """The request as ``/api/activity`` shows it (and the database keeps it)."""
        self.finish()
        t = self.timings or {}
        generated = t.get("predicted_n")
        tokens = {
            "prompt_processed": _int(t.get("prompt_n")),
            "prompt_cached": _int(t.get("cache_n")),
            "restored": self.restored,
            "generated": _int(generated),
            "drafted": _int(t.get("draft_n")),
            "accepted": _int(t.get("draft_n_accepted")),
        }
        return {
            "kind": "request",
            "id": self.id,
            "route": self.route,
            "dialect": self.dialect,
            "model": self.model or self.asked,
            "asked": self.asked,
            "stream": self.stream,
            "client": self.client(),
            "times": {
                "arrived": self.wall0,
                "acquired": self.wall(self.acquired),
                "sent": self.wall(self.sent),
                "first_byte": self.wall(self.first_byte),
                "ended": self.wall(self.ended),
            },
            "phases": self.phases(),
            "load": None if self.load is None else {k: v for k, v in self.load.items() if k != "began_at"},
            "waits": None
            if self.waits is None
            else [
                {"for": w[0], "model": w[3], "began": self.wall(w[1]), "ended": self.wall(w[2]), "load": w[4]}
                for w in self.waits
            ],
            "tokens": tokens,
            "decode_tps": t.get("predicted_per_second"),
            "status": self.status,
            "outcome": self.outcome,
            "error": self.error,
            "retries": self.retries(),
            "retried_after": list(self.retried_after),
        }


def _hit_limit(tail: bytes) -> bool:
    """Whether the answer whose last bytes ``tail`` are stopped at its token limit."""
    for reason in _LENGTH:
        if reason in tail:
            return True
    return False


def timings_of(tail: bytes) -> dict[str, float]:
    """llama-server's ``timings`` object in the last bytes of an answer (the last one there), its fields we keep."""
    at = tail.rfind(_TIMINGS)
    if at < 0:
        return {}
    start = at + len(_TIMINGS)
    end = tail.find(b"}", start)
    if end < 0:
        return {}
    try:
        found = json_codec.loads(tail[start : end + 1])
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def error_message(body: bytes) -> str:
    """The message of an error answer's body, in any dialect's shape (the body itself, cut, when it has none)."""
    try:
        data = json_codec.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace")
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return str(message) if message else body[:500].decode("utf-8", "replace")


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


class _NoTrace(RequestTrace):
    """Outside a traced request: every moment is dropped (nothing is ever set on it)."""

    def got_model(self, name: str) -> None:
        pass

    def waiting(self, what: str, model: str) -> None:
        pass

    def waited(self) -> None:
        pass

    def retrying(self, cause: str) -> None:
        pass

    def sending(self) -> None:
        pass

    def answering(self, status: int) -> None:
        pass

    def asking(self, model: str | None, body: bytes | None) -> None:
        pass

    def restoring(self, tokens: int | None) -> None:
        pass

    def streaming(self, probe: Callable[[], float | None] | None = None) -> None:
        pass

    def first_bytes(self) -> None:
        pass

    def concluded(self, timings: dict[str, Any] | None, finish_reason: str | None) -> None:
        pass

    def answered(self, first_at: float | None, tail: bytes) -> None:
        pass

    def failed(self, status: int | None, message: str, code: str | None = None) -> None:
        pass


NO_TRACE = _NoTrace("", "", "", None, None, None, False, 0.0, 0.0)
CURRENT: ContextVar[RequestTrace] = ContextVar("gguf_studio_activity_trace", default=NO_TRACE)


#: The trace of the request this code runs for (``NO_TRACE`` outside one): the variable's own ``get``, called a few
#: times a request, without a Python frame around it.
current: Callable[[], RequestTrace] = CURRENT.get
