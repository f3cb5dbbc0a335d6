"""What a model's tensor list says about its layout: blocks, weight bytes per part, FFN widths and kinds.

These read only tensor names and shapes (``TensorInfo``), never the metadata, so
they hold for any architecture, known to llama.cpp or not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gguf.reader import TensorInfo

_BLK = re.compile(r"blk\.\s*([+-]?\d+)")


def layer_of(name: str) -> int:
    """The block index N of a ``blk.N.*`` tensor name (-1: not a block tensor)."""
    m = _BLK.match(name)
    return int(m.group(1)) if m else -1


def max_block_index(tensors: Sequence[TensorInfo]) -> int:
    """The highest blk.N index among the tensors (-1: none)."""
    return max((layer_of(t.name) for t in tensors), default=-1)


def weight_bytes(tensors: Sequence[TensorInfo], n_layers: int) -> tuple[tuple[int, ...], int, int, int]:
    """(bytes per block, token embeddings, output layer, every other tensor): where partial offload puts them."""
    per_layer = [0] * max(n_layers, max_block_index(tensors) + 1)
    embd = out = other = 0
    for t in tensors:
        il = layer_of(t.name)
        if 0 <= il < len(per_layer):
            per_layer[il] += t.n_bytes
        elif t.name.startswith("token_embd"):
            embd += t.n_bytes
        elif t.name.startswith(("output.", "output_norm.")) or t.name == "output":
            out += t.n_bytes
        else:
            other += t.n_bytes
    return tuple(per_layer), embd, out, other


def ffn_width(tensors: Sequence[TensorInfo], kind: str) -> int:
    """The widest ``blk.N.<kind>.weight`` input dimension: the FFN width the graph multiplies by."""
    return max(
        (
            t.shape[0]
            for t in tensors
            if t.name.startswith("blk.") and t.name.endswith(f".{kind}.weight") and len(t.shape) >= 2
        ),
        default=0,
    )


def dense_ffn_widths(tensors: Sequence[TensorInfo], n_layer: int) -> tuple[int, ...]:
    """Per block, the input width of ``blk.N.ffn_down.weight`` (0 where a block has none)."""
    widths = [0] * n_layer
    for t in tensors:
        if t.name.startswith("blk.") and t.name.endswith(".ffn_down.weight") and len(t.shape) >= 2:
            il = layer_of(t.name)
            if 0 <= il < n_layer:
                widths[il] = t.shape[0]
    return tuple(widths)


def ffn_ungated(tensors: Sequence[TensorInfo]) -> bool:
    """True when the blocks' FFN has up and down projections but no gate, separate or fused into ``ffn_up``.

    A gated FFN keeps the gate's and the up projection's activations (and their
    product) alive at once; an ungated one only the up projection's.
    """
    kinds = {
        t.name.split(".")[2]: t
        for t in tensors
        if t.name.startswith("blk.") and t.name.count(".") >= 3 and t.name.endswith(".weight")
    }
    if any(k.startswith("ffn_gate") and not k.startswith("ffn_gate_inp") for k in kinds):
        return False
    up, down = kinds.get("ffn_up") or kinds.get("ffn_up_exps"), kinds.get("ffn_down") or kinds.get("ffn_down_exps")
    # Phi-3 and ChatGLM store gate and up side by side in ffn_up: twice the width ffn_down takes
    return up is not None and down is not None and len(up.shape) >= 2 and up.shape[1] == down.shape[0]


def fused_qkv(tensors: Sequence[TensorInfo], kv_layers: Sequence[bool]) -> bool:
    """An attention-cache layer projects Q, K and V with one ``attn_qkv`` (Qwen3.5's linear layers do not count)."""
    return any(
        ".attn_qkv." in t.name and 0 <= (il := layer_of(t.name)) < len(kv_layers) and kv_layers[il] for t in tensors
    )


#: The routed experts' tensors (weights, biases, scales) that ``--n-cpu-moe N`` keeps on the CPU for blocks 0..N-1:
#: llama.cpp searches each name for ``blk\.<i>`` and common.h's ``LLM_FFN_EXPS_REGEX``.
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")


def expert_layer(name: str) -> int:
    """The block whose routed experts ``name`` belongs to, as ``--n-cpu-moe`` matches it (-1: not an expert's)."""
    m = _EXPERTS.search(name)
    return int(m.group(1)) if m else -1


def expert_bytes(tensors: Sequence[TensorInfo], n_layers: int) -> tuple[int, ...]:
    """Per block, the bytes of its routed experts' tensors (what ``--n-cpu-moe`` moves to the CPU)."""
    per_layer = [0] * n_layers
    for t in tensors:
        il = expert_layer(t.name)
        if 0 <= il < n_layers:
            per_layer[il] += t.n_bytes
    return tuple(per_layer)


def moe_layers(tensors: Sequence[TensorInfo], n_layer: int) -> tuple[bool, ...]:
    """Which blocks hold routed-expert weights (``blk.N.ffn_down_exps``)."""
    routed = {layer_of(t.name) for t in tensors if ".ffn_down_exps." in t.name}
    return tuple(il in routed for il in range(n_layer))


def output_tied(tensors: Sequence[TensorInfo]) -> bool:
    """No ``output.weight`` beside a ``token_embd.weight``: the logits reuse the embeddings (llama-model-loader.cpp
    TENSOR_DUPLICATED; an encoder with no output layer at all counts as tied too, the safe side)."""
    return not any(t.name == "output.weight" for t in tensors) and any(t.name == "token_embd.weight" for t in tensors)
