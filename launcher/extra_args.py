"""The user's extra llama-server arguments: refused when they name a flag the studio manages or the binary lacks.

``validate_extra_args`` runs when a plan is made (``launcher.planner``), so a bad
flag is an error before anything starts; ``launcher.command`` appends what it let
through after the flags the studio sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from launcher.capabilities import Capabilities
from launcher.errors import LauncherError

__all__ = ["MANAGED_FLAGS", "ExtraArgsError", "Managed", "is_flag", "normalize_flag", "validate_extra_args"]

OptionKind = Literal["load", "config"]


@dataclass(frozen=True)
class Managed:
    """Why the studio sets a group of flags itself, and the studio option that sets them instead, if any."""

    why: str
    #: The option to use instead: a load option (a field of the load API's body and a ``[models.NAME]`` key of the
    #: config file) or a top-level config key; None where nothing should set it.
    option: str | None = None
    kind: OptionKind = "load"

    @property
    def advice(self) -> str:
        """What the refusal says: why, and which option to use."""
        if self.option is None:
            return self.why
        if self.kind == "config":
            return f"{self.why}; set {self.option} in the config file"
        return f"{self.why}; use the load option {self.option}"


#: Flags the studio sets itself, every spelling of the pinned build and of older ones, with what to use instead
#: (another build's alias of one of these is caught through its probed help: ``Capabilities.aliases_of``).
MANAGED_FLAGS: dict[tuple[str, ...], Managed] = {
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
    ): Managed("the studio chooses the model"),
    (
        "--host",
        "--port",
        "--reuse-port",
        "--path",
        "--api-prefix",
        "--ssl-key-file",
        "--ssl-cert-file",
    ): Managed("the studio chooses where llama-server listens and proxies to it"),
    ("--api-key", "--api-key-file"): Managed(
        "the studio sets a per-launch key; the studio's own token", "api_token", "config"
    ),
    ("-a", "--alias"): Managed("the studio serves the model under its name; more names for it", "aliases", "config"),
    ("-c", "--ctx-size"): Managed("the planner chooses the context", "n_ctx"),
    ("-np", "--parallel"): Managed("the planner sizes the slots", "n_parallel"),
    ("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"): Managed(
        "the planner shapes the KV cache with the slots (unified on GPUs, split per slot on the CPU)", "n_parallel"
    ),
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
        "-ncmoe",
        "--n-cpu-moe",
        "-cmoe",
        "--cpu-moe",
    ): Managed("the planner places the layers and pins the GPUs; the memory they may use", "memory_budget", "config"),
    ("--rpc",): Managed(
        "the planner splits the layers over the RPC workers (or pass --rpc to ggstudio)", "rpc_workers", "config"
    ),
    ("-t", "--threads"): Managed("the planner divides the cores among the resident models", "threads"),
    ("-tb", "--threads-batch"): Managed("the studio sets the prompt-processing threads", "threads_batch"),
    ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"): Managed(
        "the planner bills the KV cache by its type", "cache_type_kv"
    ),
    ("-fa", "--flash-attn"): Managed("the planner turns flash attention on when the cache type needs it", "flash_attn"),
    ("--context-shift", "--no-context-shift"): Managed(
        "the studio turns context shift off (overflow is an error)", "context_shift"
    ),
    ("--jinja", "--no-jinja"): Managed(
        "the studio renders chat templates with Jinja unless the template is a llama.cpp built-in's name", "jinja"
    ),
    ("--chat-template", "--chat-template-file"): Managed(
        "the studio passes the chat template (Jinja text, or a llama.cpp built-in's name)", "chat_template"
    ),
    ("--chat-template-kwargs",): Managed(
        "the studio passes the template's own reasoning default; a request may send chat_template_kwargs"
    ),
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
    ): Managed('the studio passes the model\'s projector and places it ("none" for none)', "mmproj"),
    (
        "-lv",
        "--verbosity",
        "--log-verbosity",
        "--log-disable",
        "--log-file",
        "--log-jsonl",
        "--no-log-jsonl",
    ): Managed("the studio reads llama-server's log"),
    ("--metrics",): Managed("the studio always enables metrics"),
    ("--slot-save-path",): Managed("the studio saves each model's slots in its own folder of the studio home"),
    ("-cram", "--cache-ram"): Managed("it is on the model's memory bill (MiB)", "cache_ram"),
    (
        "-h",
        "--help",
        "--usage",
        "--version",
        "--completion-bash",
        "-cl",
        "--cache-list",
        "--list-devices",
    ): Managed("it makes llama-server exit instead of serving"),
    (
        "--models-dir",
        "--models-preset",
        "--models-max",
        "--models-autoload",
        "--no-models-autoload",
    ): Managed("the studio itself routes between the models it finds", "model_dirs", "config"),
}
_MANAGED: dict[str, str] = {flag: managed.advice for flags, managed in MANAGED_FLAGS.items() for flag in flags}


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
