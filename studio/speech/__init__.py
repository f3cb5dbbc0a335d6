"""Speech out: text-to-speech models answered as audio (OpenAI's ``POST /v1/audio/speech``).

``engine`` holds the contract every engine follows, ``engines`` the table the route
picks from by the model's facts (``gguf.speech``).
"""
