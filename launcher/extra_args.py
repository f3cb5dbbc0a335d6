"""The user's extra llama-server arguments: refused when they name a flag the studio manages or the binary lacks.

``validate_extra_args`` runs when a plan is made (``launcher.planner``), so a bad
flag is an error before anything starts; ``launcher.command`` appends what it let
through after the flags the studio sets.
"""

from __future__ import annotations

from collections.abc import Sequence

from launcher.capabilities import Capabilities
from launcher.errors import LauncherError

__all__ = ["MANAGED_FLAGS", "ExtraArgsError", "is_flag", "normalize_flag", "validate_extra_args"]

#: Flags the studio sets itself, every spelling of the pinned build and of older ones, with what to use instead
#: (another build's alias of one of these is caught through its probed help: ``Capabilities.aliases_of``).
MANAGED_FLAGS: dict[tuple[str, ...], str] = {
    (
        "-m",
        "--model",
        "-mu",
        "--model-url",
        "-hf",
        "-hfr",
        "--hf-repo",
        "-hff",
        "--hf-file",
        "-dr",
        "--docker-repo",
    ): "the studio chooses the model",
    (
        "--host",
        "--port",
        "--reuse-port",
        "--path",
        "--api-prefix",
        "--ssl-key-file",
        "--ssl-cert-file",
    ): "the studio chooses where llama-server listens and proxies to it",
    ("--api-key", "--api-key-file"): "the studio sets a per-launch key",
    ("-a", "--alias"): "use the alias option",
    ("-c", "--ctx-size"): "use the context option",
    ("-np", "--parallel"): "use the parallel option",
    (
        "-ngl",
        "--gpu-layers",
        "--n-gpu-layers",
        "-ts",
        "--tensor-split",
        "-fit",
        "--fit",
        "-fitt",
        "--fit-target",
        "-fitc",
        "--fit-ctx",
        "-dev",
        "--device",
    ): "the planner places the layers and pins the GPUs",
    ("--rpc",): "list the workers in rpc_workers (config file) or pass --rpc to ggstudio",
    ("-t", "--threads"): "use the threads option",
    ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"): "use the cache type option",
    ("-fa", "--flash-attn"): "the planner turns flash attention on when the cache type needs it",
    ("--context-shift", "--no-context-shift"): "the studio turns context shift off (overflow is an error)",
    (
        "--jinja",
        "--no-jinja",
        "--chat-template",
        "--chat-template-file",
        "--chat-template-kwargs",
    ): "use the chat template option",
    (
        "-mm",
        "--mmproj",
        "-mmu",
        "--mmproj-url",
        "--no-mmproj",
        "--mmproj-auto",
        "--no-mmproj-auto",
        "--mmproj-offload",
        "--no-mmproj-offload",
        "-mmdev",
        "--mmproj-device",
    ): 'the studio passes the model\'s projector and places it (use the mmproj option; "none" for none)',
    (
        "-lv",
        "--verbosity",
        "--log-verbosity",
        "--log-disable",
        "--log-file",
        "--log-jsonl",
        "--no-log-jsonl",
    ): "the studio reads llama-server's log",
    ("--metrics",): "the studio always enables metrics",
    ("-cram", "--cache-ram"): "use the cache_ram option (MiB; it is on the model's memory bill)",
    (
        "-h",
        "--help",
        "--usage",
        "--version",
        "--completion-bash",
        "-cl",
        "--cache-list",
        "--list-devices",
    ): "it makes llama-server exit instead of serving",
    (
        "--models-dir",
        "--models-preset",
        "--models-max",
        "--models-autoload",
        "--no-models-autoload",
    ): "router mode is not supported for a single model",
}
_MANAGED: dict[str, str] = {flag: why for flags, why in MANAGED_FLAGS.items() for flag in flags}


class ExtraArgsError(LauncherError, ValueError):
    """Extra arguments for llama-server name flags the studio manages or the binary does not know."""

    def __init__(self, message: str, *, flags: Sequence[str]) -> None:
        super().__init__(message)
        self.flags = tuple(flags)


def normalize_flag(token: str) -> str:
    """llama.cpp reads ``--a_b`` as ``--a-b``."""
    return token.replace("_", "-") if token.startswith("--") else token


def is_flag(token: str) -> bool:
    """A flag starts with "-" and is not a negative number (a value such as ``-1`` or ``-0.5``)."""
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def validate_extra_args(args: Sequence[str], caps: Capabilities) -> tuple[str, ...]:
    """Return ``args`` as a tuple when every flag in them may be passed through.

    Raises:
        ExtraArgsError: naming each managed, removed or unknown flag, and what to do instead.
    """
    problems: list[str] = []
    offending: list[str] = []
    for token in args:
        if not is_flag(token):
            continue
        flag = normalize_flag(token)
        # a spelling this list lacks (a newer or older build's alias) is managed when one of its aliases is
        managed = next((_MANAGED[f] for f in caps.aliases_of(flag) if f in _MANAGED), None)
        if managed:
            problems.append(f"{token} is managed by the studio ({managed})")
        elif flag in caps.removed_flags:
            problems.append(f"{token} was removed from this llama-server (its --help says so)")
        elif not caps.supports(flag):
            problems.append(f"{token} is not a flag of this llama-server ({caps.binary})")
        else:
            continue
        offending.append(token)
    if problems:
        raise ExtraArgsError("extra llama-server arguments refused: " + "; ".join(problems), flags=offending)
    return tuple(args)
