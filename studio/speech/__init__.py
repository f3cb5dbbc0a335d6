"""Speech out: ``POST /v1/audio/speech`` answered by GGUF text-to-speech models.

Each family of models speaks through an engine (``engine.SpeechEngine``; the table the route picks
from by the model's facts, ``gguf.speech``, is ``engines.ENGINES``): llama.cpp's own ``llama-tts``
(``llama_tts``) for the architectures it knows, and the codec families (Orpheus's SNAC,
``codec_tts``), which prompt the model in llama-server and decode its codec tokens in the studio's
process.
"""
