"""Errors raised by the launcher.

::

    LauncherError
    ├── BuildError                      building llama-server from the pin failed
    │   ├── ToolMissingError            a build tool (cmake, a C++ compiler, make) is absent
    │   ├── DownloadError               the registry package could not be fetched
    │   └── ChecksumError               the fetched package is not the pinned one
    ├── BinaryNotFoundError (+FileNotFoundError)  no llama-server (or ggml-rpc-server) anywhere we looked
    ├── PortInUseError (+OSError)       the port asked for is taken
    ├── RpcWorkerError (+ConnectionError)  an RPC worker did not answer (launcher.rpc)
    ├── RemoteBindError (+ValueError)   a worker asked to listen beyond loopback unasked (launcher.rpc_worker)
    ├── ProbeError                      running a tool to learn what it supports failed (launcher.capabilities)
    ├── MemoryPlanError                 options llama-server would refuse, with llama.cpp's reason (launcher.memory)
    ├── ExtraArgsError (+ValueError)    extra args name a managed flag or one the binary lacks (launcher.command)
    ├── SpeculativeConfigError (+ValueError)  a speculative mode or draft length that is not valid
    │                                   (launcher.speculative)
    ├── SlotFileError (+ValueError)     a saved slot file that is not one, or cut short (launcher.slot_files)
    ├── PlanError (+ValueError)         a request the planner cannot plan (launcher.planner)
    │   └── ProjectorError              the projector is not one, or does not fit the model
    └── ProcessError                    the llama-server child misbehaved
        ├── LoadError                   it exited while loading
        ├── StartTimeoutError (+TimeoutError)  it never became healthy in time
        ├── StartAbortedError           a stop arrived while it was starting
        └── SpeechError                 a llama-tts run failed or wrote no audio (launcher.tts)

What each means to a user (HTTP answer, CLI exit code) is in ``studio.error_table``.
Each carries its context as attributes (``path``, ``pid``, ``exit_code``,
``log_tail``...) so callers can show more than the message.
"""

from __future__ import annotations

from pathlib import Path


class LauncherError(Exception):
    """Base of every launcher error."""


class BuildError(LauncherError):
    """Building llama-server from the pinned release failed."""

    def __init__(self, message: str, *, log_tail: str = "", log_path: Path | None = None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.log_path = log_path


class ToolMissingError(BuildError):
    """A tool the build needs is not installed."""

    def __init__(self, tool: str, debian_package: str) -> None:
        super().__init__(
            f"{tool} is not installed; it is needed to build llama-server. "
            f"Install it with: apt-get install {debian_package}"
        )
        self.tool = tool
        self.debian_package = debian_package


class DownloadError(BuildError):
    """The pinned llama.cpp package could not be downloaded."""


class ChecksumError(BuildError):
    """The downloaded package's sha256 is not the pinned one."""

    def __init__(self, path: Path, expected: str, actual: str) -> None:
        super().__init__(
            f"{path.name} has sha256 {actual}, but the pin expects {expected}; "
            "the download was deleted. Retry, and if it persists, check the "
            "registry or proxy you download through."
        )
        self.path = path
        self.expected = expected
        self.actual = actual


class BinaryNotFoundError(LauncherError, FileNotFoundError):
    """No llama-server binary was found in any searched place."""

    def __init__(self, searched: list[str], *, binary: str = "llama-server") -> None:
        places = "\n".join(f"  - {s}" for s in searched)
        variable = "GGML_RPC_SERVER_PATH" if binary == "ggml-rpc-server" else "LLAMA_SERVER_PATH"
        super().__init__(
            f"{binary} was not found. Searched:\n"
            f"{places}\n"
            "Build the pinned release with `ggstudio build-llama` (or `make run`), "
            f"or set {variable} to an existing {binary}."
        )
        self.searched = searched
        self.binary = binary


class PortInUseError(LauncherError, OSError):
    """The requested port is already taken by another program."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            f"port {port} on {host} is already in use by another program; "
            "choose another with --port N (or stop the program using it)"
        )
        self.host = host
        self.port = port


class ProcessError(LauncherError):
    """The llama-server child process failed."""

    def __init__(
        self,
        message: str,
        *,
        pid: int | None = None,
        exit_code: int | None = None,
        log_tail: str = "",
        cause: str | None = None,
        hint: str | None = None,
        failed_workers: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.pid = pid
        self.exit_code = exit_code
        self.log_tail = log_tail
        self.cause = cause  # a recognised kind, e.g. "out_of_memory", or None
        self.hint = hint  # one line telling the user what to do
        self.failed_workers = failed_workers  # RPC workers (host:port) behind the failure


class LoadError(ProcessError):
    """llama-server exited before it became ready (bad model, bad flag...)."""


class SpeechError(ProcessError):
    """A ``llama-tts`` run (one utterance) exited with an error, ran past its time or wrote no WAV."""


class StartTimeoutError(ProcessError, TimeoutError):
    """llama-server did not report healthy before the deadline."""


class StartAbortedError(ProcessError):
    """A stop (or another start) cancelled a start before the server was ready."""


class SlotFileError(LauncherError, ValueError):
    """A saved llama-server slot file that is not one of this format, or is cut short."""

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path
