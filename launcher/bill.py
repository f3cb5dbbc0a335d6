"""What llama-server allocates for a model, per device and per cache: the estimator's bill, and the log's.

``launcher.memory.estimate`` predicts a ``MemoryBill``; ``launcher.allocations``
reads the same shape from llama-server's log, so the two compare field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CacheBill", "DeviceBill", "MemoryBill", "ProjectorBill", "RecurrentBill", "StateBill"]


@dataclass(frozen=True)
class CacheBill:
    """One attention cache as llama.cpp prints it: ``cells`` per stream, K and V bytes over all devices."""

    label: str  # "main", "non-SWA", "SWA", "indexer", or DeepSeek-V4's "DSV4 CSA compressed"...
    cells: int
    streams: int
    layers: int
    k_type: str
    v_type: str
    k_bytes: int
    v_bytes: int

    @property
    def total(self) -> int:
        return self.k_bytes + self.v_bytes


@dataclass(frozen=True)
class RecurrentBill:
    """Recurrent state (conv / shift rows ``r`` and SSM / WKV state ``s``), f32, over all devices."""

    cells: int
    rows: int  # cells * (1 + rollback snapshots)
    layers: int  # as llama.cpp prints it: the model's n_layer, whichever of them hold state
    r_bytes: int
    s_bytes: int
    p_bytes: int = 0  # qwen4exp's PLE conv history ("P" in llama.cpp's line)

    @property
    def total(self) -> int:
        return self.r_bytes + self.s_bytes + self.p_bytes


@dataclass(frozen=True)
class StateBill:
    """One DeepSeek-V4 compressor state (``llama_dsv4_comp_state``): f32 ``kv`` and ``score`` tensors per layer."""

    name: str  # "csa", "hca" or "lid" (lightning indexer)
    ratio: int
    rows: int  # state_size: rows per stream
    width: int  # n_embd_state: floats per row
    streams: int
    rs_seq: int  # rollback snapshot planes per stream (0 without speculative decoding)
    layers: int
    nbytes: int  # kv + score, all layers and devices


@dataclass(frozen=True)
class DeviceBill:
    """Bytes one device holds: ``"CPU"`` (host memory), ``"GPU<i>"``, or an RPC device, ``"RPC<i>[host:port]"``."""

    device: str
    weights: int = 0
    kv: int = 0
    recurrent: int = 0
    compute: int = 0
    output: int = 0
    output_growth: int = 0  # logits rows for drafted tokens: allocated on the first speculative batch, not at start
    compute_growth: int = 0  # what the compute buffer grows by once a prompt fills a slot (MiniMax-M3's MSA)
    projector: int = 0  # the multimodal projector's weights and compute buffer (``MemoryBill.projector`` splits them)
    #: host memory llama-server's prompt cache may fill (``--cache-ram``) as prompts come: nothing at start
    prompt_cache: int = 0
    #: the llama-server process's own host memory beyond its buffers (binary, libraries, vocabulary, HTTP
    #: server, request state): on no line of its log (``launcher.memory.process_bytes`` says how it was measured)
    process: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.kv
            + self.recurrent
            + self.compute
            + self.output
            + self.output_growth
            + self.compute_growth
            + self.projector
            + self.prompt_cache
            + self.process
        )

    @property
    def growth(self) -> int:
        """What the device's share grows by after start: drafted logits, a filled slot's compute, the prompt cache."""
        return self.output_growth + self.compute_growth + self.prompt_cache


@dataclass(frozen=True)
class ProjectorBill:
    """What the multimodal projector holds on its one device (log: ``load_hparams: model size``,
    ``reserve_compute_meta``)."""

    device: str
    weights: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.compute


@dataclass(frozen=True)
class MemoryBill:
    """Memory per device plus the caches behind the KV and recurrent lines."""

    devices: tuple[DeviceBill, ...]
    caches: tuple[CacheBill, ...]
    recurrent: tuple[RecurrentBill, ...]
    approximate: bool
    reasons: tuple[str, ...] = field(default=())
    states: tuple[StateBill, ...] = field(default=())  # DeepSeek-V4 compressor states (counted in ``kv``)
    projector: ProjectorBill | None = None  # counted in its device's ``projector``

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)

    @property
    def startup_total(self) -> int:
        """What llama-server holds once it listens (before a speculative batch grows the outputs, or a
        long prompt the compute buffer), its process line included."""
        return self.total - sum(d.growth for d in self.devices)

    @property
    def logged_total(self) -> int:
        """The share of ``startup_total`` llama-server's log prints (``-lv 4``): its buffers, not the process line."""
        return self.startup_total - self.sum_of("process")

    def device(self, name: str) -> DeviceBill:
        """The bill of ``name``; an all-zero bill when nothing lives there."""
        return next((d for d in self.devices if d.device == name), DeviceBill(name))

    def sum_of(
        self,
        part: Literal[
            "weights",
            "kv",
            "recurrent",
            "compute",
            "output",
            "output_growth",
            "compute_growth",
            "projector",
            "prompt_cache",
            "process",
        ],
    ) -> int:
        return sum(getattr(d, part) for d in self.devices)
