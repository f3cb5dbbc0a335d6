"""Tiny random-weight multimodal projectors (mmproj GGUFs) the pinned ``clip.cpp`` loads.

No small real projector ships on the package registries, so the tests write
their own, at the width of a small text model here (SmolLM2-135M: 576):

- ``write_vision_projector``: an LLaVA-style projector (``clip.projector_type =
  "mlp"``): a ViT over 16x16 patches of a 64x64 image (``v.*`` tensors), then
  ``mm.0`` -> GELU -> ``mm.2`` into the text model's width. llama.cpp runs
  ``block_count - 1`` encoder blocks (``models/llava.cpp``), so two are written.
  An image becomes 16 tokens.
- ``write_audio_projector``: a Whisper-encoder projector of Voxtral's type
  (``"voxtral"``): two 1-D convolutions over 128 mel bins, encoder blocks
  (``a.*``, no K bias, as ``models/whisper-enc.cpp`` asserts), a 2x average
  pool, frames stacked ``stack_factor`` at a time, then ``mm.a.mlp.1`` -> GELU ->
  ``mm.a.mlp.2``. The encoder always sees 30 s windows of 3000 mel frames
  (``mtmd-audio.cpp``), so the position table has 1500 rows; with the stack of
  10 a window becomes 75 tokens (Qwen2-Audio's type, without the stack, makes
  750, ten times the prompt to evaluate on a CPU). 750 pooled frames must
  divide by the stack factor, or the graph and ``clip_n_output_tokens``
  disagree by one row.

Tensor names, shapes and the required ``clip.*`` keys follow the pinned
``tools/mtmd/clip.cpp`` (``load_hparams``, ``load_tensors``) and ``clip-impl.h``.
Weights are small Gaussian noise from a seeded generator, so the text that
comes out is noise too, and a file is the same bytes every time.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

from gguf.reader import UINT32
from gguf.writer import TensorToWrite, write_gguf

#: SmolLM2-135M-Instruct's embedding length, the width the tests project to.
SMOLLM2_WIDTH = 576


def _write(path: Path, metadata: dict[str, object], tensors: list[TensorToWrite]) -> Path:
    """Write the file; ``clip.cpp`` reads every integer key as uint32 (``gguf_get_val_u32`` asserts the type)."""
    types = {k: (UINT32,) for k, v in metadata.items() if isinstance(v, int) and not isinstance(v, bool)}
    return write_gguf(path, metadata, tensors, value_types=types)


def _noise(rng: random.Random, n: int, scale: float = 0.02) -> bytes:
    return struct.pack(f"<{n}f", *(rng.gauss(0.0, scale) for _ in range(n)))


def _ones(n: int) -> bytes:
    return struct.pack(f"<{n}f", *([1.0] * n))


class _Tensors:
    """Builds the tensor list: random matrices, unit norms, zero biases (F32 throughout)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.out: list[TensorToWrite] = []

    def noise(self, name: str, *shape: int) -> None:
        n = 1
        for d in shape:
            n *= d
        self.out.append(TensorToWrite(name, shape, "F32", _noise(self.rng, n)))

    def ones(self, name: str, n: int) -> None:
        self.out.append(TensorToWrite(name, (n,), "F32", _ones(n)))

    def zeros(self, name: str, *shape: int) -> None:
        self.out.append(TensorToWrite(name, shape, "F32", None))

    def encoder_block(self, prefix: str, il: int, n_embd: int, n_ff: int, *, k_bias: bool) -> None:
        """One pre-norm transformer block as ``clip.cpp`` names it (``ln1``, ``attn_*``, ``ln2``, ``ffn_*``)."""
        blk = f"{prefix}.blk.{il}"
        self.ones(f"{blk}.ln1.weight", n_embd)
        self.zeros(f"{blk}.ln1.bias", n_embd)
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            self.noise(f"{blk}.{part}.weight", n_embd, n_embd)
            if part != "attn_k" or k_bias:
                self.zeros(f"{blk}.{part}.bias", n_embd)
        self.ones(f"{blk}.ln2.weight", n_embd)
        self.zeros(f"{blk}.ln2.bias", n_embd)
        self.noise(f"{blk}.ffn_up.weight", n_embd, n_ff)  # ggml order: (input, output)
        self.zeros(f"{blk}.ffn_up.bias", n_ff)
        self.noise(f"{blk}.ffn_down.weight", n_ff, n_embd)
        self.zeros(f"{blk}.ffn_down.bias", n_embd)


def write_vision_projector(
    path: Path,
    *,
    projection_dim: int = SMOLLM2_WIDTH,
    n_embd: int = 64,
    n_ff: int = 128,
    n_layer: int = 2,
    image_size: int = 64,
    patch_size: int = 16,
    hidden: int = 128,
    seed: int = 1,
) -> Path:
    """Write an LLaVA-style (``mlp``) vision projector to ``path`` and return it."""
    n_pos = (image_size // patch_size) ** 2
    t = _Tensors(seed)
    t.noise("v.patch_embd.weight", patch_size, patch_size, 3, n_embd)
    t.zeros("v.patch_embd.bias", n_embd)
    t.noise("v.position_embd.weight", n_embd, n_pos)
    for il in range(n_layer):
        t.encoder_block("v", il, n_embd, n_ff, k_bias=True)
    t.noise("mm.0.weight", n_embd, hidden)
    t.zeros("mm.0.bias", hidden)
    t.noise("mm.2.weight", hidden, projection_dim)
    t.zeros("mm.2.bias", projection_dim)
    metadata = {
        "general.architecture": "clip",
        "general.name": "tiny-llava-projector",
        "general.file_type": 0,
        "clip.projector_type": "mlp",
        "clip.has_vision_encoder": True,
        "clip.use_gelu": True,
        "clip.vision.image_size": image_size,
        "clip.vision.patch_size": patch_size,
        "clip.vision.embedding_length": n_embd,
        "clip.vision.feed_forward_length": n_ff,
        "clip.vision.block_count": n_layer,
        "clip.vision.projection_dim": projection_dim,
        "clip.vision.attention.head_count": 2,
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
    }
    return _write(path, metadata, t.out)


def write_audio_projector(
    path: Path,
    *,
    projection_dim: int = SMOLLM2_WIDTH,
    n_embd: int = 64,
    n_ff: int = 128,
    n_layer: int = 1,
    n_mel: int = 128,
    stack_factor: int = 10,
    hidden: int = 128,
    seed: int = 2,
) -> Path:
    """Write a Whisper-encoder (``voxtral``) audio projector to ``path`` and return it."""
    if 750 % stack_factor:
        raise ValueError(f"stack_factor {stack_factor} does not divide the 750 pooled frames of a window")
    t = _Tensors(seed)
    t.noise("a.conv1d.1.weight", 3, n_mel, n_embd)  # kernel width, input channels, output channels
    t.zeros("a.conv1d.1.bias", 1, n_embd)  # one per output channel, broadcast over the frames
    t.noise("a.conv1d.2.weight", 3, n_embd, n_embd)
    t.zeros("a.conv1d.2.bias", 1, n_embd)
    t.noise("a.position_embd.weight", n_embd, 1500)
    for il in range(n_layer):
        t.encoder_block("a", il, n_embd, n_ff, k_bias=False)
    t.ones("a.post_ln.weight", n_embd)
    t.zeros("a.post_ln.bias", n_embd)
    t.noise("mm.a.mlp.1.weight", n_embd * stack_factor, hidden)
    t.noise("mm.a.mlp.2.weight", hidden, projection_dim)
    metadata = {
        "general.architecture": "clip",
        "general.name": "tiny-whisper-projector",
        "general.file_type": 0,
        "clip.projector_type": "voxtral",
        "clip.has_audio_encoder": True,
        "clip.audio.num_mel_bins": n_mel,
        "clip.audio.embedding_length": n_embd,
        "clip.audio.feed_forward_length": n_ff,
        "clip.audio.block_count": n_layer,
        "clip.audio.projection_dim": projection_dim,
        "clip.audio.attention.head_count": 2,
        "clip.audio.attention.layer_norm_epsilon": 1e-5,
        "clip.audio.projector.stack_factor": stack_factor,
    }
    return _write(path, metadata, t.out)
