"""Predict what llama-server will allocate for a model and a set of server options.

``estimate(facts, options)`` follows the pinned llama.cpp (b11434) step by step:
the server's defaults (``-np`` auto = 4 slots on one unified cache), the context
padding in ``llama_context`` (n_ctx padded to 256; per-sequence n_ctx_seq when
the cache is split per slot; ``launcher.context_shape``, which the planner asks
too), the cache layout ``llama_model::create_memory``
picks (one cache, or a full plus a sliding-window cache; recurrent state for
Mamba/RWKV and hybrid layers), the layer placement of ``-ngl N`` (the last N
blocks, then the output layer, go to the GPUs), and the output buffer sized for
one row of logits per slot, growing to one per drafted token too once
speculative decoding verifies a draft (``server_output_limits``). KV, recurrent
state and output buffers are exact formulas; the compute buffer weighs the
tensor sizes that drive it (``launcher.compute_buffer``).

Sparse-attention indexer key caches follow ``llama_kv_cache_dsa`` /
``llama_kv_cache_dsa_iswa`` / ``llama_kv_cache_msa`` / ``llama_memory_hybrid_idx``
(a second cache with one KV head of the indexer size, printed after the "main"
cache); qwen4exp's PLE conv history is the recurrent state's "P" part.
DeepSeek-V4 follows ``llama_kv_cache_dsv4``: a raw sliding-window cache, three
compressed K caches and three f32 compressor states (``_dsv4_memory``).

Options llama-server refuses (a quantized V cache with flash attention off, a
quantized K cache whose block size does not divide the head size) raise
``MemoryPlanError`` with llama.cpp's reason. Anything the estimator does not model
(facts guessed for an unknown architecture, the MTP draft context of an
architecture other than Qwen3.5) makes the bill ``approximate`` with the
reason, never a silent 0.

With ``--spec-type draft-mtp`` the target keeps ``n_max`` rollback snapshots of
its recurrent state, and a second context (``_mtp_draft``) holds the NextN
blocks' f16 KV cache, a compute buffer for the NextN graph and its own outputs.

A multimodal projector (``--mmproj``) is a second allocation on one device: the
first GPU, or the CPU with ``--no-mmproj-offload`` or when no GPU is used
(``clip_ctx``). Its weights are exact (``clip.cpp`` allocates every tensor it
loads); its compute buffer, reserved at warm-up, is estimated by
``projector_compute_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gguf import tensor_layout
from gguf.arch_traits import architectures_with
from gguf.facts import DSV4_CSA_RATIO as _DSV4_CSA
from gguf.facts import DSV4_HCA_RATIO as _DSV4_HCA
from gguf.ggml_types import BY_NAME
from launcher import compute_buffer
from launcher.bill import CacheBill, DeviceBill, MemoryBill, ProjectorBill, RecurrentBill, StateBill
from launcher.context_shape import ContextShape, context_shape, pad
from launcher.memory_options import (
    CACHE_TYPES,
    FLASH_ATTN,
    CacheType,
    FlashAttn,
    MemoryOptions,
    MemoryPlanError,
    SpecMode,
)
from launcher.units import MIB

if TYPE_CHECKING:
    from gguf.facts import ModelFacts
    from gguf.model import GGUFFile
    from gguf.projector import ProjectorFacts

#: Weight types the CPU backend repacks into interleaved rows (x86 with AVX2, the pinned build's common case).
_REPACKED_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL"})
#: The MTP draft context's cache types: ``--spec-draft-type-k/-v``, f16 whatever ``-ctk``/``-ctv`` say
#: (common.h ``common_params_speculative_draft::cache_type_k``; speculative.cpp common_base_params_to_speculative).
_DRAFT_CACHE_TYPE: CacheType = "f16"


#: The llama-server process beyond its buffers and its graphs' metadata, whatever the model: the binary and its
#: libraries' mapped pages, threads' stacks, the HTTP server, the slots.
PROCESS_BASE = 155 * MIB // 10  # 15.5 MiB
#: Heap per vocabulary entry: the tokenizer's tables (token text, scores, the piece cache, the text-to-id map)
#: and the sampler's per-token candidates.
PROCESS_PER_VOCAB = 192
#: Heap per BPE merge rule (the vocabulary's ``bpe_ranks`` map of string pairs).
PROCESS_PER_MERGE = 206
#: ``ggml_tensor_overhead()``: a ``ggml_object`` and a ``ggml_tensor`` (32 + 336 bytes on 64-bit builds).
_TENSOR_OVERHEAD = 368
#: ``sizeof(struct ggml_cgraph)`` padded, plus its context's ``ggml_object`` (ggml.c ``ggml_graph_overhead_custom``).
_GRAPH_HEADER = 144
#: The graph results resident at once after a prompt (``llama_context``'s ``gf_res_reserve`` and the decoding
#: graph's ``gf_res_prev``; measured: two, whatever ubatches the prompt spans).
_GRAPH_RESULTS = 2
#: The MTP draft context's graph results: its own ``gf_res_reserve`` and both ``gf_res_prev`` (one per
#: ``n_outputs > 0``): it decodes the target's batches with only their last token as output and drafts with every
#: token as one (measured: the draft's process line grows with the node budget like three results).
_DRAFT_GRAPH_RESULTS = 3
#: The MTP draft context's host memory beyond its graph metadata: a second context's heap, on no line of the log
#: (measured on the zoo's Qwen3.5 with an MTP block, less the target's NextN rows a prompt writes, billed as growth).
DRAFT_PROCESS_BASE = 13 * MIB // 4  # 3.25 MiB
#: ``ggml_hash_size``'s primes (ggml.c): the next prime after each power of two.
_HASH_PRIMES = (
    2, 3, 5, 11, 17, 37, 67, 131, 257, 521, 1031, 2053, 4099, 8209, 16411, 32771, 65537, 131101, 262147, 524309,
    1048583, 2097169, 4194319, 8388617, 16777259,
)  # fmt: skip


def _hash_size(min_size: int) -> int:
    return next((p for p in _HASH_PRIMES if p >= min_size), min_size | 1)


def graph_max_nodes(facts: ModelFacts, shape: ContextShape) -> int:
    """llama.cpp's node budget for this model's graphs (``llama_context::graph_max_nodes``)."""
    per_token, per_tensor = facts.traits.graph_nodes
    n_tokens = min(shape.n_ctx, shape.n_ubatch)
    return max(per_token * n_tokens, per_tensor * facts.tensor_count, 0 if per_token else 1024)


def graph_metadata_bytes(max_nodes: int, results: int = _GRAPH_RESULTS) -> int:
    """The host memory sized by the node budget, every page of it written.

    Each graph result holds a ``ggml_context`` buffer for ``max_nodes`` tensor headers and the graph itself (node
    and leaf pointers, a hash set of twice the nodes with use counts, a bitset), resized with zeros
    (``llm_graph_result::reset``); the scheduler clears its per-tensor backend ids and copies over a hash set of
    ``max_nodes`` at every reset (``ggml_backend_sched_reset``). Its split buffers are larger but written only as
    far as a graph's splits reach, which the base line holds. ``results``: the graph results resident at once.
    """
    hashed = _hash_size(2 * max_nodes)
    graph = _GRAPH_HEADER + 2 * 8 * max_nodes + (4 + 8) * hashed + 4 * ((hashed + 31) // 32)
    result = _TENSOR_OVERHEAD * max_nodes + graph
    return results * result + (4 + 8) * _hash_size(max_nodes)


def process_bytes(facts: ModelFacts, shape: ContextShape, mtp_draft: bool = False) -> int:
    """The host memory a llama-server holds beyond what its log prints: the ``process`` line of the CPU bill.

    Measured on the pinned CPU build (b11434) as the RSS after a prompt that fills a 1,000-token context, less the
    buffers the log prints, each made resident in full first (``scripts/memory_accuracy.py``'s process check), with
    the prompt cache and the context checkpoints off. The base is the zoo's models' median less their graphs'
    metadata (``graph_metadata_bytes``, from the sources); the vocabulary and merge terms were fitted on
    SmolLM2-135M (49,152 tokens, 48,900 merges) and Gemma 3 270M (262,144 tokens, no merges). The prompt cache has
    its own line; an SWA or hybrid model's context checkpoints none. A GPU build's driver and libraries hold more,
    which is not measured.

    ``mtp_draft``: the MTP draft context (``common_speculative_init_result``) is a second ``llama_context`` on the
    target model with the target's context parameters, so it has the same node budget
    (``llama_context::graph_max_nodes`` reads the architecture, the ubatch and the model's tensor count), its own
    scheduler and its own graph results.
    """
    max_nodes = graph_max_nodes(facts, shape)
    draft = DRAFT_PROCESS_BASE + graph_metadata_bytes(max_nodes, _DRAFT_GRAPH_RESULTS) if mtp_draft else 0
    return (
        PROCESS_BASE
        + PROCESS_PER_VOCAB * facts.vocab_size
        + PROCESS_PER_MERGE * facts.merge_count
        + graph_metadata_bytes(max_nodes)
        + draft
    )


def layer_devices(facts: ModelFacts, options: MemoryOptions) -> tuple[tuple[str, ...], str]:
    """(device of each block, device of the output layer) for ``-ngl N`` and ``--tensor-split``.

    llama.cpp offloads the last N of the blocks-plus-output-layer, spreading them
    over the GPUs by the cumulative split; the input embeddings stay on the CPU.
    """
    n = facts.block_count
    ngl = options.n_gpu_layers if options.n_gpu_layers >= 0 else n + 1
    start = max(n + 1 - ngl, 0)
    active = min(ngl, n + 1)
    total = sum(options.tensor_split) or 1.0
    bounds, acc = [], 0.0
    for share in options.tensor_split:
        acc += share
        bounds.append(acc / total)

    def place(il: int) -> str:
        if il < start or il - start >= active:
            return "CPU"
        x = (il - start) / active
        return split_name(options, min(sum(1 for b in bounds if b <= x), len(bounds) - 1))

    return tuple(place(il) for il in range(n)), place(n)


def split_name(options: MemoryOptions, position: int) -> str:
    """The bill's name of the device at ``position`` in the tensor split."""
    return options.split_names[position] if position < len(options.split_names) else f"GPU{position}"


def _cache_bytes(type_name: str, n_values: int) -> int:
    t = BY_NAME[type_name.upper()]
    return n_values // t.block_size * t.type_size


def _kv_caches(
    facts: ModelFacts, shape: ContextShape, options: MemoryOptions, devices: Sequence[str], draft: bool = False
) -> tuple[list[CacheBill], dict[str, int]]:
    """The attention caches (``create_memory``'s choice) and their bytes per device.

    ``draft``: the MTP draft context's cache instead, which holds only the NextN
    blocks the main context leaves out (``layer_filter_cb: il >= n_layer``).
    """
    layers = _draft_layers(facts) if draft else facts.attention_cache_layers()
    if not layers:
        return [], {}
    prefix = "MTP draft " if draft else ""
    iswa = facts.swa_type != "none" and facts.is_swa_any
    if iswa:
        swa_cells = (
            shape.n_ctx_seq
            if options.swa_full
            else pad(
                min(shape.n_ctx_seq, facts.sliding_window * (shape.n_seq if shape.unified else 1) + shape.n_ubatch)
            )
        )
        groups = [
            (prefix + "non-SWA", shape.n_ctx_seq, [il for il in layers if not facts.swa_layers[il]]),
            (prefix + "SWA", swa_cells, [il for il in layers if facts.swa_layers[il]]),
        ]
    else:
        groups = [(prefix + "main", shape.n_ctx_seq, list(layers))]
    if any(facts.indexer_layers) and not draft:
        # llama_kv_cache_dsa / _msa / llama_memory_hybrid_idx: a "main" cache, then the indexer key cache
        # (one KV head, same cells and streams); llama_kv_cache_dsa_iswa adds its SWA cache after both
        groups[0] = ("main", *groups[0][1:])
        idx = [il for il, has in enumerate(facts.indexer_layers) if has]
        groups.insert(1, ("indexer", shape.n_ctx_seq, idx))
    k_type, v_type = (_DRAFT_CACHE_TYPE, _DRAFT_CACHE_TYPE) if draft else (options.cache_type_k, options.cache_type_v)
    caches: list[CacheBill] = []
    per_device: dict[str, int] = {}
    for label, cells, group in groups:
        rows = cells * shape.n_stream
        k_total = v_total = 0
        for il in group:
            if label == "indexer":
                k = _cache_bytes(k_type, facts.indexer_cache_k * rows)
                v = _cache_bytes(v_type, facts.indexer_cache_v * rows) if facts.indexer_cache_v else 0
            else:
                k = _cache_bytes(k_type, facts.k_embd(il) * rows)
                v = 0 if facts.kv_cache_k_only else _cache_bytes(v_type, facts.v_embd(il) * rows)
            per_device[devices[il]] = per_device.get(devices[il], 0) + k + v
            k_total, v_total = k_total + k, v_total + v
        caches.append(
            CacheBill(
                label=label,
                cells=cells,
                streams=shape.n_stream,
                layers=len(group),
                k_type=k_type,
                v_type=v_type,
                k_bytes=k_total,
                v_bytes=v_total,
            )
        )
    return caches, per_device


def _draft_layers(facts: ModelFacts) -> tuple[int, ...]:
    """The NextN (MTP) blocks whose cache lives in the draft context, not in the main one."""
    return tuple(
        il
        for il in range(facts.layer_count, facts.block_count)
        if il >= len(facts.kv_layers) or not facts.kv_layers[il]
    )


def _mtp_draft(
    facts: ModelFacts, shape: ContextShape, options: MemoryOptions, devices: Sequence[str], output_device: str
) -> tuple[list[CacheBill], dict[str, int], dict[str, int], int, int]:
    """The MTP draft context ``common_speculative_init_result`` creates next to the main one.

    Same n_ctx, slots and ubatch as the target, but one output per slot
    (``common_base_params_to_speculative``: ``n_outputs_max = n_parallel``); its
    own f16 KV cache for the NextN blocks; its own compute buffer for the NextN
    graph (``graph_mtp``: one dense block, then the logits); its own output
    buffer. Returns (caches, KV per device, compute per device, output at start,
    output growth), the output in host memory.
    """
    shape = replace(shape, n_outputs_max=min(shape.n_batch, shape.n_seq), n_rs_seq=0)
    caches, kv = _kv_caches(facts, shape, options, devices, draft=True)
    return caches, kv, {output_device: compute_buffer.draft_bytes(facts, shape, caches)}, *_draft_outputs(facts, shape)


def _draft_outputs(facts: ModelFacts, shape: ContextShape) -> tuple[int, int]:
    """(the draft context's output buffer at start-up, what its first draft adds), f32 rows of one output per slot.

    At start-up ``output_reserve(n_seq_max)`` holds the logits. The draft-mtp
    speculator then asks for the NextN hidden state of each output
    (``llama_set_embeddings_nextn(ctx_dft, true, masked)``) and samples on the
    backend (``--spec-draft-backend-sampling``, on by default: logits + probs,
    and sampled + candidate token ids), which the first decode's
    ``output_reserve`` adds (llama-context.cpp ``output_reserve``).
    """
    rows = shape.n_seq
    start = facts.vocab_size * rows * 4
    grown = (facts.vocab_size + facts.embedding_length + 2 * facts.vocab_size) * rows * 4 + (
        1 + facts.vocab_size
    ) * rows * 4
    return start, grown - start


def _dsv4_memory(
    facts: ModelFacts, shape: ContextShape, options: MemoryOptions, devices: Sequence[str]
) -> tuple[list[CacheBill], list[StateBill], dict[str, int]]:
    """``llama_kv_cache_dsv4``: its caches, its compressor states and their bytes per device.

    Every part keeps one stream per slot even when the server asks for a unified
    cache. The raw cache is an ISWA pair over every layer (MTP blocks included)
    whose non-SWA half is empty, its SWA half holding ``n_swa + n_ubatch`` cells
    (not times the slots) or ``n_ctx_seq`` with ``--swa-full``. The CSA (ratio 4),
    HCA (ratio 128) and lightning-indexer (ratio 4, one head of the indexer size)
    caches hold ``ceil(n_ctx_seq / ratio)`` rows padded to 256, K only, in the K
    cache type, for the layers of that ratio. The compressor states are f32 whatever
    the cache type: per trunk layer of the ratio a ``kv`` and a ``score`` tensor of
    ``state_size x n_embd_state`` per stream (CSA and indexer: 8 rows of twice the
    head size; HCA: 128 rows of the head size), with no rollback planes (``n_rs_seq``
    is 0 without speculative decoding).
    """
    n_seq, kv_size = shape.n_seq, shape.n_ctx_seq
    layers = facts.attention_cache_layers()
    ratios = facts.compress_ratios

    def ratio(il: int) -> int:
        return ratios[il] if il < len(ratios) else 0

    def comp_cells(r: int) -> int:
        return pad(max(1, -(-kv_size // r)))

    swa_cells = kv_size if options.swa_full else pad(min(kv_size, facts.sliding_window + shape.n_ubatch))
    groups = [
        ("non-SWA", kv_size, [il for il in layers if not facts.swa_layers[il]], facts.k_embd),
        ("SWA", swa_cells, [il for il in layers if facts.swa_layers[il]], facts.k_embd),
        ("DSV4 CSA compressed", comp_cells(_DSV4_CSA), [il for il in layers if ratio(il) == _DSV4_CSA], facts.k_embd),
        ("DSV4 HCA compressed", comp_cells(_DSV4_HCA), [il for il in layers if ratio(il) == _DSV4_HCA], facts.k_embd),
        (
            "DSV4 lightning-indexer",
            comp_cells(_DSV4_CSA),
            [il for il in layers if ratio(il) == _DSV4_CSA],
            lambda il: facts.indexer_key_length,
        ),
    ]
    per_device: dict[str, int] = {}
    caches = []
    for label, cells, group, k_embd in groups:
        k_total = 0
        for il in group:
            k = _cache_bytes(options.cache_type_k, k_embd(il) * cells * n_seq)
            per_device[devices[il]] = per_device.get(devices[il], 0) + k
            k_total += k
        caches.append(
            CacheBill(
                label=label,
                cells=cells,
                streams=n_seq,
                layers=len(group),
                k_type=options.cache_type_k,
                v_type=options.cache_type_v,
                k_bytes=k_total,
                v_bytes=0,
            )
        )
    head = facts.key_length_of(0)  # llama.cpp's n_embd_head_k(): layer 0's
    states = []
    for name, r, rows, width in (
        ("csa", _DSV4_CSA, 2 * _DSV4_CSA, 2 * head),
        ("hca", _DSV4_HCA, _DSV4_HCA, head),
        ("lid", _DSV4_CSA, 2 * _DSV4_CSA, 2 * facts.indexer_key_length),
    ):
        group = [il for il in range(facts.layer_count) if ratio(il) == r]
        per_layer = 2 * width * rows * n_seq * 4  # kv + score, f32
        for il in group:
            per_device[devices[il]] = per_device.get(devices[il], 0) + per_layer
        states.append(
            StateBill(
                name=name,
                ratio=r,
                rows=rows,
                width=width,
                streams=n_seq,
                rs_seq=0,
                layers=len(group),
                nbytes=per_layer * len(group),
            )
        )
    return caches, states, per_device


def _recurrent(
    facts: ModelFacts, shape: ContextShape, devices: Sequence[str]
) -> tuple[list[RecurrentBill], dict[str, int]]:
    """Recurrent state: f32 rows per slot and recurrent layer, one plus ``n_rs_seq`` rollback snapshots."""
    layers = [il for il, has in enumerate(facts.recurrent_state_layers) if has]
    if not layers:
        return [], {}
    rows = shape.n_seq * (1 + shape.n_rs_seq)
    r_row, s_row = facts.recurrent_conv_state * 4 * rows, facts.recurrent_state * 4 * rows
    p_row = facts.ple_conv_state * 4 * rows  # llama_memory_recurrent: cache_ple_r_l for PLE layers
    ple = {il for il in layers if il < len(facts.ple_layers) and facts.ple_layers[il]}
    per_device: dict[str, int] = {}
    for il in layers:
        per_device[devices[il]] = per_device.get(devices[il], 0) + r_row + s_row + (p_row if il in ple else 0)
    return [
        RecurrentBill(
            cells=shape.n_seq,
            rows=rows,
            layers=facts.layer_count,
            r_bytes=r_row * len(layers),
            s_bytes=s_row * len(layers),
            p_bytes=p_row * len(ple),
        )
    ], per_device


def _output_bytes(facts: ModelFacts, shape: ContextShape) -> tuple[int, int]:
    """``output_reserve``: (f32 output rows for one output per slot at start-up, the growth a larger batch adds).

    A row is the logits, and with ``--embeddings`` the embedding too. A speculative batch asks for a row per
    drafted token, an embedding batch for a row per token, and llama.cpp reallocates the output buffer for
    them on the first such batch (measured on SmolLM2-135M with ``--embeddings``: 0.19 MiB at start, which a
    481-token input grows by its (49152 + 576) x 481 floats).
    """
    row = facts.vocab_size + (facts.embedding_length if shape.embeddings else 0)
    start = row * shape.n_seq * 4
    return start, row * max(shape.n_seq, shape.n_outputs_max) * 4 - start


def for_file(model: GGUFFile, options: MemoryOptions = MemoryOptions()) -> MemoryOptions:
    """``options`` completed with what only the file's tensor list tells (facts keep sums only).

    ``weight_padding_bytes``: the mapped model buffer spans the tensor data with
    its alignment gaps. ``cpu_repack_bytes``: on x86 with AVX2 the pinned build
    copies 2-D Q4_0, Q4_K and IQ4_NL matrices whose row count is a multiple of 8
    (token embeddings excepted: they are only looked up) into a ``CPU_REPACK``
    buffer; other CPUs repack other types or none, so treat it as an estimate.
    ``cpu_moe_gap_bytes``: with ``n_cpu_moe``, ``moe_split_gaps``' figure for it.
    """
    repack = padding = 0
    for shard in model.shards:
        tensors = sorted(shard.tensors, key=lambda t: t.offset)
        if tensors:
            padding += tensors[-1].offset + tensors[-1].n_bytes - tensors[0].offset - sum(t.n_bytes for t in tensors)
        repack += sum(
            t.n_bytes
            for t in tensors
            if t.ggml_type.name in _REPACKED_TYPES
            and len(t.shape) == 2
            and t.shape[1] % 8 == 0
            and not t.name.startswith("token_embd")
        )
    gaps = moe_split_gaps(model) if options.n_cpu_moe and any(model.facts.expert_weight_bytes) else (0,)
    return replace(
        options,
        cpu_repack_bytes=repack,
        weight_padding_bytes=padding,
        cpu_moe_gap_bytes=gaps[min(options.n_cpu_moe, len(gaps) - 1)],
    )


def moe_split_gaps(model: GGUFFile) -> tuple[int, ...]:
    """For each ``--n-cpu-moe N`` (0 to every block) with every block offloaded: the bytes the CPU's mapped buffer
    spans beyond its own tensors, those of N = 0 left out (``weight_padding_bytes`` counts them).

    llama.cpp maps one host buffer per file over the range from the first to the last tensor it keeps on the CPU
    (``get_mapping_range``): the token embeddings and the experts of blocks 0..N-1, and every offloaded tensor in
    between (the attention of those blocks, and whatever the file puts between). Its pages are read while loading.
    """
    n = model.facts.block_count
    gaps = [0] * (n + 1)
    for shard in model.shards:
        ranges: list[list[tuple[int, int]]] = [
            [] for _ in range(n + 1)
        ]  # [0]: the base set; [i + 1]: block i's experts
        for t in shard.tensors:
            il = tensor_layout.expert_layer(t.name)
            if 0 <= il < n:
                ranges[il + 1].append((t.offset, t.n_bytes))
            elif tensor_layout.layer_of(t.name) < 0 and not t.name.startswith("output"):
                ranges[0].append((t.offset, t.n_bytes))
        lo, hi, held = 2**63, 0, 0
        for k, group in enumerate(ranges):
            for offset, nbytes in group:
                lo, hi, held = min(lo, offset), max(hi, offset + nbytes), held + nbytes
            if held:
                gaps[k] += hi - lo - held
    return tuple(g - gaps[0] for g in gaps)


def estimate(facts: ModelFacts, options: MemoryOptions = MemoryOptions()) -> MemoryBill:
    """Predict llama-server's allocations per device for ``facts`` under ``options``."""
    reasons: list[str] = []
    if facts.approximate:
        reasons += [f"model facts are approximate: {n}" for n in facts.notes] or ["model facts are approximate"]
    mtp = options.spec == "mtp" and facts.nextn_predict_layers > 0
    if mtp and not facts.traits.mtp_draft_measured:
        measured = ", ".join(architectures_with(lambda t: t.mtp_draft_measured))
        reasons.append(
            f"the MTP draft context's compute buffer was measured only on {measured} "
            f"(a zoo model with an appended NextN block), not on {facts.architecture}'s NextN graph"
        )
    shape = context_shape(facts, options)
    devices, output_device = layer_devices(facts, options)
    states: list[StateBill] = []
    if facts.traits.compressed_kv_cache:
        caches, states, kv = _dsv4_memory(facts, shape, options, devices)
    else:
        caches, kv = _kv_caches(facts, shape, options, devices)
    recurrent, rs = _recurrent(facts, shape, devices)

    weights: dict[str, int] = {"CPU": facts.token_embedding_bytes + facts.other_weight_bytes}
    for il, nbytes in enumerate(facts.layer_weight_bytes):
        dev = devices[il] if il < len(devices) else "CPU"
        weights[dev] = weights.get(dev, 0) + nbytes
    weights[output_device] = weights.get(output_device, 0) + facts.output_weight_bytes
    if facts.output_tied and output_device != "CPU":
        # the output layer's copy of the tied embeddings (on the CPU the mapped tensor serves both)
        weights[output_device] += facts.token_embedding_bytes
    weights["CPU"] += options.cpu_repack_bytes + options.weight_padding_bytes
    # --n-cpu-moe: the routed experts of the offloaded blocks below N stay on the CPU, mapped from the file with the
    # offloaded tensors between them (the mapped buffer spans from the CPU's first tensor to its last)
    moved = [
        il for il, d in enumerate(devices[: options.n_cpu_moe]) if d != "CPU" and il < len(facts.expert_weight_bytes)
    ]
    for il in moved:
        weights[devices[il]] -= facts.expert_weight_bytes[il]
        weights["CPU"] += facts.expert_weight_bytes[il]
    if moved:
        weights["CPU"] += options.cpu_moe_gap_bytes
    projector = None
    if options.mmproj_bytes or options.mmproj_compute_bytes:
        on_gpu = options.mmproj_offload and options.n_gpu_layers != 0
        projector = ProjectorBill(
            split_name(options, 0) if on_gpu else "CPU", options.mmproj_bytes, options.mmproj_compute_bytes
        )
        reasons.append(PROJECTOR_COMPUTE_NOTE)
    compute, compute_growth = compute_buffer.per_device(
        facts, shape, caches, devices, output_device, cpu_experts=options.n_cpu_moe
    )
    draft_output = draft_growth = 0
    if mtp:
        draft_caches, draft_kv, draft_compute, draft_output, draft_growth = _mtp_draft(
            facts, shape, options, devices, output_device
        )
        caches = [*caches, *draft_caches]
        for d, n in draft_kv.items():
            kv[d] = kv.get(d, 0) + n
        for d, n in draft_compute.items():
            compute[d] = compute.get(d, 0) + n
    if any(d != "CPU" for d in (*devices, output_device)):
        reasons.append(
            "compute buffers off the CPU (GPUs, RPC workers) are estimated with the CPU formula; only "
            "CPU backends were measured"
        )
        reasons.append(
            "the host's process line was measured on the CPU build; a GPU build's driver and libraries hold more"
        )
    names = sorted({"CPU", *weights, *kv, *rs, *compute, *([projector.device] if projector else [])})
    output, growth = _output_bytes(facts, shape)
    output += draft_output
    if mtp:
        # the target hands its NextN hidden state to the draft for every batch token (unmasked embd_nextn)
        growth += draft_growth + facts.embedding_length * shape.n_batch * 4
    bills = tuple(
        DeviceBill(
            device=d,
            weights=weights.get(d, 0),
            kv=kv.get(d, 0),
            recurrent=rs.get(d, 0),
            compute=compute.get(d, 0),
            output=output if d == "CPU" else 0,
            output_growth=growth if d == "CPU" else 0,
            compute_growth=compute_growth.get(d, 0),
            projector=projector.total if projector and projector.device == d else 0,
            process=process_bytes(facts, shape, mtp_draft=mtp) if d == "CPU" else 0,
        )
        for d in names
    )
    return MemoryBill(
        devices=bills,
        caches=tuple(caches),
        recurrent=tuple(recurrent),
        approximate=bool(reasons),
        reasons=tuple(reasons),
        states=tuple(states),
        projector=projector,
    )


#: Why a bill with a projector is approximate (its weights are exact, its compute buffer is not).
PROJECTOR_COMPUTE_NOTE = (
    "the projector's compute buffer is estimated from its encoder's size (within 25 % on "
    "seven LLaVA- and Whisper-shaped encoders on the CPU); its weights are exact"
)
#: f32 activations live per encoder position at the encoder's peak, beyond the FFN's n_ff, in units of n_embd
#: (fitted on LLaVA-style ViTs of 196-4096 patches and Whisper encoders of 384-1280 wide; flash attention on).
_ENCODER_EMBD_ROWS = 3.5


def projector_compute_bytes(projector: ProjectorFacts) -> int:
    """The compute buffer ``clip.cpp`` reserves at warm-up for ``projector``: one per encoder, added.

    Each is the larger of two moments of the warm-up graph: the input (the f32
    image or mel window, and its f16 unfolding for the patch or first
    convolution, ``ggml_im2col``) and the encoder blocks (per position the FFN's
    ``n_ff`` f32 values plus about 3.5 rows of ``n_embd``). Measured on the CPU
    backend with flash attention (clip's default where the backend has it);
    without flash attention the attention scores add ``n_head x n_pos^2`` floats.
    """
    total = 0
    for enc in projector.encoders:
        inputs = enc.warmup_input_values * 4 + enc.warmup_unfolded_values * 2
        blocks = int(enc.warmup_positions * (enc.n_ff + _ENCODER_EMBD_ROWS * enc.n_embd) * 4)
        total += max(inputs, blocks)
    return total


# The estimator's public face: what it takes, returns and raises (the bill's types live in ``launcher.bill``).
__all__ = [
    "CACHE_TYPES",
    "FLASH_ATTN",
    "CacheBill",
    "CacheType",
    "DeviceBill",
    "FlashAttn",
    "MemoryBill",
    "MemoryOptions",
    "MemoryPlanError",
    "PROJECTOR_COMPUTE_NOTE",
    "ProjectorBill",
    "RecurrentBill",
    "SpecMode",
    "StateBill",
    "estimate",
    "for_file",
    "layer_devices",
    "moe_split_gaps",
    "projector_compute_bytes",
    "split_name",
]
