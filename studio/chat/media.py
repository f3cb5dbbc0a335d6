"""Images and audio in chat requests: what a model can take, and the checks before llama-server sees them.

OpenAI's chat messages carry media as content parts:
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` and
``{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}``.
llama-server decodes both itself (its ``--mmproj`` encoders); the studio only
checks, before anything is sent:

- an image is a ``data:`` URI. The studio never fetches a URL on a client's
  behalf (a service that downloads what any client names is a way into the
  network behind it), so an ``http(s)://`` image is a 400 saying to send the bytes;
- the model can take what is sent: images need a vision projector, audio an
  audio one (``gguf.projector``); a text-to-speech model (``gguf.speech``) takes
  no chat at all, and the 400 says what it is rather than letting it answer noise.

Pure functions over the request body; the proxy and ``/api/chat`` call
``check_chat_media`` with the loaded model's ``media_capabilities``, and
``preflight_chat`` before a request can load a model: malformed or remote media,
and media the named model will not take (its paired or configured projector, read
from the files), are refused before anything starts.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
from gguf.projector import projector_facts
from gguf.speech import SpeechFacts, speech_facts
from studio.errors import BadRequestError, ModelNotFoundError

if TYPE_CHECKING:
    from launcher.planner import LaunchPlan
    from studio.residency.manager import ModelManager
    from studio.residency.resident import LoadedModel


@dataclass(frozen=True)
class MediaCapabilities:
    """What a loaded model takes besides text, and whether it speaks instead of writing."""

    vision: bool = False
    audio: bool = False  # speech / audio input through an audio projector
    speech: SpeechFacts | None = None  # a text-to-speech model or vocoder: no chat

    def to_json(self) -> dict[str, Any]:
        """The GUI's view: ``vision``, ``audio`` and, for a TTS model, ``tts`` with what it is."""
        return {
            "vision": self.vision,
            "audio": self.audio,
            "tts": {"codec": self.speech.codec, "family": self.speech.family, "description": self.speech.describe()}
            if self.speech
            else None,
        }


@dataclass(frozen=True)
class MediaCounts:
    """How many media parts a request carries."""

    images: int = 0
    audio: int = 0


#: Each loaded model's capabilities, by the model's id while it lives: the files a running llama-server loaded
#: do not change under it, and reading them (a ``stat`` a chat) was ~2 % of a forwarded request's CPU. An entry
#: goes with its model (``weakref.finalize``), so an unloaded model is neither kept alive nor mistaken for a new
#: one that got its id. (``LoadedModel`` hashes all its fields, too slow for a ``WeakKeyDictionary``'s key.)
_LOADED: dict[int, MediaCapabilities] = {}


def media_capabilities(loaded: LoadedModel) -> MediaCapabilities:
    """Return what ``loaded`` can take: from its plan's projector and its own vocabulary (once per loaded model)."""
    found = _LOADED.get(id(loaded))
    if found is not None:
        return found
    capabilities = _LOADED[id(loaded)] = plan_capabilities(loaded.plan)
    weakref.finalize(loaded, _LOADED.pop, id(loaded), None)
    return capabilities


def plan_capabilities(plan: LaunchPlan) -> MediaCapabilities:
    """Return what a model launched by ``plan`` takes: from the plan's projector and the model's vocabulary."""
    projector = plan.model.projector
    return MediaCapabilities(
        vision=bool(projector and projector.vision),
        audio=bool(projector and projector.audio),
        speech=model_speech(plan.model.path),
    )


def file_capabilities(model: Path, projector: Path | None) -> MediaCapabilities:
    """What a model file would take loaded with ``projector``, from the two headers (nothing is started)."""
    facts = None
    if projector is not None:
        try:
            facts = projector_facts(gguf.read(projector))
        except gguf.GGUFError:
            facts = None  # the load names the problem
    return MediaCapabilities(
        vision=bool(facts and facts.vision), audio=bool(facts and facts.audio), speech=model_speech(model)
    )


async def preflight_chat(manager: ModelManager, body: Mapping[str, Any]) -> None:
    """Refuse a chat request whose media is malformed or remote, or that the model it names will not take,
    before the request can load that model.

    The live model costs nothing here (it is checked by ``check_chat_media`` once acquired); another
    model's files are read in a worker thread.
    """
    model = body.get("model")
    if isinstance(model, str) and manager.find(model) is not None:
        return  # a resident one: checked once acquired (``check_chat_media``), with no load to spare
    check_media_form(body)
    if not isinstance(model, str):
        return  # the default model: checked once acquired
    await asyncio.to_thread(_check_named_model, manager, body, model)


def _check_named_model(manager: ModelManager, body: Mapping[str, Any], model: str) -> None:
    from studio.residency.requests import LoadRequest, load_settings

    try:
        entry = manager.catalog.resolve(model)
    except ModelNotFoundError:
        return  # not here (yet): acquiring it downloads it (auto_download) or names the problem
    settings = load_settings(LoadRequest(model=model), entry, manager.model_defaults)
    check_chat_media(body, file_capabilities(entry.path, settings.mmproj), entry.name)


def model_speech(path: Path) -> SpeechFacts | None:
    """``gguf.speech.speech_facts`` of the model file at ``path``, once per version of the file."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _speech(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _speech(path: Path, size: int, mtime_ns: int) -> SpeechFacts | None:
    try:
        return speech_facts(gguf.read(path))
    except gguf.GGUFError:
        return None


def media_parts(
    messages: Any, types: tuple[str, ...] = ("image_url", "input_audio")
) -> Iterator[tuple[int, str, Mapping[str, Any]]]:
    """Yield ``(message index, part type, part)`` for every content part of one of ``types`` (a chat's media by
    default; an Anthropic ``image`` block or a Responses ``input_image`` part, each in its list of items)."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in types:
                yield i, part["type"], part


def check_chat_media(body: Mapping[str, Any], capabilities: MediaCapabilities, model: str) -> MediaCounts:
    """Return the media a chat request carries, after checking the model can take each part as sent.

    Raises:
        BadRequestError: a TTS model; a remote or malformed image; an audio part without data; images for a model
            without vision, audio for one without an audio encoder. ``param`` points at the part.
    """
    _refuse_speech(capabilities, model)
    counts = check_media_form(body)
    images, audio = counts.images, counts.audio
    if images and not capabilities.vision:
        raise _no_vision(model, "messages")
    if audio and not capabilities.audio:
        raise BadRequestError(
            f"{model} cannot hear audio: it was loaded without an audio projector (mmproj). Load a model with an "
            "audio encoder, or send text only",
            param="messages",
            code="model_has_no_audio",
        )
    return counts


def check_dialect_images(
    body: Mapping[str, Any], field: str, image_part: str, capabilities: MediaCapabilities, model: str
) -> None:
    """Refuse an Anthropic Messages or OpenAI Responses body the model cannot take, as ``check_chat_media`` does a
    chat's: images (parts of type ``image_part`` in the items of ``field``) for a model without vision, anything for
    a TTS model. llama-server answers the images with a 500 that names its own ``mmproj`` flag.

    Raises:
        BadRequestError: as above; ``param`` is ``field``.
    """
    _refuse_speech(capabilities, model)
    if not capabilities.vision and any(media_parts(body.get(field), (image_part,))):
        raise _no_vision(model, field)


def _refuse_speech(capabilities: MediaCapabilities, model: str) -> None:
    if capabilities.speech is not None:
        raise BadRequestError(
            f"{model} is {capabilities.speech.describe()}. It answers with audio codes, not text, so it cannot "
            "chat; use a text-to-speech pipeline with its vocoder",
            param="model",
            code="model_is_tts",
        )


def _no_vision(model: str, param: str) -> BadRequestError:
    return BadRequestError(
        f"{model} cannot read images: it was loaded without a vision projector (mmproj). Load a vision model "
        "with its projector, or send text only",
        param=param,
        code="model_has_no_vision",
    )


def check_media_form(body: Mapping[str, Any]) -> MediaCounts:
    """Return the media a chat request carries, after checking each part is sent as the studio takes it.

    Raises:
        BadRequestError: a remote or malformed image, an audio part without data.
    """
    images = audio = 0
    for i, kind, part in media_parts(body.get("messages")):
        where = f"messages[{i}].content"
        if kind == "image_url":
            images += 1
            _check_image(part, where)
        else:
            audio += 1
            _check_audio(part, where)
    return MediaCounts(images, audio)


def _check_image(part: Mapping[str, Any], where: str) -> None:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str) or not url:
        raise BadRequestError(f"{where}: an image_url part needs image_url.url", param=where, code="invalid_image")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https", "ftp", "file"):
        raise BadRequestError(
            f"{where}: the studio does not fetch image URLs ({url[:80]}); send the image itself as a data URI, "
            "data:image/png;base64,<the bytes in base64>",
            param=where,
            code="remote_image_url",
        )
    if scheme != "data" or ";base64," not in url[:200]:
        raise BadRequestError(
            f"{where}: an image must be a base64 data URI (data:image/png;base64,...)",
            param=where,
            code="invalid_image",
        )


def _check_audio(part: Mapping[str, Any], where: str) -> None:
    audio = part.get("input_audio")
    if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str) or not audio["data"]:
        raise BadRequestError(
            f"{where}: an input_audio part needs input_audio.data (the audio in base64) and "
            "input_audio.format (wav or mp3)",
            param=where,
            code="invalid_audio",
        )
