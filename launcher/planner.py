"""Decide how to run a model on this machine: GPUs, layers, context, speculative mode.

``plan(model, inventory, caps, request)`` is pure: it reads nothing from disk and
runs nothing, so every policy branch is a row in a table-driven test. Every fit
decision asks the memory estimator (``launcher.memory``) for the bill per
device and compares it with a budget: 90 % of each device's free memory (85 %
when an MTP draft is engaged: the draft context's start-up bill is measured on
Qwen3.5 only, and what it allocates after its first batch only read from the sources).
GPUs are budgeted against their free VRAM; the CPU against available RAM.

Policy:

- An explicit context is honoured. The fewest GPUs (largest free memory first)
  that hold the whole model at that context are pinned; if none do, llama-server
  places the layers itself (``--fit on``) when it can, else the largest ``-ngl``
  that fits is used.
- An automatic context aims at the model's native context (``n_ctx_train``) on
  the fewest GPUs that hold it. If no set of GPUs does, the context shrinks
  (rounded down to 256, never below 4096 unless the native context is smaller)
  on the fewest GPUs that reach the largest context possible. If even the
  smallest context does not fit, it falls back to that context and ``--fit on``
  (or the largest ``-ngl``).
- A MoE model that does not fit fully offloaded (at the context asked, or at the smallest automatic
  one) keeps the routed experts of its first N blocks on the CPU (``--n-cpu-moe N``, the fewest N
  that fit: ``expert_split``) before ``--fit`` or a lower ``-ngl`` is considered, so every block's
  attention and KV cache stay on the GPUs; an automatic context then grows to the largest that
  split allows.
- A machine without usable GPUs (none found, or none the binary has a backend
  for: see ``launcher.devices``) plans against available RAM with ``-ngl 0``.
- With RPC workers (``launcher.rpc``) that answered, the layers go over every
  device: the workers' devices (first, as llama-server orders them), the local
  GPUs, and, without local GPUs, the local CPU too, each in proportion to its free
  memory (``-ngl`` leaves the CPU's share, ``--tensor-split`` divides the rest). Workers whose
  devices report less free memory than their total (GPU workers; a CPU worker reports all of its
  RAM free) are planned like GPUs instead: every layer on them, then the MoE expert split.
  ``--fit`` is never used with workers: llama.cpp's fit is unreliable over RPC
  (llama.cpp #18175 counts 0-byte buffers, #21801 still runs out of memory). The
  context is chosen as without workers, against every device's budget.
- A multimodal projector goes where llama-server puts it, on the first pinned GPU,
  and its weights and warm-up compute buffer count in that GPU's bill. When the plan
  with it there is not the best one (the model no longer fits fully offloaded, or
  the automatic context shrinks), the plan is made again with the projector on the
  CPU (``--no-mmproj-offload``), and kept when it is better; a reason says so.
- Slots (``-np``): as requested; else 4 on one unified KV cache (``--kv-unified``, llama-server's own
  ``-np -1``) wherever the model runs: on GPUs batching several requests is where the throughput is, and
  on the CPU several clients at once get more from one batch than from one slot serving them in turn
  (``scripts/bench_concurrency.py`` measures it against llama-server's own default); 1 for an embedding
  instance. The default slots share one unified cache: its cells are the context's (each slot may fill
  them all), so a full-attention cache costs what one slot's does; what they add, all on the bill, is a
  window per slot in a sliding-window cache (``n_swa x slots + n_ubatch`` cells), an output row of logits
  per slot, and those rows in the compute buffer. Requested slots share a unified cache on GPUs and split
  the context between them on the CPU, as before.
- Threads: as requested; else the CPU's usable physical cores (``Device.cores``), divided among the
  resident models that run layers on the CPU (``PlanRequest.cpu_sharers``, this one included) when this
  one does too: llama.cpp's threads spin while they wait, so servers that each take every core thrash.
  A fully offloaded model keeps every core.
- Flash attention: as requested, except off with a quantized cache (refused); else on when the cache
  type is quantized, llama-server's auto otherwise.
- An embedding instance (``PlanRequest.embeddings``: ``--embeddings``, beside the model's chat instance),
  or a model given ``--embeddings`` without ``--pooling``, pools as the file says (``<arch>.pooling_type``
  mean, cls or last), else by the mean of the tokens (``embedding_pooling``). An embedding instance's
  automatic context is one physical batch (``EMBEDDING_CTX``, 512 tokens), since llama-server embeds a
  mean- or CLS-pooled input in one batch, or up to ``EMBEDDING_CTX_LAST`` tokens for last-token pooling,
  which it can split; it speculates nothing and keeps no prompt cache. The bill counts what
  ``--embeddings`` costs (an instance's, or among the extra flags): every token of a batch is an output,
  so the logits of 512 tokens in the compute buffer and, after the first input, in the output buffer
  (SmolLM2-135M at 512 tokens: 102.2 MiB of compute allocated, 104.7 billed; 15 without ``--embeddings``).

The plan keeps the reasons for each decision, in words a user can act on.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import gguf
from gguf.projector import ProjectorFacts, projector_facts, width_mismatch
from launcher import spec_measurements, speculative
from launcher.capabilities import Capabilities
from launcher.chat_templates import check_chat_template, renders_with_jinja, uses_jinja
from launcher.context_shape import needs_flash_attn, slot_context
from launcher.devices import Device, Inventory
from launcher.errors import LauncherError
from launcher.extra_args import validate_extra_args
from launcher.memory import (
    CACHE_TYPES,
    FLASH_ATTN,
    CacheType,
    DeviceBill,
    FlashAttn,
    MemoryBill,
    MemoryOptions,
    estimate,
    for_file,
    layer_devices,
    moe_split_gaps,
    projector_compute_bytes,
)
from launcher.rpc import LINK_WARNING
from launcher.sampling import Sampling
from launcher.spec_measurements import SpecMeasurement
from launcher.speculative import SpecModel, SpecPlan
from launcher.thinking import load_thinking
from launcher.units import MIB, format_size

if TYPE_CHECKING:
    from gguf.facts import ModelFacts
    from gguf.model import GGUFFile

Offload = Literal["ngl", "fit"]
#: ``--pooling`` values (llama.cpp's llama_pooling_type, by number); ``rank`` is a reranker's.
Pooling = Literal["none", "mean", "cls", "last", "rank"]
POOLINGS: tuple[Pooling, ...] = ("none", "mean", "cls", "last", "rank")
#: The flags that make llama-server an embedding server (``--rerank`` too: it sets ``params.embedding``).
EMBEDDING_FLAGS = frozenset({"--embedding", "--embeddings", "--rerank", "--reranking"})
#: ...of which these choose the pooling themselves (``rank``).
RERANK_FLAGS = frozenset({"--rerank", "--reranking"})

#: Share of a device's free memory a plan may use; the rest absorbs estimator error and other programs.
BUDGET_FRACTION = 0.90
#: The same with an MTP draft engaged: the draft's growth after its first batch is from the sources, unmeasured.
MTP_BUDGET_FRACTION = 0.85
#: An automatic context never shrinks below this (unless the model's own context is smaller).
MIN_AUTO_CTX = 4096
CTX_STEP = 256
#: Estimates one plan may ask for: a backstop, since each estimate is linear in the blocks. Each search is a
#: bisection: a context in [256, native] (the facts refuse a native context above 2**27: at most 20 estimates), a
#: layer count in [0, blocks + 1] (the facts refuse more than 1024 blocks: at most 12). An automatic context on G
#: GPUs tries the native one on each set of GPUs, then searches the context on each (21 G), a split searches the
#: layers (12), the slider's end searches the context from 256 on each set until one reaches the native context,
#: then on the split (20 G + 20): at most 41 G + 33 (370 with 8 GPUs), and the same bill is never estimated twice.
MAX_ESTIMATES = 2000
#: The automatic prompt cache (``--cache-ram``): room for this many copies of the model's whole KV cache...
PROMPT_CACHE_KV_COPIES = 2
#: ...but at most this share of the host memory the plan leaves free, so it never crowds out the next model...
PROMPT_CACHE_ROOM_SHARE = 0.25
#: ...and at most this much (llama-server's own default is 8 GiB, on no bill).
PROMPT_CACHE_MAX = 4096 * MIB
#: An embedding instance's automatic context: llama-server's physical batch (``-ub``, 512), which holds a mean- or
#: CLS-pooled input whole (a longer one is refused: llama-server cannot split it), one slot...
EMBEDDING_CTX = 512
#: ...and with last-token pooling, which llama-server splits over batches, up to this (or the native context).
EMBEDDING_CTX_LAST = 2048
#: Slots a model gets by default, on one unified KV cache: llama-server's own ``-np -1``.
DEFAULT_SLOTS = 4
#: The same, by its older name (GPU plans had it first).
GPU_SLOTS = DEFAULT_SLOTS
#: Backends whose GPUs a vendor tool reports; preferred over devices only llama-server lists.
_VENDOR_BACKENDS = ("CUDA", "ROCm")


class PlanError(LauncherError, ValueError):
    """The request cannot be planned (a bad context, parallel count or cache type)."""


class ProjectorError(PlanError):
    """The multimodal projector is not one, or does not fit the model (another embedding width)."""

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class ModelInfo:
    """The model as the planner sees it: facts, sizes, and an optional multimodal projector."""

    path: Path
    facts: ModelFacts
    file_bytes: int  # every shard
    cpu_repack_bytes: int = 0  # see ``launcher.memory.for_file``
    weight_padding_bytes: int = 0
    mmproj: Path | None = None
    mmproj_bytes: int = 0  # the projector's weights
    mmproj_compute_bytes: int = 0  # its warm-up compute buffer (``launcher.memory.projector_compute_bytes``)
    projector: ProjectorFacts | None = None  # what it encodes (vision, audio), from its own metadata
    #: per ``--n-cpu-moe N``, the offloaded tensors the CPU's mapped buffer spans (``launcher.memory.moe_split_gaps``)
    moe_gaps: tuple[int, ...] = ()

    @classmethod
    def from_gguf(cls, model: GGUFFile, *, mmproj: GGUFFile | None = None) -> ModelInfo:
        """Return the planner's view of a parsed model file and, if given, the parsed projector beside it.

        Raises:
            PlanError: ``mmproj`` is not a projector, or projects to another width than the model's.
        """
        options = for_file(model)
        info = cls(
            path=model.path,
            facts=model.facts,
            file_bytes=model.file_size,
            cpu_repack_bytes=options.cpu_repack_bytes,
            weight_padding_bytes=options.weight_padding_bytes,
            moe_gaps=moe_split_gaps(model) if any(model.facts.expert_weight_bytes) else (),
        )
        if mmproj is None:
            return info
        projector = projector_facts(mmproj)
        problem = (
            width_mismatch(projector, model)
            if projector is not None
            else f"it is a {mmproj.metadata.get('general.architecture')!r} model, not a clip projector"
        )
        if problem:
            raise ProjectorError(
                f"the projector {mmproj.path} cannot be used with {model.path.name}: {problem}", path=mmproj.path
            )
        assert projector is not None
        return replace(
            info,
            mmproj=mmproj.path,
            mmproj_bytes=projector.weight_bytes,
            mmproj_compute_bytes=projector_compute_bytes(projector),
            projector=projector,
        )


def load_model(path: Path, *, mmproj: Path | None = None) -> ModelInfo:
    """Return the ModelInfo of the GGUF at ``path`` (reads its header, and the projector's).

    Raises:
        GGUFError: the model or the projector is missing or malformed.
        ProjectorError: the projector does not fit the model.
    """
    return ModelInfo.from_gguf(gguf.read(path), mmproj=gguf.read(mmproj) if mmproj is not None else None)


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for; ``None`` fields are the planner's to choose."""

    n_ctx: int | None = None  # None: automatic
    #: server slots; None: 4 on a unified KV cache, 1 for an embedding instance (see the module docstring)
    n_parallel: int | None = None
    cache_type_k: CacheType = "f16"
    cache_type_v: CacheType = "f16"
    spec: str = "auto"  # a speculative mode, llama.cpp spellings accepted
    spec_n_max: int | None = None
    extra_args: tuple[str, ...] = ()
    threads: int | None = None  # None: the usable physical cores, divided among ``cpu_sharers``
    threads_batch: int | None = None  # prompt-processing threads; None: llama-server's default, ``threads``
    #: Resident models running layers on the CPU, this one included (the model manager counts them): an automatic
    #: thread count gives each its share of the cores instead of all of them.
    cpu_sharers: int = 1
    flash_attn: FlashAttn | None = None  # None: on when the cache type needs it, else llama-server's auto
    context_shift: bool = False  # False: a conversation past the context is an error, not silently shifted
    alias: str | None = None  # the model name clients see; None: the file name without .gguf
    chat_template: str | None = None  # a Jinja template, or a llama.cpp built-in's name, overriding the model's own
    #: render chat templates with Jinja (--jinja) or llama-server's built-in renderer (--no-jinja, no tool calls);
    #: None: Jinja, unless ``chat_template`` names a built-in (``launcher.chat_templates``)
    jinja: bool | None = None
    cache_ram_mib: int | None = None  # the prompt cache's cap (``--cache-ram``) in MiB; 0: off; None: automatic
    #: Where ``ggstudio bench-spec`` stores its measurements (``launcher.spec_measurements``); with one for this
    #: model, devices and binary, ``auto`` takes the measured winner. None: the policy alone.
    spec_measurements: Path | None = None
    embeddings: bool = False  # an embedding instance: --embeddings and a pooling (see the module docstring)
    sampling: Sampling = Sampling()  # sampling defaults and the answer limit it starts with
    #: thinking on or off at load (the template's switch); None: the template's default, or off for a small model
    #: of an architecture that starts small ones so (``launcher.thinking``)
    thinking: bool | None = None


@dataclass(frozen=True)
class DevicePlan:
    """One device's predicted bill against its budget."""

    name: str  # the bill's name: "CPU", "GPU<i>" for the i-th pinned GPU, "RPC<i>[host:port]" for a worker's device
    device: Device
    bill: DeviceBill
    budget_bytes: int

    @property
    def fits(self) -> bool:
        return self.bill.total <= self.budget_bytes


@dataclass(frozen=True)
class LaunchPlan:
    """How to run one model: the decisions, the predicted memory, and why."""

    model: ModelInfo
    request: PlanRequest
    gpus: tuple[Device, ...]  # pinned local GPUs in the child's order (GPU0 first); () = none
    offload: Offload  # "ngl": ``-ngl n_gpu_layers``; "fit": ``--fit on`` decides the layers
    n_gpu_layers: int  # with "fit": the estimator's guess of what --fit will choose
    tensor_split: tuple[int, ...]  # -ngl over several devices: free MiB per RPC device, then per pinned GPU; else ()
    n_ctx: int
    n_ctx_auto: bool
    max_safe_ctx: int  # the largest context that fits the budget (GUI slider); 0 if none does
    native_ctx: int
    n_parallel: int
    cache_type_k: CacheType
    cache_type_v: CacheType
    flash_attn: FlashAttn
    threads: int | None  # ``--threads``; None: the command builder's ``usable_cores()`` (the inventory had no count)
    threads_batch: int | None  # ``--threads-batch``; None: llama-server's default (``--threads``)
    context_shift: bool
    mmproj_offload: bool  # the projector (if any) on the first pinned GPU; False: ``--no-mmproj-offload``
    budget_fraction: float
    fit_target_mib: tuple[int, ...]  # --fit-target margins per pinned GPU, with "fit"
    bill: MemoryBill
    devices: tuple[DevicePlan, ...]  # RPC devices, pinned GPUs, then the CPU
    spec: SpecPlan
    extra_args: tuple[str, ...]
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    rpc_devices: tuple[Device, ...] = ()  # the RPC workers' devices the layers are split over (``RPC<n>`` order)
    cache_ram_mib: int | None = None  # ``--cache-ram``, on the CPU's bill as ``prompt_cache``; None: flag missing
    pooling: Pooling | None = None  # an embedding server's ``--pooling`` (an embedding instance's, or ``--embeddings``)
    thinking: bool | None = None  # the template's thinking switch at load; None: its own default (launcher.thinking)
    kv_unified: bool = False  # ``--kv-unified``: the slots share one KV cache of ``n_ctx`` cells
    #: ``--n-cpu-moe``: the routed experts of blocks 0..N-1 stay on the CPU, the rest of every block offloaded
    n_cpu_moe: int = 0

    @property
    def slot_ctx(self) -> int:
        """The tokens one slot may hold: the whole context on a unified cache, else its share."""
        return self.n_ctx if self.kv_unified else self.n_ctx // max(self.n_parallel, 1)

    @property
    def rpc_workers(self) -> tuple[str, ...]:
        """The workers' endpoints for ``--rpc``, in order."""
        return tuple(dict.fromkeys(d.endpoint for d in self.rpc_devices if d.endpoint))

    @property
    def fits(self) -> bool:
        """The predicted bill is within budget on every device."""
        return all(d.fits for d in self.devices)

    @property
    def gpu_backend(self) -> str | None:
        return self.gpus[0].backend if self.gpus else None

    @property
    def mtp_engaged(self) -> bool:
        return _mtp_engaged(self.spec, self.extra_args)

    @property
    def layers_on_cpu(self) -> bool:
        """Some layers run on the local CPU, so its threads compete with other models' for the cores."""
        offloaded = self.gpus or self.rpc_devices
        return not offloaded or self.n_gpu_layers < self.model.facts.block_count + 1 or self.n_cpu_moe > 0


def plan(
    model: ModelInfo, inventory: Inventory, caps: Capabilities, request: PlanRequest = PlanRequest()
) -> LaunchPlan:
    """Return the launch plan for ``model`` on ``inventory``'s devices with ``caps``' binary.

    Raises:
        PlanError: an invalid context, parallel count, thread count or cache type; flash attention off with a
            quantized cache; a chat template that is neither Jinja text nor a llama.cpp built-in's name, or
            a built-in's name with jinja true.
        ExtraArgsError: the extra arguments contain managed or unknown flags.
        SpeculativeConfigError: an unknown speculative mode or draft length.
        MemoryPlanError: cache types llama-server would refuse for this model.
    """
    _check(request)
    extra = validate_extra_args(request.extra_args, caps)
    with_gpu = _Planner(model, inventory, caps, request, extra).run()
    offload = (*with_gpu.rpc_devices, *with_gpu.gpus)  # llama-server's device order: the projector takes the first
    if model.mmproj is None or not offload:
        return with_gpu
    on_cpu = _Planner(model, inventory, caps, request, extra, mmproj_offload=False).run()
    if _rank(on_cpu) <= _rank(with_gpu):
        return with_gpu
    lost = (
        "the model would not fit"
        if not with_gpu.fits
        else f"only {with_gpu.n_gpu_layers} of {with_gpu.model.facts.block_count + 1} layers would fit on the GPUs"
        if _rank(with_gpu)[1] == 0
        else f"the context would be {with_gpu.n_ctx} tokens, not {on_cpu.n_ctx}"
    )
    held = format_size(model.mmproj_bytes + model.mmproj_compute_bytes, fine=True)
    why = f"projector on the CPU (--no-mmproj-offload): with its {held} on {_device(offload[0])}, {lost}"
    return replace(on_cpu, reasons=(*on_cpu.reasons, why))


def _device(d: Device) -> str:
    """``CUDA0``, or an RPC worker's device as llama-server names it."""
    return d.rpc_buffer_name or f"{d.backend}{'' if d.index is None else d.index}"


def _rank(p: LaunchPlan) -> tuple[int, int, int]:
    """How good a plan is, for choosing where the projector goes: fits, fully offloaded, then context."""
    full = p.offload == "ngl" and p.n_gpu_layers == p.model.facts.block_count + 1
    return (int(p.fits), int(full), p.n_ctx if p.n_ctx_auto else 0)


def predict(
    model: ModelInfo,
    caps: Capabilities,
    request: PlanRequest,
    *,
    n_ctx: int,
    gpus: tuple[Device, ...] = (),
    n_gpu_layers: int | None = None,
) -> MemoryBill:
    """The bill ``plan`` would predict for ``n_ctx`` tokens on exactly ``gpus`` (all layers by default).

    For what-if views (a context slider, a GPU picker) and for tests; no policy is applied.
    """
    _check(request)
    inventory = Inventory((*gpus, Device("CPU", None, "CPU", 0, 0, "psutil")), ())
    planner = _Planner(model, inventory, caps, request, tuple(request.extra_args))
    ngl = planner.full if n_gpu_layers is None else n_gpu_layers
    return planner.bill(n_ctx, ngl if gpus else 0, planner.gpus)


def parse_cache_type(value: str, what: str = "K") -> CacheType:
    """Return ``value`` as a KV cache type llama.cpp takes (``what`` names the cache in the message).

    Raises:
        PlanError: not one; the message lists the valid ones.
    """
    for known in CACHE_TYPES:
        if value == known:
            return known
    raise PlanError(f"unknown {what} cache type {value!r}; valid: {', '.join(CACHE_TYPES)}")


def _check(request: PlanRequest) -> None:
    if request.n_ctx is not None and request.n_ctx < 1:
        raise PlanError(f"the context must be a positive number of tokens, not {request.n_ctx}")
    if request.n_parallel is not None and request.n_parallel < 1:
        raise PlanError(f"the number of parallel slots must be at least 1, not {request.n_parallel}")
    for what, value in (("K", request.cache_type_k), ("V", request.cache_type_v)):
        parse_cache_type(value, what)  # a request built from untyped input (a test, a script) is checked too
    for what, count in (("threads", request.threads), ("threads_batch", request.threads_batch)):
        if count is not None and count < 1:
            raise PlanError(f"{what} must be at least 1, not {count}")
    if request.flash_attn not in (None, *FLASH_ATTN):
        raise PlanError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, not {request.flash_attn!r}")
    quantized = needs_flash_attn(request.cache_type_k, request.cache_type_v)
    if request.flash_attn == "off" and quantized:
        raise PlanError(
            f"a {'/'.join(quantized)} KV cache needs flash attention, and flash_attn is off: set flash_attn "
            "to on or auto, or use the f16 cache type"
        )
    if request.chat_template is not None and (problem := check_chat_template(request.chat_template)):
        raise PlanError(problem)
    if request.jinja and request.chat_template is not None and not renders_with_jinja(request.chat_template):
        raise PlanError(
            f"the built-in chat template {request.chat_template!r} is rendered only without Jinja, and jinja is "
            "true: leave jinja unset or false, or give the template as Jinja text"
        )


def _mtp_engaged(spec: SpecPlan, extra: tuple[str, ...]) -> bool:
    if spec.resolved in ("mtp", "mtp+ngram"):
        return True
    if spec.resolved == "user":  # the user's own --spec-type: look at its value
        for flag, value in zip(extra, extra[1:], strict=False):
            if flag == "--spec-type" and any(t in ("mtp", "draft-mtp") for t in value.split(",")):
                return True
    return False


def _gpus_of(inventory: Inventory) -> tuple[tuple[Device, ...], tuple[Device, ...]]:
    """(the GPUs a plan may use, those of other backends it leaves out): one backend per llama-server."""
    gpus = [d for d in inventory.gpus if d.index is not None and d.free_bytes > 0]
    if not gpus:
        return (), ()
    # Vendor-tool GPUs first, since their indices are what the env pins.
    backends = sorted({d.backend for d in gpus}, key=lambda b: (b not in _VENDOR_BACKENDS, b))
    return (tuple(d for d in gpus if d.backend == backends[0]), tuple(d for d in gpus if d.backend != backends[0]))


def _rpc_of(inventory: Inventory, caps: Capabilities) -> tuple[Device, ...]:
    """The RPC devices a plan may use: none when the binary has no ``--rpc``."""
    devices = tuple(d for d in inventory.rpc if d.free_bytes > 0)
    return devices if caps.supports("--rpc") else ()


def spec_devices(inventory: Inventory, caps: Capabilities) -> tuple[Device, ...]:
    """The devices a plan on ``inventory`` may run on, which key a speculative measurement: GPUs, RPC devices, CPU."""
    return (*_gpus_of(inventory)[0], *_rpc_of(inventory, caps), inventory.cpu)


def round_down(n: int, step: int = CTX_STEP) -> int:
    """``n`` rounded down to a multiple of ``step``."""
    return n // step * step


class _Planner:
    """One planning run; holds the inputs so the search helpers stay short."""

    def __init__(
        self,
        model: ModelInfo,
        inventory: Inventory,
        caps: Capabilities,
        request: PlanRequest,
        extra: tuple[str, ...],
        *,
        mmproj_offload: bool = True,
    ) -> None:
        self.model, self.facts, self.caps, self.request, self.extra = model, model.facts, caps, request, extra
        self.mmproj_offload = mmproj_offload
        self.cpu = inventory.cpu
        self.reasons: list[str] = []
        self.warnings: list[str] = list(inventory.warnings)
        self.gpus = self._usable_gpus(inventory)
        self.rpc = self._usable_rpc(inventory)
        # ``--embeddings`` among the extra flags costs what an embedding instance costs: bill it the same, and
        # pool as one would (llama-server's default for a chat model is none, which OpenAI's route refuses)
        flags = {a.split("=")[0] for a in extra}
        self.embeds = request.embeddings or bool(flags & EMBEDDING_FLAGS)
        self.pooling = self._pooling() if self.embeds and not flags & RERANK_FLAGS else None
        if request.embeddings:
            self.reasons.append("speculative decoding off and no prompt cache: an embedding instance generates nothing")
        self.spec = speculative.plan(
            "off" if request.embeddings else request.spec,
            caps,
            SpecModel.from_facts(model.facts, model.path),
            on_gpu=bool(self.gpus),
            n_max=request.spec_n_max,
            extra_args=extra,
            measured=self._measured_spec(),
        )
        self.warnings += self.spec.warnings
        self.mtp = _mtp_engaged(self.spec, extra)
        self.fraction = MTP_BUDGET_FRACTION if self.mtp else BUDGET_FRACTION
        self.native = self.facts.context_length
        # The slider and the automatic context stop at the native context, rounded down to 256.
        self.cap = max(round_down(self.native), CTX_STEP) if self.native else MIN_AUTO_CTX
        self.floor = min(MIN_AUTO_CTX, self.cap)
        self.flash_attn = self._flash_attn()
        self.n_parallel, self.kv_unified = self._slots()
        self.full = self.facts.block_count + 1  # every block plus the output layer
        # the layer bytes left on the CPU for each -ngl, summed once (every candidate split asks)
        self.cpu_layer_bytes = (0, *itertools.accumulate(self.facts.layer_weight_bytes))
        # every bill asked for, by (context, layers, GPUs, blocks whose experts stay on the CPU)
        self.bills: dict[tuple[int, int, tuple[Device, ...], int], MemoryBill] = {}
        self.n_cpu_moe = 0  # set once the plan keeps some blocks' experts on the CPU (``expert_split``)

    # -- inputs ------------------------------------------------------------------------------
    def _pooling(self) -> Pooling:
        """An embedding instance's pooling: a ``--pooling`` among the extra flags, else ``embedding_pooling``."""
        for flag, value in zip(self.extra, self.extra[1:], strict=False):
            if flag == "--pooling" and value in POOLINGS:
                self.reasons.append(f"embeddings pooled by {value}, as requested (--pooling)")
                return POOLINGS[POOLINGS.index(value)]
        pooling, why = embedding_pooling(self.facts)
        self.reasons.append(f"embeddings (--embeddings): {why}")
        return pooling

    def _usable_gpus(self, inventory: Inventory) -> tuple[Device, ...]:
        chosen, skipped = _gpus_of(inventory)
        if skipped:
            self.reasons.append(
                f"planning on the {chosen[0].backend} GPUs only; one llama-server uses one backend "
                f"(ignored: {', '.join(f'{d.backend}{d.index}' for d in skipped)})"
            )
        return chosen

    def _measured_spec(self) -> SpecMeasurement | None:
        """What ``bench-spec`` measured for this model on the devices it will run on, when ``auto`` asks."""
        if self.request.spec_measurements is None:
            return None
        try:
            if speculative.normalize_mode(self.request.spec) != "auto":
                return None
        except speculative.SpeculativeConfigError:
            return None  # speculative.plan says what is wrong with it
        return spec_measurements.lookup(
            self.request.spec_measurements, self.model.path, (*self.gpus, *self.rpc, self.cpu), self.caps
        )

    def _usable_rpc(self, inventory: Inventory) -> tuple[Device, ...]:
        devices = tuple(d for d in inventory.rpc if d.free_bytes > 0)
        if devices and not self.caps.supports("--rpc"):
            self.warnings.append(
                "this llama-server has no --rpc flag (built without -DGGML_RPC=ON): the RPC workers "
                "are left out; `ggstudio build-llama` builds the pinned llama-server with RPC"
            )
        return _rpc_of(inventory, self.caps)

    def _slots(self) -> tuple[int, bool]:
        """(slots, unified KV cache): as requested, else by where the model runs (module docstring), with the reason."""
        asked = self.request.n_parallel
        on_gpus = bool(self.gpus)  # an RPC worker's device may be a CPU: the studio cannot tell
        if asked is not None:
            unified = asked > 1 and on_gpus
            if unified:
                self.reasons.append(
                    f"slots: {asked}, as requested, on a unified KV cache: the model runs on GPUs, where the slots "
                    "share the context's cells (each may use the whole context)"
                )
            elif asked > 1:
                self.reasons.append(f"slots: {asked}, as requested; they split the context between them")
            else:
                self.reasons.append("slots: 1, as requested")
            return asked, unified
        if self.request.embeddings:
            return 1, False  # one input fills a batch (the embedding context's reason says so)
        why = (
            "the model runs on GPUs, where batching several requests is where the throughput is"
            if on_gpus
            else "on the CPU too, several clients at once get more tokens in total from one batch than from one "
            "slot serving them in turn, and a single client as much"
        )
        self.reasons.append(
            f"slots: {DEFAULT_SLOTS} on a unified KV cache, llama-server's own default: {why}; the slots share the "
            "context's cells (each may use the whole context), so the KV cache costs what one slot's does"
        )
        return DEFAULT_SLOTS, True

    def _flash_attn(self) -> FlashAttn:
        quantized = needs_flash_attn(self.request.cache_type_k, self.request.cache_type_v)
        asked = self.request.flash_attn
        if asked is not None:
            if not (self.caps.supports("--flash-attn") or self.caps.supports("-fa")):
                self.warnings.append(f"this llama-server has no --flash-attn flag; flash attention {asked} is left out")
                return "auto"
            self.reasons.append(f"flash attention {asked}, as requested")
            return asked
        if not quantized:
            return "auto"
        if not (self.caps.supports("--flash-attn") or self.caps.supports("-fa")):
            self.warnings.append("this llama-server has no --flash-attn flag; a quantized cache may be refused")
            return "auto"
        self.reasons.append(f"flash attention on: the {'/'.join(quantized)} cache needs it")
        return "on"

    # -- the estimator ---------------------------------------------------------------------
    def options(self, n_ctx: int, ngl: int, gpus: tuple[Device, ...], n_cpu_moe: int | None = None) -> MemoryOptions:
        facts = self.facts
        moe = self.n_cpu_moe if n_cpu_moe is None else n_cpu_moe
        gaps = self.model.moe_gaps
        repack = self.model.cpu_repack_bytes
        if ngl and repack:
            # Only weights left on the CPU are repacked; scale by the layer bytes that stay there.
            kept = min(max(facts.block_count + 1 - ngl, 0), len(facts.layer_weight_bytes))
            repack = repack * self.cpu_layer_bytes[kept] // max(self.cpu_layer_bytes[-1], 1)
        return MemoryOptions(
            n_ctx=n_ctx,
            n_parallel=self.n_parallel,
            kv_unified=self.kv_unified,
            cache_type_k=self.request.cache_type_k,
            cache_type_v=self.request.cache_type_v,
            flash_attn=self.flash_attn,
            n_gpu_layers=ngl if gpus else 0,
            tensor_split=tuple(float(d.free_bytes) for d in gpus) if len(gpus) > 1 else (1.0,),
            split_names=self.names(gpus),
            cpu_repack_bytes=repack,
            weight_padding_bytes=self.model.weight_padding_bytes,
            mmproj_bytes=self.model.mmproj_bytes,
            mmproj_compute_bytes=self.model.mmproj_compute_bytes,
            mmproj_offload=self.mmproj_offload,
            spec="mtp" if self.mtp else "none",
            spec_n_max=self.spec.n_draft,
            embeddings=self.embeds,
            n_cpu_moe=moe if gpus else 0,
            cpu_moe_gap_bytes=gaps[min(moe, len(gaps) - 1)] if gaps and gpus else 0,
        )

    def bill(self, n_ctx: int, ngl: int, gpus: tuple[Device, ...], n_cpu_moe: int | None = None) -> MemoryBill:
        """The estimator's bill for one candidate; the same candidate is estimated once.

        Raises:
            PlanError: the plan needs more than ``MAX_ESTIMATES`` estimates (see there).
        """
        moe = self.n_cpu_moe if n_cpu_moe is None else n_cpu_moe
        key = (n_ctx, ngl, gpus, moe)
        if key not in self.bills:
            if len(self.bills) >= MAX_ESTIMATES:
                raise PlanError(
                    f"planning {self.model.path.name} on {_count(self.gpus)} needs more than "
                    f"{MAX_ESTIMATES} memory estimates; make fewer GPUs visible (CUDA_VISIBLE_DEVICES)"
                )
            self.bills[key] = estimate(self.facts, self.options(n_ctx, ngl, gpus, moe))
        return self.bills[key]

    def with_prompt_cache(self, bill: MemoryBill) -> tuple[MemoryBill, int | None]:
        """``bill`` with the prompt cache's cap on the host's line, and that cap in MiB for ``--cache-ram``.

        llama-server keeps a prompt cache in host memory, 8 GiB by default; the studio always passes the
        cap it bills. Automatic: two copies of the KV cache, at most a quarter of the host memory this plan
        leaves free and 4 GiB. llama-server cannot resize it while running, so a model's cache is sized
        once, at its load.
        """
        if not self.caps.supports("--cache-ram"):
            self.reasons.append("prompt cache: this llama-server has no --cache-ram; its cache is not bounded")
            return bill, None
        asked = self.request.cache_ram_mib
        if asked is None and self.request.embeddings:
            mib = 0  # an embedding instance: each input is embedded once, nothing continues it (said with its pooling)
        elif asked is not None:
            mib = asked
            self.reasons.append(
                "prompt cache: off, as requested" if mib == 0 else f"prompt cache: {mib} MiB, as requested"
            )
        else:
            kv = sum(d.kv + d.recurrent for d in bill.devices)
            room = max(0, self.budget(self.cpu) - bill.device("CPU").total)
            want = min(PROMPT_CACHE_KV_COPIES * kv, PROMPT_CACHE_MAX)
            mib = min(want, int(room * PROMPT_CACHE_ROOM_SHARE)) // MIB
            why = (
                f"{PROMPT_CACHE_KV_COPIES} copies of the KV cache"
                if mib * MIB >= want - MIB
                else f"a quarter of the {format_size(room)} host memory the plan leaves"
            )
            self.reasons.append(
                f"prompt cache (--cache-ram): {mib} MiB, {why}" if mib else f"prompt cache: off ({why} is under 1 MiB)"
            )
        cpu = bill.device("CPU")
        devices = tuple(d for d in bill.devices if d.device != "CPU") + (replace(cpu, prompt_cache=mib * MIB),)
        return replace(bill, devices=tuple(sorted(devices, key=lambda d: d.device))), mib

    def budget(self, device: Device) -> int:
        if device.budget_bytes is not None:
            return device.budget_bytes
        return int(device.free_bytes * self.fraction)

    @staticmethod
    def names(devices: tuple[Device, ...]) -> tuple[str, ...]:
        """The bill's name of each offload device: an RPC device's buffer name, ``GPU<i>`` for the i-th local GPU."""
        gpus = iter(range(len(devices)))
        return tuple(d.rpc_buffer_name or f"GPU{next(gpus)}" for d in devices)

    def device_plans(self, bill: MemoryBill, gpus: tuple[Device, ...]) -> tuple[DevicePlan, ...]:
        named = [*zip(self.names(gpus), gpus, strict=False), ("CPU", self.cpu)]
        return tuple(DevicePlan(name, d, bill.device(name), self.budget(d)) for name, d in named)

    def fits(
        self, n_ctx: int, ngl: int, gpus: tuple[Device, ...], *, cpu: bool = True, n_cpu_moe: int | None = None
    ) -> bool:
        plans = self.device_plans(self.bill(n_ctx, ngl, gpus, n_cpu_moe), gpus)
        return all(p.fits for p in plans if cpu or p.name != "CPU")

    def largest_ctx(self, ngl: int, gpus: tuple[Device, ...], low: int = CTX_STEP) -> int:
        """The largest multiple of 256 in [low, cap] that fits; 0 when not even ``low`` does."""
        lo = max(low // CTX_STEP, 1)
        found = _largest(lambda c: self.fits(c * CTX_STEP, ngl, gpus), lo, self.cap // CTX_STEP)
        return found * CTX_STEP if found >= lo else 0

    def expert_split(self, n_ctx: int, gpus: tuple[Device, ...]) -> bool:
        """Keep the routed experts of the fewest blocks on the CPU so that the rest of every block fits ``gpus``.

        Attention, shared weights, the KV cache and the compute buffers stay offloaded, and only the experts (most
        of a MoE model's bytes, a few of them read per token) run on the CPU: much faster than moving whole blocks,
        whose attention and cache would then run on the CPU too. False (nothing set) when the model has no routed
        experts, the binary no ``--n-cpu-moe``, or even every block's experts on the CPU leave too much.
        """
        experts = self.facts.expert_weight_bytes
        if not any(experts) or not self.caps.supports("--n-cpu-moe"):
            return False
        last = max(il for il, nbytes in enumerate(experts) if nbytes) + 1
        n = _smallest(lambda k: self.fits(n_ctx, self.full, gpus, cpu=False, n_cpu_moe=k), 1, last)
        if n > last:
            return False
        self.n_cpu_moe = n
        moved = sum(1 for nbytes in experts[:n] if nbytes)
        held = format_size(sum(experts[:n]))
        self.reasons.append(
            f"--n-cpu-moe {n}: the routed experts of {moved} of {sum(1 for b in experts if b)} MoE layers "
            f"({held}) stay on the CPU, the fewest that let every layer's attention, the shared weights, the KV "
            f"cache and the compute buffers fit on {_count_devices(gpus)} at {n_ctx} tokens; the model does not fit "
            "fully offloaded, and moving only experts (a few read per token) keeps more on the GPUs than lowering -ngl"
        )
        return True

    def largest_ngl(self, n_ctx: int, gpus: tuple[Device, ...]) -> int:
        """The most layers whose GPU share fits (the CPU side is checked, and warned about, apart)."""
        return max(_largest(lambda n: self.fits(n_ctx, n, gpus, cpu=False), 0, self.full), 0)

    def gpu_prefixes(self) -> list[tuple[Device, ...]]:
        """The 1, 2, ... GPUs with the most free memory, each set in index order."""
        ranked = sorted(self.gpus, key=lambda d: (-d.free_bytes, d.index))
        return [tuple(sorted(ranked[:k], key=lambda d: d.index or 0)) for k in range(1, len(ranked) + 1)]

    def fewest_gpus(self, test: Callable[[tuple[Device, ...]], bool]) -> tuple[Device, ...] | None:
        """The smallest of ``gpu_prefixes`` passing ``test``."""
        return next((g for g in self.gpu_prefixes() if test(g)), None)

    @property
    def all_gpus(self) -> tuple[Device, ...]:
        return tuple(sorted(self.gpus, key=lambda d: d.index or 0))

    # -- the policy ------------------------------------------------------------------------
    def run(self) -> LaunchPlan:
        if self.native == 0:
            self.warnings.append(f"the model does not say its native context; assuming {MIN_AUTO_CTX}")
        if self.rpc:
            gpus, offload, ngl, n_ctx = self.over_workers()
        elif self.request.n_ctx is None and self.request.embeddings:
            gpus, offload, ngl, n_ctx = self.explicit_ctx(self.embedding_ctx(), asked=False)
        elif self.request.n_ctx is None:
            gpus, offload, ngl, n_ctx = self.auto_ctx()
        else:
            gpus, offload, ngl, n_ctx = self.explicit_ctx(self.request.n_ctx)
        return self.finish(gpus, offload, ngl, n_ctx)

    def over_workers(self) -> tuple[tuple[Device, ...], Offload, int, int]:
        """Every RPC device and local GPU (and the CPU, when there is no GPU), by free memory."""
        devices = (*self.rpc, *self.all_gpus)
        workers = len({d.endpoint for d in self.rpc})
        self.warnings.append(LINK_WARNING)
        self.reasons.append(
            f"RPC: {len(self.rpc)} device(s) on {workers} worker(s), placed ahead of the local "
            "GPUs as llama-server orders them; the studio splits the layers itself, since "
            "llama.cpp's --fit is unreliable over RPC (llama.cpp #18175, #21801)"
        )
        # workers whose devices measure their free memory are GPUs (a CPU's says all of it is free): planned like them
        like_gpus = bool(self.gpus) or all(d.free_bytes < d.total_bytes for d in self.rpc)
        if like_gpus:
            ngl = self.full
        else:
            remote = sum(d.free_bytes for d in devices)
            ngl = self.full - round(self.full * self.cpu.free_bytes / max(self.cpu.free_bytes + remote, 1))
        n_ctx = self.request.n_ctx
        if n_ctx is not None:
            self.reasons.append(f"context {n_ctx} tokens, as requested")
        else:
            n_ctx = self.largest_ctx(ngl, devices, self.floor)
            if n_ctx:
                self.reasons.append(
                    f"automatic context: {n_ctx} tokens, the largest that fits every device (native {self.native})"
                )
        if like_gpus and not self.fits(n_ctx or self.floor, ngl, devices, cpu=False):
            if self.expert_split(n_ctx or self.floor, devices):
                n_ctx = n_ctx or self.grown(self.floor, devices)
            else:
                ngl = self.largest_ngl(n_ctx or self.floor, devices)
                self.reasons.append(
                    f"-ngl {ngl}: the most layers (of {self.full}) the workers and GPUs hold; the rest stay on the CPU"
                )
                if not n_ctx:
                    n_ctx = self.largest_ctx(ngl, devices, self.floor)
        if not n_ctx:
            n_ctx = self.floor
            self.warnings.append(f"even {n_ctx} tokens do not fit every device's budget; the load may fail")
        self.reasons.append("layers by free memory: " + _layer_counts(self.facts, self.options(n_ctx, ngl, devices)))
        return devices, "ngl", ngl, n_ctx

    def auto_ctx(self) -> tuple[tuple[Device, ...], Offload, int, int]:
        where = "GPU memory" if self.gpus else "available RAM"
        if not self.gpus:
            n_ctx = self.largest_ctx(0, (), self.floor)
            if n_ctx == self.cap:
                self.reasons.append(f"automatic context: the native {self.native} tokens fit in {where}")
            elif n_ctx:
                self.reasons.append(
                    f"automatic context: {n_ctx} tokens, the largest that fits in {where} "
                    f"(native {self.native}, rounded down to 256)"
                )
            else:
                n_ctx = self.floor
                self.warnings.append(f"even {n_ctx} tokens do not fit in {where}; the load may swap or fail")
            self.reasons.append("no usable GPU: everything runs on the CPU (-ngl 0)")
            return (), "ngl", 0, n_ctx
        native_fit = self.fewest_gpus(lambda g: self.fits(self.cap, self.full, g))
        if native_fit is not None:
            self.reasons.append(
                f"automatic context: the native {self.native} tokens fit fully offloaded on "
                f"{_count(native_fit)}, the fewest GPUs that hold it"
            )
            return native_fit, "ngl", self.full, self.cap
        best: tuple[tuple[Device, ...], int] | None = None
        for chosen in self.gpu_prefixes():
            n_ctx = self.largest_ctx(self.full, chosen, self.floor)
            if n_ctx and (best is None or n_ctx > best[1]):
                best = (chosen, n_ctx)
        if best is not None:
            gpus, n_ctx = best
            self.reasons.append(
                f"automatic context: {n_ctx} tokens, the largest that fits fully offloaded "
                f"(native {self.native} does not fit; rounded down to 256) on {_count(gpus)}, "
                "the fewest GPUs that reach it"
            )
            return gpus, "ngl", self.full, n_ctx
        self.reasons.append(
            f"automatic context: even {self.floor} tokens do not fit fully offloaded on "
            f"{_count(self.gpus)}; using {self.floor} and splitting the layers with the CPU"
        )
        return self.partial(self.floor, grow=True)

    def explicit_ctx(self, n_ctx: int, *, asked: bool = True) -> tuple[tuple[Device, ...], Offload, int, int]:
        if self.native and n_ctx > self.native:
            self.warnings.append(
                f"the context {n_ctx} is beyond the model's native {self.native} tokens; quality usually drops past it"
            )
        if asked:
            self.reasons.append(f"context {n_ctx} tokens, as requested")
        if not self.gpus:
            self.reasons.append("no usable GPU: everything runs on the CPU (-ngl 0)")
            return (), "ngl", 0, n_ctx
        chosen = self.fewest_gpus(lambda g: self.fits(n_ctx, self.full, g))
        if chosen is not None:
            self.reasons.append(f"fully offloaded on {_count(chosen)}, the fewest GPUs that hold it")
            return chosen, "ngl", self.full, n_ctx
        self.reasons.append(f"the model at {n_ctx} tokens does not fit fully offloaded on {_count(self.gpus)}")
        return self.partial(n_ctx)

    def partial(self, n_ctx: int, *, grow: bool = False) -> tuple[tuple[Device, ...], Offload, int, int]:
        """Keep a MoE model's experts on the CPU (``expert_split``), else split the layers between every GPU and the
        CPU: by ``--fit`` when the binary has it. ``grow``: an automatic context, the largest the split allows."""
        gpus = self.all_gpus
        if self.expert_split(n_ctx, gpus):
            return gpus, "ngl", self.full, self.grown(n_ctx, gpus) if grow else n_ctx
        ngl = self.largest_ngl(n_ctx, gpus)
        if self.caps.supports("--fit"):
            self.reasons.append(
                f"--fit on: llama-server places the layers itself (the estimate: about {ngl} "
                f"of {self.full} on the GPUs)"
            )
            return gpus, "fit", ngl, n_ctx
        self.reasons.append(
            f"-ngl {ngl}: the most layers (of {self.full}) that fit the GPUs; this llama-server has no --fit"
        )
        return gpus, "ngl", ngl, n_ctx

    def grown(self, n_ctx: int, gpus: tuple[Device, ...]) -> int:
        """The largest automatic context the expert split allows, at least ``n_ctx``, with its reason."""
        grown = max(self.largest_ctx(self.full, gpus, n_ctx), n_ctx)
        if grown > n_ctx:
            self.reasons.append(f"automatic context: {grown} tokens, the largest that fits with that split")
        return grown

    def finish(self, gpus: tuple[Device, ...], offload: Offload, ngl: int, n_ctx: int) -> LaunchPlan:
        """The plan for these offload devices (RPC devices first, then local GPUs), layers and context."""
        bill, cache_ram_mib = self.with_prompt_cache(self.bill(n_ctx, ngl, gpus))
        devices = self.device_plans(bill, gpus)
        for d in devices:
            if not d.fits:
                self.warnings.append(
                    f"{d.name} ({d.device.name}): predicted {format_size(d.bill.total)} is over the "
                    f"budget {format_size(d.budget_bytes)}"
                )
        pct = round(self.fraction * 100)
        why = " (85 %: what an MTP draft allocates after its first batch is not measured)" if self.mtp else ""
        shared = [d for d in devices if d.device.budget_bytes is not None]
        if shared:
            self.reasons.append(
                "budget: what the studio's memory budget leaves beside the resident models: "
                + ", ".join(f"{format_size(d.budget_bytes)} on {d.name}" for d in shared)
            )
        else:
            self.reasons.append(f"budget: {pct} % of free memory per device{why}")
        if self.n_parallel > 1 and not self.kv_unified:
            per_slot = slot_context(n_ctx, self.n_parallel)
            self.reasons.append(f"{self.n_parallel} parallel slots share the context: {per_slot} tokens each")
        # The slider's end: the largest context an explicit request would still place fully in budget (it
        # may pin more GPUs than this plan does); failing that, the most this plan's layer split allows.
        if self.rpc:  # the workers are always used: the slider moves along this plan's split
            max_safe = self.largest_ctx(ngl, gpus)
        else:
            max_safe = 0
            for g in self.gpu_prefixes():
                max_safe = max(max_safe, self.largest_ctx(self.full, g))
                if max_safe == self.cap:  # no set of GPUs goes further
                    break
            max_safe = max_safe or self.largest_ctx(ngl, self.all_gpus)
        # With --fit, llama-server writes the split itself and gives up if one is passed.
        split = tuple(d.free_bytes // MIB for d in gpus) if len(gpus) > 1 and offload == "ngl" else ()
        if split:
            over = ("the RPC devices and GPUs" if self.gpus else "the RPC devices") if self.rpc else "the GPUs"
            self.reasons.append(
                f"layers split over {over} in proportion to free memory: {','.join(map(str, split))} MiB"
            )
        margins = tuple(math.ceil(d.free_bytes * (1 - self.fraction) / MIB) for d in gpus) if offload == "fit" else ()
        if bill.projector is not None:
            p = bill.projector
            where = "the CPU" if p.device == "CPU" else f"{p.device} ({_device(gpus[0])})"
            self.reasons.append(
                f"projector {self.model.mmproj.name if self.model.mmproj else ''} on {where}: "
                f"{format_size(p.weights, fine=True)} of weights and about "
                f"{format_size(p.compute, fine=True)} of compute buffer, counted in its budget"
            )
        threads = self.threads(layers_on_cpu=not gpus or ngl < self.full or self.n_cpu_moe > 0)
        if self.request.threads_batch is not None:
            self.reasons.append(f"batch threads: {self.request.threads_batch}, as requested")
        if self.request.context_shift:
            self.reasons.append(
                "context shift on, as requested: past the context, llama-server drops the oldest tokens instead of "
                "answering with an error"
            )
        thinking = self.thinking()
        self.reasons += [f"speculative: {r}" for r in self.spec.reasons]
        self.reasons += [f"estimate: {r}" for r in bill.reasons]
        return LaunchPlan(
            model=self.model,
            request=self.request,
            gpus=tuple(d for d in gpus if d.endpoint is None),
            offload=offload,
            n_gpu_layers=ngl,
            rpc_devices=tuple(d for d in gpus if d.endpoint is not None),
            cache_ram_mib=cache_ram_mib,
            pooling=self.pooling,
            thinking=thinking,
            tensor_split=split,
            n_ctx=n_ctx,
            n_ctx_auto=self.request.n_ctx is None,
            max_safe_ctx=max_safe,
            native_ctx=self.native,
            n_parallel=self.n_parallel,
            kv_unified=self.kv_unified,
            n_cpu_moe=self.n_cpu_moe,
            cache_type_k=self.request.cache_type_k,
            cache_type_v=self.request.cache_type_v,
            flash_attn=self.flash_attn,
            threads=threads,
            threads_batch=self.request.threads_batch,
            context_shift=self.request.context_shift,
            mmproj_offload=self.mmproj_offload or not gpus,
            budget_fraction=self.fraction,
            fit_target_mib=margins,
            bill=bill,
            devices=devices,
            spec=self.spec,
            extra_args=self.extra,
            reasons=tuple(self.reasons),
            warnings=tuple(dict.fromkeys(self.warnings)),
        )

    def thinking(self) -> bool | None:
        """The thinking switch passed at load (``launcher.thinking``), with its reason; None: the template's own."""
        request = self.request
        if request.embeddings or not uses_jinja(request.chat_template, request.jinja):
            return None  # an embedding instance chats not, or the built-in renderer, which takes no template kwargs
        template = request.chat_template if request.chat_template is not None else self.facts.chat_template
        decided = load_thinking(self.facts, template, request.thinking)
        if decided.reason:
            self.reasons.append(decided.reason)
        return decided.on

    def embedding_ctx(self) -> int:
        """An embedding instance's automatic context (``EMBEDDING_CTX``, ``EMBEDDING_CTX_LAST``), with the reason."""
        last = self.pooling == "last"
        want = EMBEDDING_CTX_LAST if last else EMBEDDING_CTX
        n_ctx = min(want, self.native) if self.native else want
        self.reasons.append(
            f"embedding context: {n_ctx} tokens, "
            + (
                "enough for most inputs (last-token pooling splits an input over batches)"
                if last
                else f"one physical batch: llama-server embeds a {self.pooling}-pooled input in one batch, so an "
                "input longer than that is refused and a longer context would hold nothing"
            )
        )
        return n_ctx

    def threads(self, *, layers_on_cpu: bool) -> int | None:
        """``--threads``: as requested, else the usable cores, divided among the models that run layers on the CPU.

        llama.cpp's threads spin while they wait for each other: two servers that each take every core
        thrash (``scripts/bench_threads.py`` measures it), and both generate slower than with their share each.
        """
        asked, cores, sharers = self.request.threads, self.cpu.cores, max(self.request.cpu_sharers, 1)
        if asked is not None:
            self.reasons.append(f"threads: {asked}, as requested")
            if cores is not None and asked > cores:
                self.warnings.append(f"{asked} threads on {cores} usable physical cores: they will compete for them")
            return asked
        if cores is None:
            return None
        if not layers_on_cpu or sharers == 1:
            self.reasons.append(
                f"threads: {cores}, the usable physical cores"
                + ("" if layers_on_cpu else " (every layer is offloaded; the CPU only feeds the GPUs)")
            )
            return cores
        each = max(1, cores // sharers)
        crowded = " (more residents than cores: they share them)" if sharers > cores else ""
        self.reasons.append(
            f"threads: {sharers} residents on {cores} physical cores: {each} thread{'s' if each > 1 else ''} each"
            + crowded
        )
        return each


def embedding_pooling(facts: ModelFacts) -> tuple[Pooling, str]:
    """How an embedding instance of ``facts``' model pools its token states into one vector, and why.

    The file's own ``pooling_type`` when it is mean, cls or last: an embedding model was trained for it.
    Otherwise (a chat model's file names none; ``none`` gives no vector per input, and OpenAI's route refuses
    it; ``rank`` scores instead) the mean of the tokens' states: a causal model's last state has seen the
    whole input, but a chat model trained for the next token puts that token there; the mean of every state
    is the steadier sentence vector for a model not trained to embed (SGPT, Muennighoff 2022), and what
    llama.cpp's own embedding examples use.
    """
    declared = POOLINGS[facts.pooling_type] if 0 <= facts.pooling_type < len(POOLINGS) else None
    if declared in ("mean", "cls", "last"):
        return declared, f"{declared} pooling, as the model's file says ({facts.architecture}.pooling_type)"
    said = f"the file says {declared}" if declared else "the file names no pooling, as a chat model's does"
    return "mean", f"mean pooling ({said}; the mean of the tokens' states is the steadier vector for it)"


def _layer_counts(facts: ModelFacts, options: MemoryOptions) -> str:
    """ "CPU 5, RPC0[10.0.0.2:50052] 7 + output" for a split: blocks per device, and where the output layer goes."""
    blocks, output = layer_devices(facts, options)
    counts = {name: blocks.count(name) for name in dict.fromkeys(("CPU", *blocks, output))}
    return ", ".join(
        f"{name} {n}" + (" + output" if name == output else "") for name, n in counts.items() if n or name == output
    )


def _count_devices(devices: tuple[Device, ...]) -> str:
    """ "CUDA0", "RPC0[127.0.0.1:50052]" or "2 devices (...)"."""
    names = " + ".join(_device(d) for d in devices)
    return names if len(devices) == 1 else f"{len(devices)} devices ({names})"


def _count(gpus: tuple[Device, ...]) -> str:
    """ "CUDA0" or "2 GPUs (CUDA0 + CUDA1)"."""
    names = " + ".join(f"{d.backend}{d.index}" for d in gpus)
    return names if len(gpus) == 1 else f"{len(gpus)} GPUs ({names})"


def _smallest(ok: Callable[[int], bool], low: int, high: int) -> int:
    """The smallest n in [low, high] with ``ok(n)`` (``ok`` monotone: false up to a point); high + 1 if none."""
    if high < low or not ok(high):
        return high + 1
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return low


def _largest(ok: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with ``ok(n)`` (``ok`` monotone: true up to a point); low - 1 if none."""
    if high < low or not ok(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


__all__ = [
    "BUDGET_FRACTION",
    "EMBEDDING_CTX",
    "EMBEDDING_CTX_LAST",
    "DEFAULT_SLOTS",
    "GPU_SLOTS",
    "MAX_ESTIMATES",
    "MIN_AUTO_CTX",
    "MTP_BUDGET_FRACTION",
    "DevicePlan",
    "LaunchPlan",
    "ModelInfo",
    "PlanError",
    "PlanRequest",
    "Pooling",
    "ProjectorError",
    "embedding_pooling",
    "load_model",
    "plan",
    "predict",
    "round_down",
]
