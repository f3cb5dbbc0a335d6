"""The one table of what an error means to a user: HTTP status, OpenAI ``type`` and ``code``, CLI exit code.

Every error class of ``gguf``, ``launcher`` and ``studio`` has its own row (a test walks the
subclasses of the three roots and fails on one without). ``outcome`` resolves an error by its
class's method resolution order, so the most specific row wins; an error instance may narrow
the row's ``param`` and ``code`` (a ``StudioError``'s own, a ``ProcessError``'s recognised
``cause``). An ``AnsweredError`` carries another server's answer: its status, type and code
pass on, and its exit code is the one the table gives that code or status.

The HTTP layer (``studio.http.errors``) and the CLI (``studio.cli.common``: ``exit_code``, ``error_lines``)
both read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import overload

from gguf import errors as g
from launcher import errors as l
from launcher.capabilities import ProbeError
from launcher.extra_args import ExtraArgsError
from launcher.memory import MemoryPlanError
from launcher.planner import PlanError, ProjectorError
from launcher.rpc import RpcWorkerError
from launcher.rpc_worker import RemoteBindError
from launcher.speculative import SpeculativeConfigError
from studio import errors as s
from studio.chat.model_turn import TurnError
from studio.errors import Exit
from studio.library.default_model import DefaultModelError


@dataclass(frozen=True)
class Outcome:
    """What one error class means: its HTTP answer and the CLI's exit code."""

    status: int
    type: str
    code: str | None
    exit: Exit = Exit.ERROR
    param: str | None = None


_BAD = "invalid_request_error"
_SERVER = "server_error"

#: One row per error class. Order matters only to ``exit_for_answer`` (the first row with a code, else a status,
#: wins), so the rows a server's answer most often means come first.
TABLE: Mapping[type[BaseException], Outcome] = {
    # studio
    s.UpstreamError: Outcome(502, "upstream_error", None, Exit.LLAMA_FAILED),
    s.UpstreamDiedError: Outcome(502, "upstream_error", "llama_server_died", Exit.LLAMA_FAILED),
    s.RetriesSpentError: Outcome(502, "upstream_error", "retries_spent", Exit.LLAMA_FAILED),
    s.ModelNotFoundError: Outcome(404, "not_found_error", "model_not_found", Exit.NOT_FOUND, "model"),
    s.ModelNotResidentError: Outcome(404, "not_found_error", "model_not_resident", Exit.NOT_FOUND, "model"),
    s.BadRequestError: Outcome(400, _BAD, None),
    s.DoesNotFitError: Outcome(400, _BAD, "does_not_fit", Exit.DOES_NOT_FIT),
    s.PayloadTooLargeError: Outcome(413, "request_too_large", "request_too_large"),
    s.PathNotAllowedError: Outcome(403, "permission_error", "path_not_allowed", param="model"),
    s.RouteRefusedError: Outcome(403, "permission_error", "route_refused"),
    s.BusyError: Outcome(503, "server_busy", None),
    s.ModelUnloadedError: Outcome(503, "model_unloaded", "model_unloaded"),
    s.NotReadyError: Outcome(503, "model_not_ready", "model_not_ready"),
    s.WorkTimeoutError: Outcome(504, "timeout_error", "timeout"),
    s.HubError: Outcome(502, "hub_error", None),
    s.HubAuthError: Outcome(401, "authentication_error", None),
    s.HubUnreachableError: Outcome(504, "hub_error", "hub_unreachable"),
    s.DiskSpaceError: Outcome(507, "insufficient_storage", None, Exit.DOES_NOT_FIT),
    s.DownloadCancelledError: Outcome(499, "cancelled", None),
    s.AnsweredError: Outcome(502, "upstream_error", None),
    TurnError: Outcome(502, "upstream_error", None),
    # gguf: a file that is not a usable model
    g.GGUFError: Outcome(400, _BAD, "invalid_gguf", param="model"),
    g.MissingShardError: Outcome(400, _BAD, "invalid_gguf", Exit.NOT_FOUND, "model"),
    g.NotGGUFError: Outcome(400, _BAD, "invalid_gguf", param="model"),
    g.TruncatedError: Outcome(400, _BAD, "invalid_gguf", param="model"),
    g.NeedMoreBytes: Outcome(400, _BAD, "invalid_gguf", param="model"),
    g.UnsupportedVersionError: Outcome(400, _BAD, "invalid_gguf", param="model"),
    g.ImplausibleValueError: Outcome(400, _BAD, "invalid_gguf", param="model"),
    g.InconsistentHeaderError: Outcome(400, _BAD, "invalid_gguf", param="model"),
    g.CorruptHeaderError: Outcome(400, _BAD, "invalid_gguf", param="model"),
    # launcher: a request the planner refuses
    PlanError: Outcome(400, _BAD, "invalid_plan"),
    ProjectorError: Outcome(400, _BAD, "invalid_projector", param="mmproj"),
    MemoryPlanError: Outcome(400, _BAD, "invalid_options"),
    ExtraArgsError: Outcome(400, _BAD, "invalid_extra_args", param="extra_args"),
    SpeculativeConfigError: Outcome(400, _BAD, "invalid_speculative", param="spec"),
    RemoteBindError: Outcome(400, _BAD, "remote_bind_refused", Exit.USAGE),
    # launcher: llama-server (or what it needs) failed
    l.StartAbortedError: Outcome(409, "load_cancelled", "load_cancelled", Exit.LLAMA_FAILED),
    l.LoadError: Outcome(502, _SERVER, "load_failed", Exit.LLAMA_FAILED),  # a child's death is never a 500
    l.SpeechError: Outcome(502, _SERVER, "speech_failed", Exit.LLAMA_FAILED),
    l.StartTimeoutError: Outcome(502, _SERVER, "load_failed", Exit.LLAMA_FAILED),
    l.ProcessError: Outcome(502, _SERVER, "load_failed", Exit.LLAMA_FAILED),
    l.BinaryNotFoundError: Outcome(502, _SERVER, "load_failed", Exit.NOT_FOUND),
    l.PortInUseError: Outcome(502, _SERVER, "load_failed"),
    ProbeError: Outcome(502, _SERVER, "load_failed"),
    RpcWorkerError: Outcome(502, _SERVER, "rpc_worker_failed"),
    l.ToolMissingError: Outcome(502, _SERVER, "build_failed"),
    l.DownloadError: Outcome(502, _SERVER, "build_failed"),
    l.ChecksumError: Outcome(502, _SERVER, "build_failed"),
    l.BuildError: Outcome(502, _SERVER, "build_failed"),
    l.SlotFileError: Outcome(500, _SERVER, "slot_file_invalid"),
    l.LauncherError: Outcome(502, _SERVER, "load_failed"),
    # the chat history
    s.HistoryError: Outcome(500, _SERVER, "history_failed"),
    s.HistoryUnavailableError: Outcome(503, "history_unavailable", "history_unavailable"),
    s.HistoryWriteError: Outcome(507, "insufficient_storage", "history_write_failed"),
    s.ConversationNotFoundError: Outcome(404, "not_found_error", "conversation_not_found", Exit.NOT_FOUND),
    s.StreamNotFoundError: Outcome(404, "not_found_error", "stream_not_found", Exit.NOT_FOUND, "conv_id"),
    s.CaptureNotFoundError: Outcome(404, "not_found_error", "capture_not_found", Exit.NOT_FOUND),
    # one studio per home, and the library's removals (after the launcher's rows: a bare 409 answer means a
    # cancelled load, exit 5)
    s.AlreadyRunningError: Outcome(409, "conflict_error", "already_running", Exit.ALREADY_RUNNING),
    s.ModelResidentError: Outcome(409, "conflict_error", "model_resident", param="model"),
    s.StudioHomeError: Outcome(500, _SERVER, "studio_home_unusable"),
    # the studio's catch-alls
    DefaultModelError: Outcome(500, _SERVER, "default_model_unavailable"),
    s.CommandError: Outcome(500, _SERVER, None),
    s.StudioError: Outcome(500, _SERVER, None),
    # not ours, but named by a user: a path given on the command line that is not there
    FileNotFoundError: Outcome(404, "not_found_error", "file_not_found", Exit.NOT_FOUND),
}

#: The roots whose errors the service answers (any other exception is a bug: a 500 without details).
ROOTS: tuple[type[Exception], ...] = (s.StudioError, g.GGUFError, l.LauncherError)


def row(cls: type[BaseException]) -> Outcome | None:
    """The most specific row for ``cls``: its own, else its nearest mapped base's."""
    return next((TABLE[base] for base in cls.__mro__ if base in TABLE), None)


@overload
def outcome(exc: s.StudioError) -> Outcome: ...
@overload
def outcome(exc: BaseException) -> Outcome | None: ...
def outcome(exc: BaseException) -> Outcome | None:
    """What ``exc`` means to a user; ``None`` for an error that is no one's (a bug)."""
    found = row(type(exc))
    if found is None:
        return None
    if isinstance(exc, s.AnsweredError):
        return Outcome(exc.status, exc.type or found.type, exc.code, exit_for_answer(exc.status, exc.code), exc.param)
    if isinstance(exc, s.CommandError):
        return replace(found, exit=exc.exit)
    if isinstance(exc, s.StudioError):
        return replace(found, code=exc.code or found.code, param=exc.param or found.param)
    if isinstance(exc, l.ProcessError) and exc.cause:
        return replace(found, code=exc.cause)
    return found


def exit_for_answer(status: int, code: str | None) -> Exit:
    """The exit code for a server's error answer: the first row with its code, else with its status."""
    rows = list(TABLE.values())
    by_code = next((r for r in rows if code is not None and r.code == code), None)
    by_status = next((r for r in rows if r.status == status), None)
    chosen = by_code or by_status
    return chosen.exit if chosen is not None else Exit.ERROR
