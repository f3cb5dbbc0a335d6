"""The tiny-architecture zoo: one random-weight GGUF per architecture the pinned
llama.cpp can save, written by its ``test-llama-archs -o DIR`` tool.

The zoo checks the GGUF reader's facts and the memory estimator across every
layout (MLA, SWA, hybrid/recurrent, MoE, plain GQA). It is generated once per
pin into the studio home; a marker written last makes later calls free.

``test-llama-archs`` writes no model with multi-token-prediction (NextN) blocks,
so ``derive_mtp_model`` appends one to a zoo model: the only way to measure the
MTP draft context llama-server creates for ``--spec-type draft-mtp``.
"""

from __future__ import annotations

import random
import struct
import subprocess
from pathlib import Path

import structlog

import gguf
from gguf.writer import TensorToWrite, copy_of, write_gguf
from launcher.build import BuildResult
from launcher.errors import BuildError

log = structlog.get_logger(__name__)

MARKER = ".zoo-complete"
#: Optional per-tensor NVFP4 scales: llama.cpp loads the MTP block without them.
_SCALE_SUFFIXES = (".scale", ".input_scale")
#: Arrays that may happen to have ``block_count`` entries without being per layer.
_NOT_PER_LAYER = ("rope.dimension_sections",)


def ensure_zoo(build: BuildResult, home: Path) -> Path:
    """Return the zoo folder for ``build``'s pin, generating it on first use."""
    out = home / "zoo" / build.layout.tag
    if (out / MARKER).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([str(build.test_llama_archs), "-o", str(out)], capture_output=True, text=True, timeout=900)
    models = sorted(out.glob("*.gguf"))
    if proc.returncode != 0 or not models:
        raise BuildError(
            f"test-llama-archs could not write the architecture zoo to {out} (exit {proc.returncode})",
            log_tail="\n".join((proc.stdout + proc.stderr).splitlines()[-20:]),
        )
    (out / MARKER).write_text("\n".join(m.name for m in models) + "\n")
    return out


def derive_mtp_model(src: Path, dst: Path, *, seed: int = 0, trunk_only: bool = False) -> Path:
    """Write ``src`` (a zoo model) to ``dst`` with one NextN (MTP) block appended.

    Follows the pinned loader (``llama_model_qwen35::load_arch_tensors``'s
    ``load_block_mtp``, models/qwen35.cpp): the new block ``blk.N`` copies the
    last full-attention block (its weights and the per-layer metadata entries,
    so ``attention.recurrent_layers`` marks it dense), adds ``nextn.eh_proj``
    ``[2 * n_embd, n_embd]`` (small random f32) and ``nextn.enorm`` /
    ``nextn.hnorm`` (ones); the optional embed / shared-head tensors fall back to
    the trunk's. ``block_count`` grows by one and ``nextn_predict_layers`` is 1.
    ``trunk_only`` writes that metadata without the new block's tensors, as a
    trunk-only conversion of an MTP model does (llama.cpp loads it, minus MTP).
    """
    model = gguf.read(src)
    if len(model.shards) > 1:
        raise ValueError(f"{src} is split into {len(model.shards)} files; derive_mtp_model reads single files")
    head = model.shards[0]
    arch = head.metadata["general.architecture"]
    n_layer = int(head.metadata[f"{arch}.block_count"])
    n_embd = int(head.metadata[f"{arch}.embedding_length"])
    names = {t.name for t in head.tensors}
    template = max((il for il in range(n_layer) if f"blk.{il}.attn_output.weight" in names), default=None)
    if template is None:
        raise ValueError(f"{src} has no full-attention block to copy into an MTP block")

    metadata = dict(head.metadata)
    metadata[f"{arch}.block_count"] = n_layer + 1
    metadata[f"{arch}.nextn_predict_layers"] = 1
    for key, value in head.metadata.items():  # per-layer arrays (n_layer entries) get the template's entry
        per_layer = key.startswith(f"{arch}.") and not key.endswith(_NOT_PER_LAYER)
        if per_layer and isinstance(value, (list, tuple)) and len(value) == n_layer:
            metadata[key] = [*value, value[template]]

    prefix = f"blk.{template}."
    tensors = [copy_of(head, t) for t in head.tensors]
    if trunk_only:
        return write_gguf(dst, metadata, tensors, value_types=head.value_types, version=head.version)
    tensors += [
        copy_of(head, t, f"blk.{n_layer}.{t.name[len(prefix) :]}")
        for t in head.tensors
        if t.name.startswith(prefix) and not t.name.endswith(_SCALE_SUFFIXES)
    ]
    rng = random.Random(seed)
    bound = 1.0 / (2 * n_embd) ** 0.5  # keeps the projected hidden state near unit scale: no NaN logits
    eh_proj = struct.pack(f"<{2 * n_embd * n_embd}f", *(rng.uniform(-bound, bound) for _ in range(2 * n_embd * n_embd)))
    ones = struct.pack(f"<{n_embd}f", *([1.0] * n_embd))
    tensors += [
        TensorToWrite(f"blk.{n_layer}.nextn.eh_proj.weight", (2 * n_embd, n_embd), "F32", eh_proj),
        TensorToWrite(f"blk.{n_layer}.nextn.enorm.weight", (n_embd,), "F32", ones),
        TensorToWrite(f"blk.{n_layer}.nextn.hnorm.weight", (n_embd,), "F32", ones),
    ]
    path = write_gguf(dst, metadata, tensors, value_types=head.value_types, version=head.version)
    log.info("mtp_model_derived", src=str(src), dst=str(dst), template_block=template, mtp_block=n_layer)
    return path
