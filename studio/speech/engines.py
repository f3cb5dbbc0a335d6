"""The speech engines, by name: the route asks each in turn whether it serves a model (``serves``)."""

from __future__ import annotations

from gguf.speech import SpeechFacts
from studio.speech.codec_tts import CodecSpeech
from studio.speech.engine import SpeechEngine
from studio.speech.llama_tts import LlamaTTSEngine

ENGINES: dict[str, SpeechEngine] = {
    "llama-tts": LlamaTTSEngine(),
    "codec": CodecSpeech(),
}


def speech_engine(facts: SpeechFacts) -> str | None:
    """Return the name of the first engine that speaks for a model with ``facts``, or None when none here does."""
    return next((name for name, engine in ENGINES.items() if engine.serves(facts)), None)


def engine_for(facts: SpeechFacts) -> SpeechEngine | None:
    """The engine that speaks for a model with ``facts``, or None."""
    name = speech_engine(facts)
    return ENGINES[name] if name is not None else None
