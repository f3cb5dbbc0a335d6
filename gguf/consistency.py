"""What a GGUF header claims, checked against the tensors it lists and against what any real model has.

A model folder is untrusted input (Hub downloads, other tools' output, half-written
files), and every estimate and plan does work in proportion to the block count, so
``gguf.facts_builder`` refuses a header before that work starts when:

- a value is beyond any real model (``check_limit`` with the ``MAX_*`` limits below);
- the block count disagrees with the ``blk.N`` tensors (``check_block_count``);
- head counts and head sizes disagree with the attention projections, or the expert
  count with the expert tensors, or the embedding width with the token embeddings
  (``check_shapes``).

llama.cpp refuses all of these too: ``llama_model_loader::create_tensor`` checks each
tensor against the shape the hyper-parameters give it ("wrong shape", "missing
tensor") and ``done_getting_tensors`` that every tensor in the file was used ("wrong
number of tensors"). Only the rules every architecture follows are checked here, and
only on tensors that are present, so a file llama.cpp loads is never refused (the
suite runs every zoo architecture, its widened and real-proportion MoE variants, an
MTP model and the real Gemma through these checks).

The errors name the key, the claimed value and what the tensors say instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf.errors import ImplausibleValueError, InconsistentHeaderError

if TYPE_CHECKING:
    from gguf.facts import ModelFacts

#: Blocks (llama.cpp's ``n_layer_all``, MTP blocks included). The deepest released models have 118 (PaLM 540B) and
#: 126 (Llama 3.1 405B); the pinned llama.cpp asserts at most 512 (LLAMA_MAX_LAYERS; facts flag more as approximate,
#: for a later llama.cpp that allows more). 1024 is twice that and 8x any real model: an estimate, linear in the
#: blocks, stays at milliseconds.
MAX_BLOCKS = 1024
#: ``context_length`` (n_ctx_train). The longest native contexts are Llama 4 Scout's 10M (10,485,760) and
#: MiniMax-01's 4M; conversions that invent one write 2**20 (Mamba, RWKV, Granite hybrid). 2**27 (134M) is 12x the
#: longest; a binary search over contexts up to it takes 19 steps of 256 tokens.
MAX_CONTEXT = 1 << 27
#: ``expert_count``: llama.cpp's LLAMA_MAX_EXPERTS (it asserts n_expert <= 1024; Kimi K3's is the largest).
MAX_EXPERTS = 1024
#: ``embedding_length``: the widest released models are 18,432 (PaLM 540B) and 16,384 (Llama 3.1 405B); 2**18 is 14x.
MAX_EMBEDDING = 1 << 18

#: Architectures whose full-attention Q projection also carries a per-head output gate: 2 x n_head x head size
#: (models/qwen3next.cpp, qwen35.cpp, qwen35moe.cpp, qwen4exp.cpp: ``n_embd_head_k * n_head * 2``).
_GATED_Q_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe", "qwen4exp"})
#: Architectures whose ``embedding_length`` is not the token embeddings' width (WavTokenizer's is ``features_length``).
_OTHER_EMBEDDING = frozenset({"wavtokenizer-dec"})
#: The routed experts' weights ``[n_embd, n_ff_exp, n_expert]`` (``create_tensor_gate_up_exps``, models/*.cpp).
_EXPERT_WEIGHTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
_REFUSED = "llama.cpp refuses such a file"


def check_limit(key: str, value: int, limit: int, what: str, path: Path | None) -> None:
    """Raise ``ImplausibleValueError`` when ``value`` exceeds ``limit`` (``what``: the thing it counts)."""
    if value > limit:
        raise ImplausibleValueError(
            f"metadata key {key!r} is {value:,}; no real model has more than {limit:,} {what}",
            key=key,
            value=value,
            limit=limit,
            path=path,
        )


def check_block_count(key: str, claimed: int, nextn: int, highest: int, path: Path | None) -> None:
    """``claimed`` blocks (``key``) against the highest ``blk.N`` index among the tensors (-1: none).

    Every block llama.cpp allocates loads its ``blk.N`` tensors, and every tensor
    must be used, so ``blk.0`` .. ``blk.(claimed-1)`` is the span. Only MTP blocks
    may be missing (a trunk-only file: ``nextn_predict_layers`` set, the NextN
    tensors left out); a trunk-less file (the MTP blocks alone) still ends at the
    last block. A file without any ``blk.N`` tensor (a vocabulary-only GGUF, an
    architecture naming its blocks otherwise: T5's ``enc.blk.N``, WavTokenizer's
    ``posnet.N``) has nothing to compare; ``MAX_BLOCKS`` still bounds it.
    """
    span = highest + 1
    if span and not span <= claimed <= span + nextn:
        mtp = f" (with {nextn} MTP block{'s' if nextn != 1 else ''} that may be left out)" if nextn else ""
        raise InconsistentHeaderError(
            f"metadata key {key!r} is {claimed:,} but the tensors describe {span:,} block{'s' if span != 1 else ''} "
            f"(blk.0 to blk.{highest}){mtp}; {_REFUSED}",
            key=key,
            value=claimed,
            found=span,
            path=path,
        )


def check_experts(arch: str, n_expert: int, used: Sequence[int], path: Path | None) -> None:
    """The routed-expert counts llama.cpp asserts on (``llama_model_base::load_hparams``)."""
    key, used_key = f"{arch}.expert_count", f"{arch}.expert_used_count"
    check_limit(key, n_expert, MAX_EXPERTS, "experts (llama.cpp's LLAMA_MAX_EXPERTS)", path)
    most = max(used, default=0)
    if most > n_expert or (n_expert > 0 and most == 0):
        raise InconsistentHeaderError(
            f"metadata key {used_key!r} is {most:,} but {key!r} is {n_expert:,}: a model routes each token to at "
            f"least one and at most all of its experts; {_REFUSED}",
            key=used_key,
            value=most,
            found=n_expert,
            path=path,
        )


def check_shapes(facts: ModelFacts, tensors: Sequence[Any], metadata: Mapping[str, Any], path: Path | None) -> None:
    """Head counts and sizes, the expert count and the embedding width against the tensors they shape.

    Attention layers (not recurrent, not MLA) are checked where their projections
    are present: ``attn_k`` is ``[n_embd, n_head_kv x key_length]``, ``attn_v``
    ``[n_embd, n_head_kv x value_length]``, ``attn_q`` ``[n_embd, n_head x
    key_length]`` (twice that with an output gate), a fused ``attn_qkv`` their sum
    (SWA layers use their own head sizes, ``metadata`` says under which keys). Expert weights end with ``expert_count``
    experts, the router ``ffn_gate_inp`` too. ``token_embd`` is ``[n_embd, n_vocab]``.
    """
    arch = facts.architecture
    by_name: Mapping[str, Any] = {t.name: t for t in tensors}
    _check_attention(facts, by_name, metadata, path)
    for t in tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
            continue
        kind = parts[2]
        axis = 2 if kind in _EXPERT_WEIGHTS else 1 if kind == "ffn_gate_inp" else None
        if axis is not None and len(t.shape) == axis + 1 and t.shape[axis] != facts.expert_count:
            key = f"{arch}.expert_count"
            raise InconsistentHeaderError(
                f"metadata key {key!r} is {facts.expert_count:,} but {t.name} holds {t.shape[axis]:,} experts; "
                f"{_REFUSED}",
                key=key,
                value=facts.expert_count,
                found=t.shape[axis],
                path=path,
            )
    embd = by_name.get("token_embd.weight")
    if (
        embd is not None
        and arch not in _OTHER_EMBEDDING
        and len(embd.shape) == 2
        and embd.shape[0] != facts.embedding_length
    ):
        key = f"{arch}.embedding_length"
        raise InconsistentHeaderError(
            f"metadata key {key!r} is {facts.embedding_length:,} but token_embd.weight is {embd.shape[0]:,} wide; "
            f"{_REFUSED}",
            key=key,
            value=facts.embedding_length,
            found=embd.shape[0],
            path=path,
        )


def _check_attention(
    facts: ModelFacts, by_name: Mapping[str, Any], metadata: Mapping[str, Any], path: Path | None
) -> None:
    arch = facts.architecture
    if facts.kv_lora_rank or facts.key_length_mla:  # MLA: Q and the latent KV have their own shapes
        return
    gate = 2 if arch in _GATED_Q_ARCHS else 1
    heads, kv_heads = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    for il in range(facts.block_count):
        if facts.recurrent_layers[il]:  # linear-attention / SSM layers project to their own state sizes
            continue
        k_len, v_len = (_head_size_key(metadata, arch, kind, facts.swa_layers[il]) for kind in ("key", "value"))
        n_head, n_kv = facts.head_count[il], facts.head_count_kv[il]
        q_terms = [(heads, n_head), (k_len, facts.key_length_of(il))] + ([("the output gate", 2)] if gate == 2 else [])
        k_terms = [(kv_heads, n_kv), (k_len, facts.key_length_of(il))]
        v_terms = [(kv_heads, n_kv), (v_len, facts.value_length_of(il))]
        for suffix, products in (
            ("attn_k", [k_terms]),
            ("attn_v", [v_terms]),
            ("attn_q", [q_terms]),
            ("attn_qkv", [q_terms, k_terms, v_terms]),
        ):
            t = by_name.get(f"blk.{il}.{suffix}.weight")
            width = sum(_product(p) for p in products)
            if t is None or len(t.shape) != 2 or t.shape[1] == width:
                continue
            said = " + ".join(" x ".join(name for name, _ in p) for p in products)
            values = " + ".join(" x ".join(f"{v:,}" for _, v in p) for p in products)
            key, value = products[0][0]
            raise InconsistentHeaderError(
                f"layer {il}: {said} is {values} = {width:,} but {t.name} is {t.shape[1]:,} wide; {_REFUSED}",
                key=key,
                value=value,
                found=t.shape[1],
                path=path,
            )


def _head_size_key(metadata: Mapping[str, Any], arch: str, kind: str, swa: bool) -> str:
    """The key a layer's head size comes from: the SWA one where the file has it, else the general one."""
    key = f"{arch}.attention.{kind}_length"
    return f"{key}_swa" if swa and f"{key}_swa" in metadata else key


def _product(terms: Sequence[tuple[str, int]]) -> int:
    out = 1
    for _, value in terms:
        out *= value
    return out
