"""Multimodal projectors (llama.cpp's ``mmproj`` files): what a projector reads and what it feeds.

A projector is a GGUF whose ``general.architecture`` is ``"clip"``. The pinned
``tools/mtmd/clip.cpp`` (b11434) decides what it holds from its own metadata:

- ``clip.has_vision_encoder`` / ``clip.has_audio_encoder`` (booleans, absent =
  false): an image encoder, a speech/audio-in encoder (Whisper-style and
  others); ``clip.has_gen_audio_encoder``: an audio *generation* head (TTS).
- The projector type: ``clip.projector_type``, else per modality
  ``clip.vision.projector_type`` / ``clip.audio.projector_type``.
- ``clip.<modality>.projection_dim``: the width its embeddings come out at,
  which must be the text model's embedding length (``mtmd_context`` refuses
  another: "mismatch between text model (n_embd = ...) and mmproj").
- Encoder sizes per modality: ``embedding_length``, ``feed_forward_length``,
  ``block_count``, ``attention.head_count``; vision ``image_size`` and
  ``patch_size``, audio ``num_mel_bins``.

``clip.cpp`` allocates every tensor it loads in one weights buffer and logs
their sum as ``load_hparams: model size``; ``weight_bytes`` is that sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gguf.model import GGUFFile

Modality = Literal["vision", "audio"]

#: The architecture name llama.cpp gives projectors.
PROJECTOR_ARCHITECTURE = "clip"
#: Mel frames of one Whisper-style window (30 s at a 10 ms hop): what ``clip.cpp`` warms an audio encoder up with.
AUDIO_WINDOW_FRAMES = 3000


@dataclass(frozen=True)
class EncoderFacts:
    """One encoder of a projector (vision or audio), as ``clip.cpp``'s ``load_hparams`` reads it."""

    modality: Modality
    projector_type: str  # "mlp", "gemma3", "voxtral", ...; "" when the file names none (clip.cpp refuses it)
    n_embd: int
    n_ff: int
    n_head: int
    n_layer: int
    projection_dim: int  # the text model width the embeddings come out at
    image_size: int = 0  # vision: the side the image is resized to (0: dynamic)
    patch_size: int = 0
    n_mel_bins: int = 0  # audio

    @property
    def warmup_positions(self) -> int:
        """Tokens through the encoder at ``clip.cpp``'s warm-up: fixed-size patches, or a 30 s window halved."""
        if self.modality == "audio":
            return AUDIO_WINDOW_FRAMES // 2  # the second convolution has stride 2
        if self.image_size and self.patch_size:
            return (self.image_size // self.patch_size) ** 2
        return 0

    @property
    def warmup_unfolded_values(self) -> int:
        """Values of the warm-up input unfolded for the first layer (``ggml_im2col``): a 3-channel patch per
        position (the patch embedding), or 3 frames of every mel bin per frame (Whisper's first convolution)."""
        if self.modality == "audio":
            return 3 * self.n_mel_bins * AUDIO_WINDOW_FRAMES
        return 3 * self.patch_size * self.patch_size * self.warmup_positions

    @property
    def warmup_input_values(self) -> int:
        """f32 values of the warm-up input: an RGB image of ``image_size`` squared, or a window of mel frames."""
        if self.modality == "audio":
            return self.n_mel_bins * AUDIO_WINDOW_FRAMES
        return 3 * self.image_size * self.image_size


@dataclass(frozen=True)
class ProjectorFacts:
    """What a projector file holds: its encoders, whether it speaks, and the bytes of its weights."""

    encoders: tuple[EncoderFacts, ...]  # vision first, then audio
    speech_out: bool  # an audio generation (TTS) head: clip.has_gen_audio_encoder
    weight_bytes: int

    @property
    def vision(self) -> bool:
        """Images can be sent."""
        return any(e.modality == "vision" for e in self.encoders)

    @property
    def audio(self) -> bool:
        """Audio (speech) can be sent."""
        return any(e.modality == "audio" for e in self.encoders)

    @property
    def projection_dims(self) -> tuple[int, ...]:
        """The text widths the encoders project to (one per encoder that says)."""
        return tuple(e.projection_dim for e in self.encoders if e.projection_dim)

    @property
    def types(self) -> tuple[str, ...]:
        """The projector type of each encoder."""
        return tuple(e.projector_type for e in self.encoders)


def is_projector(metadata: Mapping[str, object]) -> bool:
    """Return whether a GGUF's metadata is a multimodal projector's (``general.architecture == "clip"``)."""
    return metadata.get("general.architecture") == PROJECTOR_ARCHITECTURE


def projector_facts(model: GGUFFile) -> ProjectorFacts | None:
    """Return the projector facts of ``model``, or None when it is not a projector."""
    md = model.metadata
    if not is_projector(md):
        return None
    encoders = []
    shared_type = _str(md.get("clip.projector_type"))
    for modality in ("vision", "audio"):
        if md.get(f"clip.has_{modality}_encoder") is not True:
            continue
        key = f"clip.{modality}."
        encoders.append(
            EncoderFacts(
                modality=modality,
                projector_type=shared_type or _str(md.get(f"{key}projector_type")),
                n_embd=_int(md.get(f"{key}embedding_length")),
                n_ff=_int(md.get(f"{key}feed_forward_length")),
                n_head=_int(md.get(f"{key}attention.head_count")),
                n_layer=_int(md.get(f"{key}block_count")),
                projection_dim=_int(md.get(f"{key}projection_dim")),
                image_size=_int(md.get(f"{key}image_size")),
                patch_size=_int(md.get(f"{key}patch_size")),
                n_mel_bins=_int(md.get(f"{key}num_mel_bins")),
            )
        )
    return ProjectorFacts(
        tuple(encoders), speech_out=md.get("clip.has_gen_audio_encoder") is True, weight_bytes=model.tensor_bytes
    )


def width_mismatch(projector: ProjectorFacts, model: GGUFFile) -> str | None:
    """Return why ``projector`` cannot feed ``model`` (its output width is not the model's embedding width), or None."""
    arch = model.metadata.get("general.architecture")
    if arch == PROJECTOR_ARCHITECTURE:
        return "the model file is itself a projector"
    n_embd = model.metadata.get(f"{arch}.embedding_length")
    dims = projector.projection_dims
    if not projector.encoders:
        return "it declares neither a vision nor an audio encoder (clip.has_vision_encoder / has_audio_encoder)"
    if isinstance(n_embd, int) and dims and any(d != n_embd for d in dims):
        wrong = next(d for d in dims if d != n_embd)
        return f"it projects to {wrong} but the {arch} model's embedding length is {n_embd}"
    return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""
