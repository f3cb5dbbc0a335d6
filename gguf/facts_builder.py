"""Architecture-aware facts about a GGUF model: what a memory planner needs (``model_facts``).

``model_facts(model)`` reads a parsed ``GGUFFile`` the way the pinned llama.cpp
(b11434) reads it when it loads the model: its hyper-parameters, generic and per
architecture (``gguf.arch_rules``, through the typed reader ``gguf.metadata``),
which layers get an attention cache or recurrent state, the vocabulary, the file
type (``gguf.file_types``) and what the tensor list says (``gguf.tensor_layout``).

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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gguf import arch_rules, file_types, tensor_layout
from gguf.arch_traits import KNOWN_ARCHITECTURES
from gguf.consistency import check_shapes
from gguf.errors import GGUFError
from gguf.facts import ModelFacts, SSMFacts
from gguf.hparams import LoadContext
from gguf.metadata import Metadata
from gguf.reader import LazyArray, TensorInfo

__all__ = ["ParsedModel", "model_facts"]

# Default special tokens per tokenizer model (llama-vocab.cpp), before the GGUF's own ids.
_TOKENIZER_DEFAULTS: dict[str, tuple[int | None, int | None]] = {
    "llama": (1, 2),
    "bert": (101, None),
    "gpt2": (11, 11),
    "hybriddna": (11, 11),
    "whitespace": (11, 11),
    "t5": (None, 1),
    "rwkv": (None, None),
    "test": (None, None),
    "plamo2": (1, 2),
    "gemma4": (None, None),
}

_SWA_TYPES = ("none", "standard", "chunked", "symmetric")


class ParsedModel(Protocol):
    """What the facts are read from: a ``GGUFFile`` (``gguf.model``), or a stand-in with the same three parts."""

    @property
    def path(self) -> Path | None: ...
    @property
    def metadata(self) -> Mapping[str, Any]: ...
    @property
    def tensors(self) -> Sequence[TensorInfo]: ...


def model_facts(model: ParsedModel, *, hf_config: Mapping[str, Any] | None = None) -> ModelFacts:
    """Return the facts of ``model`` (a ``GGUFFile``, or anything with its metadata, tensors and path).

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
        raise GGUFError(
            f"cannot derive model facts from the metadata: {exc}", path=getattr(model, "path", None)
        ) from exc


def _model_facts(model: ParsedModel, hf_config: Mapping[str, Any] | None) -> ModelFacts:
    md: Mapping[str, Any] = model.metadata
    path = model.path
    notes: list[str] = []
    approximate = [False]
    tensors = model.tensors
    ctx = LoadContext(tensors, notes, approximate)

    probe = Metadata(md, "", path, notes)
    arch = probe.raw_str("general.architecture")
    if arch is None:
        raise GGUFError("metadata key 'general.architecture' is missing; llama.cpp cannot load the model", path=path)
    meta = Metadata(md, arch, path, notes)
    known = arch in KNOWN_ARCHITECTURES
    hp = arch_rules.load_hparams(meta, ctx, hf_config)

    n = hp.n_layer_all
    kv_layers, state_layers = arch_rules.main_context_layers(arch, hp, known)
    k_only = arch_rules.kv_cache_k_only(meta, hp)
    notes += arch_rules.memory_notes(arch)

    # -- vocabulary ----------------------------------------------------------
    tokenizer_model = meta.raw_str("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, (list, LazyArray)):
        raise meta.error("tokenizer.ggml.tokens", tokens, "an array of strings")
    if tokenizer_model in ("none", "no_vocab"):
        vocab_size = meta.u32("vocab_size", 0) or 0
    else:
        vocab_size = len(tokens) if tokens is not None else meta.u32("vocab_size", 0) or 0
    bos, eos = _special_ids(meta, tokenizer_model, vocab_size)
    merges = md.get("tokenizer.ggml.merges")
    merge_count = len(merges) if isinstance(merges, (list, LazyArray)) else 0
    chat_template = meta.raw_str("tokenizer.chat_template")

    # -- file type and weights ------------------------------------------------
    file_type_value = meta.raw_u32("general.file_type")
    guessed = file_type_value is None
    file_type = file_types.guess_file_type(tensors) if file_type_value is None else file_type_value
    short, described = file_types.file_type_names(file_type)
    if guessed:
        described = "(guessed) " + described
    layer_bytes, embd_bytes, out_bytes, other_bytes = tensor_layout.weight_bytes(tensors, n)
    idx_heads, idx_size, idx_layers, idx_k, idx_v = arch_rules.indexer_cache(arch, meta, hp)
    kpool, topk_layers = arch_rules.indexer_selection(arch, meta, hp)
    ple_state, ple_layers = arch_rules.ple_state(arch, meta, hp)
    mtp_blocks = arch_rules.mtp_block_count(meta, hp)
    # the first MTP block's projection, as llama.cpp probes it; an MTP-only draft model (gemma4-assistant) has one
    # projection for all its blocks instead
    mtp_probes = (f"blk.{n - mtp_blocks}.nextn.eh_proj.weight", "nextn.pre_projection.weight")

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
        tensor_count=len(tensors),
        context_length=hp.n_ctx_train,
        embedding_length=hp.n_embd,
        block_count=n,
        layer_count=hp.n_layer,
        nextn_predict_layers=mtp_blocks,
        mtp_tensors=mtp_blocks > 0 and any(t.name in mtp_probes for t in tensors),
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
        recurrent_conv_state=hp.n_embd_r(),
        recurrent_state=hp.n_embd_s(),
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
        expert_feed_forward_length=tensor_layout.ffn_width(tensors, "ffn_down_exps"),
        expert_shared_feed_forward_length=tensor_layout.ffn_width(tensors, "ffn_down_shexp"),
        moe_layers=tensor_layout.moe_layers(tensors, hp.n_layer_all),
        expert_weight_bytes=tensor_layout.expert_bytes(tensors, len(layer_bytes)),
        dense_ffn_widths=tensor_layout.dense_ffn_widths(tensors, n),
        ffn_ungated=tensor_layout.ffn_ungated(tensors),
        merge_count=merge_count,
        sampling=_sampling(md),
        output_tied=tensor_layout.output_tied(tensors),
        fused_qkv=tensor_layout.fused_qkv(tensors, kv_layers),
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
        pooling_type=meta.u32("pooling_type", -1),
    )
    check_shapes(facts, tensors, md, path)
    return facts


def _special_ids(meta: Metadata, tokenizer_model: str | None, vocab_size: int) -> tuple[int | None, int | None]:
    """BOS/EOS as llama.cpp resolves them: tokenizer defaults, then the GGUF's ids when in range."""
    if tokenizer_model is None or tokenizer_model in ("none", "no_vocab"):
        return None, None
    if tokenizer_model not in _TOKENIZER_DEFAULTS:
        meta.notes.append(
            f"llama.cpp b11434 does not know tokenizer model {tokenizer_model!r} and will refuse the file"
        )
    bos, eos = _TOKENIZER_DEFAULTS.get(tokenizer_model, (None, None))
    out = []
    for default, key in ((bos, "tokenizer.ggml.bos_token_id"), (eos, "tokenizer.ggml.eos_token_id")):
        value = default if default is not None and default < vocab_size else None
        given = meta.raw_u32(key)
        if given is not None and given < vocab_size:
            value = given
        out.append(value)
    return out[0], out[1]


def _sampling(md: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """The numeric ``general.sampling.*`` keys; another type is left out, as llama.cpp ignores it (no error)."""
    prefix = "general.sampling."
    return tuple(
        (key.removeprefix(prefix), float(v))
        for key, v in md.items()
        if key.startswith(prefix) and isinstance(v, (int, float)) and not isinstance(v, bool)
    )
