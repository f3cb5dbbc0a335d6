"""The speech engines, by name: the route asks each in turn whether it serves a model (``serves``)."""

from __future__ import annotations

from gguf.speech import SpeechFacts
from studio.speech.engine import SpeechEngine
from studio.speech.llama_tts import LlamaTTSEngine

ENGINES: dict[str, SpeechEngine] = {
    "llama-tts": LlamaTTSEngine(),
}


def speech_engine(facts: SpeechFacts) -> str | None:
    """Return the name of the first engine that speaks for a model with ``facts``, or None when none here does."""
    return next((name for name, engine in ENGINES.items() if engine.serves(facts)), None)
