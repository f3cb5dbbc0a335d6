"""The speech engines, by name: the route asks each in turn whether it serves a model (``serves``)."""

from __future__ import annotations

from studio.speech.engine import SpeechEngine
from studio.speech.llama_tts import LlamaTTSEngine

ENGINES: dict[str, SpeechEngine] = {
    "llama-tts": LlamaTTSEngine(),
}
