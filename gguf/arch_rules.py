"""How llama.cpp's loaders read each architecture's hyper-parameters, and which layers get which memory.

``load_hparams`` follows the pinned llama.cpp (b11434): the generic
hyper-parameters every architecture shares (``llama_model_base::load_hparams``),
then the rules each architecture's loader adds (``src/models/<arch>.cpp``): which
layers use a sliding window and the window llama.cpp falls back to when the GGUF
does not say, which layers are recurrent (hybrid Mamba / linear-attention models),
MLA latent sizes, layers that share another layer's KV cache, multi-token-prediction
(MTP) blocks, and so on. ``main_context_layers``, ``indexer_cache``,
``indexer_selection`` and ``ple_state`` apply ``llama_model::create_memory``'s rules
per architecture. Only the rules are reproduced here, no llama.cpp code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gguf.arch_traits import KNOWN_ARCHITECTURES
from gguf.consistency import MAX_BLOCKS, MAX_CONTEXT, MAX_EMBEDDING, check_block_count, check_experts, check_limit
from gguf.errors import GGUFError, InconsistentHeaderError
from gguf.hparams import HParams, LoadContext, array_into
from gguf.metadata import MAX_LAYERS, Metadata, is_int
from gguf.tensor_layout import max_block_index

#: Architectures whose every layer is recurrent (``llm_arch_is_recurrent``).
_PURE_RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# Which SSM keys each loader reads (the rest stay 0, as in llama.cpp).
_SSM_ALL = ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")
_SSM_KEYS: dict[str, tuple[str, ...]] = {
    **{
        a: _SSM_ALL
        for a in (
            "mamba2",
            "falcon-h1",
            "granitehybrid",
            "nemotron_h",
            "nemotron_h_moe",
            "plamo2",
            "qwen3next",
            "qwen35",
            "qwen35moe",
            "qwen4exp",
            "clef",
        )
    },
    **{a: _SSM_ALL[:4] for a in ("mamba", "jamba")},
    **{a: ("conv_kernel",) for a in ("bailingmoe3", "glm5-next", "kimi-k3", "kimi-linear")},
}
#: Architectures llama.cpp runs without any KV cache or recurrent state (embedding, diffusion models).
_NO_MEMORY = frozenset(
    {
        "bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "nomic-bert",
        "nomic-bert-moe",
        "neo-bert",
        "eurobert",
        "wavtokenizer-dec",
        "modern-bert",
        "gemma-embedding",
        "dream",
        "llada",
        "llada-moe",
        "rnd1",
        "clef",
    }
)
#: ``llm_arch_is_hybrid``: attention KV cache plus recurrent state.
_HYBRID = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "deepseek4",
        "minimax-01",
    }
)
_KDA_ARCHS = frozenset({"bailingmoe3", "glm5-next", "kimi-k3", "kimi-linear"})
_RWKV_ARCHS = frozenset({"rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


ArchRule = Callable[[Metadata, HParams, LoadContext], None]
"""One architecture's loader rules: they read ``Metadata`` into ``HParams``, noting guesses in the context."""


def _load_swa_pattern(meta: Metadata, hp: HParams, n_pattern: int, dense_first: bool = False) -> None:
    """An array pattern from the GGUF, else its scalar period, else llama.cpp's built-in period."""
    values = meta.int_array("attention.sliding_window_pattern")
    if values is not None:
        hp.is_swa = array_into(hp.is_swa, values)
        return
    period = meta.u32("attention.sliding_window_pattern")
    if period is None:
        meta.notes.append(
            f"{meta.key('attention.sliding_window_pattern')} is absent; llama.cpp uses its built-in "
            f"pattern for {meta.arch}: every {n_pattern}-th layer is full attention"
            + (" (starting with the first)" if dense_first else "")
        )
        period = n_pattern
    hp.set_swa_pattern(period, dense_first)
    hp.full_attention_interval = period if period > 0 else None


def _required_swa_array(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    values = meta.int_array("attention.sliding_window_pattern")
    if values is None:
        if meta.has("attention.sliding_window_pattern"):
            raise GGUFError(
                f"metadata key {meta.key('attention.sliding_window_pattern')!r} must be a per-layer "
                f"array for {meta.arch}",
                path=meta.path,
            )
        meta.missing_required.append(meta.key("attention.sliding_window_pattern"))
        return
    hp.is_swa = array_into(hp.is_swa, values)


def _swa_gated(n_pattern: int, dense_first: bool = False, kind: int = 1) -> ArchRule:
    """SWA only when the GGUF has a sliding window > 0 (gemma3, olmo2, mellum, ...)."""

    def rule(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
        hp.n_swa = meta.u32("attention.sliding_window", 0)
        if hp.n_swa > 0:
            hp.swa_type = kind
            _load_swa_pattern(meta, hp, n_pattern, dense_first)
        else:
            hp.swa_type = 0

    return rule


def _swa_always(
    n_pattern: int, dense_first: bool = False, kind: int = 1, default_window: int | None = None
) -> ArchRule:
    """Always SWA; the window is required unless llama.cpp has a default for it."""

    def rule(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
        hp.swa_type = kind
        if default_window is not None:
            hp.n_swa = default_window
            if not meta.has("attention.sliding_window"):
                meta.notes.append(
                    f"{meta.key('attention.sliding_window')} is absent; llama.cpp uses {default_window} for {meta.arch}"
                )
        _load_swa_pattern(meta, hp, n_pattern, dense_first)
        hp.n_swa = meta.u32("attention.sliding_window", hp.n_swa, required=default_window is None)

    return rule


def _swa_array(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    """Always SWA with a required per-layer pattern array (gemma4, mimo2, step35, ...)."""
    hp.swa_type = 1
    hp.n_swa = meta.u32("attention.sliding_window", 0, required=True)
    _required_swa_array(meta, hp, ctx)


def _mla(required: bool, v_is_latent: bool = False) -> ArchRule:
    def rule(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
        hp.n_lora_kv = meta.u32("attention.kv_lora_rank", 0, required=True)
        hp.k_mla = meta.u32("attention.key_length_mla", 0, required=required)
        hp.v_mla = meta.u32("attention.value_length_mla", 0, required=required)
        if v_is_latent:  # the MLA cache holds the compressed latent
            hp.n_embd_head_v = hp.n_lora_kv

    return rule


def _recr_by_kv_heads(all_layers: bool = False) -> ArchRule:
    """A layer is recurrent when it has no KV heads (Jamba, Granite hybrid, Kimi linear, ...)."""

    def rule(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
        n = hp.n_layer_all if all_layers else hp.n_layer
        for il in range(n):
            hp.is_recr[il] = hp.n_head_kv[il] == 0

    return rule


def _recr_interval(default_interval: int) -> ArchRule:
    """Linear attention everywhere but every n-th layer (Qwen3-Next / 3.5, MiniMax-01)."""

    def rule(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
        values = meta.per_layer("attention.recurrent_layers", hp.n_layer_all, None)
        if values is not None:
            hp.is_recr = [v != 0 for v in values]
            return
        interval = meta.u32("full_attention_interval", default_interval)
        if not meta.has("full_attention_interval"):
            meta.notes.append(
                f"{meta.key('full_attention_interval')} is absent; llama.cpp uses {default_interval} for {meta.arch}"
            )
        if interval == 0:
            raise GGUFError(
                f"metadata key {meta.key('full_attention_interval')!r} is 0; it must be at least 1", path=meta.path
            )
        hp.full_attention_interval = interval
        hp.is_recr = [il < hp.n_layer and (il + 1) % interval != 0 for il in range(hp.n_layer_all)]

    return rule


def _seq(*rules: ArchRule) -> ArchRule:
    def rule(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
        for r in rules:
            r(meta, hp, ctx)

    return rule


def _exaone4(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    if hp.n_layer == 64:  # the 32B: 3 sliding layers, then 1 full
        hp.swa_type = 1
        hp.n_swa = 4096
        _load_swa_pattern(meta, hp, 4)
    hp.n_swa = meta.u32("attention.sliding_window", hp.n_swa)


def _llama4(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    window = meta.u32("attention.sliding_window")
    if window == 0:
        hp.swa_type = 0
        hp.n_swa = 0
    else:  # chunked attention, llama.cpp hard-codes the 8192 chunk
        hp.swa_type = 2
        hp.n_swa = 8192
        _load_swa_pattern(meta, hp, 4)


def _smallthinker(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    window = meta.u32("attention.sliding_window", 0)
    hp.n_swa = window
    if window > 0:
        hp.swa_type = 1
        hp.n_swa = 4096  # llama.cpp hard-codes the window
        _load_swa_pattern(meta, hp, 4, dense_first=True)
    else:
        hp.swa_type = 0


def _phi3(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    if hp.n_swa > 0:  # llama.cpp disables Phi SWA
        hp.swa_type = 0
        hp.n_swa = 0
        hp.set_swa_pattern(1)


def _modern_bert(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    _swa_gated(3, dense_first=True, kind=3)(meta, hp, ctx)
    n_decision = meta.u32("decision.block_count", 0)
    if 0 < n_decision < hp.n_layer:
        for il in range(hp.n_layer - n_decision, hp.n_layer):
            hp.is_swa[il] = False


def _lfm2(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    hp.shortconv_l_cache = meta.u32("shortconv.l_cache", 0, required=True)
    _recr_by_kv_heads()(meta, hp, ctx)
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    if hp.n_swa > 0:
        hp.swa_type = 1
        for il in range(hp.n_layer):
            hp.is_swa[il] = not hp.is_recr[il]


def _lfm2moe(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    hp.shortconv_l_cache = meta.u32("shortconv.l_cache", 0, required=True)
    _recr_by_kv_heads()(meta, hp, ctx)


def _deepseek4(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    if hp.n_layer_nextn > 0:  # MTP blocks only count when their tensors are in the file
        probe = f"blk.{hp.n_layer_all - hp.n_layer_nextn}.nextn.eh_proj.weight"
        if not any(t.name == probe for t in ctx.tensors):
            meta.notes.append(
                f"{meta.key('nextn_predict_layers')} is set but {probe} is missing; llama.cpp ignores the MTP blocks"
            )
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
        ctx.guess(
            f"{meta.key('attention.compress_ratios')} has {len(ratios)} values for {hp.n_layer_all} layers; "
            "llama.cpp refuses the file"
        )
    hp.compress_ratios = (list(ratios or ()) + [0] * hp.n_layer_all)[: hp.n_layer_all]
    meta.u32("attention.indexer.key_length", 0, required=True)  # the lightning-indexer cache's head size
    ctx.notes.append("deepseek4 also keeps compressed and indexer KV caches that kv_bytes_per_token() does not count")


def _dflash(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    if meta.u32("hyper_connection.count", 0) > 0:
        hp.n_swa = meta.u32("attention.sliding_window", 0, required=True)
        hp.swa_type = 1
        hp.is_swa = [True] * hp.n_layer_all
        return
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    if hp.n_swa > 0:
        hp.swa_type = 1
        _required_swa_array(meta, hp, ctx)


def _gemma3n(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    _swa_always(5)(meta, hp, ctx)
    hp.n_layer_kv_from_start = 20
    hp.shared_kv_layers = max(hp.n_layer_all - 20, 0)


def _gemma4(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    _swa_array(meta, hp, ctx)
    shared = meta.u32("attention.shared_kv_layers", 0)
    hp.shared_kv_layers = shared
    hp.n_layer_kv_from_start = hp.n_layer_all - shared
    hp.n_embd_head_k_swa = meta.u32("attention.key_length_swa", hp.n_embd_head_k_swa, required=True)
    hp.n_embd_head_v_swa = meta.u32("attention.value_length_swa", hp.n_embd_head_v_swa, required=True)


def _gemma4_assistant(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    _swa_array(meta, hp, ctx)
    hp.shared_kv_layers = meta.u32("attention.shared_kv_layers", 0)
    hp.n_embd_head_k_swa = meta.u32("attention.key_length_swa", hp.n_embd_head_k_swa, required=True)
    hp.n_embd_head_v_swa = meta.u32("attention.value_length_swa", hp.n_embd_head_v_swa, required=True)


def _dots3note(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    _mla(required=True)(meta, hp, ctx)
    hp.n_lora_kv_swa = meta.u32("attention.kv_lora_rank_swa", 0, required=True)
    hp.k_mla_swa = meta.u32("attention.key_length_mla_swa", 0, required=True)
    hp.v_mla_swa = meta.u32("attention.value_length_mla_swa", 0, required=True)
    _swa_array(meta, hp, ctx)
    ctx.notes.append("dots3note also keeps a DSA indexer key cache that kv_bytes_per_token() does not count")


def _laguna(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    hp.n_expert_shared = meta.u32("expert_shared_count", 1)
    _swa_gated(4, dense_first=True)(meta, hp, ctx)


def _plamo2(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    hp.n_embd_head_k = meta.u32("attention.key_length", hp.n_embd_head_k)
    hp.n_embd_head_v = meta.u32("attention.value_length", hp.n_embd_head_v)
    _recr_by_kv_heads()(meta, hp, ctx)


def _nemotron_h(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    # a layer is recurrent when it has neither KV heads nor a FFN; appended MTP blocks are dense
    hp.is_recr = [il < hp.n_layer and hp.n_head_kv[il] == 0 and hp.n_ff[il] == 0 for il in range(hp.n_layer_all)]


def _minimax01(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    hp.n_embd_head_la = hp.n_embd_head_k
    _recr_interval(8)(meta, hp, ctx)


def _nanbeige(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    loops = meta.u32("num_loops", 1)
    if loops < 1:
        raise GGUFError(f"metadata key {meta.key('num_loops')!r} is 0; it must be at least 1", path=meta.path)
    if loops > 1:  # the physical blocks run `loops` times, each pass with its own KV cache
        phys = hp.n_layer
        if phys * loops > MAX_LAYERS:
            raise GGUFError(
                f"{meta.key('num_loops')} x block_count exceeds llama.cpp's {MAX_LAYERS} layers", path=meta.path
            )
        for name in ("n_head", "n_head_kv", "n_ff", "is_swa", "is_recr", "n_expert_used"):
            setattr(hp, name, getattr(hp, name)[:phys] * loops)
        hp.n_layer_all = phys * loops
        ctx.notes.append(f"nanbeige runs its {phys} blocks {loops} times; per-layer facts list every pass")


def _graniteswitch(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    # one extra single-head attention block at the end holds the adapter router's K/V
    n_real = hp.n_layer
    hp.n_layer_all = n_real + 1
    hp.n_layer_nextn = 1
    for name, value in (
        ("n_head", 1),
        ("n_head_kv", 1),
        ("n_ff", 0),
        ("is_swa", False),
        ("is_recr", False),
        ("n_expert_used", hp.n_expert_used[0] if hp.n_expert_used else 0),
    ):
        values = getattr(hp, name)[:n_real]
        setattr(hp, name, values + [value])
    ctx.notes.append("graniteswitch adds a router block after its layers; it is counted in block_count")


def _hunyuan_vl(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    alpha = meta.f32("rope.scaling.alpha", 0.0)
    if alpha > 0:  # XDRoPE / NTK-aware scaling of the base
        dim = hp.n_embd_head_k
        if dim > 2:
            hp.rope_freq_base = hp.rope_freq_base * alpha ** (dim / (dim - 2))


def _step35(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    _swa_array(meta, hp, ctx)


def _dsa_note(arch: str) -> ArchRule:
    def rule(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
        ctx.notes.append(f"{arch} also keeps an indexer key cache that kv_bytes_per_token() does not count")

    return rule


_ARCH_RULES: dict[str, ArchRule] = {
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


def _generic_rules(meta: Metadata, hp: HParams, ctx: LoadContext) -> None:
    """Best effort for an architecture llama.cpp does not know: read whatever keys are there."""
    ctx.guess(
        f"llama.cpp b11434 has no loader for architecture {meta.arch!r}; facts follow the generic "
        "GGUF keys and may not match how a newer llama.cpp runs it"
    )
    hp.n_swa = meta.u32("attention.sliding_window", 0)
    values = meta.int_array("attention.sliding_window_pattern")
    if hp.n_swa > 0:
        hp.swa_type = 1
        if values is not None:
            hp.is_swa = array_into(hp.is_swa, values)
        elif meta.has("attention.sliding_window_pattern"):
            period = meta.u32("attention.sliding_window_pattern", 0)
            hp.set_swa_pattern(period)
            hp.full_attention_interval = period or None
        else:
            ctx.guess(
                "a sliding window is set but no per-layer pattern; assuming every layer uses full attention "
                "(an upper bound for the KV cache)"
            )
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


def load_hparams(meta: Metadata, ctx: LoadContext, hf_config: Mapping[str, Any] | None) -> HParams:
    """The hyper-parameters llama.cpp loads for ``meta``'s architecture: the generic ones, then its own rules.

    ``llama_model_base::load_hparams`` reads what every architecture shares; each
    ``src/models/<arch>.cpp`` loader adds its rules (``_ARCH_RULES``); an
    architecture llama.cpp does not know gets ``_generic_rules``, with the
    sliding-window layers of ``hf_config`` (a source ``config.json``) when its GGUF
    lacks them. The block count is checked against its limit and the tensors
    before anything per layer is built.
    """
    arch, path, tensors, notes = meta.arch, meta.path, ctx.tensors, ctx.notes
    known = arch in KNOWN_ARCHITECTURES
    hp = HParams()

    # -- generic hyper-parameters (llama_model_base::load_hparams) ----------
    hp.n_ctx_train = meta.u32("context_length", 0, required=True)
    check_limit(meta.key("context_length"), hp.n_ctx_train, MAX_CONTEXT, "tokens of context", path)
    hp.n_embd = meta.u32("embedding_length", 0, required=True)
    check_limit(meta.key("embedding_length"), hp.n_embd, MAX_EMBEDDING, "embedding dimensions", path)
    block_count = meta.u32("block_count", required=True)
    highest = max_block_index(tensors)
    hp.n_layer_nextn = meta.u32("nextn_predict_layers", 0)
    if block_count is None or block_count == 0:
        ctx.guess(
            f"{meta.key('block_count')} is {'missing' if block_count is None else 0}; "
            f"using {highest + 1} from the blk.N tensors"
        )
        block_count = highest + 1
    check_limit(meta.key("block_count"), block_count, MAX_BLOCKS, "blocks", path)
    if hp.n_layer_nextn > block_count:
        raise InconsistentHeaderError(
            f"metadata key {meta.key('nextn_predict_layers')!r} is {hp.n_layer_nextn:,} but "
            f"{meta.key('block_count')!r} is {block_count:,}; the MTP blocks are among the blocks, so llama.cpp "
            "refuses such a file",
            key=meta.key("nextn_predict_layers"),
            value=hp.n_layer_nextn,
            found=block_count,
            path=path,
        )
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
            raise GGUFError(
                f"metadata key {meta.key('rope.scaling.type')!r} is {scaling!r}; llama.cpp knows "
                f"{', '.join(_ROPE_SCALING_TYPES)}",
                path=path,
            )
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
        ctx.guess(
            "llama.cpp requires "
            + ", ".join(dict.fromkeys(meta.missing_required))
            + " and will refuse this file; defaults were used"
        )
    if hp.full_attention_interval is None and full_interval:
        hp.full_attention_interval = full_interval
    return hp


def kv_cache_k_only(meta: Metadata, hp: HParams) -> bool:
    """The attention cache stores K alone: an MLA latent, or DeepSeek-V4's (and a DFlash drafter's) shared K/V."""
    return (
        bool(hp.k_mla and hp.v_mla)
        or meta.arch == "deepseek4"
        or (meta.arch == "dflash" and meta.u32("hyper_connection.count", 0) > 0)
    )


def memory_notes(arch: str) -> list[str]:
    """What the per-layer memory facts leave unsaid for ``arch``."""
    return ["deepseek4 keeps one KV stream per sequence even with a unified KV cache"] if arch == "deepseek4" else []


def mtp_block_count(meta: Metadata, hp: HParams) -> int:
    """The MTP (NextN) blocks at the end: graniteswitch's extra block is its adapter router's, not MTP."""
    return 0 if meta.arch == "graniteswitch" else hp.n_layer_nextn


#: GLM-5.2's indexer layout when the GGUF has no indexer types (glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES).
_GLM52_INDEXER_TYPES = tuple(il < 2 or (il - 2) % 4 == 0 for il in range(78))


def _indexer_types(meta: Metadata, n_layer: int, default: Sequence[bool]) -> list[bool]:
    """``is_indexer_full`` per trunk layer: the default, then the GGUF's scalar or per-layer array."""
    full = [bool(default[il]) if il < len(default) else False for il in range(n_layer)]
    values = meta.int_array("attention.indexer.types")
    if values is not None:
        return array_into(full, values)
    if meta.has("attention.indexer.types"):
        return [meta.u32("attention.indexer.types") != 0] * n_layer
    return full


def indexer_cache(arch: str, meta: Metadata, hp: HParams) -> tuple[int, int, tuple[bool, ...], int, int]:
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
        layers = padded(
            _indexer_types(meta, n_layer, [True] * n_layer if hp.n_ctx_train < 1048576 else _GLM52_INDEXER_TYPES)
        )
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


def indexer_selection(arch: str, meta: Metadata, hp: HParams) -> tuple[int, tuple[bool, ...]]:
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


def ple_state(arch: str, meta: Metadata, hp: HParams) -> tuple[int, tuple[bool, ...]]:
    """qwen4exp's PLE conv history: ``(kernel - 1) * ngram * hyper_connection.count * n_embd`` floats per sequence."""
    n = hp.n_layer_all
    layers = meta.int_array("ple.layers") if arch == "qwen4exp" else None
    if not layers:
        return 0, (False,) * n
    kernel, ngram = meta.u32("ple.conv_kernel", 0), meta.u32("ple.ngram_size", 0)
    hc = meta.u32("hyper_connection.count", 0)
    state = (kernel - 1) * ngram * hc * hp.n_embd if kernel and hp.n_embd else 0
    return state, tuple(il in layers for il in range(n))


def main_context_layers(arch: str, hp: HParams, known: bool) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
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
    return tuple(a and k for a, k in zip(attn, has_kv, strict=False)), tuple(state)


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
    if is_int(period) and period > 0:
        return tuple(il % period < period - 1 for il in range(n_layer))
    return None
