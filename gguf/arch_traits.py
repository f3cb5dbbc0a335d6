"""How the pinned llama.cpp (b11434) runs each architecture, where the GGUF's metadata and tensors do not say.

The facts (``gguf.facts``) describe a model's shapes; some of what llama-server
allocates for it depends instead on code that tests the architecture by name:
``llama-arch.cpp``'s predicates, ``llama-context.cpp``'s checks, and the graph
each ``src/models/<arch>.cpp`` builds. ``ArchTraits`` names each of those
behaviours once, ``TRAITS`` says which architectures have them, and
``traits_of(arch)`` answers for any name (``DEFAULT_TRAITS`` for an architecture
that has none of them, or that llama.cpp does not know). The launcher asks these
traits (``ModelFacts.traits``) and never compares architecture names itself.

Each trait's docstring says what llama.cpp does and where in the pinned sources
(``~/.gguf-studio/llama.cpp/b11434-src/src``) it is seen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "DEFAULT_TRAITS",
    "KNOWN_ARCHITECTURES",
    "TRAITS",
    "ArchTraits",
    "RecurrentGraph",
    "SparseAttention",
    "architectures_with",
    "traits_of",
]

#: Every architecture name the pinned llama.cpp (b11434) knows (``llama-arch.cpp``).
KNOWN_ARCHITECTURES: frozenset[str] = frozenset(
    """
    clip llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert modern-bert
    nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert bloom stablelm qwen qwen2 qwen2moe
    qwen2vl qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe clef qwen4exp phi2 phi3 phimoe plamo
    plamo2 plamo3 codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3 gemma3n gemma4 gemma4-assistant
    gemma-embedding starcoder2 mamba mamba2 maple jamba falcon-h1 xverse command-r cohere2 cohere2moe dbrx olmo
    olmo2 olmoe muse-glimmer openelm arctic deepseek deepseek2 deepseek2-ocr deepseek32 deepseek4 chatglm glm4
    glm4moe glm-dsa bitnet t5 t5encoder jais jais2 nemotron nemotron_h nemotron_h_moe exaone exaone4 exaone-moe
    rwkv6 rwkv6qwen2 rwkv7 arwkv7 granite granitemoe granitehybrid graniteswitch granite_swa chameleon
    wavtokenizer-dec plm bailingmoe bailingmoe2 bailingmoe3 dots1 dots3note arcee afmoe laguna ernie4_5
    ernie4_5-moe hunyuan-moe hunyuan-dense hunyuan_vl hy_v3 hy_v4 smollm3 gpt-oss lfm2 lfm2moe dream
    smallthinker llada llada-moe seed_oss grovemoe apertus minimax-01 hrm_text minimax-m2 minimax-m3 cogvlm rnd1
    pangu-embedded mistral3 eagle3 dflash mistral4 paddleocr mimo2 step35 spark2_5 llama-embed maincoder
    kimi-linear kimi-k3 glm5-next talkie mellum nanbeige qwen3tts pockettts
""".split()
)

#: Which builder a recurrent layer's graph comes from (only read for models with recurrent layers).
RecurrentGraph = Literal["generic", "mamba-1", "mamba-2"]
#: The sparse-attention indexer a graph runs beside its attention cache.
SparseAttention = Literal["none", "dsa", "msa", "kpool-lightning", "kpool-qsa", "csa"]


@dataclass(frozen=True)
class ArchTraits:
    """What llama.cpp does differently for an architecture, beyond the shapes its GGUF gives."""

    mixed_batch_input: bool = True
    """The graph has the mixed token/embedding input path: besides the token embeddings it allocates an
    ``inp_mixed_embd`` [n_embd, n_tokens] f32 input (``llm_arch_supports_mixed_batch``, llama-arch.cpp:1182;
    read in llama-graph.cpp:2471). Off where the graph picks weights or routing per ubatch by input kind."""

    parallel_attention_ffn: bool = False
    """Each block runs attention and FFN side by side from the same norm and adds both to the residual, so the
    attention output stays alive through the FFN (models/command-r.cpp:106-119, cohere2.cpp, cohere2moe.cpp,
    plamo.cpp, phi2.cpp, falcon.cpp)."""

    last_ffn_on_all_tokens: bool = False
    """The last block runs its FFN on every token of the ubatch: the graph gathers the output rows before it
    only for an MTP draft context (``il == n_layer - 1 && inp_out_ids && cparams.embeddings_nextn_masked``,
    e.g. models/qwen35.cpp:178); other graphs gather them first, whenever no unmasked NextN state is asked for."""

    runs_experts: bool = True
    """The graph runs the routed experts of a MoE file. Off where it calls only ``build_ffn`` on the dense
    ``ffn_up``/``ffn_gate``/``ffn_down``: the loader accepts expert tensors, but they are never run
    (models/refact.cpp:61-63, 128)."""

    mla_unroped_k: bool = False
    """An MLA graph uses ``k_pe``, a view of the compressed KV projection, without RoPE, so the projection stays
    alive until K is concatenated from it (models/kimi-linear.cpp:398-444, kimi-k3.cpp:506-530)."""

    recurrent_graph: RecurrentGraph = "generic"
    """The builder of the recurrent layers: ``"mamba-1"`` (``build_mamba_layer``: Mamba-1's per-channel decay, B and C
    from ``x_proj``; models/mamba.cpp:106, jamba.cpp:128), ``"mamba-2"`` (``build_mamba2_layer``: per-head scalar
    decay, B and C in ``n_group`` groups, one fused input projection; models/mamba-base.cpp, mamba.cpp:104,
    falcon-h1.cpp:161, granite-hybrid.cpp:164, nemotron-h.cpp:215), else another scan (``"generic"``: RWKV,
    linear attention, short convolutions...)."""

    sparse_attention: SparseAttention = "none"
    """The sparse-attention indexer beside the attention cache: ``"dsa"`` (a lightning indexer whose top-k is
    scattered into the mask, ``build_attn`` with top_k in llama-graph.cpp; llama-kv-cache-dsa.cpp), ``"msa"``
    (MiniMax sparse attention: one mask for every layer, block masks expanded to cells;
    ``build_attn_inp_kv_msa`` llama-graph.cpp:3469, models/minimax-m3.cpp:237, llama-kv-cache-msa.cpp),
    ``"kpool-lightning"`` (a k-pool indexer that pools key | gate rows with a position bias, keeps a slot mask
    and attends small ubatches over gathered latents; models/glm5-next.cpp:239-334, 777-980),
    ``"kpool-qsa"`` (QSA: a k-pool indexer pooling raw and pooled keys by compress ratio; models/qwen4exp.cpp:64-77,
    425, 709-867; both k-pool kinds in llama-memory-hybrid-idx.cpp), ``"csa"`` (DeepSeek-V4's compressed sparse
    attention with its lightning indexer, ``build_csa_lid_attention`` in models/deepseek4.cpp)."""

    lightning_attention_decay: bool = False
    """Lightning attention reads an [n_tokens, n_tokens, n_head] f32 decay input in every layer
    (models/minimax-01.cpp:106-126)."""

    input_state_alive: bool = False
    """The input embedding is the high-level state zH and stays alive through the low-level cycles that read it,
    one hidden state more than a plain trunk holds (models/hrm-text.cpp:174-198)."""

    moe_weight_before_ffn: bool = False
    """``build_moe_ffn`` weighs the experts' input by the router's probabilities before their FFN, a repeated
    [n_embd, n_expert_used, n_tokens] f32 tensor (``weight_before_ffn``, llama-graph.cpp:2071, 2210)."""

    rs_rollback: bool = False
    """The recurrent state keeps rollback snapshots for speculative decoding; elsewhere ``llama_context``
    clamps ``n_rs_seq`` to 0 (``llm_arch_supports_rs_rollback``, llama-arch.cpp:1162)."""

    flash_attn: bool = True
    """Flash attention can run. Off: llama-context.cpp:3819 forces it off ("flash_attn is not compatible with
    Grok - forcing off") whatever ``-fa`` says."""

    kv_types_must_match: bool = False
    """The K and V caches must have one type even without MLA (llama-context.cpp:3838: ``hparams.is_mla() ||
    arch == LLM_ARCH_DEEPSEEK4``, "model does not support different K and V cache types")."""

    compressed_kv_cache: bool = False
    """The memory is ``llama_kv_cache_dsv4`` (llama-kv-cache-dsv4.cpp): a raw sliding-window cache, compressed
    K caches and f32 compressor states, one stream per slot even with a unified cache."""

    mtp_draft_measured: bool = False
    """The MTP draft context's compute buffer (``launcher.compute_buffer.draft_bytes``) was measured on this
    architecture's NextN graph (``graph_mtp``), with a zoo model given an appended NextN block
    (``tests.support.zoo.derive_mtp_model``); not a llama.cpp behaviour, how well the estimate is known."""

    graph_nodes: tuple[int, int] = (0, 8)
    """The node budget llama.cpp sizes its graphs' metadata for (``graph_max_nodes``, llama-context.cpp:2398): nodes
    per ubatch token, nodes per model tensor, the larger product (at least 1024 where no per-token budget). The
    chunked and looped graphs budget by tokens; the metadata's size is host memory of the process line
    (``launcher.memory.process_bytes``)."""

    thinking_from_params: int = 0
    """Models of this architecture below this many parameters start with thinking off: not a llama.cpp
    behaviour, the reference backend's (Unsloth Studio) load-time rule for Qwen3.5/3.6, which think on only from
    the 9B size; small ones reason long and answer little. 0: no such rule (``launcher.thinking``)."""


#: Qwen3.5/3.6's line between the 4B and 9B sizes, in counted tensor elements: the 9B holds about 8.95B of them
#: without its MTP block (32 blocks of 4096, 248k vocabulary, untied output), so a line at 9.0B would turn its
#: thinking off; the 4B holds under 5B.
_QWEN35_THINKING_FROM = 8_500_000_000

#: The traits of an architecture none of ``TRAITS`` names, known to llama.cpp or not.
DEFAULT_TRAITS = ArchTraits()

_NO_MIXED_BATCH = ArchTraits(mixed_batch_input=False)
_PARALLEL = ArchTraits(parallel_attention_ffn=True)
_LAST_FFN = ArchTraits(last_ffn_on_all_tokens=True)
_MAMBA2 = ArchTraits(recurrent_graph="mamba-2")
_DSA = ArchTraits(sparse_attention="dsa")
_ROLLBACK = ArchTraits(rs_rollback=True)
#: graph_max_nodes's long list (llama-context.cpp:2406-2419): 40 nodes a token, 32 a tensor
_WIDE = (40, 32)

_TABLE: dict[str, ArchTraits] = {
    "bailingmoe3": ArchTraits(last_ffn_on_all_tokens=True, rs_rollback=True, graph_nodes=_WIDE),
    "clef": ArchTraits(graph_nodes=_WIDE),
    "cogvlm": _NO_MIXED_BATCH,
    "cohere2": _PARALLEL,
    "cohere2moe": ArchTraits(parallel_attention_ffn=True, last_ffn_on_all_tokens=True),
    "command-r": _PARALLEL,
    "deepseek32": _DSA,
    "deepseek4": ArchTraits(
        mixed_batch_input=False,
        sparse_attention="csa",
        rs_rollback=True,
        kv_types_must_match=True,
        compressed_kv_cache=True,
        graph_nodes=_WIDE,
    ),
    "dflash": _NO_MIXED_BATCH,
    "dots3note": _DSA,
    "eagle3": _NO_MIXED_BATCH,
    "falcon": _PARALLEL,
    "falcon-h1": _MAMBA2,
    "gemma4": _LAST_FFN,
    "gemma4-assistant": _NO_MIXED_BATCH,
    "glm-dsa": _DSA,
    "glm5-next": ArchTraits(sparse_attention="kpool-lightning", rs_rollback=True, graph_nodes=(160, 64)),
    "gpt-oss": _LAST_FFN,
    "granitehybrid": _MAMBA2,
    "graniteswitch": _NO_MIXED_BATCH,
    "grok": ArchTraits(flash_attn=False),
    "hrm_text": ArchTraits(input_state_alive=True, graph_nodes=(80, 64)),
    "hy_v3": _LAST_FFN,
    "hy_v4": ArchTraits(sparse_attention="dsa", graph_nodes=_WIDE),
    "jamba": ArchTraits(recurrent_graph="mamba-1"),
    "kimi-k3": ArchTraits(mla_unroped_k=True, rs_rollback=True, graph_nodes=(160, 64)),
    "kimi-linear": ArchTraits(mla_unroped_k=True, graph_nodes=_WIDE),
    "lfm2": _ROLLBACK,
    "lfm2moe": _ROLLBACK,
    "llama4": ArchTraits(moe_weight_before_ffn=True),
    "mamba": ArchTraits(recurrent_graph="mamba-1"),
    "mamba2": _MAMBA2,
    "minimax-01": ArchTraits(lightning_attention_decay=True, graph_nodes=_WIDE),
    "minimax-m3": ArchTraits(sparse_attention="msa", graph_nodes=_WIDE),
    "nanbeige": ArchTraits(graph_nodes=_WIDE),
    "nemotron_h": ArchTraits(last_ffn_on_all_tokens=True, recurrent_graph="mamba-2", rs_rollback=True),
    "nemotron_h_moe": ArchTraits(recurrent_graph="mamba-2", rs_rollback=True),
    "phi2": _PARALLEL,
    "plamo": _PARALLEL,
    "qwen35": ArchTraits(
        last_ffn_on_all_tokens=True,
        rs_rollback=True,
        mtp_draft_measured=True,
        thinking_from_params=_QWEN35_THINKING_FROM,
        graph_nodes=_WIDE,
    ),
    "qwen35moe": ArchTraits(
        last_ffn_on_all_tokens=True, rs_rollback=True, thinking_from_params=_QWEN35_THINKING_FROM, graph_nodes=_WIDE
    ),
    "qwen3next": ArchTraits(last_ffn_on_all_tokens=True, graph_nodes=_WIDE),
    "qwen4exp": ArchTraits(sparse_attention="kpool-qsa", rs_rollback=True, graph_nodes=_WIDE),
    "refact": ArchTraits(runs_experts=False),
    "step35": _LAST_FFN,
}
#: Architecture name -> its traits, for every architecture whose traits differ from ``DEFAULT_TRAITS``.
TRAITS: Mapping[str, ArchTraits] = MappingProxyType(_TABLE)


def traits_of(architecture: str) -> ArchTraits:
    """Return the traits of ``architecture`` (``DEFAULT_TRAITS`` for one the table does not name)."""
    return TRAITS.get(architecture, DEFAULT_TRAITS)


def architectures_with(has: Callable[[ArchTraits], bool]) -> tuple[str, ...]:
    """Return the architectures (sorted) whose traits satisfy ``has``, for messages that list them."""
    return tuple(sorted(arch for arch, traits in TRAITS.items() if has(traits)))
