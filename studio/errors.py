"""Errors of the studio, the CLI's exit codes, and the one OpenAI-shaped body every HTTP error uses.

::

    StudioError
    ├── ModelNotFoundError (+LookupError)   a model name or path the studio cannot find
    ├── BadRequestError (+ValueError)       a request the studio refuses as given
    │   └── PayloadTooLargeError            the request body is over max_body_bytes
    ├── BusyError                           too many requests waiting, or memory held by busy models (+ Retry-After)
    ├── DoesNotFitError                     the model does not fit even with every idle model evicted
    ├── ModelNotResidentError (+LookupError) an unload, pin or TTL names a model that is not resident
    ├── ModelResidentError                  a removal names a model that is resident (unload it, or force)
    ├── ModelUnloadedError                  the model was unloaded while the request ran
    ├── NotReadyError                       a resident is loading or going away (studio.residency.resident)
    ├── WorkTimeoutError (+TimeoutError)    a header read, plan or device query ran past its time limit
    ├── PathNotAllowedError (+PermissionError) an API client named a file outside the library
    ├── RouteRefusedError (+PermissionError) a llama-server route that would reach files or programs
    ├── DefaultModelError                   the embedded default model's package is missing or bad
    │                                       (studio.library.default_model)
    ├── HubError                            Hugging Face Hub access or a download failed
    │   ├── HubAuthError (+PermissionError) the repo needs a token with access: set HF_TOKEN
    │   ├── HubUnreachableError (+ConnectionError) the Hub did not answer within the timeout
    │   ├── DiskSpaceError (+OSError)       the download does not fit on the disk
    │   └── DownloadCancelledError          the download was cancelled; the cache stays consistent
    ├── HistoryError                        the conversation store failed (studio.history)
    │   ├── HistoryUnavailableError         its database is corrupt, from a newer studio or unreadable
    │   └── HistoryWriteError (+OSError)    a write failed (a full disk): the chat goes on unsaved
    ├── ConversationNotFoundError (+LookupError) no stored conversation (or attachment) has that id
    ├── StreamNotFoundError (+LookupError)  no resident model holds a resumable stream of that conversation id
    ├── CaptureNotFoundError (+LookupError) no capture of that activity record is kept (studio.activity)
    ├── AlreadyRunningError                 another studio holds this studio home (studio.instance)
    ├── StudioHomeError (+OSError)          the studio home cannot be locked or written (a read-only folder)
    ├── UpstreamError                       llama-server failed or went away
    │   ├── UpstreamDiedError               it died before answering: the request is sent again (a few times)
    │   └── RetriesSpentError               it died under the request each time it was sent, until its retries ran out
    ├── AnsweredError                       another server answered with an error: its status and code, kept
    │   └── TurnError                       llama-server, to one model call of a chat (studio.chat.model_turn)
    └── CommandError                        a CLI command's own refusal: one line, a hint, an exit code

What each class means to a user (HTTP status, OpenAI ``type`` and ``code``, CLI exit code) is
in one table, ``studio.error_table``, with the errors of the layers below (``gguf.GGUFError``,
``launcher.errors.LauncherError``); clients receive ``{"error": {"message", "type", "param", "code"}}``.
This module imports nothing heavy, so the CLI can raise these errors without loading the service.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any


class Exit(IntEnum):
    """The CLI's exit codes (``studio.error_table`` says which error gets which)."""

    OK = 0
    ERROR = 1  # any other error
    USAGE = 2  # a bad command line (click's own code)
    NOT_FOUND = 3  # a model, GGUF file or llama-server binary that is not there
    DOES_NOT_FIT = 4  # the plan does not fit in memory, or a download does not fit on the disk
    LLAMA_FAILED = 5  # llama-server could not load or start the model
    ALREADY_RUNNING = 6  # another studio already runs in this studio home
    INTERRUPTED = 130  # Ctrl-C


class StudioError(Exception):
    """Base of the studio's own errors; ``param`` and ``code`` narrow what the table says for the class."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFoundError(StudioError, LookupError):
    """The named model is neither registered nor an existing file."""


class BadRequestError(StudioError, ValueError):
    """The request is malformed or asks for something the studio refuses."""


class PathNotAllowedError(StudioError, PermissionError):
    """An API client named a model file outside the model folders, the Hugging Face cache and the studio home."""

    def __init__(self, message: str, *, path: str, param: str = "model", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.path = path


class RouteRefusedError(StudioError, PermissionError):
    """A llama-server route the studio does not pass on: it would let a client reach files or run programs."""


class PayloadTooLargeError(BadRequestError):
    """The request body is longer than the configured ``max_body_bytes``."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class BusyError(StudioError):
    """A load is in progress and the queue of waiting requests is full."""

    def __init__(self, message: str, *, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DoesNotFitError(StudioError):
    """The plan does not fit the memory budget even with every idle, unpinned model evicted."""

    def __init__(self, message: str, *, param: str | None = "n_ctx") -> None:
        super().__init__(message, param=param)


class ModelNotResidentError(StudioError, LookupError):
    """An unload, pin or TTL change names a model that is not resident."""


class ModelUnloadedError(StudioError):
    """The model was unloaded (by a user, a TTL or an eviction) while the request was running."""


class WorkTimeoutError(StudioError, TimeoutError):
    """Blocking work (a header read, a plan, a device query) ran past its time limit."""


class HubError(StudioError):
    """The Hugging Face Hub could not be reached or answered with an error."""


class HubAuthError(HubError, PermissionError):
    """The repo is gated or private and no token with access was given (set HF_TOKEN)."""


class HubUnreachableError(HubError, ConnectionError):
    """The Hub could not be reached (refused, DNS, no answer within the timeout); nothing was changed."""


class DiskSpaceError(HubError, OSError):
    """The files still to download need more space than the cache disk has free."""

    def __init__(self, message: str, *, needed: int = 0, free: int = 0, fallback: str | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.fallback = fallback


class DownloadCancelledError(HubError):
    """The download was cancelled; complete files stay in the cache, the partial one is gone."""


class HistoryError(StudioError):
    """The conversation store failed."""


class HistoryUnavailableError(HistoryError):
    """The history database cannot be used (corrupt, from a newer studio, unreadable); the file is left as it is."""


class HistoryWriteError(HistoryError, OSError):
    """A write to the history database failed (a full disk, a read-only file): nothing of it was stored."""


class ConversationNotFoundError(StudioError, LookupError):
    """No stored conversation (or attachment) has the id asked for."""


class StreamNotFoundError(StudioError, LookupError):
    """No resident model holds a resumable stream session (``GET /v1/stream``) for the conversation id asked for."""


class CaptureNotFoundError(StudioError, LookupError):
    """No capture of that activity record is kept (captures were off, or it was dropped)."""


class UpstreamError(StudioError):
    """llama-server failed to answer or went away."""


class UpstreamDiedError(UpstreamError):
    """llama-server died under a request before the first byte of its answer."""


class RetriesSpentError(UpstreamError):
    """llama-server died under a request (or its load) each time it was sent, until its retries ran out: the model
    keeps dying, where one more try would not help. ``tries``: the times it was sent (or loaded); the last death is
    the ``__cause__``."""

    def __init__(self, message: str, *, tries: int) -> None:
        super().__init__(message)
        self.tries = tries


class AnsweredError(StudioError):
    """Another server (llama-server, or a running studio asked by the CLI) answered with an error.

    Its ``status``, ``type`` and ``code`` are the answer's own and pass on as they came.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = type
        self.hint = hint

    @classmethod
    def from_body(cls, status: int, body: bytes, *, server: str = "the studio") -> AnsweredError:
        """The error inside an answer in OpenAI's shape; a body that is not one is quoted (shortened)."""
        error = error_in(body)
        if error is None or not error.get("message"):
            text = body.decode("utf-8", "replace").strip()[:200]
            return cls(f"{server} answered HTTP {status}" + (f": {text}" if text else ""), status=status)
        code = error.get("code")
        return cls(
            str(error["message"]),
            status=status,
            type=error.get("type"),
            param=error.get("param"),
            code=code if isinstance(code, str) else None,
        )


class ModelResidentError(StudioError):
    """A removal names a model that is resident: unload it first (``--force`` does)."""


class AlreadyRunningError(StudioError):
    """Another studio holds this studio home's lock: one studio per home, and this is where the first one is."""

    def __init__(self, message: str, *, home: str, pid: int | None, url: str | None, hint: str | None = None) -> None:
        super().__init__(message)
        self.home = home
        self.pid = pid
        self.url = url
        self.hint = hint


class StudioHomeError(StudioError, OSError):
    """The studio home cannot hold the lock or the discovery file (a read-only or missing folder)."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class CommandError(StudioError):
    """A failure the CLI reports as it is: one line, an optional hint, an exit code."""

    def __init__(self, message: str, *, exit: Exit = Exit.ERROR, hint: str | None = None) -> None:
        super().__init__(message)
        self.exit = exit
        self.hint = hint


class NotReadyError(StudioError):
    """The model is not ready (loading, going away or gone): the manager decides what to do."""


def error_in(body: bytes) -> dict[str, Any] | None:
    """The ``error`` object of a body in OpenAI's error shape (llama-server's, a studio's); ``None`` if not one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) else None


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None, **extra: Any
) -> dict[str, Any]:
    """Return OpenAI's error shape; ``extra`` adds fields such as ``n_ctx``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}
