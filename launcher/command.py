"""Build the llama-server argv and environment for a launch plan.

``build_command(plan, caps, binary=...)`` spells every decision of the plan as
the probed binary wants it, and leaves out flags that binary does not have (an
older build without ``--fit`` or ``--parallel`` simply runs with its defaults).
The user's extra arguments go last, as the planner passed them
(``launcher.extra_args`` has refused the flags the studio manages and flags the
binary does not know).

Secrets: each launch gets a random API key. It travels in a 0600 file
(``--api-key-file``) where the binary has it, so it never shows in ``ps``
output; every ``repr`` and the redacted argv print ``<redacted>`` instead. A
chat-template override goes into a 0600 file as well; ``LaunchCommand.cleanup``
removes those files (and a finalizer does, if nobody calls it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import site
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.capabilities import Capabilities
from launcher.chat_templates import is_builtin_template, uses_jinja
from launcher.devices import usable_cores
from launcher.errors import LoadError
from launcher.planner import EMBEDDING_FLAGS
from launcher.process import LlamaServer, free_port
from launcher.rpc import RpcWorkers, explain_failure
from launcher.supervisor import ExitExplanation, LaunchSpec
from launcher.thinking import switch_kwargs, template_of

if TYPE_CHECKING:
    from launcher.planner import LaunchPlan

HOST = "127.0.0.1"
REDACTED = "<redacted>"
#: What ``LaunchCommand.shown_argv`` puts where each launch has a value of its own, and what goes there.
PLACEHOLDERS = {
    "<port>": "the free port each launch picks",
    "<launch>": "the private folder each launch makes for its API key (a secret) and chat template files, "
    "removed when it stops",
}
#: llama-server's log verbosity at which it prints every buffer it allocates (launcher.allocations).
ALLOCATION_VERBOSITY = "4"
#: How long each RPC worker has to answer right before a launch.
WORKER_READY_TIMEOUT_S = 5.0

#: Environment variables that would override what the studio passes (llama.cpp reads LLAMA_ARG_*).
_ENV_OVERRIDES = ("LLAMA_ARG_", "LLAMA_API_KEY", "LLAMA_CHAT_TEMPLATE_KWARGS", "LLAMA_LOG_")
#: Where a CUDA toolkit keeps its libraries, under its root (``CUDA_HOME``, ``CUDA_PATH``, ``/usr/local/cuda``).
_CUDA_LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")


class Secret(str):
    """A string whose ``repr`` never shows it (``str()`` and formatting still give the value)."""

    def __repr__(self) -> str:
        return repr(REDACTED)


def chat_template_kwargs(template: str | None, thinking: bool | None = None) -> dict[str, object] | None:
    """The kwargs that start thinking as ``thinking`` says (``launcher.thinking``), else as the template's own
    default does (llama-server otherwise passes its own)."""
    found = template_of(template)  # a built-in renders no Jinja kwargs
    if found is None:
        return None
    if thinking is not None:
        return switch_kwargs(found.reasoning_style, thinking) or None
    if found.reasoning_style == "enable_thinking" and found.reasoning_default is not None:
        return {"enable_thinking": found.reasoning_default}
    return None


class LaunchCommand:
    """The argv (for any port) and environment of one launch, and the private files it needs."""

    def __init__(
        self,
        *,
        binary: Path,
        head: Sequence[str],
        tail: Sequence[str],
        env: Mapping[str, str],
        api_key: Secret,
        api_key_in_argv: bool,
        model_bytes: int,
        files_dir: Path | None,
        notes: Sequence[str],
        rpc_workers: Sequence[str] = (),
    ) -> None:
        self.binary = binary
        self._head = tuple(head)
        self._tail = tuple(tail)
        self.env = dict(env)
        self.api_key = api_key
        self.api_key_in_argv = api_key_in_argv  # an older binary without --api-key-file: redact argv in logs
        self.model_bytes = model_bytes
        self.files_dir = files_dir
        self.notes = tuple(notes)  # flags left out because the binary lacks them
        self.rpc_workers = tuple(rpc_workers)  # the --rpc endpoints, to name the one that fails
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(files_dir), True) if files_dir else None

    def argv(self, port: int) -> list[str]:
        """The full argv serving on ``port`` (it carries the API key when the binary has no key file flag)."""
        return [*self._head, "--port", str(port), *self._tail]

    @property
    def auth_headers(self) -> dict[str, str]:
        """The header every request to this launch's llama-server carries."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def server(self, log_path: Path, *, host: str = "127.0.0.1", port: int | None = None) -> LlamaServer:
        """A llama-server child running this command on ``port`` (a free one when None), not started yet: the
        form the scripts and tests that run a launch by hand use, with its key and environment."""
        port = free_port(host) if port is None else port
        return LlamaServer(self.argv(port), host=host, port=port, log_path=log_path, env=self.env, api_key=self.api_key)

    def redacted_argv(self, port: int) -> list[str]:
        """``argv(port)`` with the API key replaced: the form for logs and messages."""
        argv = self.argv(port)
        return [REDACTED if a == self.api_key and i and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]

    def shown_argv(self) -> list[str]:
        """``redacted_argv`` as every launch of this command runs it, with ``PLACEHOLDERS`` for what each
        launch makes anew: its port, and its private folder (the key file's and the template file's)."""
        argv = self.redacted_argv(0)
        argv[argv.index("--port") + 1] = "<port>"
        if self.files_dir is None:
            return argv
        return [a.replace(str(self.files_dir), str(self.files_dir.parent / "<launch>")) for a in argv]

    def launch_spec(self, *, start_timeout: float = 600.0) -> LaunchSpec:
        """The supervisor's LaunchSpec for this command."""
        return LaunchSpec(
            make_argv=self.argv,
            binary=str(self.binary),
            env=self.env,
            api_key=self.api_key,
            model_bytes=self.model_bytes,
            host=HOST,
            start_timeout=start_timeout,
            explain_exit=self._explain_exit if self.rpc_workers else None,
            before_start=self._workers_ready if self.rpc_workers else None,
        )

    def _workers_ready(self) -> None:
        """Raise LoadError unless every worker answers now: llama-server hangs on a busy one, aborts on a gone one."""
        # A worker freed by the llama-server just stopped may first drain a probe left in its one-place backlog.
        down = [r for r in RpcWorkers(self.rpc_workers, timeout=WORKER_READY_TIMEOUT_S).query() if not r.usable]
        if down:
            raise LoadError(
                "cannot start llama-server: "
                + "; ".join(f"RPC worker {r.endpoint} is not ready ({r.problem})" for r in down),
                cause="rpc_worker_failed",
                failed_workers=tuple(r.endpoint for r in down),
                hint="a worker serves one llama-server at a time; `ggstudio doctor` shows which answer",
            )

    def _explain_exit(self, log_lines: Sequence[str]) -> ExitExplanation | None:
        """Which RPC worker took llama-server down, if one did."""
        failure = explain_failure(log_lines, self.rpc_workers)
        return ExitExplanation(failure.message, failure.workers) if failure is not None else None

    def cleanup(self) -> None:
        """Remove the key and template files (idempotent); call once the server is stopped for good."""
        if self._cleanup is not None:
            self._cleanup()

    def __enter__(self) -> LaunchCommand:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"LaunchCommand({' '.join(self.shown_argv())!r})"


def build_command(
    plan: LaunchPlan,
    caps: Capabilities,
    *,
    binary: Path,
    api_key: str | None = None,
    threads: int | None = None,
    base_env: Mapping[str, str] | None = None,
    files_root: Path | None = None,
    slot_dir: Path | None = None,
) -> LaunchCommand:
    """Return the command that runs ``plan`` with ``binary`` (described by ``caps``).

    ``api_key`` defaults to a fresh random key; ``threads`` to the plan's, else
    ``usable_cores()``; ``base_env`` to this process's environment. Private files
    go in a new 0700 folder under ``files_root`` (default: the system temp dir). With ``slot_dir``,
    llama-server saves and restores slots there (``--slot-save-path``).
    """
    key = Secret(api_key or secrets.token_urlsafe(32))
    out = _Argv(caps, files_root)
    try:
        _add_flags(out, plan, key, threads)
        if slot_dir is not None:  # llama-server joins the folder and a bare file name with no separator
            out.add(("--slot-save-path",), f"{slot_dir}{os.sep}", why="slots cannot be saved across a stop")
    except BaseException:
        out.discard_files()  # nothing will own the files written so far
        raise
    return LaunchCommand(
        binary=binary,
        head=[str(binary), "-m", str(plan.model.path), "--host", HOST],
        tail=out.argv,
        env=child_env(plan, binary, base_env),
        api_key=key,
        api_key_in_argv="--api-key" in out.argv,
        model_bytes=plan.model.file_bytes,
        files_dir=out.files_dir,
        notes=out.notes,
        rpc_workers=plan.rpc_workers,
    )


class _Argv:
    """Flags spelled as one binary wants them, notes on those it lacks, and the private files."""

    def __init__(self, caps: Capabilities, files_root: Path | None) -> None:
        self.caps = caps
        self.files_root = files_root
        self.files_dir: Path | None = None
        self.argv: list[str] = []
        self.notes: list[str] = []

    def has(self, *spellings: str) -> str | None:
        return next((s for s in spellings if self.caps.supports(s)), None)

    def add(self, spellings: Sequence[str], *values: str, why: str = "") -> None:
        """Append the first spelling the binary has; without one, note ``why`` it matters (if it does)."""
        flag = self.has(*spellings)
        if flag:
            self.argv += [flag, *values]
        elif why:
            self.notes.append(f"{spellings[0]} left out: this llama-server lacks it ({why})")

    def private_file(self, name: str, text: str) -> Path:
        """Write ``text`` to a 0600 file in this launch's 0700 folder."""
        if self.files_dir is None:
            if self.files_root is not None:
                self.files_root.mkdir(parents=True, exist_ok=True)
            self.files_dir = Path(tempfile.mkdtemp(prefix="ggstudio-launch-", dir=self.files_root))
        path = self.files_dir / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def discard_files(self) -> None:
        if self.files_dir is not None:
            shutil.rmtree(self.files_dir, ignore_errors=True)


def _add_flags(out: _Argv, plan: LaunchPlan, key: Secret, threads: int | None) -> None:
    """Everything after ``--port``, in order; the user's extra arguments last."""
    request = plan.request
    out.add(("--ctx-size", "-c"), str(plan.n_ctx), why="the context is its default")
    out.add(("--parallel", "-np"), str(plan.n_parallel), why="its default slot count is used")
    if plan.kv_unified:  # an explicit -np splits the cache per slot unless told otherwise
        out.add(("--kv-unified", "-kvu"), why="each slot gets its share of the context, not the whole of it")
    if plan.rpc_workers:  # the planner left the workers out unless the binary has --rpc
        out.argv += ["--rpc", ",".join(plan.rpc_workers)]
    if plan.offload == "fit":
        out.add(("--fit", "-fit"), "on")
        if plan.fit_target_mib:
            out.add(("--fit-target", "-fitt"), ",".join(map(str, plan.fit_target_mib)))
    else:
        out.add(("--n-gpu-layers", "-ngl", "--gpu-layers"), str(plan.n_gpu_layers))
        out.add(("--fit", "-fit"), "off")  # the plan placed the layers; --fit (on by default) must not redo it
        if plan.n_cpu_moe:  # the planner asks for it only when the binary has it
            out.add(("--n-cpu-moe", "-ncmoe"), str(plan.n_cpu_moe))
    if plan.tensor_split:
        out.add(("--tensor-split", "-ts"), ",".join(map(str, plan.tensor_split)), why="llama.cpp splits by itself")
    if plan.gpus and plan.gpu_backend not in ("CUDA", "ROCm", "HIP"):  # those are pinned through the env
        # --device replaces llama-server's own device list: the RPC devices lead it, as they would by default
        out.add(
            ("--device", "-dev"),
            ",".join(f"{d.backend}{d.index}" for d in (*plan.rpc_devices, *plan.gpus)),
            why="GPUs cannot be pinned",
        )
    if plan.flash_attn == "on":
        out.add(("--flash-attn", "-fa"), "on", why="a quantized V cache may be refused")
    elif plan.flash_attn == "off":
        out.add(("--flash-attn", "-fa"), "off", why="flash attention stays llama-server's auto")
    for flags, value in (
        (("--cache-type-k", "-ctk"), plan.cache_type_k),
        (("--cache-type-v", "-ctv"), plan.cache_type_v),
    ):
        out.add(flags, value, why=f"its default f16 cache is used, not {value}" if value != "f16" else "")
    out.add(("--threads", "-t"), str(threads or plan.threads or usable_cores()))
    if plan.cache_ram_mib is not None:  # billed: llama-server's own default (8 GiB) is on no bill
        out.add(("--cache-ram", "-cram"), str(plan.cache_ram_mib))
    if plan.threads_batch is not None:
        out.add(("--threads-batch", "-tb"), str(plan.threads_batch), why="prompts are processed with --threads")
    if plan.context_shift:
        out.add(("--context-shift",), why="a conversation past the context is an error")
    else:
        out.add(("--no-context-shift",), why="it may shift the context instead of reporting an overflow")
    template = request.chat_template
    jinja = uses_jinja(template, request.jinja)
    if jinja:
        out.add(("--jinja",), why="chat templates are rendered the legacy way")
    elif request.jinja is False:
        out.add(("--no-jinja",), why="chat templates are rendered with Jinja, not as jinja = false asks")
    else:  # a built-in template's name: llama-server renders those only without Jinja
        out.add(("--no-jinja",), why=f"the name {template!r} may be read as a Jinja template")
    if template is not None and is_builtin_template(template):
        out.add(("--chat-template",), template, why="the model's own template is used")
    elif template is not None:
        if out.has("--chat-template-file"):
            out.argv += ["--chat-template-file", str(out.private_file("chat-template.jinja", template))]
        else:
            out.add(("--chat-template",), template, why="the model's own template is used")
    kwargs = chat_template_kwargs(template if template is not None else plan.model.facts.chat_template, plan.thinking)
    if kwargs and jinja:  # Jinja kwargs: the built-in renderer takes none
        out.add(("--chat-template-kwargs",), json.dumps(kwargs), why="llama-server's reasoning default applies")
    if plan.model.mmproj is not None:
        out.add(("--mmproj", "-mm"), str(plan.model.mmproj), why="images and audio cannot be used")
        if plan.gpus and not plan.mmproj_offload:
            out.add(
                ("--no-mmproj-offload",), why="the projector goes on the first GPU, where the plan has no room for it"
            )
    if out.has("--api-key-file"):
        out.argv += ["--api-key-file", str(out.private_file("api-key", f"{key}\n"))]
    else:
        out.argv += ["--api-key", key]
    out.add(
        ("-lv", "--verbosity", "--log-verbosity"), ALLOCATION_VERBOSITY, why="allocations cannot be read from its log"
    )
    out.add(("--metrics",), why="no /metrics")
    out.add(
        ("--alias", "-a"),
        request.alias or plan.model.path.name.removesuffix(".gguf"),
        why="clients see the file path as the model name",
    )
    if plan.request.embeddings and not EMBEDDING_FLAGS.intersection(plan.extra_args):
        out.add(("--embeddings", "--embedding"), why="the embedding instance cannot embed")
    if plan.pooling is not None:  # the extra flags' own --pooling wins
        if "--pooling" not in plan.extra_args:
            out.add(("--pooling",), plan.pooling, why="embeddings are pooled as the model's file says")
    if not plan.request.embeddings:  # the user's extra flags, after these, still win
        out.argv += request.sampling.argv(plan.slot_ctx)
    out.argv += [*plan.spec.argv, *plan.extra_args]


def child_env(
    plan: LaunchPlan,
    binary: Path,
    base_env: Mapping[str, str] | None = None,
    *,
    site_dirs: Sequence[str] | None = None,
    cuda_roots: Sequence[str] | None = None,
) -> dict[str, str]:
    """The child's environment: pinned GPUs, the binary's libraries, no LLAMA_ARG_* overrides.

    ``site_dirs`` and ``cuda_roots`` say where to look for CUDA libraries (``library_path``); None: this
    interpreter's site-packages, and ``CUDA_HOME``, ``CUDA_PATH`` and ``/usr/local/cuda``.
    """
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items() if not k.startswith(_ENV_OVERRIDES)}
    if cuda_roots is None:
        cuda_roots = [r for r in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda") if r]
    env["LD_LIBRARY_PATH"] = library_path(binary, env.get("LD_LIBRARY_PATH"), site_dirs, cuda_roots)
    if plan.rpc_workers:
        # A worker that dies makes llama-server abort; ggml's backtrace would first attach gdb for seconds.
        env["GGML_NO_BACKTRACE"] = "1"
    gpus = plan.gpus
    if not gpus:
        # Nothing planned on a GPU: hide them, so a GPU build cannot put buffers the plan did not count.
        env["CUDA_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = ""
        return env
    # UUIDs pin the same GPU whatever the enumeration order; indices are nvidia-smi's / rocm-smi's.
    ids = (
        ",".join(d.uuid for d in gpus if d.uuid) if all(d.uuid for d in gpus) else ",".join(str(d.index) for d in gpus)
    )
    if plan.gpu_backend == "CUDA":
        env["CUDA_VISIBLE_DEVICES"] = ids
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # index pins then mean what nvidia-smi numbered
    elif plan.gpu_backend in ("ROCm", "HIP"):
        # ROCR filters the physical devices; HIP then numbers what is left from 0.
        env["ROCR_VISIBLE_DEVICES"] = ids
        env["HIP_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
        env.pop("CUDA_VISIBLE_DEVICES", None)  # HIP reads it too; the parent's mask must not apply on top
        if any(d.integrated for d in gpus):
            # An APU's VRAM is a small carve-out of system memory; managed allocations can use the rest of it, as
            # the reference backend sets for APUs (ggml-cuda.cu reads the variable in HIP builds too).
            env.setdefault("GGML_CUDA_ENABLE_UNIFIED_MEMORY", "1")
    return env


def library_path(
    binary: Path, inherited: str | None, site_dirs: Sequence[str] | None, cuda_roots: Sequence[str]
) -> str:
    """The child's ``LD_LIBRARY_PATH``: the binary's folder, the inherited path, then the CUDA libraries found.

    A prebuilt dynamic llama-server (a release archive, a wheel) finds its ggml libraries beside it, and its
    CUDA runtime and cuBLAS in pip's NVIDIA wheels (``site-packages/nvidia/*/lib``) or a CUDA toolkit, which
    the dynamic loader does not search by itself; the reference backend adds the same folders. The inherited
    path comes before these guesses, so a user's own choice wins.
    """
    sites = site_dirs if site_dirs is not None else [*site.getsitepackages(), site.getusersitepackages()]
    toolkit = [Path(root, sub) for root in cuda_roots for sub in _CUDA_LIB_DIRS]
    pip = [lib for folder in sites for lib in sorted(Path(folder).glob("nvidia/*/lib"))]
    found = [str(d) for d in (*toolkit, *pip) if d.is_dir()]
    parts = [str(binary.resolve().parent), *filter(None, [inherited]), *found]
    return os.pathsep.join(dict.fromkeys(parts))
