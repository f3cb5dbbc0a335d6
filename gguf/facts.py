"""Architecture-aware facts about a GGUF model: what a memory planner needs, per layer where it matters.

``ModelFacts`` is what llama.cpp (b11434) will make of a model when it loads it;
``gguf.facts_builder.model_facts`` derives it from a parsed file (and
``GGUFFile.facts`` caches it). ``ModelFacts.traits`` says how llama.cpp runs the
architecture where the shapes do not (``gguf.arch_traits``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.arch_traits import ArchTraits, traits_of

__all__ = ["DSV4_CSA_RATIO", "DSV4_HCA_RATIO", "KVBytesPerToken", "ModelFacts", "SSMFacts"]


@dataclass(frozen=True)
class SSMFacts:
    """State-space (Mamba-style) sizes; all 0 for models without SSM layers."""

    conv_kernel: int = 0  # d_conv
    inner_size: int = 0  # d_inner
    state_size: int = 0  # d_state
    time_step_rank: int = 0  # dt_rank
    group_count: int = 0  # n_group


@dataclass(frozen=True)
class KVBytesPerToken:
    """K+V cache bytes one token costs, split by attention kind.

    ``full`` grows with the whole context; ``swa`` only up to the sliding window
    (plus a batch) per sequence, since SWA layers keep a ring of recent tokens.
    """

    full: float
    swa: float

    @property
    def total(self) -> float:
        return self.full + self.swa


#: DeepSeek-V4's compression ratios (llama-kv-cache-dsv4.cpp DSV4_CSA_RATIO, DSV4_HCA_RATIO): a layer with ratio 4
#: keeps the CSA and lightning-indexer caches, one with 128 the HCA cache.
DSV4_CSA_RATIO, DSV4_HCA_RATIO = 4, 128


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp will make of a GGUF model, per layer where it matters.

    Per-layer tuples have one entry per block llama.cpp allocates
    (``block_count`` = llama.cpp's ``n_layer_all``, MTP blocks included).
    """

    architecture: str
    known_architecture: bool  # llama.cpp b11434 has a loader for it
    # general.*
    name: str | None
    basename: str | None
    size_label: str | None
    file_type: int  # llama_ftype id; guessed from the tensors when general.file_type is absent
    file_type_guessed: bool
    quant_label: str  # e.g. "Q4_K_M"
    file_type_description: str  # llama.cpp's words, e.g. "Q4_K - Medium" or "(guessed) F16"
    parameter_count: int  # every tensor element, as llama.cpp's "model params"
    tensor_bytes: int
    # sizes
    context_length: int  # n_ctx_train
    embedding_length: int  # n_embd
    block_count: int  # n_layer_all: every block, MTP / router blocks included
    layer_count: int  # n_layer: blocks of the main forward pass
    nextn_predict_layers: int  # MTP blocks at the end (0: no MTP)
    head_count: tuple[int, ...]
    head_count_kv: tuple[int, ...]
    feed_forward_length: tuple[int, ...]
    key_length: int  # per head, full-attention layers (n_embd_head_k)
    value_length: int
    key_length_swa: int  # per head, sliding-window layers
    value_length_swa: int
    key_length_mla: int  # MLA decompressed head sizes; 0 when the model does not use MLA
    value_length_mla: int
    key_length_mla_swa: int  # the same for sliding-window MLA layers (dots3note)
    value_length_mla_swa: int
    kv_lora_rank: int  # MLA latent rank (0: none)
    kv_lora_rank_swa: int
    # attention layout
    swa_type: str  # "none", "standard", "chunked" (llama4) or "symmetric" (embedding models)
    sliding_window: int  # n_swa; 0 = none
    swa_layers: tuple[bool, ...]
    full_attention_interval: int | None  # every n-th layer is full attention (None: not periodic / unknown)
    recurrent_layers: tuple[bool, ...]
    kv_layers: tuple[bool, ...]  # layers with their own K/V cache in the main (non-draft) context
    kv_cache_k_only: bool  # the cache stores K alone (MLA latent, DeepSeek-V4 shared K/V): no V bytes
    recurrent_state_layers: tuple[bool, ...]  # layers holding recurrent state in the main context
    shared_kv_layers: int  # trailing layers reusing an earlier layer's KV (Gemma 3n / 4)
    ssm: SSMFacts
    recurrent_conv_state: int  # floats per sequence per recurrent layer (llama.cpp n_embd_r)
    recurrent_state: int  # floats per sequence per recurrent layer (llama.cpp n_embd_s)
    # experts
    expert_count: int
    expert_used_counts: tuple[int, ...]
    expert_shared_count: int
    # rope
    rope_scaling_type: str  # "none", "linear", "yarn", "longrope"
    rope_scaling_factor: float  # 0.0: no scaling
    rope_original_context_length: int  # n_ctx_orig_yarn
    rope_freq_base: float
    # vocabulary
    tokenizer_model: str | None
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    # weights, for partial offload
    layer_weight_bytes: tuple[int, ...]  # bytes of the blk.N.* tensors, index N
    token_embedding_bytes: int  # token_embd.* (llama.cpp keeps these on the CPU)
    output_weight_bytes: int  # output.* and output_norm.* (the "output layer")
    other_weight_bytes: int  # every other tensor outside blk.N
    approximate: bool
    notes: tuple[str, ...]
    # expert FFN widths, as the graph multiplies by them (the ffn_*_exps / ffn_*_shexp tensors; 0: none)
    expert_feed_forward_length: int = 0  # one routed expert (llama.cpp n_ff_exp)
    expert_shared_feed_forward_length: int = 0  # the shared expert(s), all together (n_ff_shexp x count)
    moe_layers: tuple[bool, ...] = ()  # blocks with routed experts (leading dense blocks and interleaving leave gaps)
    #: per block, the bytes of its routed experts' tensors (part of ``layer_weight_bytes``; ``--n-cpu-moe`` moves them)
    expert_weight_bytes: tuple[int, ...] = ()
    # each block's dense FFN width as the graph multiplies by it (blk.N.ffn_down's input; 0: none), which can differ
    # from feed_forward_length: Qwen's blocks are n_ff / 2 wide, Arctic's residual FFN n_embd
    dense_ffn_widths: tuple[int, ...] = ()
    # the FFN is up -> activation -> down, with no gate (GELU MLPs: StarCoder2, Phi-2, Nemotron...)
    ffn_ungated: bool = False
    #: the authors' sampling defaults (``general.sampling.*``, numbers only), as (key after the prefix, value):
    #: llama-server applies these itself where its command line sets none
    sampling: tuple[tuple[str, float], ...] = ()
    #: BPE merge rules (``tokenizer.ggml.merges``): llama-server keeps each in a map, a host-memory cost per rule
    merge_count: int = 0
    # no output.weight: the logits reuse token_embd.weight, which llama.cpp loads again on the output layer's
    # device when that is not the CPU (llama-model-loader.cpp TENSOR_DUPLICATED; an encoder with no output layer
    # at all is counted as tied too, erring on the safe side)
    output_tied: bool = False
    # an attention-cache layer projects Q, K and V with one fused ``attn_qkv`` (build_qkv's views into its output)
    fused_qkv: bool = False
    # sparse-attention indexer key cache (DSA / MSA / QSA; llama-kv-cache-dsa.cpp, -msa.cpp, memory-hybrid-idx.cpp)
    indexer_head_count: int = 0
    indexer_key_length: int = 0  # per indexer head (llama.cpp indexer_head_size)
    indexer_layers: tuple[bool, ...] = ()  # layers with an indexer key cache in the main context
    indexer_cache_k: int = 0  # K values cached per token and indexer layer (one head; k-pool rows side by side)
    indexer_cache_v: int = 0  # V values per token and indexer layer (MSA keeps V too; DSA/QSA none)
    indexer_top_k: int = 0  # keys the indexer keeps per query (llama.cpp indexer_top_k; 0: none)
    indexer_kpool: int = 0  # cells per pool of a k-pool indexer, which selects whole pools (glm5-next, qwen4exp)
    # layers whose attention scatters the indexer's top-k into its mask (DSA: build_attn with top_k, llama-graph.cpp)
    topk_mask_layers: tuple[bool, ...] = ()
    # PLE n-gram conv history kept next to the recurrent state (qwen4exp; llama.cpp ple_conv_state)
    ple_conv_state: int = 0  # floats per sequence
    ple_layers: tuple[bool, ...] = ()
    # DeepSeek-V4's compressed caches (llama-kv-cache-dsv4.cpp): each layer's compression ratio (llama.cpp
    # dsv4_compress_ratios; 0: the raw window cache only, 4: CSA and lightning-indexer caches, 128: HCA cache)
    compress_ratios: tuple[int, ...] = ()
    # DeepSeek-V4's hyper-connections: the residual stream is this many n_embd-wide copies (dsv4_hc_mult)
    hyper_connections: int = 1
    # the first MTP block's NextN projection (``blk.{n_layer}.nextn.eh_proj.weight``) is in the file, the probe
    # llama.cpp's loaders use (models/deepseek2.cpp ``mtp_probe``): a trunk-only file keeps ``nextn_predict_layers``
    # but drops those tensors, and llama-server then refuses draft-mtp ("failed to create MTP context")
    mtp_tensors: bool = False
    # rotary dims per head of full-attention layers (llama.cpp n_rot: rope.dimension_count, else the K head size)
    rope_dimension_count: int = 0
    # how the file asks its embeddings pooled (``<arch>.pooling_type``, llama.cpp's llama_pooling_type: 0 none,
    # 1 mean, 2 cls, 3 last, 4 rank); -1: it does not say, as a chat model's file usually does not
    pooling_type: int = -1
    # tensors in the file: llama.cpp's ``n_tensors()``, which sizes its graphs' metadata (``traits.graph_nodes``)
    tensor_count: int = 0

    # -- derived ------------------------------------------------------------
    @property
    def traits(self) -> ArchTraits:
        """How llama.cpp runs this architecture where the shapes do not say (``gguf.arch_traits``)."""
        return traits_of(self.architecture)

    @property
    def has_mtp(self) -> bool:
        """The file carries multi-token-prediction (nextn) blocks, their tensors included."""
        return self.nextn_predict_layers > 0 and self.mtp_tensors

    @property
    def trunk_only(self) -> bool:
        """The file declares MTP blocks but carries none of their tensors (the trunk of an MTP model)."""
        return self.nextn_predict_layers > 0 and not self.mtp_tensors

    @property
    def is_swa_any(self) -> bool:
        return any(self.swa_layers)

    @property
    def is_mla(self) -> bool:
        """K/V are cached as one compressed latent (DeepSeek-style MLA): no separate V cache."""
        return self.key_length_mla != 0 and self.value_length_mla != 0

    @property
    def is_recurrent(self) -> bool:
        """Every layer is recurrent (Mamba, RWKV): no KV cache at all."""
        return all(self.recurrent_layers) and bool(self.recurrent_layers)

    @property
    def is_hybrid(self) -> bool:
        return any(self.recurrent_layers) and not all(self.recurrent_layers)

    @property
    def expert_used_count(self) -> int:
        """Experts routed per token (the largest per-layer value)."""
        return max(self.expert_used_counts, default=0)

    @property
    def non_layer_weight_bytes(self) -> int:
        return self.token_embedding_bytes + self.output_weight_bytes + self.other_weight_bytes

    def key_length_of(self, layer: int) -> int:
        """K head size of ``layer`` (SWA layers may differ)."""
        return self.key_length_swa if self.swa_layers[layer] else self.key_length

    def value_length_of(self, layer: int) -> int:
        return self.value_length_swa if self.swa_layers[layer] else self.value_length

    def k_embd(self, layer: int) -> int:
        """K values cached per token in ``layer`` (llama.cpp n_embd_k_gqa)."""
        return self.key_length_of(layer) * self.head_count_kv[layer]

    def v_embd(self, layer: int) -> int:
        """V values per token in ``layer`` (llama.cpp n_embd_v_gqa); MLA caches no V."""
        return self.value_length_of(layer) * self.head_count_kv[layer]

    def attention_cache_layers(self) -> tuple[int, ...]:
        """Indexes of the layers that get a K/V cache."""
        return tuple(i for i, has in enumerate(self.kv_layers) if has)

    def kv_bytes_per_token(self, cache_type_bytes: float = 2.0) -> KVBytesPerToken:
        """K+V cache bytes per token (f16 cache by default), full vs sliding-window layers.

        Extra caches some architectures add (DSA indexer keys, DeepSeek-V4
        compressed caches) are not included; see ``notes``.
        """
        full = swa = 0
        for il in self.attention_cache_layers():
            n = self.k_embd(il) + (0 if self.kv_cache_k_only else self.v_embd(il))
            if self.swa_layers[il]:
                swa += n
            else:
                full += n
        return KVBytesPerToken(full=full * cache_type_bytes, swa=swa * cache_type_bytes)

    def recurrent_state_bytes_per_sequence(self, state_type_bytes: float = 4.0) -> float:
        """Bytes of recurrent state (conv + SSM/WKV state) one sequence needs, f32 by default."""
        n = sum(self.recurrent_state_layers)
        return n * (self.recurrent_conv_state + self.recurrent_state) * state_type_bytes
