"""Text-to-speech models: a language model whose vocabulary carries an audio codec's tokens.

Such a model answers a prompt with codec codes, which a vocoder turns into sound;
as a chat model it produces noise. The styles in use (the reference backend,
Unsloth Studio, probes for the first four):

================  ============================================  =====================================
codec             tokens in the vocabulary                      models
================  ============================================  =====================================
SNAC              ``<custom_token_N>`` (7 x 4096 + a few)        Orpheus, Canopy
BiCodec           ``<|bicodec_semantic_N|>`` + ``_global_N``    Spark-TTS
DAC               ``<|c1_N|>``, ``<|c2_N|>`` (a codebook each)  OuteTTS 1.0
Mimi (CSM)        ``<|AUDIO|>`` + ``<|audio_eos|>``, no bos     Sesame CSM
XCodec2           ``<|s_N|>`` (65536)                           Llasa
WavTokenizer      ``<|N|>`` (4100) + ``<|audio_start|>``        OuteTTS 0.2 / 0.3
audio codes       ``<|audio_N|>``                               other codec LMs
================  ============================================  =====================================

A style counts only with hundreds of its numbered tokens (a few stray ones are
not a codec), and Mimi's markers only without ``<|audio_bos|>``: Qwen2-Audio,
a speech-*in* model, has ``<|AUDIO|>`` and ``<|audio_eos|>`` too, with
``<|audio_bos|>``. The pinned llama.cpp also knows TTS architectures outright
(``qwen3tts``, ``pockettts``: they speak through a projector's generation head)
and the WavTokenizer vocoder (``wavtokenizer-dec``).

The vocabulary is matched as raw bytes (regular expressions over the string
array's encoded region), so a 262k-token vocabulary costs milliseconds.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf.reader import LazyArray

if TYPE_CHECKING:
    from gguf.model import GGUFFile

#: Numbered codec tokens needed before a vocabulary counts as a codec's (real codebooks hold 1024 and up).
MIN_CODEC_TOKENS = 256


@dataclass(frozen=True)
class SpeechFacts:
    """Why a model is a text-to-speech model (or a vocoder): the codec and the evidence."""

    codec: str  # "SNAC", "BiCodec", "DAC", ...
    family: str  # the models that use it ("Orpheus", ...)
    evidence: str  # what in the file says so
    vocoder: bool = False  # a codec decoder (no text at all), not a speaking language model

    def describe(self) -> str:
        """One line for people: what the model is and why the studio thinks so."""
        kind = self.family if self.family == self.codec else f"{self.family}, {self.codec} codec"
        what = "an audio vocoder" if self.vocoder else f"a text-to-speech model ({kind})"
        return f"{what}: {self.evidence}"


_ARCHITECTURES = {
    "qwen3tts": SpeechFacts("Qwen3-TTS", "Qwen3-TTS", "its architecture is qwen3tts (it speaks through its projector)"),
    "pockettts": SpeechFacts("Mimi", "Pocket TTS", "its architecture is pockettts (it speaks through its projector)"),
    "wavtokenizer-dec": SpeechFacts("WavTokenizer", "OuteTTS", "its architecture is wavtokenizer-dec", vocoder=True),
}
#: (codec, family, numbered-token pattern, companion token that must be present too, or None)
_NUMBERED: tuple[tuple[str, str, bytes, bytes | None], ...] = (
    ("SNAC", "Orpheus", rb"<custom_token_\d+>", None),
    ("BiCodec", "Spark-TTS", rb"<\|bicodec_semantic_\d+\|>", rb"<|bicodec_global_0|>"),
    ("DAC", "OuteTTS 1.0", rb"<\|c1_\d+\|>", rb"<|c2_0|>"),
    ("XCodec2", "Llasa", rb"<\|s_\d+\|>", None),
    ("WavTokenizer", "OuteTTS 0.2/0.3", rb"<\|\d+\|>", rb"<|audio_start|>"),
    ("audio codes", "a codec language model", rb"<\|audio_\d+\|>", None),
)


@functools.lru_cache(maxsize=1024)
def speech_facts(model: GGUFFile) -> SpeechFacts | None:
    """Return why ``model`` is a text-to-speech model or a vocoder, or None for a model that writes text.

    Cached per parsed file (``gguf.read`` hands out the same object while the file is unchanged): a
    large vocabulary costs tens of milliseconds to match, and the library asks on every scan.
    """
    md = model.metadata
    arch = md.get("general.architecture")
    known = _ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if known is not None:
        return known
    vocab = _vocab_bytes(md.get("tokenizer.ggml.tokens"))
    if not vocab:
        return None
    for codec, family, pattern, companion in _NUMBERED:
        tokens: list[bytes] = re.findall(pattern, vocab)  # no groups in the patterns: whole tokens
        if len(tokens) >= MIN_CODEC_TOKENS and (companion is None or companion in vocab):
            return SpeechFacts(
                codec, family, f"its vocabulary holds {len(tokens)} codec tokens like {tokens[0].decode()}"
            )
    if b"<|AUDIO|>" in vocab and b"<|audio_eos|>" in vocab and b"<|audio_bos|>" not in vocab:
        return SpeechFacts("Mimi", "Sesame CSM", "its vocabulary has the <|AUDIO|> and <|audio_eos|> markers of CSM")
    return None


def has_token(model: GGUFFile, token: str) -> bool:
    """Return whether ``model``'s vocabulary holds ``token`` exactly.

    A lazy array is matched in its raw region, where each string follows its uint64 length: the length
    and the bytes together are one whole token, not a piece of a longer one.
    """
    tokens = model.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, LazyArray):
        raw = token.encode()
        return struct.pack("<Q", len(raw)) + raw in _vocab_bytes(tokens)
    return isinstance(tokens, (list, tuple)) and token in tokens


def _vocab_bytes(tokens: Any) -> bytes:
    """The vocabulary's strings as one bytes blob (the raw array region for a lazy array: no decoding)."""
    if isinstance(tokens, LazyArray):
        with tokens.path.open("rb") as fh:
            fh.seek(tokens.offset)
            return fh.read(tokens.end - tokens.offset)
    if isinstance(tokens, (list, tuple)):
        return "\n".join(t for t in tokens if isinstance(t, str)).encode()
    return b""
