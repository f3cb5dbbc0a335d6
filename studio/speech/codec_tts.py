"""The codec families' engine: the model writes codec tokens in llama-server, the studio decodes them.

As the reference backend does, a model is prompted through llama-server's ``/completion`` in its
codec's format and its answer's token ids come back (``return_tokens``); ``/detokenize`` spells them
out (special tokens included, which a completion's ``content`` leaves out), so codes written as one
special token or spelled in plain text read the same. SNAC (Orpheus) is decoded here with
onnxruntime (``studio.speech.snac``), its weights fetched through huggingface_hub
(``studio.speech.codec_weights``). BiCodec (Spark-TTS) and DAC (OuteTTS 1.0) need their codecs' own
PyTorch packages, which the studio does not ship: such a model gets a 400 that names what is missing.

The model is held by a lease for the generation only, like any request (it loads on demand and may
be evicted after); the decoding runs in a worker thread after the lease is released. Long text is
spoken in pieces of whole sentences (``orpheus.chunks``), one generation each, joined end to end.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import structlog

from gguf.speech import SpeechFacts
from studio import json_codec
from studio.errors import AnsweredError, BadRequestError, UpstreamError
from studio.http.clients.load_wait import acquire_surviving
from studio.residency.resident import LoadedModel
from studio.speech import orpheus, snac
from studio.speech.codec_weights import codec_path
from studio.speech.engine import SpeechAudio, SpeechRequest
from studio.speech.wav import wav_bytes

log = structlog.get_logger(__name__)

#: What each codec family would need to speak here, where the studio has no runtime for it.
MISSING = {
    "BiCodec": "the BiCodec decoder (Spark-TTS's `sparktts` package on PyTorch, with the BiCodec weights of "
    "SparkAudio/Spark-TTS-0.5B)",
    "DAC": "the DAC decoder (the `outetts` package on PyTorch, with ibm-research/DAC.speech.v1.0)",
}
#: OpenAI's stock voices: a client that sends one gets Orpheus's default speaker.
OPENAI_VOICES = frozenset(
    {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar"}
)
DEFAULT_VOICE = orpheus.VOICES[0]
#: Tokens of the context a generation leaves free beyond its prompt (BOS, and a margin).
_MARGIN = 8


class CodecSpeech:
    """Speaks with the models whose vocabulary carries a codec's tokens (``gguf.speech``): SNAC, BiCodec, DAC."""

    name = "codec"

    def serves(self, facts: SpeechFacts) -> bool:
        return not facts.vocoder and (facts.codec == "SNAC" or facts.codec in MISSING)

    async def speak(self, request: SpeechRequest) -> SpeechAudio:
        facts = request.facts
        if facts.codec in MISSING:
            raise BadRequestError(
                f"{facts.family} speaks through the {facts.codec} codec, and decoding it needs "
                f"{MISSING[facts.codec]}, which the studio does not ship; SNAC models (Orpheus) speak here",
                param="model",
                code="codec_runtime_missing",
            )
        if request.speed != 1.0:
            raise BadRequestError(
                f"{facts.family} speaks at its own pace: `speed` must be 1.0, not {request.speed}", param="speed"
            )
        if not request.text.strip():
            raise BadRequestError("`input` is empty: there is nothing to say", param="input")
        await asyncio.to_thread(snac.runtime)  # before a download or a load: a missing extra is said at once
        if request.runtime is None:
            raise TypeError("a codec engine's request carries the studio's runtime (its model manager)")
        decoder = await asyncio.to_thread(lambda: snac.decoder(codec_path()))  # a session takes a while to load
        voice = _voice(request.voice)
        loaded, lease = await acquire_surviving(request.runtime.manager, request.model)
        try:
            async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
                answers = [await _generate(client, loaded, piece, voice) for piece in orpheus.chunks(request.text)]
        finally:
            await lease()
        parts = [await asyncio.to_thread(decoder.decode, snac.layers(snac.codes_of(n))) for n in answers]
        frames = sum(len(n) // snac.FRAME for n in answers)
        samples = await asyncio.to_thread(_joined, parts)
        log.info("speech.spoken", model=loaded.name, frames=frames, pieces=len(answers), voice=voice)
        return SpeechAudio(wav_bytes(samples, snac.SAMPLE_RATE), snac.SAMPLE_RATE, len(samples), codes=frames)


def _voice(voice: str | None) -> str:
    """The speaker prefix: Orpheus's own names as given, its default for none or an OpenAI stock name."""
    if voice is None or not voice.strip() or voice.strip().lower() in OPENAI_VOICES:
        return DEFAULT_VOICE
    name = voice.strip()
    return name.lower() if name.lower() in orpheus.VOICES else name


async def _generate(client: httpx.AsyncClient, loaded: LoadedModel, text: str, voice: str) -> list[int]:
    """The ``N`` of each codec token the model answers ``text`` with, up to the end-of-speech marker."""
    prompt = orpheus.prompt(text, voice)
    room = (loaded.n_ctx - len(prompt.encode()) - _MARGIN) // snac.FRAME  # a byte is a token at most
    if room <= 0:
        raise BadRequestError(
            f"{loaded.name}'s context ({loaded.n_ctx} tokens) leaves no room to speak; load it with a larger one",
            param="model",
        )
    body = {
        "prompt": prompt,
        "n_predict": snac.FRAME * min(room, orpheus.frame_budget(text)),
        "grammar": orpheus.grammar(),
        "return_tokens": True,
        "cache_prompt": True,
        **orpheus.SAMPLING,
    }
    answer = await _post(client, loaded, "/completion", body)
    ids = answer.get("tokens") or []
    if not ids:
        return []
    spelled = await _post(client, loaded, "/detokenize", {"tokens": ids})
    numbers = snac.token_numbers(str(spelled.get("content", "")))
    end = next((i for i, n in enumerate(numbers) if n < snac.FIRST_CODE_TOKEN), len(numbers))
    return numbers[:end]  # the end-of-speech marker and anything after it are not audio


async def _post(client: httpx.AsyncClient, loaded: LoadedModel, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's JSON answer to ``body`` on ``path``.

    Raises:
        AnsweredError: llama-server answered with an error (its own message and status).
        UpstreamError: it could not be reached or broke off.
    """
    try:
        resp = await client.post(loaded.url + path, json=body, headers=loaded.auth_headers)
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{loaded.name}'s llama-server failed on {path}: {exc}") from exc
    if resp.status_code != 200:
        raise AnsweredError.from_body(resp.status_code, resp.content, server=f"{loaded.name}'s llama-server")
    try:
        data = json_codec.loads(resp.content)
    except ValueError as exc:
        raise UpstreamError(f"{loaded.name}'s llama-server answered {path} with no JSON") from exc
    if not isinstance(data, dict):
        raise UpstreamError(f"{loaded.name}'s llama-server answered {path} with JSON that is not an object")
    return data


def _joined(parts: list[Any]) -> Any:
    import numpy as np

    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
