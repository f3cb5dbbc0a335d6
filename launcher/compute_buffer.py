"""The compute buffer: what ggml's allocator holds at its peak while llama-server reserves the prompt graph.

``sched_reserve`` sizes one buffer per device for one ubatch of ``n_tokens =
min(n_ctx, n_ubatch)`` tokens against a full cache, with ``min(n_tokens,
n_outputs_max)`` outputs. Its size is ggml-alloc's high-water mark over the
architecture's graph: inputs and leaves (masks, zeros) sit below everything,
each node gets a block that is freed after its last reader, and the peak is
where the most large tensors coexist.

The estimate is built from the sizes of the tensors that set that peak (``terms``,
in bytes, one family of graphs per helper), read from the pinned llama.cpp's
graph code and checked against llama-server's own log (and, where it was unclear,
an allocator-debug build that prints what is live at each high-water mark).
``combine_terms`` weighs them (``COMPUTE_FIT``) into the moments the allocator
peaks at: inside a layer (the always-live tensors plus the largest transient),
a Mamba layer's scan, a late FFN, and the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gguf.facts import DSV4_CSA_RATIO
from gguf.ggml_types import BY_NAME

if TYPE_CHECKING:
    from gguf.facts import ModelFacts
    from launcher.bill import CacheBill
    from launcher.context_shape import ContextShape

#: MSA's position axis at the reserve: the cache's positions padded to 256 (llama-kv-cache-msa.cpp:262-273), with none.
MSA_RESERVE_POSITIONS = 256

#: Weights of the compute terms. ggml's allocator reuses freed blocks, so how many copies of each
#: tensor coexist at the peak depends on each architecture's graph. The shared weights (first lines)
#: are fitted by coordinate descent on the zoo plus Gemma (``scripts/memory_accuracy.py``) and on the
#: zoo widened 8x (``tests.support.wide_zoo``: n_embd 2048, where tensor sizes rather than the placement of
#: small tensors set the peak) with FFN-to-embedding ratios of 1.5 and 4.5, then checked on a ratio
#: the fit never saw (3.0, n_ff 6144): 721 of its 780 cases within 10 %, against 638 with the weights
#: fitted on the small zoo alone. Since then only counted terms were added (which masks and inputs are
#: freed before a moment, and which tensors fit in their holes), and two widenings no weight was fitted
#: on keep within 10 % in 291 (n_embd 1024, n_ff 3456) and 292 (n_embd 4096, n_ff 15360) of 293 cases;
#: the misses are a freed hole one activation did or did not fit in (granitehybrid, lfm2) and Falcon's
#: quantized-cache FFN over-counted by one hidden state. FFNs narrower than n_embd (n_ff 768 at n_embd
#: 2048, ``memory_accuracy --widen 8x2``) fit worse: 279 of 293 (dense models that narrow do not exist;
#: MoE models at real proportions are the harness's ``moe:`` section). ``final_hidden`` also carries
#: Gemma's speculative configs. The DeepSeek-V4 and Mamba ones are counted from the graphs, not fitted:
#: ggml-alloc's peak holds two lightning-indexer queries (the projection and its RoPE'd copy), one CSA KQ
#: and one top-k zeros leaf; one of each Mamba-2 and Mamba-1 tensor.
COMPUTE_FIT: dict[str, float] = {
    # "hidden" leaves out the mixed-input copy of the embeddings, counted apart (``mixed_embd``): cogvlm has none
    "mask": 1.0,
    "hidden": 2.625,
    "query": 0.625,
    "v_index": 2.125,
    "kq": 1.0,
    "ffn": 3.0,
    "ssm": 2.5,
    "conv": 1.125,
    "indexer_q": 2.25,
    "indexer": 1.75,
    "decay": 0.75,
    "mla": 1.0,
    "final_hidden": 7.25,
    "ffn_ungated": 1.375,
    "lid_q": 2.0,
    "lid_kq": 1.0,
    "topk_zeros": 1.0,
    "mamba2_layer": 1.0,
    # below a Mamba-1 layer's tensors (counted): the input embeddings, the residual, the mixed-input copy and
    # the two hidden-sized blocks the layer's norm and the mixed-input rows freed
    "mamba1_hidden": 5.0,
    # DSA indexers: the queries twice (projected and Hadamard-rotated). qwen4exp's k-pool selection rows
    # [n_sel, n_tokens] (index, slot-liveness and dump rows) above its inputs and the layer's queries are measured
    "topk_q": 2.0,
    "qsa_sel": 5.5,
    # counted: the hidden-sized tensors below a fused-QKV attention's rotations (see combine_terms)
    "qkv_rot_hidden": 3.0,
    # counted (see combine_terms): MSA's block mask expanded to cells and its transposed copy, and the hidden
    # states and Q copies below them
    "msa_block": 2.0,
    "msa_hidden": 3.0,
    "msa_query": 2.0,
}
#: The MTP draft graph's attention moment beyond the mask and KQ scores, in ``n_embd`` rows per token (measured).
DRAFT_COMPUTE_FIT: dict[str, float] = {"attention_hidden": 7.0}


def terms(
    facts: ModelFacts,
    shape: ContextShape,
    caches: Sequence[CacheBill],
    positions: int = MSA_RESERVE_POSITIONS,
    cpu_experts: int = 0,
) -> dict[str, int]:
    """The tensor sizes (bytes) that drive the compute buffer of ``sched_reserve``'s prompt graph (``positions``:
    MSA's position axis, at the reserve the empty cache's; ``cpu_experts``: blocks 0..N-1 run their routed experts
    on another device, ``--n-cpu-moe``)."""
    n_tokens = min(shape.n_ctx, shape.n_ubatch)
    live = [c for c in caches if c.layers]
    attention = _attention_terms(facts, shape, live, n_tokens)
    cells = sum(c.cells for c in live)
    # masks counted whole: a cache-less graph's ubatch masks, and MiniMax-M3's one mask every layer reads
    whole_mask = not any(facts.kv_layers) or facts.traits.sparse_attention == "msa"
    indexer = _indexer_terms(facts, shape, live, n_tokens, positions)
    # MSA's f32 copy of the (f16) mask is alive from the first sparse layer's attention to the last's, through
    # the FFNs between them (measured: a 4-layer zoo variant, 4 split slots at ubatch 256, peaks in an MoE FFN)
    sparse = [il for il, s in enumerate(facts.indexer_layers[: facts.layer_count]) if s]
    msa_copy = 2 * attention["mask"] if indexer["msa_block"] else 0
    last_reader = _last_readers(facts)
    # with routed experts on the CPU, the masks first read after the first such block are copied to the device
    # in a later split: their block there is not below everything, so it is neither alive nor a hole outside
    # the layers that read it (see ``_late_masks``)
    late, first_reader = _late_masks(facts, live, cpu_experts), _first_readers(facts)
    late_masks = [attention["mask"] * c.cells // cells for c in live if c.label in late]
    hidden = n_tokens * facts.embedding_length * facts.hyper_connections * 4

    def masks_after(il: int, tensor: int, last: bool = False, reuse: bool = True) -> int:
        """The mask bytes in the way of ``tensor``-sized FFN activations after ``il``'s attention: every mask, less
        the activations (up to gate, up and their product) that fit in the hole of the masks no later layer reads
        (with the K/V index inputs freed beside them; none with ``reuse`` off). After the ``last`` attention layer
        the V indices (i64, one per value without flash attention) are freed too, next to the masks."""
        v_index = attention["v_index"] if last else 0
        mask = attention["mask"] + v_index
        if not reuse:
            return mask
        if whole_mask or not cells:
            return mask + (msa_copy if msa_copy and sparse[0] <= il < sparse[-1] else 0)
        # a late mask counts only from its first reader to its last (allocated at the first, its hole merged after)
        alive = {c.label for c in live if c.label in late and first_reader[c.label] <= il < last_reader[c.label]}
        mask -= attention["mask"] * sum(c.cells for c in live if c.label in late - alive) // cells
        read_later = sum(
            c.cells for c in live if il < last_reader.get(c.label, il + 1) and (c.label not in late or c.label in alive)
        )
        freed = mask - attention["mask"] * read_later // cells
        return mask - tensor * min(3, max(freed + 16 * n_tokens, 0) // max(tensor, 1))

    return {
        **attention,
        "hidden": hidden,
        "mixed_embd": n_tokens * facts.embedding_length * 4 if facts.traits.mixed_batch_input else 0,
        **_ffn_terms(facts, n_tokens, shape.n_outputs_max, masks_after, cpu_experts),
        **_recurrent_terms(facts, shape, n_tokens, attention["mask"]),
        **indexer,
        "logits": facts.vocab_size * min(n_tokens, shape.n_outputs_max) * 4,
        # the CPU's originals of the late masks, alive through the first CPU block's experts
        "late_mask": sum(late_masks),
        # the device's copies of those too large for a hole the layer before left (see ``_weighing``)
        "late_mask_above": sum(m for m in late_masks if m > hidden),
    }


def _attention_terms(
    facts: ModelFacts, shape: ContextShape, live: Sequence[CacheBill], n_tokens: int
) -> dict[str, int]:
    """Masks, scores and the attention's own copies (``llama-graph.cpp`` ``build_attn``).

    One mask per cache of ``[n_kv, n_tokens / n_stream, 1, n_stream]`` (f16 with
    flash attention, f32 without), so ``n_kv x n_tokens`` whatever the streams (a
    k-pool indexer's cache has none, its row is the selection mask the attention
    reads instead, ``indexer_sel``); the
    KQ scores ``[n_kv, n_tokens, n_head]`` f32 without flash attention, when V is
    stored transposed and its ``set_rows`` index is one i64 per value.
    """
    layers = range(facts.layer_count)
    n_head = max(facts.head_count, default=0)
    # Without any cache (diffusion and embedding models) attention runs over the ubatch itself:
    # build_attn_inp_no_cache makes an [n_tokens, n_tokens] mask (and one more for SWA), so n_kv = n_tokens
    no_cache = not any(facts.kv_layers) and not any(facts.recurrent_layers) and n_head > 0
    # llama_kv_cache: a quantized K cache is stored Hadamard-rotated when the head size is a multiple of 64
    k_rotated = any(BY_NAME[c.k_type.upper()].quantized for c in live) and facts.key_length_of(0) % 64 == 0
    v_rotated = any(BY_NAME[c.v_type.upper()].quantized for c in live) and facts.value_length_of(0) % 64 == 0
    n_kv = n_tokens if no_cache else max((c.cells for c in live), default=0)
    mask_rows = n_tokens * (2 if facts.swa_type != "none" else 1) if no_cache else sum(c.cells for c in live)
    mask_bytes = 2 if shape.flash_attn else 4
    if facts.traits.sparse_attention == "msa":
        # build_attn_inp_kv_msa: one mask, the main cache's; the indexer cache has none. MSA's f32 copy of it
        # (msa_mf) is counted with the sparse layers (_indexer_terms)
        mask_rows = sum(c.cells for c in live if c.label != "indexer")
    return {
        "mask": mask_rows * n_tokens * mask_bytes,
        "kq": 0 if shape.flash_attn else n_kv * n_tokens * n_head * 4,
        # no cache, no flash attention: the ubatch's K [n_embd_k_gqa, n_tokens] and build_attn_mha's v_cont
        # [n_tokens, n_embd_v_gqa] (f32) are still alive when kq is allocated (llama-graph.cpp:2763, 2802)
        "ubatch_kv": n_tokens * max((facts.k_embd(il) + facts.v_embd(il) for il in layers), default=0) * 4
        if no_cache and not shape.flash_attn
        else 0,
        # a K-only cache (MLA latent, build_attn_inp_k: llama-graph.cpp:3027) stores no V, so it has no V index
        "v_index": 0
        if shape.flash_attn or not live or facts.kv_cache_k_only
        else n_tokens * max((facts.v_embd(il) for il in layers), default=0) * 8,
        "query": n_tokens * max((h * facts.key_length_of(il) for il, h in enumerate(facts.head_count)), default=0) * 4,
        # Parallel blocks with a Hadamard-rotated (quantized) K cache: the rotated Q copy holds the hole the
        # attention output [n_head * n_embd_head_v, n_tokens] would reuse, and that output stays alive through
        # the FFN computed beside it (its V un-rotation and wo come after the FFN in graph order)
        "parallel_attn_out": n_tokens
        * max((h * facts.value_length_of(il) for il, h in enumerate(facts.head_count)), default=0)
        * 4
        if facts.traits.parallel_attention_ffn and k_rotated
        else 0,
        # A fused attn_qkv with a rotated cache: build_attn rotates Q, then V, then K (llama_mul_mat_hadamard, in
        # that expand order), each a new [n_embd_head, n_head, n_tokens] f32 product, the views into the fused
        # output first made contiguous. The fused output [n_embd_q + n_embd_k + n_embd_v, n_tokens] stays alive
        # until K's copy, so the attention peaks at V's rotation with it, rotated Q, V's contiguous copy and
        # rotated V (at Q's: Q's copy and rotated Q) -- measured with the allocator-debug build on gpt2, bloom
        # and falcon. An attention moment of its own: none of these is alive at the FFN
        "qkv_rot": n_tokens
        * 4
        * max(
            (
                _fused_qkv_rotation(
                    h * facts.key_length_of(il), facts.k_embd(il), facts.v_embd(il), k_rotated, v_rotated
                )
                for il, h in enumerate(facts.head_count)
                if il < len(facts.kv_layers) and facts.kv_layers[il]
            ),
            default=0,
        )
        if facts.fused_qkv and (k_rotated or v_rotated) and live
        else 0,
        # MLA with absorbed weights: q_nope x wk_b [kv_lora_rank, n_head, n_tokens], concatenated with the rope
        # part into Qcur [kv_lora_rank + n_rot, n_head, n_tokens] (models/deepseek2.cpp); a nope-only MLA attends
        # with the product itself (glm5-next.cpp:939-943, 956)
        "mla": n_tokens * n_head * (facts.kv_lora_rank + (facts.key_length if facts.rope_dimension_count else 0)) * 4
        if facts.is_mla
        else 0,
        # Its K path after Qcur: the KV projection [kv_lora_rank + n_rot, n_tokens], the normed latent
        # [kv_lora_rank, n_tokens] and K, their concatenation (in the projection's place once RoPE has copied k_pe
        # out of it, beside it where k_pe is used as is). The hole of the freed q_nope x wk_b holds it from 3-4
        # heads on; with fewer (the zoo's one) the rest adds to the attention's peak (measured: deepseek2,
        # bailingmoe3 5.5 MiB, kimi-linear 6.9 MiB)
        "mla_k": n_tokens
        * 4
        * max(
            0,
            facts.key_length
            + facts.kv_lora_rank
            + (facts.key_length if facts.traits.mla_unroped_k else 0)
            - n_head * facts.kv_lora_rank,
        )
        if facts.is_mla
        else 0,
        # MLA without absorbed weights (minicpm3.cpp:145, plm.cpp:111; deepseek2.cpp:595 without key_length_mla):
        # wkv_b decompresses the RMS-normed latent into kv [n_head * (n_embd_head_k - n_rot + n_embd_head_v),
        # n_tokens] while wkv_a_mqa's output [kv_lora_rank + n_rot, n_tokens] and the normed latent [kv_lora_rank,
        # n_tokens] (a new block: the norm reads a view of it) are still alive; all are freed before KQ. The
        # absorbed path's latent is smaller than its Q copies ("mla")
        "mla_latent": n_tokens
        * 4
        * (
            2 * facts.kv_lora_rank
            + facts.rope_dimension_count
            + n_head * (facts.key_length - facts.rope_dimension_count + facts.value_length)
        )
        if facts.kv_lora_rank and not facts.is_mla
        else 0,
        # MiniMax-01's lightning attention: the [n_tokens, n_tokens, n_head] f32 decay input every layer reads
        # (``sched_reserve`` reserves it with one sequence, its worst case)
        "decay": n_tokens * n_tokens * n_head * 4 if facts.traits.lightning_attention_decay else 0,
        # HRM's high-level state zH (the input embedding) stays alive through the low-level cycles that read
        # it, one hidden state more than a plain trunk holds (models/hrm-text.cpp:174-195)
        "hrm_zh": n_tokens * facts.embedding_length * 4 if facts.traits.input_state_alive else 0,
    }


def _last_readers(facts: ModelFacts) -> dict[str, int]:
    """The last layer that reads each cache's mask ("main", "SWA", "non-SWA"; -1: none), one pass over the layers.

    ggml-alloc frees an input after its last reader, so a layer's FFN runs beside
    the masks a later layer still reads: the SWA (or non-SWA) mask goes with the
    last layer of its kind, near the end of a real model but after the first block
    in a two-layer one whose blocks differ. Layers reusing an earlier layer's KV
    read the masks too. Other caches' masks (an indexer's, a draft's) stay alive.
    """
    n = facts.layer_count
    last = {"main": -1, "SWA": -1, "non-SWA": -1}
    for j in range(n):
        if (j < len(facts.kv_layers) and facts.kv_layers[j]) or j >= n - facts.shared_kv_layers:
            last["main"] = j
            last["SWA" if facts.swa_layers[j] else "non-SWA"] = j
    return last


def _first_readers(facts: ModelFacts) -> dict[str, int]:
    """The first layer that reads each cache's mask ("main", "SWA", "non-SWA"; the layer count: none)."""
    n = facts.layer_count
    first = {"main": n, "SWA": n, "non-SWA": n}
    for j in reversed(range(n)):
        if (j < len(facts.kv_layers) and facts.kv_layers[j]) or j >= n - facts.shared_kv_layers:
            first["main"] = j
            first["SWA" if facts.swa_layers[j] else "non-SWA"] = j
    return first


def _late_masks(facts: ModelFacts, live: Sequence[CacheBill], cpu_experts: int) -> set[str]:
    """The caches whose mask no layer reads before the first block running its routed experts on the CPU.

    A mask is a graph input, kept on the CPU (``ggml_backend_sched_backend_id_from_cur``: "1.inp"). The
    scheduler copies it to a device at the start of the first split there that reads it (pass 5), and
    ``graph_copy`` places that copy and a dependency on the original at that split's start: ggml-alloc frees
    the CPU's original right after the copy, and allocates the device's copy there, among the freed tensors of
    the layers before (not below everything, as the inputs of the device's first split are). A block running
    its experts on the CPU ends a split; a mask first read after it (GPT-OSS's full-attention mask, read by
    every second layer) stays on the CPU through that block's experts, and on the device it is a tensor like
    any other, whose block merges with its neighbours' once its last reader is done.
    """
    blocks = range(min(cpu_experts, facts.layer_count))
    first_cpu = next((il for il in blocks if il < len(facts.moe_layers) and facts.moe_layers[il]), None)
    if first_cpu is None:
        return set()
    first = _first_readers(facts)
    return {c.label for c in live if c.label in first and first_cpu < first[c.label] < facts.layer_count}


def _fused_qkv_rotation(q: int, k: int, v: int, k_rotated: bool, v_rotated: bool) -> int:
    """Values per token alive at a fused QKV's worst rotation step: the fused output, plus Q's contiguous copy and
    rotated Q (Q is rotated with K), or rotated Q with V's copy and rotated V, or rotated Q with K's."""
    rotated_q = q if k_rotated else 0
    steps = (2 * q if k_rotated else 0, rotated_q + 2 * v if v_rotated else 0, q + 2 * k if k_rotated else 0)
    return q + k + v + max(steps)


def _ffn_terms(
    facts: ModelFacts, n_tokens: int, n_outputs: int, masks_after: Callable[..., int], cpu_experts: int = 0
) -> dict[str, int]:
    """The FFN activations of the block with the most (MoE: ``mul_mat_id``'s ``[n_ff_exp, n_expert_used,
    n_tokens]``): a gated FFN holds gate, up and their product, an ungated one only the up projection's; and the
    masks still allocated beside them (``masks_after``: those a later layer reads). Blocks below ``cpu_experts``
    run only their shared expert here (their routed ones run on the CPU)."""
    moe_ff = max(facts.expert_feed_forward_length * facts.expert_used_count, facts.expert_shared_feed_forward_length)
    experts_run = facts.traits.runs_experts
    n_layer = facts.layer_count

    moe = [il < len(facts.moe_layers) and facts.moe_layers[il] and il >= cpu_experts for il in range(n_layer)]
    widths = {
        il: (moe_ff if experts_run else 0)
        if moe[il]
        else facts.expert_shared_feed_forward_length
        if il < cpu_experts and il < len(facts.moe_layers) and facts.moe_layers[il]
        else _dense_ffn_width(facts, il)
        for il in range(n_layer)
    }
    # The last block keeps only the output rows (``ggml_get_rows(cur, inp_out_ids)``) before its FFN, except in
    # graphs that gather them there only for an MTP draft: one per slot, or per drafted token when speculating
    rows = {
        il: n_tokens
        if il < n_layer - 1 or n_layer == 1 or facts.traits.last_ffn_on_all_tokens
        else min(n_tokens, n_outputs)
        for il in widths
    }
    acts = {il: rows[il] * w * 4 for il, w in widths.items()}
    # Hybrids: the FFN of the last attention layer and of the recurrent layers after it run once the V indices
    # are freed and with the masks only as holes (an input lives until its last reader), none of the attention's
    # tensors alive (measured: the widened lfm2 without flash attention peaks at 57.5 MiB at its KQ, 53.5 at its FFN)
    last_attn = (
        max((il for il, kv in enumerate(facts.kv_layers[:n_layer]) if kv), default=-1)
        if any(facts.recurrent_layers)
        else n_layer
    )
    act = max((a for il, a in acts.items() if il < last_attn), default=0)
    widest = next((il for il, a in acts.items() if il < last_attn and a == act), None)
    late = max((a for il, a in acts.items() if il >= last_attn), default=0)
    return {
        # (beside the output-rows block's FFN every mask counts: measured on bailingmoe2 and laguna drafting 64
        # tokens)
        "ffn_mask": max(
            (masks_after(il, act, reuse=rows[il] == n_tokens) for il, a in acts.items() if il < last_attn and a == act),
            default=0,
        ),
        "ffn": 0 if facts.ffn_ungated else act,
        "ffn_ungated": act if facts.ffn_ungated else 0,
        # the (SwiGLU) FFN activations after the last attention layer, and what of the masks and V indices they
        # do not fill (measured: granitehybrid at n_embd 1024 without flash attention, 6.75 MiB activations over a
        # 5.5 MiB hole)
        "ffn_late": late,
        "ffn_late_mask": max(
            (masks_after(il, late, last=True) for il, a in acts.items() if il >= last_attn and a == late), default=0
        )
        if late
        else 0,
        # Llama 4 weighs the experts' input before their FFN (build_moe_ffn, weight_before_ffn): the repeated
        # input [n_embd, n_expert_used, n_tokens] f32 is freed under the gate/up activations, too small a hole
        # for the SwiGLU output, so it adds to the MoE FFN's peak (llama-graph.cpp:2210-2214)
        "moe_weighted": n_tokens * facts.embedding_length * facts.expert_used_count * 4
        if facts.traits.moe_weight_before_ffn and any(facts.moe_layers)
        else 0,
        # the experts' down projections [n_embd, n_expert_used, n_tokens] f32 (build_moe_ffn's mul_mat_id), beside
        # their SwiGLU input: when the freed gate and up activations are too small a hole for them they go on top
        # (fine-grained MoE: Qwen3-30B-A3B's 8 x 768-wide experts at n_embd 2048, traced: 24 MiB of hidden states
        # and inputs, gate, up and SwiGLU 12 MiB each, then 32 MiB of down projections; DeepSeek's are 8 x 2048
        # at 7168)
        "moe_down": rows[widest] * facts.embedding_length * facts.expert_used_count * 4
        if widest is not None and experts_run and moe[widest] and widths[widest] == moe_ff
        else 0,
        "moe_shared_input": n_tokens * facts.embedding_length * 4 if facts.expert_shared_feed_forward_length else 0,
    }


def _dense_ffn_width(facts: ModelFacts, il: int) -> int:
    """The block's FFN width from its ``ffn_down`` weight, else from the metadata's ``feed_forward_length``."""
    if il < len(facts.dense_ffn_widths) and facts.dense_ffn_widths[il]:
        return facts.dense_ffn_widths[il]
    return facts.feed_forward_length[il] if il < len(facts.feed_forward_length) else 0


def _mamba1(facts: ModelFacts) -> bool:
    return any(facts.recurrent_layers) and facts.traits.recurrent_graph == "mamba-1"


def _recurrent_terms(facts: ModelFacts, shape: ContextShape, n_tokens: int, mask: int) -> dict[str, int]:
    """The SSM layers' tensors: a generic scan, or the Mamba-1 / Mamba-2 layers' own peaks."""
    recurrent = any(facts.recurrent_layers)
    mamba1, mamba2 = _mamba1(facts), recurrent and facts.traits.recurrent_graph == "mamba-2"
    conv_k = facts.ssm.conv_kernel
    conv_ch = facts.recurrent_conv_state // max(conv_k - 1, 1)  # channels ggml_ssm_conv filters
    first_recurrent = facts.recurrent_layers.index(True) if recurrent else 0
    conv_x = (n_tokens + conv_k) * conv_ch * 4
    # ggml_ssm_scan's result (y, then each sequence's final state) reuses ssm_conv's freed input when it fits
    scan_y, scan_states = n_tokens * facts.ssm.inner_size * 4, facts.recurrent_state * shape.n_seq * 4
    scan_y = 0 if scan_y + scan_states <= conv_x else scan_y
    # build_mamba_layer, build_mamba2_layer: the reserve's ubatch splits n_tokens over n_seqs sequences, each with
    # its d_conv - 1 cached columns in ggml_ssm_conv's input (Mamba-1: d_inner channels; Mamba-2: x, B and C)
    conv_cols = (n_tokens + (conv_k - 1) * min(shape.n_seq, n_tokens)) * 4
    conv_x1, conv_x2 = conv_cols * facts.ssm.inner_size, conv_cols * conv_ch
    # the masks stay allocated through a recurrent layer only while attention follows (an input is freed after
    # its last reader); freed, their hole takes the layer's first tensors (ssm_conv's input among them)
    masks_alive = any(facts.kv_layers[first_recurrent:])
    # build_rs gathers the n_rs - 1 other sequences' states right after the scan (llama-graph.cpp:3613); they
    # take new memory on top of it unless they fit where ssm_conv's input was, with the rest of the masks' hole
    # (measured: Jamba, 4 split slots, ubatch 256)
    rs_extra = (shape.n_seq - 1) * facts.recurrent_state * 4
    rs_room = 0 if masks_alive else mask
    return {
        # ggml_ssm_scan's result: y [d_inner, n_tokens] followed by the final states of every sequence
        "ssm": (n_tokens * facts.ssm.inner_size + facts.recurrent_state * shape.n_seq) * 4
        if recurrent and not (mamba1 or mamba2)
        else 0,
        # build_mamba_layer's peak (models/mamba-base.cpp:44-150), at ggml_ssm_scan: xz [2 d_inner, n_tokens]
        # (its ssm_in scale multiplied in place), ssm_conv's input (where dt [d_inner, n_tokens] goes once it is
        # freed), the convolved x [d_inner, n_tokens] (bias and SiLU in place; read again by y + x * D), x_proj's
        # dt/B/C [dt_rank + 2 d_state, n_tokens] (or, with B/C/dt norms, the normalised B and C), and the scan's
        # result: y [d_inner, n_tokens] and every sequence's final state
        "mamba1_layer": (4 * facts.ssm.inner_size + facts.ssm.time_step_rank + 2 * facts.ssm.state_size) * n_tokens * 4
        + conv_x1
        + scan_states
        + (rs_extra if rs_extra > conv_x1 + rs_room else 0)
        if mamba1
        else 0,
        # build_mamba2_layer, when z is made contiguous (models/mamba-base.cpp:192-288): the fused projection zxBCdt
        # [2 d_inner + 2 n_group d_state + n_head, n_tokens], the convolved xBC [d_inner + 2 n_group d_state,
        # n_tokens], z [d_inner, n_tokens], the scan's result and, as in Mamba-1, the other sequences' states
        "mamba2_layer": (facts.ssm.inner_size + conv_ch + facts.ssm.time_step_rank + conv_ch + facts.ssm.inner_size)
        * n_tokens
        * 4
        + scan_y
        + scan_states
        + (rs_extra if rs_extra > conv_x2 + rs_room else 0)
        if mamba2
        else 0,
        # the masks still alive during a recurrent layer
        "scan_mask": mask if masks_alive else 0,
        # the rollback snapshots' states, written by the same scan (measured: once, beside the layer's peak)
        "rs_snapshots": facts.recurrent_state * shape.n_seq * shape.n_rs_seq * 4 if recurrent else 0,
        # ggml_ssm_conv's input: the cached (d_conv - 1) columns concatenated with the ubatch, per channel
        "conv": conv_x if recurrent and not mamba1 else 0,
    }


def _indexer_terms(
    facts: ModelFacts, shape: ContextShape, live: Sequence[CacheBill], n_tokens: int, positions: int
) -> dict[str, int]:
    """Sparse-attention indexers: queries and ``[n_kv, n_tokens]`` scores, a top-k selection (DSA, k-pool), or
    DeepSeek-V4's lightning indexer and top-k mask inputs.

    A k-pool indexer (glm5-next, qwen4exp) peaks before its layer's attention at its queries, at the pooling of
    every pool or at its selection rows, and inside the attention where its selection mask is scattered."""
    idx_kv = sum(c.cells for c in live if c.label == "indexer")
    # MiniMax-M3 runs MSA only with flash attention and one sequence or split streams, else dense attention in
    # every layer, its indexer unused (models/minimax-m3.cpp:233-235); MSA's tensors are its own (msa_*)
    msa = (
        facts.traits.sparse_attention == "msa"
        and bool(idx_kv)
        and shape.flash_attn
        and (shape.n_seq == 1 or not shape.unified)
    )
    indexer = bool(idx_kv) and facts.traits.sparse_attention != "msa"
    # DeepSeek-V4's trunk CSA layers run the lightning indexer (models/deepseek4.cpp build_csa_lid_attention);
    # its MTP blocks and the draft context's caches do not
    cells = {c.label: c.cells for c in live}
    raw_kv, csa_kv, lid_kv = (cells.get(k, 0) for k in ("SWA", "DSV4 CSA compressed", "DSV4 lightning-indexer"))
    csa = (
        facts.traits.sparse_attention == "csa"
        and bool(csa_kv and lid_kv)
        and DSV4_CSA_RATIO in facts.compress_ratios[: facts.layer_count]
    )
    idx_q = facts.indexer_head_count * facts.indexer_key_length * n_tokens * 4 if indexer else 0
    # DSA: the [n_kv, n_tokens] f32 scores and their top_k [n_top_k, n_tokens] i32; build_attn (llama-graph.cpp)
    # scatters the top-k into the mask from a [1, n_top_k, n_tokens] f32 zeros leaf per layer, and ggml-alloc
    # places every leaf before the first node
    dsa = indexer and any(facts.topk_mask_layers)
    n_top_k = min(facts.indexer_top_k, idx_kv)
    # k-pool: the selection rows [n_sel, n_tokens], n_sel = kpool * min(n_pool, top_k / kpool) cells plus the
    # kpool - 1 tail, n_pool the reserve's (cells / kpool) * n_seq pools padded by kpool_pad
    # (llama-memory-hybrid-idx.cpp; build_kpool_select in models/glm5-next.cpp and qwen4exp.cpp)
    kpool = facts.indexer_kpool if indexer else 0
    n_pool = max(64, -(-(idx_kv // kpool * shape.n_seq + 1) // 64) * 64) if kpool else 0
    n_top_pool = min(n_pool, facts.indexer_top_k // kpool) if kpool else 0
    n_sel = kpool * n_top_pool + kpool - 1 if kpool else 0
    selection = dsa or bool(kpool)
    # MSA's batch path, per stream of the ubatch (models/minimax-m3.cpp:449-524): the block mask expanded to cells,
    # bmc [n_tps * Hd, n_kv] f32, is alive with its transposed copy bmx [n_kv, n_tps, Hd] (:510-511); then bmx is
    # added to the f32 copy of the mask (msa_mf, :295), cast when the first stream's add needs it (it is the add's
    # second source) and alive until the last stream's of the last sparse layer: at every later peak of the block
    # masks, none with one sparse layer and one stream (measured: 291.8 MiB at -c 32768 with the zoo's one sparse
    # layer, 355.8 MiB with three: the f16 mask, or its hole, + the copy + 2 x bmc)
    streams = shape.n_seq if msa and not shape.unified else 1
    main_kv = sum(c.cells for c in live if c.label != "indexer")
    mask_f32 = main_kv * n_tokens * 4 if msa else 0
    glm5 = facts.traits.sparse_attention == "kpool-lightning"
    mask_bytes = 2 if shape.flash_attn else 4
    # inputs every full k-pool layer reads: the lightning indexer's f16 pool mask [n_pool, n_tokens] and glm5-next's
    # f32 slot mask [n_sel, n_tokens] (glm5-next.cpp:307, 334; qwen4exp.cpp:709)
    kpool_reads = (n_pool * 2 + (n_sel * 4 if glm5 else 0)) * n_tokens if kpool else 0
    # the reserve pools every pool the cache can hold (n_new = n_pool_max, llama-memory-hybrid-idx.cpp:532): their
    # member rows, whatever n_tokens
    pool_cells = idx_kv // kpool * shape.n_seq * kpool if kpool else 0
    # glm5-next attends small ubatches over the gathered latents of its selection instead of a mask
    # (glm5-next.cpp:331): K [kv_lora_rank, n_sel, 1, n_tokens] f32, its KQ [n_sel, 1, n_head, n_tokens] and
    # the transposed copy of K it reads as V (glm5-next.cpp:969-980)
    gather = glm5 and shape.n_ubatch <= 16 and shape.n_ctx > facts.indexer_top_k + kpool - 1
    # where glm5-next's f32 copy of its selection indices goes (see "kpool_sel")
    holes = (facts.embedding_length if facts.traits.mixed_batch_input else 0) * n_tokens * 4 + (
        n_pool * n_tokens * 2 if sum(facts.indexer_layers) == 1 else 0
    )
    q_side = max(facts.head_count, default=0) * (facts.key_length_mla + facts.kv_lora_rank) * n_tokens * 4
    sel_copy_above = not gather and (not shape.flash_attn or q_side > holes)
    return {
        "msa_mask": mask_f32 if sum(facts.indexer_layers[: facts.layer_count]) > 1 or streams > 1 else 0,
        "msa_block": facts.indexer_head_count * mask_f32 // streams,
        # the indexer query [n_idx_dim, Hd, n_tokens], read by every stream's scores: alive at all streams' but the
        # last's block masks
        "msa_q": facts.indexer_head_count * facts.indexer_key_length * n_tokens * 4 if streams > 1 else 0,
        # the position mask input [n_ps, n_tokens] f32, a leaf; n_ps is the positions in the cache padded to 256,
        # 256 at the reserve (llama-kv-cache-msa.cpp:262-273: its empty cache)
        "msa_pos": positions * n_tokens * 4 if msa else 0,
        "indexer_q": 0 if selection else idx_q,
        "indexer": idx_kv * n_tokens * 4 if indexer and not selection else 0,
        "topk_q": idx_q if dsa else 0,
        "topk_score": idx_kv * n_tokens * 4 if dsa else 0,
        "topk_index": n_top_k * n_tokens * 4 if dsa else 0,
        # k-pool, before its layer's attention: the queries. glm5-next's fused lightning indexer reads the projected
        # query (glm5-next.cpp:777, 832), qwen4exp's RMS-normed copy of it (qwen4exp.cpp:798-809); the scores
        # [n_pool, n_tokens] f32 and the gathered pooled keys [head_size, n_pool] f32 beside the one the indexer reads
        "kpool_q": max(idx_q * (1 if glm5 else 2), idx_q + (n_tokens + facts.indexer_key_length) * n_pool * 4)
        if kpool
        else 0,
        # the pooling of every pool: glm5-next gathers key | gate [2 head_size, kpool, n_new] f32 and adds the pool
        # position bias into a new block that is then made contiguous (glm5-next.cpp:799-806), qwen4exp gathers the
        # keys [head_size, kpool, n_new] and sums their slices into a contiguous one (qwen4exp.cpp:771-778)
        "kpool_pool": facts.indexer_key_length * 4 * (4 * pool_cells if glm5 else pool_cells + pool_cells // kpool)
        if kpool
        else 0,
        # the inputs below them: the main cache's mask (the indexer cache has none) and the pool and slot masks
        "kpool_inputs": cells.get("main", 0) * mask_bytes * n_tokens + kpool_reads if kpool else 0,
        # the attention's selection mask: scattered into -inf rows [n_kv + n_sel, n_tokens] of the kq mask's type,
        # which are alive when it is added to the causal mask into a new [n_kv, n_tokens] block ("mask" counts it as
        # the indexer cache's row) read by the attention (glm5-next.cpp:881-905, qwen4exp.cpp:833-867); without
        # flash attention after KQ, which soft_max_ext reads with it (llama-graph.cpp:2763, 2797). The pool and slot
        # masks are still alive while a later layer reads them
        "kpool_scatter": (
            n_sel * n_tokens * 4 * (2 * facts.kv_lora_rank + max(facts.head_count, default=0))
            if gather
            else (idx_kv + n_sel) * n_tokens * mask_bytes
        )
        + (kpool_reads if sum(facts.indexer_layers) > 1 else 0)
        if kpool
        else 0,
        # glm5-next's selection rows (i32, f32 per value): the pools' member indices [kpool * n_top_pool, n_tokens]
        # above the two top-k blocks [n_top_pool, n_tokens], then the tail appended in a new block [n_sel, n_tokens]
        # (glm5-next.cpp:849-867). The block of the first is freed, but the scatter's repeated zeros and f32 copy
        # of the indices (glm5-next.cpp:888, 896) need its kpool - 1 tail columns more, so the copy goes above
        # unless the block below stays free: it does when the layer's query and its absorbed product
        # [n_head * (n_embd_head_k_mla + kv_lora_rank), n_tokens] fit in the holes the mixed-input embeddings and
        # the last full layer's pool mask left (measured: c1000 3.5 rows, c2048 2.5 rows)
        "kpool_sel": n_tokens * 4 * (kpool * n_top_pool + n_sel + 2 * n_top_pool + (n_sel if sel_copy_above else 0))
        if kpool and glm5
        else 0,
        "qsa_sel": n_sel * n_tokens * 4 if kpool and facts.traits.sparse_attention == "kpool-qsa" else 0,
        # build_lid_top_k: the indexer query [indexer_head_size, indexer_n_head, n_tokens] f32 from
        # indexer_attn_q_b, and its RoPE'd copy next to it
        "lid_q": facts.indexer_head_count * facts.indexer_key_length * n_tokens * 4 if csa else 0,
        # without flash attention, the CSA layer's KQ scores over the raw window and the compressed keys: ggml
        # computes them (soft_max's first source) before the top-k mask the indexer's scores lead to
        "lid_kq": (raw_kv + csa_kv) * n_tokens * max(facts.head_count, default=0) * 4
        if csa and not shape.flash_attn
        else 0,
        # build_top_k_mask's zeros [1, n_top_k, n_tokens] (f16 with flash attention, f32 without), a leaf that,
        # like the masks, stays allocated all graph long; n_top_k = min(lightning-indexer cells, indexer_top_k);
        # DSA: the f32 zeros leaf of every top-k layer
        "topk_zeros": min(lid_kv, facts.indexer_top_k) * n_tokens * (2 if shape.flash_attn else 4)
        if csa
        else sum(facts.topk_mask_layers) * n_top_k * n_tokens * 4
        if dsa
        else 0,
    }


def combine_terms(t: dict[str, int], fit: dict[str, float] = COMPUTE_FIT) -> tuple[int, int]:
    """(inside a layer, at the logits): the moments when ggml's allocator peaks.

    Inside a layer: the masks and a few hidden-state copies stay alive while the
    largest transient (KQ scores, FFN activations, the SSM scan, or DeepSeek-V4's
    lightning-indexer query: two copies, plus the CSA KQ scores without flash
    attention) is computed.
    A k-pool indexer peaks on its own inputs before the attention, which holds
    its selection mask's scatter. A Mamba layer peaks on its own at its scan;
    in a hybrid an FFN after the last attention layer peaks without the
    attention's tensors and the V indices. MiniMax-M3's sparse (MSA) layers
    peak at their block masks, expanded to cells.
    At the end: the logits are placed above what the masks and the last
    layer's tensors left behind (measured: logits + masks + ~6 hidden states,
    which is what makes ``--spec-default`` cost Gemma 3 270M 260 MiB with 4 slots).
    """
    # the attention's transients beside every mask, a scan's beside the masks while attention follows, the FFN's
    # beside the masks later layers read
    transient = max(
        fit["mask"] * t["mask"]
        + t["kpool_scatter"]
        + max(
            fit["kq"] * t["kq"] + t["ubatch_kv"],
            t["mla_k"],
            t["mla_latent"],
            fit["lid_q"] * t["lid_q"] + fit["lid_kq"] * t["lid_kq"],
        ),
        fit["mask"] * t["scan_mask"] + fit["ssm"] * t["ssm"] + fit["conv"] * t["conv"],
        fit["mask"] * t["ffn_mask"]
        + max(
            fit["ffn"] * t["ffn"] + t["moe_weighted"], _moe_down_moment(t, fit), fit["ffn_ungated"] * t["ffn_ungated"]
        ),
    )
    # A DSA indexer peaks at its queries or at its scores with their top-k (the queries' block still below them)
    selection = max(fit["topk_q"] * t["topk_q"], t["topk_q"] + t["topk_score"] + t["topk_index"])
    below = (
        fit["hidden"] * t["hidden"]
        + t["mixed_embd"]
        + fit["query"] * t["query"]
        + fit["v_index"] * t["v_index"]
        + fit["indexer_q"] * t["indexer_q"]
        + fit["indexer"] * t["indexer"]
        + fit["decay"] * t["decay"]
        + fit["mla"] * t["mla"]
        + fit["topk_zeros"] * t["topk_zeros"]
        + t["rs_snapshots"]
        + t["hrm_zh"]
        + t["parallel_attn_out"]
    )
    layer = below + transient + selection
    # A k-pool indexer peaks before its layer's attention, on its inputs: first at its queries or at the pooling,
    # with only the hidden states and inputs below (no projection of the layer has been made), then at the
    # selection's index rows, beside the layer's queries
    kpool = (
        max(
            fit["hidden"] * t["hidden"]
            + t["mixed_embd"]
            + fit["v_index"] * t["v_index"]
            + max(t["kpool_q"], t["kpool_pool"]),
            below + t["kpool_sel"] + fit["qsa_sel"] * t["qsa_sel"],
        )
        + t["kpool_inputs"]
        if t["kpool_inputs"]
        else 0
    )
    # A Mamba layer peaks on its own: the attention tensors are gone, masks and V indices only while attention
    # follows (falcon-h1 without flash attention: its V indices sit below the scan)
    scan = (
        fit["mask"] * t["scan_mask"]
        + (t["v_index"] if t["scan_mask"] else 0)
        + (
            fit["hidden"] * t["hidden"]
            + t["mixed_embd"]
            + fit["mamba2_layer"] * t["mamba2_layer"]
            + fit["conv"] * t["conv"]
            if t["mamba2_layer"]
            else fit["mamba1_hidden"] * t["hidden"] + t["mamba1_layer"]
        )
        if t["mamba1_layer"] or t["mamba2_layer"]
        else 0
    )
    # The fused-QKV rotation moment: the masks, the input-embeddings leaf, the embeddings and the residual (or,
    # in a parallel block, the norm the FFN reads later) below the attention's fused output and rotated copies
    qkv_rot = fit["mask"] * t["mask"] + fit["qkv_rot_hidden"] * t["hidden"] + t["qkv_rot"] if t["qkv_rot"] else 0
    # MSA's block-mask moment: the mask (or its hole) and MSA's inputs and tensors, placed above the high-water mark
    # of the layer's Q/K projections, too small a hole for them: the embeddings, the residual, the attention norm's
    # output, the mixed-input copy and Q, raw and RMS-normed (the norm of a reshaped view gets a block of its own:
    # models/minimax-m3.cpp:315)
    msa = (
        fit["mask"] * t["mask"]
        + t["msa_pos"]
        + fit["msa_hidden"] * t["hidden"]
        + t["mixed_embd"]
        + fit["msa_query"] * t["query"]
        + t["msa_mask"]
        + fit["msa_block"] * t["msa_block"]
        + t["msa_q"]
        if t["msa_block"]
        else 0
    )
    late_ffn = (
        fit["hidden"] * t["hidden"]
        + t["mixed_embd"]
        + fit["query"] * t["query"]
        + fit["ffn"] * t["ffn_late"]
        + fit["mask"] * t["ffn_late_mask"]
    )
    final = t["logits"] + t["mask"] + fit["final_hidden"] * t["hidden"]
    return int(max(layer, kpool, scan, late_ffn, qkv_rot, msa)), int(final)


def _moe_down_moment(t: dict[str, int], fit: dict[str, float]) -> float:
    """The experts' FFN when their down projections [n_embd, n_expert_used, n_tokens] outgrow the hole the freed
    gate and up activations leave: they go on top of the SwiGLU output, and of gate and up too unless those fit
    in the hidden-sized holes below (activations narrower than n_embd); a shared expert keeps the FFN's input
    alive for after the routed ones (traced: a Qwen3-30B-A3B-shaped model, 8 x 768-wide experts at n_embd 2048:
    gate, up and SwiGLU 12 MiB each, then 32 MiB; qwen2moe with its shared expert at 2 x 768)."""
    if not t["moe_down"] or t["moe_down"] <= 2 * t["ffn"]:
        return 0
    activations = fit["ffn"] * t["ffn"] if t["ffn"] >= t["hidden"] else t["ffn"]
    return activations + t["moe_down"] + t["moe_shared_input"]


def _cpu_experts(facts: ModelFacts, shape: ContextShape, cpu_experts: int) -> tuple[int, int]:
    """(the CPU's moment running the routed experts of blocks 0..N-1, the down projections' copy their device gets).

    The scheduler runs each such block's ``mul_mat_id`` on the CPU, where the expert weights are, over a copy of
    the FFN's input, and copies the down projections ``[n_embd, n_expert_used, n_tokens]`` back to the block's
    device, which weighs and sums them (``_weighing``). The CPU peaks at the larger of two moments: two of the
    ``[n_ff_exp, n_expert_used, n_tokens]`` activations beside the down projections, or the down projections
    twice less a hidden-sized hole; five hidden states of its own sit below (measured over a loopback RPC worker:
    Qwen3-30B-A3B's and OLMoE's proportions, 8 routed experts 0.375 n_embd wide, and GPT-OSS's, 4 routed
    1.5 n_embd wide, at ubatches of 256 and 512 and contexts of 1024 to 8192; ``scripts/memory_accuracy.py
    --moe-split``).
    """
    n_tokens = min(shape.n_ctx, shape.n_ubatch)
    n_layer = facts.layer_count
    layers = [il for il in range(min(cpu_experts, n_layer)) if il < len(facts.moe_layers) and facts.moe_layers[il]]
    if not layers or not facts.traits.runs_experts:
        return 0, 0
    last_rows = n_tokens if n_layer == 1 or facts.traits.last_ffn_on_all_tokens else min(n_tokens, shape.n_outputs_max)
    rows = max(n_tokens if il < n_layer - 1 else last_rows for il in layers)
    used = facts.expert_used_count
    act = rows * facts.expert_feed_forward_length * used * 4
    down = rows * facts.embedding_length * used * 4
    hidden = rows * facts.embedding_length * 4
    return 5 * hidden + max(2 * act + down, 2 * down - hidden), down


def _weighing(t: dict[str, int], down_copy: int) -> float:
    """The device's moment weighing a CPU block's down projections: the split that does it starts with their copy.

    ``graph_copy`` allocates a split's input copies at its start (ggml-backend.cpp, "add inputs to the graph
    copy"): the down projections' copy, then the late masks first read in that split (``_late_masks``). Below
    them: the hidden states and the first split's inputs (the masks it copied among them, alive or holes at the
    bottom of the buffer). ggml-alloc places each in the best-fitting free block: a late mask no larger than a
    hidden state takes one of the hidden-sized blocks the layer before freed (its norm, Q, K, V), a larger one
    goes on top, like the down projections, which the weighing multiplies in place.
    """
    below = COMPUTE_FIT["hidden"] * t["hidden"] + t["mixed_embd"] + COMPUTE_FIT["query"] * t["query"]
    return below + t["mask"] - t["late_mask"] + t["late_mask_above"] + down_copy


def per_device(
    facts: ModelFacts,
    shape: ContextShape,
    caches: Sequence[CacheBill],
    devices: Sequence[str],
    output_device: str,
    cpu_experts: int = 0,
) -> tuple[dict[str, int], dict[str, int]]:
    """Each device's compute buffer as reserved, and what it grows by past the reserve once a prompt fills a slot.

    A device running blocks needs the layer moment; the output layer's device
    also the logits moment. The CPU always keeps a buffer for the input
    embeddings and the graph's inputs even when every block is offloaded. With
    ``cpu_experts`` (``--n-cpu-moe``) the offloaded blocks below it run their
    routed experts on the CPU (``_cpu_experts``), beside the masks no layer
    before them read (``_late_masks``), and their device weighs the down
    projections (``_weighing``).

    Growth: MiniMax-M3's sparse attention (MSA) is reserved for an empty cache:
    its position axis is 256 wide (``get_n_pos``) and, with split slots, the
    ubatch is shared among their streams. A long prompt in one slot runs it with
    every position of the slot and all ubatch tokens in one stream, so the block
    masks and the position mask grow (measured on the zoo model: 39.7 MiB
    reserved at -c 4096, 43.3 after a 3600-token prompt, 49.1 extrapolated to a
    full slot; 31.7 reserved with two split slots of 4096, 43.3 after one
    prompt). Every other graph is reserved over a full cache, its worst case;
    growth was measured only here.
    """
    moved = cpu_experts if any(d != "CPU" for d in devices[:cpu_experts]) else 0
    t = terms(facts, shape, caches)
    layer, final = combine_terms(t)
    cpu_moment, down_copy = _cpu_experts(facts, shape, moved)
    offloaded = layer
    if down_copy:  # the rest of the graph, the same without any routed expert, or the down projections' weighing
        rest = terms(facts, shape, caches, cpu_experts=moved)
        bare = terms(facts, shape, caches, cpu_experts=facts.layer_count)
        offloaded = int(max(combine_terms(rest)[0], combine_terms(bare)[0], _weighing(bare, down_copy)))
        cpu_moment += rest["late_mask"]  # the CPU's originals of the masks copied after the first CPU block
    out = {d: layer if d == "CPU" else offloaded for d in devices}
    out[output_device] = max(out.get(output_device, 0), final)
    # with every block offloaded: the graph's inputs (the mask among them) and the input embeddings (measured over
    # a loopback RPC worker, the zoo's MoE models at real proportions)
    out.setdefault("CPU", 4 * t["hidden"] + t["mask"])
    out["CPU"] = max(out["CPU"], cpu_moment)
    if not t["msa_block"]:
        return out, {}
    one_slot = replace(shape, n_seq=1, unified=True, n_ctx=shape.n_ctx_seq)
    full = [replace(c, cells=shape.n_ctx_seq, streams=1) for c in caches]
    # a full slot's positions: n_ctx_seq, already a multiple of 256 (get_n_pos pads to at least that)
    extra = combine_terms(terms(facts, one_slot, full, positions=shape.n_ctx_seq))[0] - layer
    sparse = {devices[il] for il, s in enumerate(facts.indexer_layers[: len(devices)]) if s}
    return out, ({d: extra for d in sparse} if extra > 0 else {})


def draft_bytes(facts: ModelFacts, shape: ContextShape, caches: Sequence[CacheBill]) -> int:
    """The MTP draft context's compute buffer: the largest of its three moments.

    The NextN graph has one block, so the attention mask dies with its attention
    and no recurrent state or trunk-wide FFN is involved. Measured on the zoo's
    Qwen3.5 with an MTP block appended (``tests.support.zoo.derive_mtp_model``): the
    attention moment is the mask and the KQ scores exactly plus ~7 rows of
    ``n_embd`` per token (residual, Q and gate, K, V, the attention output);
    the FFN and logits moments follow the trunk's rules and were not the peak there.
    """
    t = terms(facts, shape, caches)
    attention = t["mask"] + t["kq"] + DRAFT_COMPUTE_FIT["attention_hidden"] * t["hidden"]
    ffn = 2 * t["hidden"] + COMPUTE_FIT["ffn"] * t["ffn"]
    final = t["logits"] + 2 * t["hidden"]
    return int(max(attention, ffn, final))
