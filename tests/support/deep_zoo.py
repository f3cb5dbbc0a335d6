"""Zoo models re-written with many blocks, to measure how the estimator and the planner scale with depth.

The zoo's models have 2 to 6 blocks, real ones 16 to 126 and llama.cpp allows 512:
work that grows with the square of the block count hides at 2 and freezes at 512.
``deepen_model`` repeats a model's blocks (their tensors, as holes, and each
per-layer metadata array) until it has ``n_blocks``; the file is sparse and
written in milliseconds. The result is for the studio's own code (facts,
estimates, plans), not for llama-server, which would run it with garbage weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
from gguf.reader import LazyArray
from gguf.writer import TensorToWrite, write_gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.(.*)$")
#: Arrays that may happen to have ``block_count`` entries without being per layer.
_NOT_PER_LAYER = ("rope.dimension_sections",)


def deepen_model(src: Path, dst: Path, n_blocks: int) -> Path | None:
    """Write ``src`` with its blocks repeated up to ``n_blocks`` to ``dst``; None for a split model, one with MTP
    blocks or one whose blocks are not ``blk.N`` (their order would not survive the repetition)."""
    model = gguf.read(src)
    head = model.shards[0]
    metadata = dict(head.metadata)
    arch = str(metadata["general.architecture"])
    n = metadata.get(f"{arch}.block_count")
    if len(model.shards) > 1 or not isinstance(n, int) or n < 1 or metadata.get(f"{arch}.nextn_predict_layers"):
        return None
    blocks: dict[int, list[tuple[str, gguf.TensorInfo]]] = {}
    others = []
    for t in head.tensors:
        m = _BLOCK.match(t.name)
        if m:
            blocks.setdefault(int(m.group(1)), []).append((m.group(2), t))
        else:
            others.append(t)
    if sorted(blocks) != list(range(n)):
        return None
    for key, value in head.metadata.items():
        if (
            key.startswith(f"{arch}.")
            and not key.endswith(_NOT_PER_LAYER)
            and isinstance(value, (list, tuple, LazyArray))
            and len(value) == n
        ):
            values = list(value)
            metadata[key] = [values[il % n] for il in range(n_blocks)]
    metadata[f"{arch}.block_count"] = n_blocks
    tensors = [TensorToWrite(t.name, t.shape, t.ggml_type) for t in others]
    tensors += [
        TensorToWrite(f"blk.{il}.{rest}", t.shape, t.ggml_type) for il in range(n_blocks) for rest, t in blocks[il % n]
    ]
    return write_gguf(dst, metadata, tensors, value_types=head.value_types, version=head.version)
