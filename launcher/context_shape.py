"""The context llama.cpp settles from the server options, decided once for the planner and the estimator.

``context_shape`` follows the ``llama_context`` constructor and the server: slots
(``-np`` auto = 4 on one unified cache), the context padded to 256 and, with a
split cache, each slot's share (``slot_context``), the batch sizes, the outputs a
batch may ask for, rollback snapshots, and whether flash attention runs
(``flash_attn_enabled``). ``needs_flash_attn`` is the planner's side of the same
rule: the cache types that make it ask for ``-fa on``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf.ggml_types import BY_NAME
from launcher.memory_options import MemoryOptions, MemoryPlanError

if TYPE_CHECKING:
    from gguf.facts import ModelFacts

__all__ = [
    "ContextShape",
    "context_shape",
    "flash_attn_enabled",
    "needs_flash_attn",
    "pad",
    "rollback_snapshots",
    "slot_context",
]


@dataclass(frozen=True)
class ContextShape:
    """The context sizes llama.cpp derives from the options (``llama_context`` constructor)."""

    n_seq: int
    unified: bool
    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_ubatch: int
    flash_attn: bool
    n_outputs_max: int  # logits rows one batch may ask for: n_seq x (1 + drafted tokens), at most n_batch
    n_rs_seq: int = 0  # recurrent-state rollback snapshots per slot (``rollback_snapshots``)
    embeddings: bool = False  # the outputs carry an embedding row beside the logits (``--embeddings``)

    @property
    def n_stream(self) -> int:
        """KV streams: one for a unified cache, one per slot for a split one."""
        return 1 if self.unified else self.n_seq


def pad(x: int, n: int = 256) -> int:
    """llama.cpp's GGML_PAD: ``x`` rounded up to a multiple of ``n``."""
    return (x + n - 1) // n * n


def slot_context(n_ctx: int, n_seq: int) -> int:
    """Cells each of ``n_seq`` slots gets with a split (non-unified) cache.

    ``llama_context`` pads the context to 256, divides it among the sequences and
    pads each share to 256 again (llama-context.cpp:292-298).
    """
    return pad(pad(n_ctx) // n_seq)


def context_shape(facts: ModelFacts, options: MemoryOptions) -> ContextShape:
    """n_seq, n_ctx and batch sizes as the server and ``llama_context`` settle them."""
    auto = options.n_parallel < 0
    n_seq = 4 if auto else max(1, options.n_parallel)
    unified = True if auto else bool(options.kv_unified)
    if options.n_ctx < 0 or options.n_batch < 1 or options.n_ubatch < 1:
        raise MemoryPlanError("n_ctx must be >= 0 and n_batch / n_ubatch >= 1")
    n_ctx = options.n_ctx or facts.context_length
    if n_ctx == 0:
        raise MemoryPlanError("n_ctx and the model's n_ctx_train cannot both be zero")
    if unified:
        n_ctx = n_ctx_seq = pad(n_ctx)
    else:
        n_ctx_seq = slot_context(n_ctx, n_seq)
        n_ctx = n_ctx_seq * n_seq
    n_batch = min(n_ctx, options.n_batch)
    if options.embeddings:  # server.cpp: an input is embedded in one ubatch, so n_batch = n_ubatch
        n_batch = min(n_batch, options.n_ubatch)
    n_ubatch = min(n_batch, options.n_ubatch)
    # server_output_limits: one output per slot, plus one per drafted token when speculating; embedding, every token
    n_outputs_max = n_batch if options.embeddings else min(n_batch, n_seq * (1 + max(options.spec_n_max, 0)))
    return ContextShape(
        n_seq=n_seq,
        unified=unified,
        n_ctx=n_ctx,
        n_ctx_seq=n_ctx_seq,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        flash_attn=flash_attn_enabled(facts, options),
        n_outputs_max=n_outputs_max,
        n_rs_seq=rollback_snapshots(facts, options),
        embeddings=options.embeddings,
    )


def flash_attn_enabled(facts: ModelFacts, options: MemoryOptions) -> bool:
    """Whether llama.cpp ends up running flash attention under ``options`` (``-fa auto`` resolves to on).

    Raises:
        MemoryPlanError: cache types llama.cpp refuses for this model or without flash attention.
    """
    k, v = BY_NAME[options.cache_type_k.upper()], BY_NAME[options.cache_type_v.upper()]
    if (facts.is_mla or facts.traits.kv_types_must_match) and options.cache_type_k != options.cache_type_v:
        raise MemoryPlanError(
            f"model does not support different K ({options.cache_type_k}) and V ({options.cache_type_v}) cache types"
        )
    fa = options.flash_attn
    if not facts.traits.flash_attn:
        fa = "off"  # llama.cpp forces it off whatever -fa says
    if v.quantized and fa != "on":
        if fa == "off":
            raise MemoryPlanError("quantized V cache requires flash_attn to be enabled")
        fa = "on"
    if fa != "off":
        layers = range(facts.layer_count)
        for t, head, what in ((k, facts.key_length_of, "K"), (v, facts.value_length_of, "V")):
            bad = next((head(il) for il in layers if t.quantized and head(il) % t.block_size), None)
            if bad is not None:
                raise MemoryPlanError(
                    f"{what} cache type {t.name.lower()} with block size {t.block_size} does not "
                    f"divide n_embd_head_{what.lower()}={bad}"
                )
    return fa != "off"


def needs_flash_attn(cache_type_k: str, cache_type_v: str) -> tuple[str, ...]:
    """The quantized cache types among K and V (sorted, once each): the ones that need flash attention on.

    llama.cpp refuses a quantized V cache without flash attention
    (``flash_attn_enabled``), so the planner asks for ``-fa on`` whenever either
    cache is quantized rather than leave ``auto`` to a backend's choice.
    """
    return tuple(sorted({t for t in (cache_type_k, cache_type_v) if BY_NAME[t.upper()].quantized}))


def rollback_snapshots(facts: ModelFacts, options: MemoryOptions) -> int:
    """Rollback snapshots per slot: ``--spec-draft-n-max`` with an MTP draft, where the architecture keeps them.

    common.h ``need_n_rs_seq`` (draft-mtp asks for ``n_max``), clamped to 0 by
    ``llama_context`` unless ``llm_arch_supports_rs_rollback``; the draft context itself asks for none.
    """
    mtp = options.spec == "mtp" and facts.nextn_predict_layers > 0
    return max(options.spec_n_max, 0) if mtp and facts.traits.rs_rollback else 0
