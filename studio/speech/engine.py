"""The contract between the speech route and its engines.

An engine turns text into a WAV for the models it serves: llama.cpp's own
``llama-tts`` (Qwen3-TTS, Pocket TTS through their projector), or a codec
language model through llama-server with the codec decoded in the studio. The
route picks the first engine whose ``serves`` accepts the model's facts, so an
engine says by itself what it can speak, and a new engine is one row in
``studio.speech.engines.ENGINES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from gguf.speech import SpeechFacts

#: Output formats a client may ask for (OpenAI's set); engines answer ``wav``.
ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


@dataclass(frozen=True)
class SpeechRuntime:
    """What an engine may use of the running studio, handed in with each request."""

    manager: Any  # studio.residency.manager.ModelManager: llama-server models, the catalog, the pinned binary
    logs_dir: Path  # where a child's log is kept
    voices_dir: Path  # speaker reference recordings, ``<name>.wav`` or ``<name>.mp3``
    registry: Any = None  # launcher.registry.ChildRegistry for children started per request, or None


@dataclass(frozen=True)
class SpeechRequest:
    """One thing to say: the model (its file and facts), the text and how to say it."""

    model: str  # the name the client used
    path: Path  # the model's GGUF file
    facts: SpeechFacts  # why the model speaks (its codec and family)
    text: str  # what to say (one sentence or a short passage)
    voice: str | None = None  # a named voice, or a speaker reference file's path, where the model has them
    speed: float = 1.0  # 1.0 is the model's own pace
    response_format: ResponseFormat = "wav"
    projector: Path | None = None  # the projector the library pairs with the model, if any
    language: str | None = None  # a studio extension: the language to speak, where the model takes one
    runtime: SpeechRuntime | None = None


@dataclass(frozen=True)
class SpeechAudio:
    """What an engine said: a complete WAV file and its shape, for checks and concatenation."""

    wav: bytes  # a RIFF/WAVE file, header included
    sample_rate: int  # samples per second
    frames: int  # samples per channel in ``wav``
    codes: int = 0  # the model frames (or codec codes) behind the audio, as the engine counted them


class SpeechEngine(Protocol):
    """Something that speaks: says which models it serves, and turns a request into audio."""

    name: str

    def serves(self, facts: SpeechFacts) -> bool:
        """Return whether this engine can speak for a model with these facts."""
        ...

    async def speak(self, request: SpeechRequest) -> SpeechAudio:
        """Return the request's text as audio; raises a ``StudioError`` with a clear message on failure."""
        ...
