"""The first speech engine: llama.cpp's own ``llama-tts`` for the TTS architectures it knows (Qwen3-TTS, Pocket TTS).

The model speaks through its projector's generation head (``clip.has_gen_audio_encoder``), so
there is no codec to run in the studio: each utterance is one supervised ``llama-tts`` run
(``launcher.tts``) that writes a WAV. The run is billed before it starts: the backbone's
weights and its context for this utterance (``launcher.memory.estimate``) plus the
projector's weights, and refused when that is more than the host has free. Runs take turns
(one at a time per studio): each uses every core it is given.

A voice is a speaker reference recording in the studio's voices folder (``<name>.wav`` or
``.mp3``). Qwen3-TTS speaks in a voice of its own without one, so OpenAI's built-in voice
names (``alloy``...) mean that voice; Pocket TTS needs a recording.
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import replace
from pathlib import Path

import psutil
import structlog

import gguf
from gguf.projector import projector_facts
from gguf.speech import SpeechFacts, has_token
from launcher.errors import SpeechError
from launcher.memory import estimate, for_file
from launcher.tts import TTSJob, default_threads, frame_samples, run_tts
from launcher.units import format_mib
from studio.blocking import run_blocking
from studio.errors import BadRequestError, DoesNotFitError
from studio.speech.engine import SpeechAudio, SpeechRequest, SpeechRuntime

log = structlog.get_logger(__name__)

#: The architectures llama-tts speaks for (``gguf.speech``'s family names).
FAMILIES = frozenset({"Qwen3-TTS", "Pocket TTS"})
#: Families that speak without a speaker reference.
OWN_VOICE = frozenset({"Qwen3-TTS"})
#: OpenAI's built-in voice names: a client always sends one; for a model with a voice of its own they mean that voice.
OPENAI_VOICES = frozenset(
    {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "default"}
)
VOICE_SUFFIXES = (".wav", ".mp3")
#: Qwen3-TTS's languages (``mtmd-helper-gen.cpp``'s ``tts_lang_codes``): a code or the name it stands for.
LANGUAGES = {
    "zh": "chinese",
    "en": "english",
    "de": "german",
    "it": "italian",
    "pt": "portuguese",
    "es": "spanish",
    "ja": "japanese",
    "ko": "korean",
    "fr": "french",
    "ru": "russian",
}
_VOICE_NAME = re.compile(r"^[\w][\w .-]{0,63}$")
#: Frames allowed per character of text, and a floor: real speech takes about one 12.5 Hz frame per character.
FRAMES_PER_CHAR = 2
MIN_FRAMES = 32
MAX_FRAMES = 4096
#: Seconds one utterance may take: a sentence on a slow CPU takes seconds, never this long.
RUN_TIMEOUT = 600.0


class LlamaTTSEngine:
    """Speaks through ``llama-tts`` (see the module docstring)."""

    name = "llama-tts"

    def __init__(self) -> None:
        self._turn = asyncio.Lock()

    def serves(self, facts: SpeechFacts) -> bool:
        """Return whether ``facts`` name an architecture llama-tts runs (it has no codec to decode)."""
        return facts.family in FAMILIES and not facts.vocoder

    async def speak(self, request: SpeechRequest) -> SpeechAudio:
        """Return ``request.text`` spoken by one llama-tts run.

        Raises:
            BadRequestError: no projector, a projector without a generation head, an unknown voice, a speed.
            DoesNotFitError: the run's bill is more than the host's free memory.
            launcher.errors.SpeechError: llama-tts failed (its log tail is kept on the error).
        """
        runtime = request.runtime
        if runtime is None:
            raise RuntimeError("the llama-tts engine needs the studio's runtime on the request")
        if not math.isclose(request.speed, 1.0):
            raise BadRequestError(
                f"{request.model} speaks at its own pace: llama-tts has no speed control; send speed 1.0 or leave "
                "it out",
                param="speed",
                code="unsupported_speed",
            )
        _check_language(request)
        projector = self._projector(request)
        speaker = self._speaker(request, runtime)
        binary = Path(runtime.manager.binary).with_name("llama-tts")
        if not binary.is_file():
            raise SpeechError(
                f"llama-tts is not beside the llama-server this studio runs ({binary.parent}): the pinned build "
                "includes it, so build it with `ggstudio build-llama` (or `make`), or put a llama-tts of the same "
                "release there"
            )
        max_frames = min(MAX_FRAMES, max(MIN_FRAMES, FRAMES_PER_CHAR * len(request.text)))
        n_ctx = _round_up(len(request.text.encode()) + max_frames + 64, 256)
        job = TTSJob(
            binary=binary,
            model=request.path,
            projector=projector,
            text=request.text,
            max_frames=max_frames,
            n_ctx=n_ctx,
            threads=default_threads(),
            speaker=speaker,
            language=request.language,
            samples_per_frame=frame_samples({t.name: t.shape for t in gguf.read(projector).tensors}),
        )
        bill = await run_blocking(_bill, job, timeout=runtime.manager.work_timeout, what="billing llama-tts")
        async with self._turn:
            free = psutil.virtual_memory().available
            if bill > free:
                raise DoesNotFitError(
                    f"speaking with {request.model} needs {format_mib(bill)} of memory (its weights, projector and "
                    f"a {n_ctx}-position context) and {format_mib(free)} is free: unload a model first",
                    param="model",
                )
            log.info("tts_bill", model=request.model, bill=bill, free=free, n_ctx=n_ctx)
            result = await run_tts(
                job,
                log_path=runtime.logs_dir / "llama-tts" / f"{request.path.stem}.log",
                registry=runtime.registry,
                timeout=RUN_TIMEOUT,
            )
        return SpeechAudio(wav=result.wav, sample_rate=result.sample_rate, frames=result.samples, codes=result.frames)

    def _projector(self, request: SpeechRequest) -> Path:
        """The model's projector, checked to hold a generation head."""
        if request.projector is None:
            raise BadRequestError(
                f"{request.model} speaks through its projector (an mmproj-*.gguf file beside the model) and none is "
                f"there: `ggstudio pull` of the model's repository fetches both",
                param="model",
                code="missing_projector",
            )
        facts = projector_facts(gguf.read(request.projector))
        if facts is None or not facts.speech_out:
            raise BadRequestError(
                f"{request.projector.name}, the projector beside {request.model}, has no audio generation head "
                "(clip.has_gen_audio_encoder): it is not this TTS model's projector",
                param="model",
                code="missing_projector",
            )
        return request.projector

    def _speaker(self, request: SpeechRequest, runtime: SpeechRuntime) -> Path | None:
        """The speaker reference file the voice names, or None for the model's own voice."""
        voice = (request.voice or "").strip()
        family = request.facts.family
        if (not voice or voice.lower() in OPENAI_VOICES) and family in OWN_VOICE:
            return None
        if voice and _VOICE_NAME.match(voice) and voice not in (".", ".."):
            for suffix in VOICE_SUFFIXES:
                path = runtime.voices_dir / f"{voice}{suffix}"
                if path.is_file():
                    return path
        known = sorted({p.stem for s in VOICE_SUFFIXES for p in runtime.voices_dir.glob(f"*{s}")})
        own = " or leave it out for the model's own voice" if family in OWN_VOICE else ""
        need = f"{request.model} ({family}) needs a speaker reference recording as its voice" if not own else ""
        raise BadRequestError(
            (need + ": " if need else "")
            + f"no voice {voice!r} in {runtime.voices_dir} (a <name>.wav or <name>.mp3 recording); voices there: "
            + (", ".join(known) or "none")
            + own,
            param="voice",
            code="unknown_voice",
        )


def _check_language(request: SpeechRequest) -> None:
    """Refuse a language the Qwen3-TTS model has no ``<|codec_language_NAME|>`` token for (llama-tts would fail the
    run); Pocket TTS's language is in its weights."""
    language = request.language
    if language is None or request.facts.family not in OWN_VOICE:
        return
    model = gguf.read(request.path)
    spoken = [code for code, name in LANGUAGES.items() if has_token(model, f"<|codec_language_{name}|>")]
    name = LANGUAGES.get(language.lower(), language.lower())
    if name not in (LANGUAGES[code] for code in spoken):
        raise BadRequestError(
            f"{request.model} does not speak {language!r}; it speaks " + (", ".join(spoken) or "no named language"),
            param="language",
            code="unsupported_language",
        )


def _bill(job: TTSJob) -> int:
    """Bytes the run holds: the backbone with this run's context, and the projector's weights."""
    model = gguf.read(job.model)
    projector = projector_facts(gguf.read(job.projector))
    options = replace(
        for_file(model),
        n_ctx=job.n_ctx,
        n_parallel=1,
        kv_unified=True,
        embeddings=True,
        mmproj_bytes=projector.weight_bytes if projector else job.projector.stat().st_size,
    )
    return estimate(model.facts, options).total


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
