"""The llama-server options the memory estimator reads, and the error for options llama-server refuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from launcher.errors import LauncherError

__all__ = ["CACHE_TYPES", "FLASH_ATTN", "CacheType", "FlashAttn", "MemoryOptions", "MemoryPlanError", "SpecMode"]

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"]
FlashAttn = Literal["auto", "on", "off"]
SpecMode = Literal["none", "mtp"]

CACHE_TYPES: tuple[CacheType, ...] = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
#: What ``--flash-attn`` takes.
FLASH_ATTN: tuple[FlashAttn, ...] = ("on", "off", "auto")


class MemoryPlanError(LauncherError):
    """The options are ones llama-server would refuse; the message gives llama.cpp's reason."""


@dataclass(frozen=True)
class MemoryOptions:
    """The llama-server flags that change memory, with llama-server's defaults.

    ``n_parallel=-1`` is the server's auto mode (4 slots, unified cache);
    ``kv_unified=None`` means the server's choice (unified only in auto mode).
    ``tensor_split`` gives each GPU's share of the offloaded layers (one GPU: ``(1.0,)``);
    ``split_names`` names those devices in the bill, in the same order (default ``GPU<i>``;
    RPC workers' devices go by their buffer names, ``RPC<i>[host:port]``).
    """

    n_ctx: int = 0  # 0: the model's n_ctx_train
    n_parallel: int = -1
    kv_unified: bool | None = None
    cache_type_k: CacheType = "f16"
    cache_type_v: CacheType = "f16"
    swa_full: bool = False
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: FlashAttn = "auto"
    n_gpu_layers: int = 0
    tensor_split: tuple[float, ...] = (1.0,)
    split_names: tuple[str, ...] = ()
    cpu_repack_bytes: int = 0  # weights the CPU backend copies into repacked buffers (see ``for_file``)
    weight_padding_bytes: int = 0  # alignment gaps between tensors inside the mapped file (see ``for_file``)
    mmproj_bytes: int = 0  # the multimodal projector's weights, loaded by the server on the first GPU or the CPU
    mmproj_compute_bytes: int = 0  # its compute buffer (``launcher.memory.projector_compute_bytes``)
    mmproj_offload: bool = True  # False: ``--no-mmproj-offload``, the projector stays on the CPU
    spec: SpecMode = "none"  # "mtp": an MTP draft context runs beside the main one (drafts are ``spec_n_max``)
    spec_n_max: int = 0  # tokens drafted per slot and step; each needs its own logits row when verified
    #: ``--n-cpu-moe N``: the routed experts of blocks 0..N-1 stay on the CPU, the rest of those blocks offloaded
    n_cpu_moe: int = 0
    #: with ``n_cpu_moe``: the offloaded tensors lying between the CPU's own in the file, which its mapped buffer
    #: spans too (``launcher.memory.moe_split_gaps``)
    cpu_moe_gap_bytes: int = 0
    embeddings: bool = False  # --embeddings: a batch is one ubatch, and every one of its tokens is an output
