"""``POST /v1/audio/speech``: OpenAI's text-to-speech route, for the GGUF TTS models the studio detects.

The body is OpenAI's (``model``, ``input``, ``voice``, ``response_format``, ``speed``) plus the
studio's ``language``. The model's facts (``gguf.speech``) pick the engine
(``studio.speech.engines``). The input is split into sentences, each spoken on its own, so a
long text never asks a model for more than it was trained to say at once: ``pcm`` (OpenAI's raw
24 kHz 16-bit mono) streams each sentence as it is ready; ``wav`` answers one file once all are
spoken (a WAV header holds the length). OpenAI's compressed formats need an encoder the studio
does not ship, and are refused by name, as is a ``speed`` the engine cannot honour.
"""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Literal, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field

from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.blocking import run_blocking
from studio.chat.media import model_speech
from studio.errors import BadRequestError
from studio.home import studio_home
from studio.http.guards.model_paths import check_model_path
from studio.http.gui.bodies import ApiBody
from studio.http.wire.relay import client_gone
from studio.speech.engine import SpeechAudio, SpeechEngine, SpeechRequest, SpeechRuntime
from studio.speech.engines import ENGINES, speech_engine

router = APIRouter()
T = TypeVar("T")

#: OpenAI's limit on ``input``.
MAX_INPUT_CHARS = 4096
#: A sentence is cut at this many characters (at a comma or a space) so no run asks for minutes of speech.
MAX_SENTENCE_CHARS = 300
#: Pieces shorter than this join the next one: a model speaks "Hi." badly on its own.
MIN_SENTENCE_CHARS = 24
FORMATS = ("wav", "pcm")
_FULL_WIDTH_STOPS = ("。", "！", "？", "；")
_SENTENCE_END = re.compile(r"(?<=[.!?;:…])\s+|(?<=[。！？；])|\n+")


class SpeechBody(ApiBody):
    """OpenAI's speech request, and the studio's ``language``."""

    model: str = Field(description="a text-to-speech model the studio lists (ggstudio pull owner/repo)")
    input: str = Field(description=f"the text to speak, at most {MAX_INPUT_CHARS} characters")
    voice: str | None = Field(None, description="a speaker recording's name in the voices folder, or OpenAI's")
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "wav"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    language: str | None = Field(None, description="the language to speak (en, zh, de...), where the model takes one")
    instructions: str | None = Field(None, description="OpenAI's style instructions: refused, no GGUF model takes them")
    stream_format: Literal["audio", "sse"] | None = None


@router.post("/v1/audio/speech")
async def speech(body: SpeechBody, request: Request) -> Response:
    """Return ``input`` spoken by ``model``: a WAV, or 16-bit PCM streamed sentence by sentence."""
    if body.response_format not in FORMATS:
        raise BadRequestError(
            f"response_format {body.response_format!r} needs an audio encoder the studio does not ship; ask for "
            f"{' or '.join(FORMATS)}",
            param="response_format",
            code="unsupported_response_format",
        )
    if body.stream_format == "sse":
        raise BadRequestError(
            "stream_format 'sse' is not served: ask for response_format 'pcm', which streams the audio itself",
            param="stream_format",
            code="unsupported_stream_format",
        )
    if body.instructions:
        raise BadRequestError(
            "instructions are not supported: GGUF text-to-speech models take no style instructions",
            param="instructions",
            code="unsupported_instructions",
        )
    if not body.input.strip():
        raise BadRequestError("input is empty: send the text to speak", param="input", code="empty_input")
    if len(body.input) > MAX_INPUT_CHARS:
        raise BadRequestError(
            f"input is {len(body.input)} characters; at most {MAX_INPUT_CHARS} are spoken at once",
            param="input",
            code="input_too_long",
        )
    manager = request.app.state.manager
    await check_model_path(request, body.model)
    entry = await run_blocking(
        manager.catalog.resolve, body.model, timeout=manager.work_timeout, what=f"finding {body.model}"
    )
    facts = await run_blocking(model_speech, entry.path, timeout=manager.work_timeout, what=f"reading {entry.path}")
    if facts is None:
        raise BadRequestError(
            f"{body.model} is not a text-to-speech model: it writes text (send it to /v1/chat/completions)",
            param="model",
            code="model_not_tts",
        )
    name = speech_engine(facts)
    if name is None:
        raise BadRequestError(
            f"{body.model} is {facts.describe()}, and no speech engine here speaks it: the studio speaks "
            f"{', '.join(ENGINES)}",
            param="model",
            code="unsupported_tts_model",
        )
    base = SpeechRequest(
        model=body.model,
        path=entry.path,
        facts=facts,
        text="",
        voice=body.voice,
        speed=body.speed,
        response_format=body.response_format,
        projector=entry.mmproj,
        language=body.language,
        runtime=_runtime(request),
    )
    engine = ENGINES[name]
    pieces = sentences(body.input)
    if body.response_format == "pcm":
        first = await engine.speak(_with_text(base, pieces[0]))  # errors of the first answer as errors, not a cut
        return StreamingResponse(
            _pcm_stream(engine, base, first, pieces[1:]),
            media_type="audio/pcm",
            headers={"x-sample-rate": str(first.sample_rate)},
        )
    spoken = await _unless_client_leaves(request, _speak_all(engine, base, pieces))
    if spoken is None:
        return Response(status_code=499)  # nobody reads it: the client is gone, and so is the run
    audio = join_wavs(spoken)
    return Response(
        audio.wav,
        media_type="audio/wav",
        headers={"x-audio-codes": str(audio.codes), "x-sentences": str(len(pieces))},
    )


async def _speak_all(engine: SpeechEngine, base: SpeechRequest, pieces: list[str]) -> list[SpeechAudio]:
    return [await engine.speak(_with_text(base, piece)) for piece in pieces]


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None when the client disconnects first: then ``work`` is cancelled (a llama-tts run
    is killed with its process group), as a streamed answer is when its reader goes."""
    working = asyncio.ensure_future(work)
    leaving = asyncio.ensure_future(client_gone(request.receive))
    try:
        await asyncio.wait({working, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (working, leaving):
            if not task.done():
                task.cancel()
    if working.done() and not working.cancelled():
        return working.result()
    await asyncio.gather(working, return_exceptions=True)  # the run is reaped before the answer goes
    return None


def sentences(text: str) -> list[str]:
    """Return ``text`` cut into sentences, the short ones joined to the next, the long ones cut at a comma or space."""
    out: list[str] = []
    carry = ""
    for raw in _SENTENCE_END.split(text):
        piece = " ".join(raw.split())
        if not piece:
            continue
        piece = _joined(carry, piece) if carry else piece
        carry = ""
        if len(piece) < MIN_SENTENCE_CHARS:
            carry = piece
            continue
        out.extend(_cut(piece))
    if carry:
        if out and len(out[-1]) + len(carry) < MAX_SENTENCE_CHARS:
            out[-1] = _joined(out[-1], carry)
        else:
            out.append(carry)
    return out


def _joined(first: str, second: str) -> str:
    """Two pieces as one: a space between them, none after a full-width stop (Chinese, Japanese)."""
    return first + second if first.endswith(_FULL_WIDTH_STOPS) else f"{first} {second}"


def _cut(piece: str) -> list[str]:
    parts = []
    while len(piece) > MAX_SENTENCE_CHARS:
        at = max(piece.rfind(", ", 0, MAX_SENTENCE_CHARS), piece.rfind(" ", 0, MAX_SENTENCE_CHARS))
        at = at if at > 0 else MAX_SENTENCE_CHARS
        parts.append(piece[: at + 1].strip())
        piece = piece[at + 1 :].strip()
    return [*parts, piece] if piece else parts


def join_wavs(parts: list[SpeechAudio]) -> SpeechAudio:
    """Return one 16-bit mono WAV of ``parts`` spoken one after the other.

    Raises:
        BadRequestError: the parts are at different sample rates (an engine would have to resample).
    """
    rates = {p.sample_rate for p in parts}
    if len(rates) != 1:
        raise BadRequestError(f"the sentences came back at different sample rates ({sorted(rates)})")
    pcm = b"".join(_pcm_of(p.wav) for p in parts)
    rate = rates.pop()
    return SpeechAudio(
        wav=wav_header(rate, len(pcm)) + pcm,
        sample_rate=rate,
        frames=len(pcm) // 2,
        codes=sum(p.codes for p in parts),
    )


def wav_header(rate: int, data_bytes: int) -> bytes:
    """A 44-byte RIFF header for ``data_bytes`` of 16-bit mono PCM at ``rate``."""
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data_bytes)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )


def _pcm_of(wav: bytes) -> bytes:
    """The PCM after a 44-byte header (what llama-tts and ``wav_header`` write)."""
    size = struct.unpack_from("<I", wav, 40)[0]
    return wav[44 : 44 + size]


async def _pcm_stream(
    engine: SpeechEngine, base: SpeechRequest, first: SpeechAudio, rest: list[str]
) -> AsyncIterator[bytes]:
    """The first sentence's PCM, then each next one as it is spoken (a client that leaves cancels the run)."""
    yield _pcm_of(first.wav)
    for piece in rest:
        audio = await engine.speak(_with_text(base, piece))
        yield _pcm_of(audio.wav)


def _with_text(base: SpeechRequest, text: str) -> SpeechRequest:
    return replace(base, text=text)


def _runtime(request: Request) -> SpeechRuntime:
    """The studio's parts an engine may use, made once per app."""
    state = request.app.state
    runtime: SpeechRuntime | None = getattr(state, "speech_runtime", None)
    if runtime is None:
        manager = state.manager
        run_dir: Path | None = manager.builder.files_root
        home = run_dir.parent if run_dir is not None else studio_home()
        runtime = SpeechRuntime(
            manager=manager,
            logs_dir=home / "logs",
            voices_dir=home / "voices",
            registry=ChildRegistry(run_dir, owner_token()) if run_dir is not None else None,
        )
        state.speech_runtime = runtime
    return runtime
