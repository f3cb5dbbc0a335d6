"""Recognise why llama-server failed from its own log lines, with a hint for the user.

The patterns are the pinned llama-server's wording (b11434); the reason returned
is always llama-server's own line, so an unrecognised failure still says what
the server said.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Literal

Cause = Literal[
    "out_of_memory",
    "unknown_architecture",
    "invalid_gguf",
    "missing_file",
    "unsupported_flag",
    "port_in_use",
    "rpc_worker_failed",
    "killed",
    "crashed",
]

# llama.cpp's log prefix: "0.00.004.632 E " (time, level) before the message.
_PREFIX = re.compile(r"^\s*\d+\.\d+\.\d+\.\d+ [A-Z] ")

_RULES: tuple[tuple[Cause, re.Pattern[str], str], ...] = (
    (
        "rpc_worker_failed",
        re.compile(
            r"Failed to connect to \S+|RPC handshake failed for|Remote RPC server crashed|RPC server version mismatch"
        ),
        "an RPC worker could not be reached or went away; `ggstudio doctor` shows which workers answer",
    ),
    (
        "port_in_use",
        re.compile(r"couldn't bind HTTP server socket|address already in use", re.I),
        "another program holds the port; a new port is tried automatically",
    ),
    (
        "unsupported_flag",
        re.compile(r"error: (invalid|unknown) argument|the argument has been removed", re.I),
        "this llama-server does not accept a flag we passed; check extra args or update llama-server",
    ),
    (
        "missing_file",
        re.compile(r"failed to open GGUF file .*\(No such file|No such file or directory", re.I),
        "the model file does not exist (moved or deleted?); check the path",
    ),
    (
        "unknown_architecture",
        re.compile(r"unknown model architecture", re.I),
        "this llama-server build does not know the model's architecture; use a newer llama.cpp",
    ),
    (
        "invalid_gguf",
        re.compile(
            r"invalid magic characters|not within the file bounds|failed to read|gguf_init_from_\w+: .*(invalid|failed)"
            r"|model is corrupted or incomplete|tensor .* has (invalid|wrong)",
            re.I,
        ),
        "the file is not a valid GGUF or is incomplete; download it again",
    ),
    (
        "out_of_memory",
        re.compile(
            r"out of memory|failed to allocate|cudaMalloc failed|unable to allocate|ErrorOutOfDeviceMemory"
            r"|std::bad_alloc",
            re.I,
        ),
        "not enough memory for this model and context; lower the context, offload fewer layers or use a smaller quant",
    ),
)

_ERROR_LINE = re.compile(r"^\s*\d+\.\d+\.\d+\.\d+ E |^error:|error loading model", re.I)


@dataclass(frozen=True)
class Diagnosis:
    """What went wrong: a recognised cause (or None), the server's own reason, a hint."""

    cause: Cause | None
    reason: str
    hint: str | None


def diagnose(log_lines: list[str]) -> Diagnosis:
    """Return the most specific diagnosis the log supports."""
    for cause, pattern, hint in _RULES:
        for line in log_lines:
            if pattern.search(line):
                return Diagnosis(cause, _strip(line), hint)
    errors = [line for line in log_lines if _ERROR_LINE.search(line)]
    reason = _strip(errors[0]) if errors else (_strip(log_lines[-1]) if log_lines else "no output")
    return Diagnosis(None, reason, None)


def _strip(line: str) -> str:
    return _PREFIX.sub("", line).strip()


#: Signals that mean the program itself failed (a bug, a bad instruction, an assertion), not that it was stopped.
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


def exit_by_signal(code: int, *, oom_killed: bool, log_lines: list[str]) -> Diagnosis | None:
    """Why a child that exited with ``code`` died, when a signal ended it (``code`` < 0), else None.

    A signal says more than the last log line, which is whatever llama-server printed before it died:
    ``oom_killed`` (the kernel's out-of-memory killer killed something meanwhile) names the likely cause of a
    SIGKILL; a crash signal comes with the log's last error.
    """
    if code >= 0:
        return None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL and oom_killed:
        return Diagnosis(
            "out_of_memory",
            "it was killed by SIGKILL, likely by the kernel's out-of-memory killer (the machine ran out of memory)",
            "free memory (close programs, unload models) or load a smaller model or context",
        )
    if -code in _CRASH_SIGNALS:
        said = diagnose(log_lines).reason if log_lines else "no output"
        return Diagnosis("crashed", f"it crashed ({name}); its last words: {said}", None)
    return Diagnosis("killed", f"it was killed by {name} (another program or the system stopped it)", None)
