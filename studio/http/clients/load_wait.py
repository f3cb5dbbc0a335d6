"""Streamed requests that wait for a cold load, or a long prompt, hear from the studio: headers, then keep-alives.

A load takes seconds to minutes; a client, or a proxy in between, with an idle timeout would cut a stream
that sends nothing meanwhile, and a client that sees no response cannot tell a load from a hung server.
A streamed request whose answer has not begun within ``FIRST_BEAT`` seconds (its model is not ready, or
is reading a long prompt) gets its ``200`` and headers then, and one keep-alive line at least every
``BEAT`` seconds until the answer begins: an SSE comment (``: loading SmolLM2 45%``, the share of the
weights read when llama-server reports it; then ``: SmolLM2 is reading the prompt`` until its first
token) that SSE clients skip by the standard, or on Ollama's listener a chunk with empty content and
``done: false``, which Ollama's clients add to the answer as nothing (Ollama itself sends nothing while
it loads). The first ``FIRST_BEAT`` seconds let the quick refusals (an unknown model, one that cannot
fit) stay plain HTTP errors; an error after the headers ends the stream with the dialect's error event
instead (``studio.http.errors.stream_error_line``).

A request whose llama-server dies before the first byte of its answer (killed while loading, or while the
request waited for its answer: the kernel's out-of-memory killer does this on a desktop) has lost nothing
its client saw, keep-alives aside. That holds for a stream whose head llama-server sent already: b11434 sends
it as it starts reading the prompt (``send_partial_response``'s ``is_begin``), the first bytes only after the
prompt, so a stream's response is relayed only once its body has begun (``Relay.first_bytes``).
``answer_surviving`` sends it again once the model is back (the resident restarts it), up to ``RETRIES``
times, each time through the queue like a new request. A model that dies on every start runs out of
restarts, and the request then gets the cause (a 502). A retry plans the model again against the memory
free now: when another program took the room meanwhile, the request gets a 503 with ``Retry-After`` saying
what the model needs and what holds the memory, instead of a restart that would die the same way. Bytes
already on their way are not sent twice: a stream that broke off mid-answer ends with the dialect's error
event. The page's chat (``studio.http.gui.gui_chat``) sends each model call of its tool loop through the same
``Survival``, its answer llama-server's stream, which the chat reshapes into its own events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Generic, TypeGuard, TypeVar

import structlog
from starlette.responses import Response

from launcher.errors import LoadError
from studio.activity.trace import current, error_message
from studio.errors import BusyError, DoesNotFitError, RetriesSpentError, StudioError, UpstreamDiedError
from studio.http.errors import SHAPES, Dialect, ErrorAnswer, describe, stream_error_line
from studio.http.wire.relay import LoadWait, Relay
from studio.residency.manager import ModelManager
from studio.residency.resident import Lease, LoadedModel

log = structlog.get_logger(__name__)

#: Seconds a streamed request waits for its model before its headers go out.
FIRST_BEAT = 1.0
#: Seconds between keep-alive lines while the load goes on (the promise is at most 2).
BEAT = 1.0

#: Seconds a failed upstream request waits to hear whether its llama-server died (its owner hears of an exit at
#: once; the bound only delays a failure that was not a death).
DEATH_NOTICE = 3.0
#: Times a request its llama-server died under, before any byte of its answer, is sent again.
RETRIES = 2

#: What a request does with its model once it has it: returns the response (a stream, or a whole answer).
Answer = Callable[[LoadedModel, Lease], Awaitable[Response]]
#: What a ``Survival``'s request gets from its model's llama-server: a response, or (the page's chat) the upstream's.
R = TypeVar("R")


def loading_comment(name: str, share: float | None) -> bytes:
    """The SSE comment line a waiting stream gets: ``: loading <model> 45%``, without a share when unknown."""
    return f": loading {name}{f' {share:.0%}' if share is not None else ''}\n\n".encode()


def reading_comment(name: str) -> bytes:
    """The line once the model is loaded and has the request: nothing of the answer comes until its first token,
    so a long prompt would otherwise still read as ``loading``."""
    return f": {name} is reading the prompt\n\n".encode()


async def answer_when_loaded(
    manager: ModelManager,
    model: str | None,
    answer: Answer,
    *,
    dialect: Dialect,
    beat: Callable[[], bytes] | None = None,
    media_type: str = "text/event-stream",
    detach: bool = False,
) -> Response:
    """``answer``'s response for ``model``; when the model is not ready, or its answer does not begin at once (a
    long prompt), a stream that keeps the client company until it does (see the module docstring). ``beat`` makes
    the keep-alive line (default: the SSE comment). With ``detach`` a client that leaves during the wait leaves the
    request going (``LoadWait``).
    """
    survival = Survival(manager, model, answer, _relay_opening, found=manager.acquire_now(model))
    waited = False  # the first ``FIRST_BEAT`` went by here, without a task: the keep-alive begins at once
    if survival.found is not None:  # ready: asked and waited for here; only an answer that has not begun gets a task
        try:
            response = await survival.ask()
            if not _unbegun(response):
                return response
            begun = await survival.begun_within(FIRST_BEAT)
            if begun is not None:
                return begun
            waited = True
        except UpstreamDiedError as exc:
            survival.again(exc)
    # its first step runs before this task can cancel it: a response asked above is closed there if need be
    task = asyncio.ensure_future(survival.answered())
    if not waited:
        try:
            done, _ = await asyncio.wait({task}, timeout=FIRST_BEAT)
        except BaseException:
            task.cancel()
            raise
        if done:
            return task.result()  # ready or refused quickly: an ordinary answer, or an HTTP error
    acquired = survival.acquired

    def comment() -> bytes:
        return reading_comment(acquired[0]) if acquired else loading_comment(*manager.load_progress(model))

    return LoadWait(
        task,
        beat=beat or comment,
        ended=lambda outcome: _error_line(outcome, dialect),
        every=BEAT,
        headers={"cache-control": "no-cache"},
        media_type=media_type,
        detach=detach,
    )


async def answer_surviving(
    manager: ModelManager,
    model: str | None,
    answer: Answer,
    *,
    embeddings: bool = False,
    found: tuple[LoadedModel, Lease] | None = None,
) -> Response:
    """``answer``'s response on ``model`` (``found``: already acquired), once its body has begun; sent again when
    its llama-server died before that (the module docstring).

    One budget of ``RETRIES`` covers the request's whole life: deaths while its model loads and deaths once it
    was sent count alike, so a model that dies on every start is started at most ``RETRIES + 1`` times for it.
    """
    return await Survival(manager, model, answer, _relay_opening, embeddings=embeddings, found=found).answered()


async def acquire_surviving(
    manager: ModelManager, model: str | None, *, embeddings: bool = False, retries: Retries | None = None
) -> tuple[LoadedModel, Lease]:
    """``manager.acquire``, loading again when the load was killed (a load that fails on its own says so), on the
    budget of ``retries`` (default: a new one)."""
    return await _acquire(manager, model, embeddings, retries or Retries())


class Retries:
    """What is left of one request's ``RETRIES``: shared by its load and its sending (``Survival``)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = RETRIES

    @property
    def taken(self) -> bool:
        """Whether the request was sent (or its model loaded) again already."""
        return self.left < RETRIES

    def another(self) -> bool:
        """Whether the request may be sent (or its model loaded) again; takes one retry when it may."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True


class Survival(Generic[R]):
    """One request on its way to an answer whose body has begun, sent again each time its llama-server dies first
    (``answered``), on the budget of ``retries`` (default: a new one); ``acquired`` has the model's name while the
    request has it.

    ``answer`` asks the model's llama-server; ``opening`` waits for what it returned to begin its body (``None``:
    it began, or there is none to wait for). The forwarded routes' answer is a response (``answer_surviving``); the
    page's chat asks for each model call of its tool loop, its answer llama-server's stream itself. Once
    ``answered`` returns, the lease is the caller's; when it raises, every lease it held was let go.
    """

    __slots__ = ("acquired", "answer", "asked", "embeddings", "found", "manager", "model", "opening", "retries")

    def __init__(
        self,
        manager: ModelManager,
        model: str | None,
        answer: Callable[[LoadedModel, Lease], Awaitable[R]],
        opening: Callable[[R], Awaitable[None] | None],
        *,
        embeddings: bool = False,
        found: tuple[LoadedModel, Lease] | None = None,
        retries: Retries | None = None,
    ) -> None:
        self.manager, self.model, self.embeddings = manager, model, embeddings
        self.answer, self.opening = answer, opening
        self.found = found
        self.asked: R | None = None  # asked of ``found``'s llama-server: its body may not have begun
        self.acquired: list[str] = []
        self.retries = retries or Retries()

    async def answered(self) -> R:
        """The response, once its body has begun: asked (again) until it does, or the retries run out."""
        while True:
            try:
                if self.asked is None:
                    await self.ask()
                return await self._begun()
            except UpstreamDiedError as exc:
                self.again(exc)

    async def ask(self) -> R:
        """The response of the model's llama-server (the model acquired first, if need be): a stream's head is
        in, its body may not have begun."""
        if self.found is None:
            self.found = await _acquire(self.manager, self.model, self.embeddings, self.retries)
        loaded, lease = self.found
        self.acquired.append(loaded.name)
        try:
            self.asked = await self.answer(loaded, lease)
        except BaseException:
            await lease()
            raise
        return self.asked

    async def _begun(self) -> R:
        """The answer asked, once its body has begun; its llama-server dying first raises ``UpstreamDiedError``,
        the answer (``opening`` closes it) and the lease let go."""
        asked, found = self.asked, self.found
        assert asked is not None and found is not None
        opening = self.opening(asked)
        if opening is not None:
            try:
                await opening
            except BaseException:
                await found[1]()
                raise
        return asked

    async def begun_within(self, seconds: float) -> R | None:
        """The response asked, if its body begins within ``seconds`` (as ``_begun`` gives it: a break before its
        first bytes raises); ``None``: not yet."""
        asked, found = self.asked, self.found
        assert isinstance(asked, Relay) and found is not None
        try:
            if not await asked.begins_within(seconds):
                return None
            await asked.first_bytes()  # at once: what it raises if the upstream broke off instead
        except BaseException:
            await found[1]()
            raise
        return asked

    def again(self, died: UpstreamDiedError) -> None:
        """Get ready to send the request again after its llama-server ``died`` before any byte of the answer (it
        takes a retry; the request's record counts the death either way).

        Raises:
            RetriesSpentError: its retries ran out.
        """
        current().retrying(died.message)  # the last one, if it ends the request, is not counted as a retry
        if not self.retries.another():
            raise _given_up(died) from died
        log.warning("sending a request again: its llama-server died first", model=self.model, error=str(died))
        self.found = self.asked = None
        self.acquired.clear()  # loading again, until the model is back


def _unbegun(response: Response) -> TypeGuard[Relay]:
    """Whether ``response`` relays an answer whose body has not begun: a death before it costs the client nothing."""
    return isinstance(response, Relay) and response.unbegun()


def _relay_opening(response: Response) -> Awaitable[None] | None:
    """The wait for a relayed answer's body to begin (``Relay.first_bytes``); ``None`` for any other response."""
    return response.first_bytes() if _unbegun(response) else None


async def _acquire(
    manager: ModelManager, model: str | None, embeddings: bool, retries: Retries
) -> tuple[LoadedModel, Lease]:
    while True:
        try:
            return await manager.acquire(model, embeddings=embeddings, waits=current)  # its trace hears each wait
        except LoadError as exc:
            if not _killed_while_loading(exc):
                raise
            current().retrying(str(exc))  # as ``Survival.again``: the request's record counts the death
            if not retries.another():
                raise _given_up(exc) from exc
            log.warning("loading again: its llama-server was killed while loading", model=model, error=str(exc))
        except DoesNotFitError as exc:
            if not retries.taken:
                raise
            # it fitted before it died: another program took the room meanwhile, which it may give back
            raise BusyError(f"{exc.message}; its llama-server died, and the memory it held is taken now") from exc


def _given_up(last: StudioError | LoadError) -> RetriesSpentError:
    """The error of a request sent again until its retries ran out, ``last`` the death that ended it: a client (and
    the soak) can tell a model that keeps dying from a death that one more try would have survived, by its code
    (``retries_spent``); its message says why the last one died, and how many times it did."""
    why = last.message if isinstance(last, StudioError) else str(last.args[0])
    tries = RETRIES + 1
    return RetriesSpentError(
        f"{why} (it died {tries} times under this request, which was sent again each time)", tries=tries
    )


def _killed_while_loading(exc: LoadError) -> bool:
    """Whether a failed load may be tried again: its llama-server was killed by a signal (a file that fails on its
    own fails again, and says so at once)."""
    return (exc.exit_code or 0) < 0


async def _answer(found: tuple[LoadedModel, Lease], answer: Answer) -> Response:
    loaded, lease = found
    try:
        return await answer(loaded, lease)
    except BaseException:
        await lease()
        raise


def _error_line(outcome: BaseException | bytes, dialect: Dialect) -> bytes:
    """The last part of a stream whose answer failed: an exception, or a whole error answer's body."""
    if isinstance(outcome, bytes):
        current().failed(None, error_message(outcome), "upstream_error")
        return stream_error_line(outcome, dialect)
    found = describe(outcome)
    if found is None:  # a bug: the client hears that much, the log the rest
        log.error("a streamed answer failed while its model loaded", exc_info=outcome)
        found = ErrorAnswer(500, f"internal error: {type(outcome).__name__}", "server_error")
    current().failed(found.status, found.message, found.code or found.type)
    return stream_error_line(json.dumps(SHAPES[dialect](found)).encode(), dialect)
