"""Architecture-aware facts about a GGUF model: what a memory planner needs.

``model_facts(model)`` reads a parsed ``GGUFFile`` the way the pinned llama.cpp
(b11434) reads it when it loads the model: the generic hyper-parameters every
architecture shares (``llama_model_base::load_hparams``), then the rules each
architecture's loader adds (``src/models/<arch>.cpp``): which layers use a
sliding window and the window llama.cpp falls back to when the GGUF does not say,
which layers are recurrent (hybrid Mamba / linear-attention models), MLA latent
sizes, layers that share another layer's KV cache, multi-token-prediction (MTP)
blocks, and so on. Only the rules are reproduced here, no llama.cpp code.

The numbers match what llama-server prints in its ``print_info:`` lines for the
same file (the test suite checks this for every architecture the pinned
``test-llama-archs`` can write, and for the real Gemma 3 model).

Facts that had to be guessed (an architecture llama.cpp does not know, a required
key missing) set ``approximate`` and say why in ``notes``.

Errors: a metadata value of the wrong type (a string where a count belongs, a
per-layer array of the wrong length, ...) raises ``GGUFError`` naming the key; one
the file's own tensors contradict (a block count, head counts, an expert count) or
that no real model has raises its subclasses ``InconsistentHeaderError`` /
``ImplausibleValueError`` (``gguf.consistency``), checked before any per-layer work;
nothing else escapes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf.consistency import (
    MAX_BLOCKS, MAX_CONTEXT, MAX_EMBEDDING, check_block_count, check_experts, check_limit, check_shapes,
)
from gguf.arch_traits import KNOWN_ARCHITECTURES, ArchTraits, traits_of
from gguf.errors import GGUFError, InconsistentHeaderError
from gguf.reader import LazyArray

if TYPE_CHECKING:
    from gguf.model import GGUFFile

__all__ = [
    "KVBytesPerToken", "ModelFacts", "SSMFacts", "file_type_names", "model_facts",
    "swa_layers_from_hf_config",
]

#: llama.cpp's LLAMA_MAX_LAYERS: per-layer arrays longer than this cannot load.
MAX_LAYERS = 512

#: Architectures whose every layer is recurrent (``llm_arch_is_recurrent``).
_PURE_RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# Which SSM keys each loader reads (the rest stay 0, as in llama.cpp).
_SSM_ALL = ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")
_SSM_KEYS: dict[str, tuple[str, ...]] = {
    **{a: _SSM_ALL for a in ("mamba2", "falcon-h1", "granitehybrid", "nemotron_h", "nemotron_h_moe", "plamo2",
                             "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "clef")},
    **{a: _SSM_ALL[:4] for a in ("mamba", "jamba")},
    **{a: ("conv_kernel",) for a in ("bailingmoe3", "glm5-next", "kimi-k3", "kimi-linear")},
}
#: Architectures llama.cpp runs without any KV cache or recurrent state (embedding, diffusion models).
_NO_MEMORY = frozenset({
    "bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe", "neo-bert", "eurobert",
    "wavtokenizer-dec", "modern-bert", "gemma-embedding", "dream", "llada", "llada-moe", "rnd1", "clef",
})
#: ``llm_arch_is_hybrid``: attention KV cache plus recurrent state.
_HYBRID = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
})
_KDA_ARCHS = frozenset({"bailingmoe3", "glm5-next", "kimi-k3", "kimi-linear"})
_RWKV_ARCHS = frozenset({"rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# llama_ftype id -> (short label, llama.cpp's llama_ftype_name()).
_FILE_TYPES: dict[int, tuple[str, str]] = {
    0: ("F32", "all F32"), 1: ("F16", "F16"), 2: ("Q4_0", "Q4_0"), 3: ("Q4_1", "Q4_1"), 7: ("Q8_0", "Q8_0"),
    8: ("Q5_0", "Q5_0"), 9: ("Q5_1", "Q5_1"), 10: ("Q2_K", "Q2_K - Medium"), 11: ("Q3_K_S", "Q3_K - Small"),
    12: ("Q3_K_M", "Q3_K - Medium"), 13: ("Q3_K_L", "Q3_K - Large"), 14: ("Q4_K_S", "Q4_K - Small"),
    15: ("Q4_K_M", "Q4_K - Medium"), 16: ("Q5_K_S", "Q5_K - Small"), 17: ("Q5_K_M", "Q5_K - Medium"),
    18: ("Q6_K", "Q6_K"), 19: ("IQ2_XXS", "IQ2_XXS - 2.0625 bpw"), 20: ("IQ2_XS", "IQ2_XS - 2.3125 bpw"),
    21: ("Q2_K_S", "Q2_K - Small"), 22: ("IQ3_XS", "IQ3_XS - 3.3 bpw"), 23: ("IQ3_XXS", "IQ3_XXS - 3.0625 bpw"),
    24: ("IQ1_S", "IQ1_S - 1.5625 bpw"), 25: ("IQ4_NL", "IQ4_NL - 4.5 bpw"), 26: ("IQ3_S", "IQ3_S - 3.4375 bpw"),
    27: ("IQ3_M", "IQ3_S mix - 3.66 bpw"), 28: ("IQ2_S", "IQ2_S - 2.5 bpw"), 29: ("IQ2_M", "IQ2_M - 2.7 bpw"),
    30: ("IQ4_XS", "IQ4_XS - 4.25 bpw"), 31: ("IQ1_M", "IQ1_M - 1.75 bpw"), 32: ("BF16", "BF16"),
    36: ("TQ1_0", "TQ1_0 - 1.69 bpw ternary"), 37: ("TQ2_0", "TQ2_0 - 2.06 bpw ternary"),
    38: ("MXFP4_MOE", "MXFP4 MoE"), 39: ("NVFP4", "NVFP4"), 40: ("Q1_0", "Q1_0"), 41: ("Q2_0", "Q2_0"),
}
# The file type llama.cpp guesses from the most common tensor type when general.file_type is absent.
_GUESSED_FILE_TYPE: dict[str, int] = {
    "F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q2_K": 10,
    "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "TQ1_0": 36, "TQ2_0": 37, "IQ2_XXS": 19, "IQ2_XS": 20,
    "IQ2_S": 28, "IQ3_XXS": 23, "IQ1_S": 24, "IQ1_M": 31, "IQ4_NL": 25, "IQ4_XS": 30, "IQ3_S": 26,
    "NVFP4": 39, "Q1_0": 40, "Q2_0": 41,
}

# Default special tokens per tokenizer model (llama-vocab.cpp), before the GGUF's own ids.
_TOKENIZER_DEFAULTS: dict[str, tuple[int | None, int | None]] = {
    "llama": (1, 2), "bert": (101, None), "gpt2": (11, 11), "hybriddna": (11, 11), "whitespace": (11, 11),
    "t5": (None, 1), "rwkv": (None, None), "test": (None, None), "plamo2": (1, 2), "gemma4": (None, None),
}

_SWA_TYPES = ("none", "standard", "chunked", "symmetric")
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
_BLK = re.compile(r"blk\.\s*([+-]?\d+)")


def file_type_names(file_type: int) -> tuple[str, str]:
    """Return (short label, llama.cpp description) of a ``general.file_type`` id."""
    return _FILE_TYPES.get(file_type, ("unknown", "unknown, may not work"))


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
    # each block's dense FFN width as the graph multiplies by it (blk.N.ffn_down's input; 0: none), which can differ
    # from feed_forward_length: Qwen's blocks are n_ff / 2 wide, Arctic's residual FFN n_embd
    dense_ffn_widths: tuple[int, ...] = ()
    # the FFN is up -> activation -> down, with no gate (GELU MLPs: StarCoder2, Phi-2, Nemotron...)
    ffn_ungated: bool = False
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
    # rotary dims per head of full-attention layers (llama.cpp n_rot: rope.dimension_count, else the K head size)
    rope_dimension_count: int = 0

    # -- derived ------------------------------------------------------------
    @property
    def traits(self) -> ArchTraits:
        """How llama.cpp runs this architecture where the shapes do not say (``gguf.arch_traits``)."""
        return traits_of(self.architecture)

    @property
    def has_mtp(self) -> bool:
        """The file carries multi-token-prediction (nextn) blocks."""
        return self.nextn_predict_layers > 0

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


# ---------------------------------------------------------------------------
# metadata access with type checks
# ---------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_name(v: Any) -> str:
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, LazyArray)):
        return f"an array of {len(v)}"
    return type(v).__name__


class _Meta:
    """Typed reads of one model's metadata; wrong types raise GGUFError naming the key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, path: Any, notes: list[str]) -> None:
        self.md = metadata
        self.arch = arch
        self.path = path
        self.notes = notes
        self.missing_required: list[str] = []

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def _err(self, key: str, value: Any, expected: str) -> GGUFError:
        return GGUFError(f"metadata key {key!r} is {_type_name(value)} ({_short(value)}); expected {expected}",
                         path=self.path)

    def has(self, name: str) -> bool:
        return self.key(name) in self.md

    def raw_u32(self, key: str, default: int | None = None) -> int | None:
        if key not in self.md:
            return default
        v = self.md[key]
        if not _is_int(v):
            raise self._err(key, v, "an unsigned integer")
        if v < 0:
            raise self._err(key, v, "a non-negative integer")
        return v

    def u32(self, name: str, default: int | None = None, *, required: bool = False) -> int | None:
        key = self.key(name)
        if required and key not in self.md:
            self.missing_required.append(key)
        return self.raw_u32(key, default)

    def f32(self, name: str, default: float | None = None) -> float | None:
        key = self.key(name)
        if key not in self.md:
            return default
        v = self.md[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._err(key, v, "a number")
        return float(v)

    def raw_str(self, key: str) -> str | None:
        if key not in self.md:
            return None
        v = self.md[key]
        if not isinstance(v, str):
            raise self._err(key, v, "a string")
        return v

    def int_array(self, name: str) -> list[int] | None:
        """The key's values when it is an array of integers/bools; None when absent or a scalar."""
        key = self.key(name)
        v = self.md.get(key)
        if not isinstance(v, (list, LazyArray)):
            return None
        values = list(v)
        if len(values) > MAX_LAYERS:
            raise GGUFError(f"metadata key {key!r} has {len(values)} values; llama.cpp allows at most "
                            f"{MAX_LAYERS}", path=self.path)
        out = []
        for x in values:
            if isinstance(x, bool):
                out.append(int(x))
            elif _is_int(x):
                out.append(x)
            else:
                raise self._err(key, v, "an array of integers")
        return out

    def per_layer(self, name: str, n: int, default: int | None) -> list[int] | None:
        """A scalar repeated ``n`` times, or an array that must hold exactly ``n`` values."""
        key = self.key(name)
        if key not in self.md:
            return None if default is None else [default] * n
        v = self.md[key]
        if isinstance(v, (list, LazyArray)):
            if len(v) != n:
                raise GGUFError(f"metadata key {key!r} has {len(v)} values but the model has {n} layers "
                                "(block_count); llama.cpp refuses such a file", path=self.path)
            return self.int_array(name)
        value = self.u32(name)
        return [value] * n  # type: ignore[list-item]


def _short(v: Any) -> str:
    if isinstance(v, LazyArray):
        return repr(v)
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------
# hyper-parameters, mirroring llama.cpp's llama_hparams
# ---------------------------------------------------------------------------


class _HParams:
    def __init__(self) -> None:
        self.n_ctx_train = 0
        self.n_embd = 0
        self.n_layer_all = 0
        self.n_layer_nextn = 0
        self.n_expert = 0
        self.n_expert_used: list[int] = []
        self.n_head: list[int] = []
        self.n_head_kv: list[int] = []
        self.n_ff: list[int] = []
        self.n_embd_head_k = 0
        self.n_embd_head_v = 0
        self.n_embd_head_k_swa = 0
        self.n_embd_head_v_swa = 0
        self.k_mla = 0
        self.v_mla = 0
        self.n_lora_kv = 0
        self.n_lora_kv_swa = 0
        self.k_mla_swa = 0
        self.v_mla_swa = 0
        self.swa_type = 0
        self.n_swa = 0
        self.is_swa: list[bool] = []
        self.is_recr: list[bool] = []
        self.n_layer_kv_from_start = -1
        self.shared_kv_layers = 0
        self.full_attention_interval: int | None = None
        self.ssm = [0, 0, 0, 0, 0]  # conv_kernel, inner_size, state_size, time_step_rank, group_count
        self.n_expert_shared = 0
        self.rope_scaling_type = "linear"
        self.rope_scaling_factor = 0.0
        self.n_ctx_orig_yarn = 0
        self.rope_freq_base = 10000.0
        self.wkv_head_size = 0
        self.token_shift_count = 2
        self.shortconv_l_cache = 0
        self.n_embd_head_kda = 0
        self.n_embd_head_la = 0
        self.compress_ratios: list[int] = []

    @property
    def n_layer(self) -> int:
        return self.n_layer_all - self.n_layer_nextn

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """Every ``n_pattern``-th layer is dense (0: all SWA); MTP layers are dense."""
        flags = []
        for il in range(self.n_layer_all):
            if il >= self.n_layer:
                flags.append(False)
            elif n_pattern == 0:
                flags.append(True)
            elif dense_first:
                flags.append(il % n_pattern != 0)
            else:
                flags.append(il % n_pattern < n_pattern - 1)
        self.is_swa = flags


def _array_into(flags: list[bool], values: Sequence[int]) -> list[bool]:
    """llama.cpp's get_arr into a per-layer array: the array's values, the rest unchanged."""
    out = list(flags)
    for i, v in enumerate(values[: len(out)]):
        out[i] = v != 0
    return out


# ---------------------------------------------------------------------------
# per-architecture rules
# ---------------------------------------------------------------------------

_ArchRule = Callable[[_Meta, _HParams, "_Context"], None]


@dataclass
class _Context:
    tensors: Sequence[Any]
    notes: list[str]
    approximate: list[bool]

    def guess(self, note: str) -> None:
        self.notes.append(note)
        self.approximate[0] = True


def _load_swa_pattern(meta: _Meta, hp: _HParams, n_pattern: int, dense_first: bool = False) -> None:
    """An array pattern from the GGUF, else its scalar period, else llama.cpp's built-in period."""
    values = meta.int_array("attention.sliding_window_pattern")
    if values is not None:
        hp.is_swa = _array_into(hp.is_swa, values)
        return
    period = meta.u32("attention.sliding_window_pattern")
    if period is None:
        meta.notes.append(f"{meta.key('attention.sliding_window_pattern')} is absent; llama.cpp uses its built-in "
                          f"pattern for {meta.arch}: every {n_pattern}-th layer is full attention"
                          + (" (starting with the first)" if dense_first else ""))
        period = n_pattern
    hp.set_swa_pattern(period, dense_first)
    hp.full_attention_interval = period if period > 0 else None


def _required_swa_array(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    values = meta.int_array("attention.sliding_window_pattern")
    if values is None:
        if meta.has("attention.sliding_window_pattern"):
            raise GGUFError(f"metadata key {meta.key('attention.sliding_window_pattern')!r} must be a per-layer "
                            f"array for {meta.arch}", path=meta.path)
        meta.missing_required.append(meta.key("attention.sliding_window_pattern"))
        return
    hp.is_swa = _array_into(hp.is_swa, values)


def _swa_gated(n_pattern: int, dense_first: bool = False, kind: int = 1) -> _ArchRule:
    """SWA only when the GGUF has a sliding window > 0 (gemma3, olmo2, mellum, ...)."""
    def rule(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
        hp.n_swa = meta.u32("attention.sliding_window", 0)
        if hp.n_swa > 0:
            hp.swa_type = kind
            _load_swa_pattern(meta, hp, n_pattern, dense_first)
        else:
            hp.swa_type = 0
    return rule


def _swa_always(n_pattern: int, dense_first: bool = False, kind: int = 1,
                default_window: int | None = None) -> _ArchRule:
    """Always SWA; the window is required unless llama.cpp has a default for it."""
    def rule(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
        hp.swa_type = kind
        if default_window is not None:
            hp.n_swa = default_window
            if not meta.has("attention.sliding_window"):
                meta.notes.append(f"{meta.key('attention.sliding_window')} is absent; llama.cpp uses "
                                  f"{default_window} for {meta.arch}")
        _load_swa_pattern(meta, hp, n_pattern, dense_first)
        hp.n_swa = meta.u32("attention.sliding_window", hp.n_swa, required=default_window is None)
    return rule


def _swa_array(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    """Always SWA with a required per-layer pattern array (gemma4, mimo2, step35, ...)."""
    hp.swa_type = 1
    hp.n_swa = meta.u32("attention.sliding_window", 0, required=True)
    _required_swa_array(meta, hp, ctx)


def _mla(required: bool, v_is_latent: bool = False) -> _ArchRule:
    def rule(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
        hp.n_lora_kv = meta.u32("attention.kv_lora_rank", 0, required=True)
        hp.k_mla = meta.u32("attention.key_length_mla", 0, required=required)
        hp.v_mla = meta.u32("attention.value_length_mla", 0, required=required)
        if v_is_latent:  # the MLA cache holds the compressed latent
            hp.n_embd_head_v = hp.n_lora_kv
    return rule


def _recr_by_kv_heads(all_layers: bool = False) -> _ArchRule:
    """A layer is recurrent when it has no KV heads (Jamba, Granite hybrid, Kimi linear, ...)."""
    def rule(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
        n = hp.n_layer_all if all_layers else hp.n_layer
        for il in range(n):
            hp.is_recr[il] = hp.n_head_kv[il] == 0
    return rule


def _recr_interval(default_interval: int) -> _ArchRule:
    """Linear attention everywhere but every n-th layer (Qwen3-Next / 3.5, MiniMax-01)."""
    def rule(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
        values = meta.per_layer("attention.recurrent_layers", hp.n_layer_all, None)
        if values is not None:
            hp.is_recr = [v != 0 for v in values]
            return
        interval = meta.u32("full_attention_interval", default_interval)
        if not meta.has("full_attention_interval"):
            meta.notes.append(f"{meta.key('full_attention_interval')} is absent; llama.cpp uses "
                              f"{default_interval} for {meta.arch}")
        if interval == 0:
            raise GGUFError(f"metadata key {meta.key('full_attention_interval')!r} is 0; it must be at least 1",
                            path=meta.path)
        hp.full_attention_interval = interval
        hp.is_recr = [il < hp.n_layer and (il + 1) % interval != 0 for il in range(hp.n_layer_all)]
    return rule


def _seq(*rules: _ArchRule) -> _ArchRule:
    def rule(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
        for r in rules:
            r(meta, hp, ctx)
    return rule


def _exaone4(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    if hp.n_layer == 64:  # the 32B: 3 sliding layers, then 1 full
        hp.swa_type = 1
        hp.n_swa = 4096
        _load_swa_pattern(meta, hp, 4)
    hp.n_swa = meta.u32("attention.sliding_window", hp.n_swa)


def _llama4(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    window = meta.u32("attention.sliding_window")
    if window == 0:
        hp.swa_type = 0
        hp.n_swa = 0
    else:  # chunked attention, llama.cpp hard-codes the 8192 chunk
        hp.swa_type = 2
        hp.n_swa = 8192
        _load_swa_pattern(meta, hp, 4)


def _smallthinker(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    window = meta.u32("attention.sliding_window", 0)
    hp.n_swa = window
    if window > 0:
        hp.swa_type = 1
        hp.n_swa = 4096  # llama.cpp hard-codes the window
        _load_swa_pattern(meta, hp, 4, dense_first=True)
    else:
        hp.swa_type = 0


def _phi3(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    if hp.n_swa > 0:  # llama.cpp disables Phi SWA
        hp.swa_type = 0
        hp.n_swa = 0
        hp.set_swa_pattern(1)


def _modern_bert(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    _swa_gated(3, dense_first=True, kind=3)(meta, hp, ctx)
    n_decision = meta.u32("decision.block_count", 0)
    if 0 < n_decision < hp.n_layer:
        for il in range(hp.n_layer - n_decision, hp.n_layer):
            hp.is_swa[il] = False


def _lfm2(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    hp.shortconv_l_cache = meta.u32("shortconv.l_cache", 0, required=True)
    _recr_by_kv_heads()(meta, hp, ctx)
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    if hp.n_swa > 0:
        hp.swa_type = 1
        for il in range(hp.n_layer):
            hp.is_swa[il] = not hp.is_recr[il]


def _lfm2moe(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    hp.shortconv_l_cache = meta.u32("shortconv.l_cache", 0, required=True)
    _recr_by_kv_heads()(meta, hp, ctx)


def _deepseek4(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    if hp.n_layer_nextn > 0:  # MTP blocks only count when their tensors are in the file
        probe = f"blk.{hp.n_layer_all - hp.n_layer_nextn}.nextn.eh_proj.weight"
        if not any(t.name == probe for t in ctx.tensors):
            meta.notes.append(f"{meta.key('nextn_predict_layers')} is set but {probe} is missing; llama.cpp "
                              "ignores the MTP blocks")
            hp.n_layer_nextn = 0
    hp.n_swa = meta.u32("attention.sliding_window", 0, required=True)
    hp.swa_type = 1
    hp.set_swa_pattern(0)
    for il in range(hp.n_layer, hp.n_layer_all):
        hp.is_swa[il] = True
    ratios = meta.int_array("attention.compress_ratios")
    if ratios is None:
        meta.missing_required.append(meta.key("attention.compress_ratios"))
    elif len(ratios) < hp.n_layer_all:
        ctx.guess(f"{meta.key('attention.compress_ratios')} has {len(ratios)} values for {hp.n_layer_all} layers; "
                  "llama.cpp refuses the file")
    hp.compress_ratios = (list(ratios or ()) + [0] * hp.n_layer_all)[: hp.n_layer_all]
    meta.u32("attention.indexer.key_length", 0, required=True)  # the lightning-indexer cache's head size
    ctx.notes.append("deepseek4 also keeps compressed and indexer KV caches that kv_bytes_per_token() does not count")


def _dflash(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    if meta.u32("hyper_connection.count", 0) > 0:
        hp.n_swa = meta.u32("attention.sliding_window", 0, required=True)
        hp.swa_type = 1
        hp.is_swa = [True] * hp.n_layer_all
        return
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    if hp.n_swa > 0:
        hp.swa_type = 1
        _required_swa_array(meta, hp, ctx)


def _gemma3n(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    _swa_always(5)(meta, hp, ctx)
    hp.n_layer_kv_from_start = 20
    hp.shared_kv_layers = max(hp.n_layer_all - 20, 0)


def _gemma4(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    _swa_array(meta, hp, ctx)
    shared = meta.u32("attention.shared_kv_layers", 0)
    hp.shared_kv_layers = shared
    hp.n_layer_kv_from_start = hp.n_layer_all - shared
    hp.n_embd_head_k_swa = meta.u32("attention.key_length_swa", hp.n_embd_head_k_swa, required=True)
    hp.n_embd_head_v_swa = meta.u32("attention.value_length_swa", hp.n_embd_head_v_swa, required=True)


def _gemma4_assistant(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    _swa_array(meta, hp, ctx)
    hp.shared_kv_layers = meta.u32("attention.shared_kv_layers", 0)
    hp.n_embd_head_k_swa = meta.u32("attention.key_length_swa", hp.n_embd_head_k_swa, required=True)
    hp.n_embd_head_v_swa = meta.u32("attention.value_length_swa", hp.n_embd_head_v_swa, required=True)


def _dots3note(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    _mla(required=True)(meta, hp, ctx)
    hp.n_lora_kv_swa = meta.u32("attention.kv_lora_rank_swa", 0, required=True)
    hp.k_mla_swa = meta.u32("attention.key_length_mla_swa", 0, required=True)
    hp.v_mla_swa = meta.u32("attention.value_length_mla_swa", 0, required=True)
    _swa_array(meta, hp, ctx)
    ctx.notes.append("dots3note also keeps a DSA indexer key cache that kv_bytes_per_token() does not count")


def _laguna(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    hp.n_expert_shared = meta.u32("expert_shared_count", 1)
    _swa_gated(4, dense_first=True)(meta, hp, ctx)


def _plamo2(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    hp.n_embd_head_k = meta.u32("attention.key_length", hp.n_embd_head_k)
    hp.n_embd_head_v = meta.u32("attention.value_length", hp.n_embd_head_v)
    _recr_by_kv_heads()(meta, hp, ctx)


def _nemotron_h(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    # a layer is recurrent when it has neither KV heads nor a FFN; appended MTP blocks are dense
    hp.is_recr = [il < hp.n_layer and hp.n_head_kv[il] == 0 and hp.n_ff[il] == 0 for il in range(hp.n_layer_all)]


def _minimax01(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    hp.n_embd_head_la = hp.n_embd_head_k
    _recr_interval(8)(meta, hp, ctx)


def _nanbeige(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    loops = meta.u32("num_loops", 1)
    if loops < 1:
        raise GGUFError(f"metadata key {meta.key('num_loops')!r} is 0; it must be at least 1", path=meta.path)
    if loops > 1:  # the physical blocks run `loops` times, each pass with its own KV cache
        phys = hp.n_layer
        if phys * loops > MAX_LAYERS:
            raise GGUFError(f"{meta.key('num_loops')} x block_count exceeds llama.cpp's {MAX_LAYERS} layers",
                            path=meta.path)
        for name in ("n_head", "n_head_kv", "n_ff", "is_swa", "is_recr", "n_expert_used"):
            setattr(hp, name, getattr(hp, name)[:phys] * loops)
        hp.n_layer_all = phys * loops
        ctx.notes.append(f"nanbeige runs its {phys} blocks {loops} times; per-layer facts list every pass")


def _graniteswitch(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    # one extra single-head attention block at the end holds the adapter router's K/V
    n_real = hp.n_layer
    hp.n_layer_all = n_real + 1
    hp.n_layer_nextn = 1
    for name, value in (("n_head", 1), ("n_head_kv", 1), ("n_ff", 0), ("is_swa", False), ("is_recr", False),
                        ("n_expert_used", hp.n_expert_used[0] if hp.n_expert_used else 0)):
        values = getattr(hp, name)[:n_real]
        setattr(hp, name, values + [value])
    ctx.notes.append("graniteswitch adds a router block after its layers; it is counted in block_count")


def _hunyuan_vl(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    alpha = meta.f32("rope.scaling.alpha", 0.0)
    if alpha > 0:  # XDRoPE / NTK-aware scaling of the base
        dim = hp.n_embd_head_k
        if dim > 2:
            hp.rope_freq_base = hp.rope_freq_base * alpha ** (dim / (dim - 2))


def _step35(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    _swa_array(meta, hp, ctx)


def _dsa_note(arch: str) -> _ArchRule:
    def rule(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
        ctx.notes.append(f"{arch} also keeps an indexer key cache that kv_bytes_per_token() does not count")
    return rule


_ARCH_RULES: dict[str, _ArchRule] = {
    # sliding-window families
    "afmoe": _swa_gated(4),
    "gemma3": _swa_gated(6),
    "mellum": _swa_gated(4),
    "olmo2": _swa_gated(4),
    "plamo3": _swa_gated(8),
    "modern-bert": _modern_bert,
    "laguna": _laguna,
    "cohere2": _swa_always(4),
    "cohere2moe": _swa_always(4, dense_first=True),
    "gemma-embedding": _swa_always(6, kind=3),
    "muse-glimmer": _swa_always(4),
    "gpt-oss": _swa_always(2),
    "exaone-moe": _swa_always(4),
    "gemma2": _swa_always(2, default_window=4096),
    "gemma3n": _gemma3n,
    "gemma4": _gemma4,
    "gemma4-assistant": _gemma4_assistant,
    "granite_swa": _swa_array,
    "maple": _swa_array,
    "mimo2": _swa_array,
    "spark2_5": _swa_array,
    "step35": _step35,
    "dots3note": _dots3note,
    "exaone4": _exaone4,
    "llama4": _llama4,
    "smallthinker": _smallthinker,
    "phi3": _phi3,
    "deepseek4": _deepseek4,
    "dflash": _dflash,
    # MLA
    "deepseek2": _mla(required=False),
    "mistral4": _mla(required=False),
    "deepseek32": _seq(_mla(required=False), _dsa_note("deepseek32")),
    "glm-dsa": _seq(_mla(required=False), _dsa_note("glm-dsa")),
    "hy_v4": _mla(required=True),
    "minicpm3": lambda meta, hp, ctx: setattr(hp, "n_lora_kv", meta.u32("attention.kv_lora_rank", 0, required=True)),
    "plm": lambda meta, hp, ctx: setattr(hp, "n_lora_kv", meta.u32("attention.kv_lora_rank", 0, required=True)),
    # hybrids
    "bailingmoe3": _seq(_mla(required=True), _recr_by_kv_heads()),
    "kimi-linear": _seq(_mla(required=True), _recr_by_kv_heads()),
    "kimi-k3": _seq(_mla(required=True, v_is_latent=True), _recr_by_kv_heads()),
    "glm5-next": _seq(_mla(required=True, v_is_latent=True), _recr_by_kv_heads(all_layers=True)),
    "jamba": _recr_by_kv_heads(),
    "granitehybrid": _recr_by_kv_heads(),
    "lfm2": _lfm2,
    "lfm2moe": _lfm2moe,
    "plamo2": _plamo2,
    "falcon-h1": lambda meta, hp, ctx: setattr(hp, "is_recr", [True] * hp.n_layer_all),
    "nemotron_h": _nemotron_h,
    "nemotron_h_moe": _nemotron_h,
    "qwen3next": _recr_interval(4),
    "qwen35": _recr_interval(4),
    "qwen35moe": _recr_interval(4),
    "clef": _recr_interval(4),
    "qwen4exp": _recr_interval(4),
    "minimax-01": _minimax01,
    "minimax-m3": _dsa_note("minimax-m3"),
    # layer-count changes
    "nanbeige": _nanbeige,
    "graniteswitch": _graniteswitch,
    "hunyuan_vl": _hunyuan_vl,
    "hunyuan-dense": _hunyuan_vl,
}


def _generic_rules(meta: _Meta, hp: _HParams, ctx: _Context) -> None:
    """Best effort for an architecture llama.cpp does not know: read whatever keys are there."""
    ctx.guess(f"llama.cpp b11434 has no loader for architecture {meta.arch!r}; facts follow the generic "
              "GGUF keys and may not match how a newer llama.cpp runs it")
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    values = meta.int_array("attention.sliding_window_pattern")
    if hp.n_swa > 0:
        hp.swa_type = 1
        if values is not None:
            hp.is_swa = _array_into(hp.is_swa, values)
        elif meta.has("attention.sliding_window_pattern"):
            period = meta.u32("attention.sliding_window_pattern")
            hp.set_swa_pattern(period)
            hp.full_attention_interval = period or None
        else:
            ctx.guess("a sliding window is set but no per-layer pattern; assuming every layer uses full attention "
                      "(an upper bound for the KV cache)")
    recr = meta.per_layer("attention.recurrent_layers", hp.n_layer_all, None)
    if recr is not None:
        hp.is_recr = [v != 0 for v in recr]
    elif any(meta.has(f"ssm.{k}") for k in _SSM_ALL) or meta.has("wkv.head_size"):
        if any(hp.n_head_kv):
            hp.is_recr = [hp.n_head_kv[il] == 0 for il in range(hp.n_layer_all)]
        else:
            hp.is_recr = [True] * hp.n_layer_all
    hp.n_lora_kv = meta.u32("attention.kv_lora_rank", 0)
    hp.k_mla = meta.u32("attention.key_length_mla", 0)
    hp.v_mla = meta.u32("attention.value_length_mla", 0)
    shared = meta.u32("attention.shared_kv_layers", 0)
    if shared:
        hp.shared_kv_layers = shared
        hp.n_layer_kv_from_start = hp.n_layer_all - shared


# ---------------------------------------------------------------------------
# the public entry point
# ---------------------------------------------------------------------------


def model_facts(model: GGUFFile, *, hf_config: Mapping[str, Any] | None = None) -> ModelFacts:
    """Return the facts of ``model`` (a ``GGUFFile``).

    ``hf_config`` is an optional source-repository ``config.json`` (already
    loaded); it is only consulted for the sliding-window layout of an
    architecture llama.cpp does not know and whose GGUF lacks the pattern.

    Raises:
        GGUFError: a metadata value has the wrong type or shape, its tensors contradict it or no real model has it
            (the message names the key).
    """
    try:
        return _model_facts(model, hf_config)
    except GGUFError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, ZeroDivisionError, AttributeError) as exc:
        # Belt and braces: whatever odd metadata slipped past the checks is still a bad file.
        raise GGUFError(f"cannot derive model facts from the metadata: {exc}",
                        path=getattr(model, "path", None)) from exc


def _model_facts(model: GGUFFile, hf_config: Mapping[str, Any] | None) -> ModelFacts:
    md: Mapping[str, Any] = model.metadata
    path = model.path
    notes: list[str] = []
    approximate = [False]
    tensors = model.tensors
    ctx = _Context(tensors, notes, approximate)

    probe = _Meta(md, "", path, notes)
    arch = probe.raw_str("general.architecture")
    if arch is None:
        raise GGUFError("metadata key 'general.architecture' is missing; llama.cpp cannot load the model",
                        path=path)
    meta = _Meta(md, arch, path, notes)
    known = arch in KNOWN_ARCHITECTURES
    hp = _HParams()

    # -- generic hyper-parameters (llama_model_base::load_hparams) ----------
    hp.n_ctx_train = meta.u32("context_length", 0, required=True)
    check_limit(meta.key("context_length"), hp.n_ctx_train, MAX_CONTEXT, "tokens of context", path)
    hp.n_embd = meta.u32("embedding_length", 0, required=True)
    check_limit(meta.key("embedding_length"), hp.n_embd, MAX_EMBEDDING, "embedding dimensions", path)
    # Before anything per layer is built: the block count is checked against its limit and the tensors
    block_count = meta.u32("block_count", required=True)
    highest = _max_block_index(tensors)
    hp.n_layer_nextn = meta.u32("nextn_predict_layers", 0)
    if block_count is None or block_count == 0:
        ctx.guess(f"{meta.key('block_count')} is {'missing' if block_count is None else 0}; "
                  f"using {highest + 1} from the blk.N tensors")
        block_count = highest + 1
    check_limit(meta.key("block_count"), block_count, MAX_BLOCKS, "blocks", path)
    if hp.n_layer_nextn > block_count:
        raise InconsistentHeaderError(
            f"metadata key {meta.key('nextn_predict_layers')!r} is {hp.n_layer_nextn:,} but "
            f"{meta.key('block_count')!r} is {block_count:,}; the MTP blocks are among the blocks, so llama.cpp "
            "refuses such a file", key=meta.key("nextn_predict_layers"), value=hp.n_layer_nextn, found=block_count,
            path=path)
    check_block_count(meta.key("block_count"), block_count, hp.n_layer_nextn, highest, path)
    if block_count > MAX_LAYERS:
        ctx.guess(f"{meta.key('block_count')} is {block_count}; llama.cpp b11434 supports at most {MAX_LAYERS}")
    hp.n_layer_all = block_count
    n = block_count
    hp.n_expert = meta.u32("expert_count", 0)
    hp.n_expert_used = meta.per_layer("expert_used_count", n, 0)
    if arch in ("hunyuan_vl", "hunyuan-dense") and hp.n_expert <= 1:
        hp.n_expert = 0
        hp.n_expert_used = [0] * n
    check_experts(arch, hp.n_expert, hp.n_expert_used, path)
    if arch == "wavtokenizer-dec":
        hp.n_embd = meta.u32("features_length", hp.n_embd, required=True)
    hp.n_ff = meta.per_layer("feed_forward_length", n, 0)
    hp.n_head = meta.per_layer("attention.head_count", n, 0)
    hp.n_head_kv = meta.per_layer("attention.head_count_kv", n, None) or list(hp.n_head)
    hp.n_ctx_orig_yarn = meta.u32("rope.scaling.original_context_length", hp.n_ctx_train)
    hp.rope_freq_base = meta.f32("rope.freq_base", 10000.0)
    scaling = meta.raw_str(meta.key("rope.scaling.type"))
    if scaling is not None:
        if scaling not in _ROPE_SCALING_TYPES:
            raise GGUFError(f"metadata key {meta.key('rope.scaling.type')!r} is {scaling!r}; llama.cpp knows "
                            f"{', '.join(_ROPE_SCALING_TYPES)}", path=path)
        hp.rope_scaling_type = scaling
    factor = meta.f32("rope.scaling.factor")
    if factor is None:
        factor = meta.f32("rope.scale_linear", 0.0)
    hp.rope_scaling_factor = factor
    if hp.n_head and hp.n_head[0] > 0:
        hp.n_embd_head_k = meta.u32("attention.key_length", hp.n_embd // hp.n_head[0])
        hp.n_embd_head_v = meta.u32("attention.value_length", hp.n_embd // hp.n_head[0])
    hp.n_embd_head_k_swa = meta.u32("attention.key_length_swa", hp.n_embd_head_k)
    hp.n_embd_head_v_swa = meta.u32("attention.value_length_swa", hp.n_embd_head_v)
    hp.is_swa = [False] * n
    hp.is_recr = [arch in _PURE_RECURRENT] * n
    hp.n_expert_shared = meta.u32("expert_shared_count", 0)
    for i, key in enumerate(_SSM_ALL):
        if key in _SSM_KEYS.get(arch, _SSM_ALL if not known else ()):
            hp.ssm[i] = meta.u32(f"ssm.{key}", 0, required=known)
    if arch in _KDA_ARCHS or (not known and meta.has("kda.head_dim")):
        hp.n_embd_head_kda = meta.u32("kda.head_dim", 0, required=known)
    if arch in _RWKV_ARCHS or (not known and meta.has("wkv.head_size")):
        hp.wkv_head_size = meta.u32("wkv.head_size", 0, required=known)
        hp.token_shift_count = meta.u32("token_shift_count", 2)
    full_interval = meta.u32("full_attention_interval")

    # -- per-architecture rules ---------------------------------------------
    if known:
        rule = _ARCH_RULES.get(arch)
        if rule is not None:
            rule(meta, hp, ctx)
    else:
        _generic_rules(meta, hp, ctx)
        if hp.n_swa > 0 and not any(hp.is_swa) and hf_config is not None:
            from_hf = swa_layers_from_hf_config(hf_config, hp.n_layer)
            if from_hf is not None:
                hp.is_swa = list(from_hf) + [False] * (hp.n_layer_all - len(from_hf))
                notes.append("sliding-window layers taken from the source repository's config.json")
    if meta.missing_required:
        ctx.guess("llama.cpp requires " + ", ".join(dict.fromkeys(meta.missing_required))
                  + " and will refuse this file; defaults were used")
    if hp.full_attention_interval is None and full_interval:
        hp.full_attention_interval = full_interval

    n = hp.n_layer_all
    kv_layers, state_layers = _main_context_layers(arch, hp, known)
    k_only = bool(hp.k_mla and hp.v_mla) or arch == "deepseek4" or (
        arch == "dflash" and meta.u32("hyper_connection.count", 0) > 0)
    if arch == "deepseek4":
        notes.append("deepseek4 keeps one KV stream per sequence even with a unified KV cache")

    # -- vocabulary ----------------------------------------------------------
    tokenizer_model = meta.raw_str("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, (list, LazyArray)):
        raise meta._err("tokenizer.ggml.tokens", tokens, "an array of strings")
    if tokenizer_model in ("none", "no_vocab"):
        vocab_size = meta.u32("vocab_size", 0) or 0
    else:
        vocab_size = len(tokens) if tokens is not None else meta.u32("vocab_size", 0) or 0
    bos, eos = _special_ids(meta, tokenizer_model, vocab_size)
    chat_template = meta.raw_str("tokenizer.chat_template")

    # -- file type and weights ------------------------------------------------
    file_type_value = meta.raw_u32("general.file_type")
    guessed = file_type_value is None
    file_type = _guess_file_type(tensors) if guessed else file_type_value
    short, described = file_type_names(file_type)
    if guessed:
        described = "(guessed) " + described
    layer_bytes, embd_bytes, out_bytes, other_bytes = _weight_bytes(tensors, n)
    idx_heads, idx_size, idx_layers, idx_k, idx_v = _indexer_cache(arch, meta, hp)
    kpool, topk_layers = _indexer_selection(arch, meta, hp)
    ple_state, ple_layers = _ple(arch, meta, hp)

    facts = ModelFacts(
        architecture=arch,
        known_architecture=known,
        name=meta.raw_str("general.name"),
        basename=meta.raw_str("general.basename"),
        size_label=meta.raw_str("general.size_label"),
        file_type=file_type,
        file_type_guessed=guessed,
        quant_label=short,
        file_type_description=described,
        parameter_count=sum(t.n_elements for t in tensors),
        tensor_bytes=sum(t.n_bytes for t in tensors),
        context_length=hp.n_ctx_train,
        embedding_length=hp.n_embd,
        block_count=n,
        layer_count=hp.n_layer,
        nextn_predict_layers=0 if arch == "graniteswitch" else hp.n_layer_nextn,
        head_count=tuple(hp.n_head[:n]),
        head_count_kv=tuple(hp.n_head_kv[:n]),
        feed_forward_length=tuple(hp.n_ff[:n]),
        key_length=hp.n_embd_head_k,
        value_length=hp.n_embd_head_v,
        key_length_swa=hp.n_embd_head_k_swa,
        value_length_swa=hp.n_embd_head_v_swa,
        key_length_mla=hp.k_mla if hp.k_mla and hp.v_mla else 0,
        value_length_mla=hp.v_mla if hp.k_mla and hp.v_mla else 0,
        key_length_mla_swa=hp.k_mla_swa,
        value_length_mla_swa=hp.v_mla_swa,
        kv_lora_rank=hp.n_lora_kv,
        kv_lora_rank_swa=hp.n_lora_kv_swa,
        swa_type=_SWA_TYPES[hp.swa_type],
        sliding_window=hp.n_swa,
        swa_layers=tuple(hp.is_swa[:n]),
        full_attention_interval=hp.full_attention_interval,
        recurrent_layers=tuple(hp.is_recr[:n]),
        kv_layers=kv_layers,
        kv_cache_k_only=k_only,
        recurrent_state_layers=state_layers,
        shared_kv_layers=hp.shared_kv_layers,
        ssm=SSMFacts(*hp.ssm),
        recurrent_conv_state=_n_embd_r(hp),
        recurrent_state=_n_embd_s(hp),
        expert_count=hp.n_expert,
        expert_used_counts=tuple(hp.n_expert_used[:n]),
        expert_shared_count=hp.n_expert_shared,
        rope_scaling_type=hp.rope_scaling_type,
        rope_scaling_factor=hp.rope_scaling_factor,
        rope_original_context_length=hp.n_ctx_orig_yarn,
        rope_freq_base=hp.rope_freq_base,
        tokenizer_model=tokenizer_model,
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
        chat_template=chat_template,
        layer_weight_bytes=layer_bytes,
        token_embedding_bytes=embd_bytes,
        output_weight_bytes=out_bytes,
        other_weight_bytes=other_bytes,
        approximate=approximate[0],
        notes=tuple(dict.fromkeys(notes)),
        expert_feed_forward_length=_ffn_width(tensors, "ffn_down_exps"),
        expert_shared_feed_forward_length=_ffn_width(tensors, "ffn_down_shexp"),
        moe_layers=_moe_layers(tensors, hp.n_layer_all),
        dense_ffn_widths=_dense_ffn_widths(tensors, n),
        ffn_ungated=_ffn_ungated(tensors),
        output_tied=not any(t.name == "output.weight" for t in tensors) and any(
            t.name == "token_embd.weight" for t in tensors),
        fused_qkv=_fused_qkv(tensors, kv_layers),
        indexer_head_count=idx_heads,
        indexer_key_length=idx_size,
        indexer_layers=idx_layers,
        indexer_cache_k=idx_k,
        indexer_cache_v=idx_v,
        indexer_top_k=meta.u32("attention.indexer.top_k", 0),
        indexer_kpool=kpool,
        topk_mask_layers=topk_layers,
        ple_conv_state=ple_state,
        ple_layers=ple_layers,
        compress_ratios=tuple(hp.compress_ratios),
        hyper_connections=max(meta.u32("hyper_connection.count", 1), 1),
        rope_dimension_count=meta.u32("rope.dimension_count", hp.n_embd_head_k) if any(hp.n_head) else 0,
    )
    check_shapes(facts, tensors, md, path)
    return facts


#: GLM-5.2's indexer layout when the GGUF has no indexer types (glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES).
_GLM52_INDEXER_TYPES = tuple(il < 2 or (il - 2) % 4 == 0 for il in range(78))


def _indexer_types(meta: _Meta, n_layer: int, default: Sequence[bool]) -> list[bool]:
    """``is_indexer_full`` per trunk layer: the default, then the GGUF's scalar or per-layer array."""
    full = [bool(default[il]) if il < len(default) else False for il in range(n_layer)]
    values = meta.int_array("attention.indexer.types")
    if values is not None:
        return _array_into(full, values)
    if meta.has("attention.indexer.types"):
        return [meta.u32("attention.indexer.types") != 0] * n_layer
    return full


def _indexer_cache(arch: str, meta: _Meta, hp: _HParams) -> tuple[int, int, tuple[bool, ...], int, int]:
    """(indexer heads, head size, layers with an indexer key cache, K and V values per token and layer).

    llama.cpp caches the lightning indexer's keys as a second KV cache with one
    KV head of ``indexer_head_size`` (``llama_kv_cache_dsa``); a k-pool indexer
    stores ``indexer_kpool_row`` head-size slots per row (glm5-next: 3, qwen4exp:
    2; ``llama_memory_hybrid_idx``); the MSA cache (minimax-m3) keeps a V head too.
    """
    n, n_layer = hp.n_layer_all, hp.n_layer
    heads = meta.u32("attention.indexer.head_count", 0) if meta.has("attention.indexer.head_count") else 0
    size = meta.u32("attention.indexer.key_length", 0) if meta.has("attention.indexer.key_length") else 0
    top_k = meta.u32("attention.indexer.top_k", 0)
    k, v = size, 0
    trunk = [il < n_layer for il in range(n)]

    def padded(flags: Sequence[bool]) -> list[bool]:
        return list(flags) + [False] * (n - len(flags))

    if arch == "deepseek32":
        layers = trunk
    elif arch == "glm-dsa":
        layers = padded(_indexer_types(meta, n_layer, [True] * n_layer if hp.n_ctx_train < 1048576
                                       else _GLM52_INDEXER_TYPES))
    elif arch == "hy_v4":
        layers = padded(_indexer_types(meta, n_layer, [False] * n_layer)) if top_k else [False] * n
    elif arch == "dots3note":
        layers = padded(_indexer_types(meta, n_layer, [False] * n_layer))
    elif arch == "glm5-next":
        full = padded(_indexer_types(meta, n_layer, [True] * n_layer))
        layers = [full[il] and not hp.is_recr[il] for il in range(n)]
        k = size * 3  # key | gate | pooled
    elif arch == "qwen4exp" and size > 0:
        layers = [il < n_layer and not hp.is_recr[il] for il in range(n)]
        ratios = meta.int_array("attention.compress_ratios") or [meta.u32("attention.compress_ratios", 0)]
        k = size * (2 if any(ratios) else 1)  # raw key | pooled key
    elif arch == "minimax-m3":
        lead = meta.u32("leading_dense_block_count", 0)
        layers = [il >= lead for il in range(n)]
        v = hp.n_embd_head_v
    elif arch == "deepseek4":  # its indexer keys live in the compressed caches (see compress_ratios)
        return heads, size, (False,) * n, 0, 0
    else:
        return 0, 0, (False,) * n, 0, 0
    return heads, size, tuple(layers), k, v


def _indexer_selection(arch: str, meta: _Meta, hp: _HParams) -> tuple[int, tuple[bool, ...]]:
    """(k-pool size, layers attending through a top-k mask) of a sparse-attention indexer.

    The DSA graphs call ``build_attn`` with the indexer's top-k in every trunk layer
    (deepseek32; glm-dsa and hy_v4, whose shared-indexer layers reuse the last top-k)
    or in the non-SWA ones (dots3note); the k-pool graphs (glm5-next, qwen4exp) build
    their selection mask from whole pools of ``kpool`` cells instead.
    """
    n, n_layer = hp.n_layer_all, hp.n_layer
    none = (False,) * n
    if not meta.u32("attention.indexer.top_k", 0):
        return 0, none
    if arch in ("deepseek32", "glm-dsa", "hy_v4"):
        return 0, tuple(il < n_layer for il in range(n))
    if arch == "dots3note":
        return 0, tuple(il < n_layer and not hp.is_swa[il] for il in range(n))
    if arch in ("glm5-next", "qwen4exp"):
        kpool = meta.u32("attention.indexer.kpool", 0)
        return (kpool if kpool > 1 else 0), none
    return 0, none


def _ple(arch: str, meta: _Meta, hp: _HParams) -> tuple[int, tuple[bool, ...]]:
    """qwen4exp's PLE conv history: ``(kernel - 1) * ngram * hyper_connection.count * n_embd`` floats per sequence."""
    n = hp.n_layer_all
    layers = meta.int_array("ple.layers") if arch == "qwen4exp" else None
    if not layers:
        return 0, (False,) * n
    kernel, ngram = meta.u32("ple.conv_kernel", 0), meta.u32("ple.ngram_size", 0)
    hc = meta.u32("hyper_connection.count", 0)
    state = (kernel - 1) * ngram * hc * hp.n_embd if kernel and hp.n_embd else 0
    return state, tuple(il in layers for il in range(n))


def _ffn_width(tensors: Sequence[Any], kind: str) -> int:
    """The widest ``blk.N.<kind>.weight`` input dimension: the FFN width the graph multiplies by."""
    return max((t.shape[0] for t in tensors if t.name.startswith("blk.") and t.name.endswith(f".{kind}.weight")
                and len(t.shape) >= 2), default=0)


def _dense_ffn_widths(tensors: Sequence[Any], n_layer: int) -> tuple[int, ...]:
    """Per block, the input width of ``blk.N.ffn_down.weight`` (0 where a block has none)."""
    widths = [0] * n_layer
    for t in tensors:
        if t.name.startswith("blk.") and t.name.endswith(".ffn_down.weight") and len(t.shape) >= 2:
            il = _layer_of(t.name)
            if 0 <= il < n_layer:
                widths[il] = t.shape[0]
    return tuple(widths)


def _ffn_ungated(tensors: Sequence[Any]) -> bool:
    """True when the blocks' FFN has up and down projections but no gate, separate or fused into ``ffn_up``.

    A gated FFN keeps the gate's and the up projection's activations (and their
    product) alive at once; an ungated one only the up projection's.
    """
    kinds = {t.name.split(".")[2]: t for t in tensors if t.name.startswith("blk.") and t.name.count(".") >= 3
             and t.name.endswith(".weight")}
    if any(k.startswith("ffn_gate") and not k.startswith("ffn_gate_inp") for k in kinds):
        return False
    up, down = kinds.get("ffn_up") or kinds.get("ffn_up_exps"), kinds.get("ffn_down") or kinds.get("ffn_down_exps")
    # Phi-3 and ChatGLM store gate and up side by side in ffn_up: twice the width ffn_down takes
    return up is not None and down is not None and len(up.shape) >= 2 and up.shape[1] == down.shape[0]


def _fused_qkv(tensors: Sequence[Any], kv_layers: Sequence[bool]) -> bool:
    """An attention-cache layer projects Q, K and V with one ``attn_qkv`` (Qwen3.5's linear layers do not count)."""
    return any(".attn_qkv." in t.name and 0 <= (il := _layer_of(t.name)) < len(kv_layers) and kv_layers[il]
               for t in tensors)


def _moe_layers(tensors: Sequence[Any], n_layer: int) -> tuple[bool, ...]:
    """Which blocks hold routed-expert weights (``blk.N.ffn_down_exps``)."""
    routed = {_layer_of(t.name) for t in tensors if ".ffn_down_exps." in t.name}
    return tuple(il in routed for il in range(n_layer))


def _main_context_layers(arch: str, hp: _HParams, known: bool) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(attention-cache layers, recurrent-state layers) of the main context, by llama.cpp's memory rules.

    MTP blocks get their cache only in the separate draft context, except where
    llama.cpp keeps them in the main one (hybrid wrappers, hy_v4, minimax-m3).
    """
    n = hp.n_layer_all
    recr = hp.is_recr
    main = [il < hp.n_layer for il in range(n)]
    if arch in _NO_MEMORY:
        attn, state = [False] * n, [False] * n
    elif arch in _PURE_RECURRENT:
        attn, state = [False] * n, [True] * n
    elif arch == "deepseek4":
        attn, state = [True] * n, [False] * n
    elif arch in _HYBRID or (not known and any(recr)):
        if arch == "falcon-h1":  # attention and SSM side by side in every layer
            attn, state = [True] * n, [True] * n
        elif arch in ("nemotron_h", "nemotron_h_moe"):  # attention-only and mamba-only blocks; MLP blocks hold none
            attn = [not recr[il] and hp.n_ff[il] == 0 for il in range(n)]
            state = [recr[il] and hp.n_ff[il] == 0 for il in range(n)]
        elif arch in ("qwen3next", "qwen35", "qwen35moe", "qwen4exp", "minimax-01", "glm5-next"):
            attn = [main[il] and not recr[il] for il in range(n)]
            state = [main[il] and recr[il] for il in range(n)]
        else:
            attn = [not r for r in recr]
            state = list(recr)
    elif arch in ("hy_v4", "minimax-m3") or arch == "graniteswitch" or hp.n_layer_nextn == 0 or hp.n_layer == 0:
        attn, state = [True] * n, [False] * n
    else:  # the trunk's cache leaves the MTP blocks to the draft context
        attn, state = list(main), [False] * n
    has_kv = [hp.n_layer_kv_from_start < 0 or il < hp.n_layer_kv_from_start for il in range(n)]
    return tuple(a and k for a, k in zip(attn, has_kv)), tuple(state)


def _special_ids(meta: _Meta, tokenizer_model: str | None, vocab_size: int) -> tuple[int | None, int | None]:
    """BOS/EOS as llama.cpp resolves them: tokenizer defaults, then the GGUF's ids when in range."""
    if tokenizer_model in (None, "none", "no_vocab"):
        return None, None
    if tokenizer_model not in _TOKENIZER_DEFAULTS:
        meta.notes.append(f"llama.cpp b11434 does not know tokenizer model {tokenizer_model!r} and will refuse "
                          "the file")
    bos, eos = _TOKENIZER_DEFAULTS.get(tokenizer_model, (None, None))
    out = []
    for default, key in ((bos, "tokenizer.ggml.bos_token_id"), (eos, "tokenizer.ggml.eos_token_id")):
        value = default if default is not None and default < vocab_size else None
        given = meta.raw_u32(key)
        if given is not None and given < vocab_size:
            value = given
        out.append(value)
    return out[0], out[1]


def _layer_of(name: str) -> int:
    m = _BLK.match(name)
    return int(m.group(1)) if m else -1


def _max_block_index(tensors: Sequence[Any]) -> int:
    """The highest blk.N index among the tensors (-1: none)."""
    return max((_layer_of(t.name) for t in tensors), default=-1)


def _guess_file_type(tensors: Sequence[Any]) -> int:
    """llama.cpp's guess: the most common tensor type, ties going to the first to reach the count."""
    counts: dict[str, int] = {}
    best, best_count = "F32", 0
    for t in sorted(tensors, key=lambda t: (_layer_of(t.name), t.name)):
        name = t.ggml_type.name
        counts[name] = counts.get(name, 0) + 1
        if counts[name] > best_count:
            best, best_count = name, counts[name]
    return _GUESSED_FILE_TYPE.get(best, 0)


def _weight_bytes(tensors: Sequence[Any], n_layers: int) -> tuple[tuple[int, ...], int, int, int]:
    per_layer = [0] * max(n_layers, _max_block_index(tensors) + 1)
    embd = out = other = 0
    for t in tensors:
        il = _layer_of(t.name)
        if 0 <= il < len(per_layer):
            per_layer[il] += t.n_bytes
        elif t.name.startswith("token_embd"):
            embd += t.n_bytes
        elif t.name.startswith(("output.", "output_norm.")) or t.name == "output":
            out += t.n_bytes
        else:
            other += t.n_bytes
    return tuple(per_layer), embd, out, other


def _n_embd_r(hp: _HParams) -> int:
    """Rolling (conv / token-shift) state floats per sequence and recurrent layer."""
    if hp.wkv_head_size:
        return hp.token_shift_count * hp.n_embd
    if hp.shortconv_l_cache:
        return hp.n_embd * (hp.shortconv_l_cache - 1)
    if hp.n_embd_head_kda:
        d_inner = (hp.n_head[0] if hp.n_head else 0) * hp.n_embd_head_kda
        return 3 * (hp.ssm[0] - 1 if hp.ssm[0] > 0 else 3) * d_inner
    d_conv, d_inner, d_state, _, n_group = hp.ssm
    return (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)


def _n_embd_s(hp: _HParams) -> int:
    """Recurrent (SSM / WKV / linear-attention) state floats per sequence and recurrent layer."""
    n_head0 = hp.n_head[0] if hp.n_head else 0
    if hp.wkv_head_size:
        return hp.n_embd * hp.wkv_head_size
    if hp.n_embd_head_kda:
        return hp.n_embd_head_kda * hp.n_embd_head_kda * n_head0
    if hp.n_embd_head_la:
        return hp.n_embd_head_la * hp.n_embd_head_la * n_head0
    return hp.ssm[2] * hp.ssm[1]


def swa_layers_from_hf_config(config: Mapping[str, Any], n_layer: int) -> tuple[bool, ...] | None:
    """Sliding-window layers from a Hugging Face ``config.json`` (already loaded), or None.

    Understands ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``)
    and the older ``sliding_window_pattern`` period (every n-th layer full).
    The caller fetches the file (e.g. with ``huggingface_hub``); this stays offline.
    """
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        nested = swa_layers_from_hf_config(text_config, n_layer)
        if nested is not None:
            return nested
    layer_types = config.get("layer_types")
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str) and len(layer_types) >= n_layer:
        if all(isinstance(x, str) for x in layer_types):
            return tuple(x in ("sliding_attention", "chunked_attention") for x in layer_types[:n_layer])
    period = config.get("sliding_window_pattern")
    if _is_int(period) and period > 0:
        return tuple(il % period < period - 1 for il in range(n_layer))
    return None

