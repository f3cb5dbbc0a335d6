"""WAV files from float samples: 16-bit PCM, mono, what every player and OpenAI's clients read."""

from __future__ import annotations

import io
import wave
from typing import Any


def wav_bytes(samples: Any, sample_rate: int) -> bytes:
    """Return a mono 16-bit PCM WAV file of ``samples`` (floats in -1..1, clipped) at ``sample_rate``."""
    import numpy as np

    pcm = (np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()
