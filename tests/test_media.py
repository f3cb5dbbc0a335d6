"""Media in chats (pure checks), request body limits, and text-to-speech models told apart by their vocabulary."""

from __future__ import annotations

import asyncio
import base64
import gc
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request

import gguf
from gguf.speech import speech_facts
from gguf.writer import write_gguf
from studio.chat import media
from studio.chat.media import MediaCapabilities, check_chat_media, check_dialect_images, check_media_form
from studio.errors import BadRequestError, StudioError
from studio.http.errors import error_response
from studio.http.guards.limits import BodySizeLimit
from studio.residency.resident import LoadedModel
from studio.settings import Settings

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
VISION = MediaCapabilities(vision=True)
AUDIO = MediaCapabilities(audio=True)
TEXT = MediaCapabilities()
HI_TEXT = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def chat(*parts: dict) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, *parts]},
        ]
    }


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def sound(data: str = "AAAA", fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def test_a_loaded_models_capabilities_are_read_once_and_forgotten_with_it(monkeypatch):
    """Each chat asks; the files are read once per loaded model, and an unloaded one is not kept alive by it."""
    reads: list[object] = []
    monkeypatch.setattr(media, "plan_capabilities", lambda plan: reads.append(plan) or VISION)

    def loaded(plan: str) -> LoadedModel:
        fields = dict(settings=None, url="", api_key="", n_ctx=0, facts=None, template=None, command=None)
        return LoadedModel(name="m", plan=plan, **fields)  # type: ignore[arg-type]

    first = loaded("first plan")
    assert media.media_capabilities(first) is VISION and media.media_capabilities(first) is VISION
    assert reads == ["first plan"]
    gone = id(first)
    del first
    gc.collect()
    assert gone not in media._LOADED
    media.media_capabilities(loaded("second plan"))  # a new incarnation is read anew, whatever its id
    assert reads == ["first plan", "second plan"]


def test_data_uri_images_and_audio_are_counted_for_a_model_that_takes_them():
    both = MediaCapabilities(vision=True, audio=True)
    counts = check_chat_media(chat(image(PNG), image(PNG), sound()), both, "m")
    assert (counts.images, counts.audio) == (2, 1)
    assert check_chat_media({"messages": [{"role": "user", "content": "plain text"}]}, TEXT, "m").images == 0


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://10.0.0.1/x.jpg", "file:///etc/passwd"])
def test_a_remote_image_url_is_refused_asking_for_the_bytes(url):
    with pytest.raises(BadRequestError, match="does not fetch image URLs") as info:
        check_media_form(chat(image(url)))
    assert info.value.code == "remote_image_url" and info.value.param == "messages[1].content"
    assert "data:image/png;base64" in info.value.message


@pytest.mark.parametrize(
    "part",
    [
        image("cat.png"),
        image("data:image/png,rawbytes"),
        {"type": "image_url"},
        {"type": "input_audio", "input_audio": {"format": "wav"}},
    ],
)
def test_malformed_media_parts_are_refused(part):
    with pytest.raises(BadRequestError) as info:
        check_media_form(chat(part))
    assert info.value.code in ("invalid_image", "invalid_audio")


def test_media_for_a_model_without_the_projector_names_what_is_missing():
    with pytest.raises(BadRequestError, match="tiny cannot read images: it was loaded without a vision projector"):
        check_chat_media(chat(image(PNG)), AUDIO, "tiny")
    with pytest.raises(BadRequestError, match="tiny cannot hear audio") as info:
        check_chat_media(chat(sound()), VISION, "tiny")
    assert info.value.code == "model_has_no_audio"


# ---------------------------------------------------------------- text-to-speech vocabularies


@pytest.fixture(scope="module")
def llama_tokens(llama_src) -> list[str]:
    return list(gguf.read(llama_src / "models" / "ggml-vocab-llama-bpe.gguf").metadata["tokenizer.ggml.tokens"])


def vocab_model(path: Path, tokens: list[str]) -> gguf.GGUFFile:
    write_gguf(path, {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens})
    return gguf.read(path)


@pytest.mark.parametrize(
    ("added", "codec"),
    [
        ([f"<custom_token_{i}>" for i in range(7 * 4096 + 10)], "SNAC"),
        (
            [f"<|bicodec_semantic_{i}|>" for i in range(8192)] + [f"<|bicodec_global_{i}|>" for i in range(4096)],
            "BiCodec",
        ),
        ([f"<|c1_{i}|>" for i in range(1024)] + [f"<|c2_{i}|>" for i in range(1024)] + ["<|audio_start|>"], "DAC"),
        ([f"<|s_{i}|>" for i in range(65536)], "XCodec2"),
        ([f"<|{i}|>" for i in range(4100)] + ["<|audio_start|>", "<|audio_end|>"], "WavTokenizer"),
        (["<|AUDIO|>", "<|audio_eos|>"], "Mimi"),
    ],
)
def test_a_codec_vocabulary_marks_a_tts_model(llama_tokens, tmp_path, added, codec):
    facts = speech_facts(vocab_model(tmp_path / "tts.gguf", llama_tokens + added))
    assert facts is not None and facts.codec == codec
    with pytest.raises(BadRequestError, match="is a text-to-speech model") as info:
        check_chat_media({"messages": [{"role": "user", "content": "hi"}]}, MediaCapabilities(speech=facts), "orpheus")
    assert info.value.code == "model_is_tts"
    with pytest.raises(BadRequestError, match="is a text-to-speech model"):  # in the other dialects too
        check_dialect_images({"input": "hi"}, "input", "input_image", MediaCapabilities(speech=facts), "orpheus")


def test_an_anthropic_or_responses_image_needs_a_model_with_vision():
    image = {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}, {"type": "text"}]}]}
    check_dialect_images(image, "messages", "image", VISION, "m")
    check_dialect_images({"messages": HI_TEXT}, "messages", "image", TEXT, "m")
    check_dialect_images({"input": "a string is text"}, "input", "input_image", TEXT, "m")
    with pytest.raises(BadRequestError, match="cannot read images") as info:
        check_dialect_images(image, "messages", "image", TEXT, "m")
    assert (info.value.param, info.value.code) == ("messages", "model_has_no_vision")


@pytest.mark.parametrize(
    "added",
    [
        ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"],  # Qwen2-Audio hears speech: not a TTS model
        [f"<custom_token_{i}>" for i in range(40)],  # a few stray numbered tokens are no codebook
        [f"<|{i}|>" for i in range(4100)],  # numbered tokens without WavTokenizer's markers
    ],
)
def test_audio_markers_that_are_not_a_codec_do_not_count(llama_tokens, tmp_path, added):
    assert speech_facts(vocab_model(tmp_path / "not-tts.gguf", llama_tokens + added)) is None


def test_no_model_here_is_taken_for_a_tts_model(llama_src, zoo_dir, gemma_model):
    """Every tokenizer-only vocabulary of the pinned tree, every zoo model, Gemma: only the TTS architectures."""
    files = [*sorted((llama_src / "models").glob("ggml-vocab-*.gguf")), *sorted(zoo_dir.glob("*.gguf")), gemma_model]
    found = {p.name: speech_facts(gguf.read(p)) for p in files}
    assert len(found) > 100
    assert {name for name, facts in found.items() if facts} == {"qwen3tts-dense.gguf", "pockettts-dense.gguf"}


# ---------------------------------------------------------------- body size limit


def limited_app(limit: int) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(StudioError)
    async def studio_error(request: Request, exc: StudioError):
        return error_response(exc)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body())}

    app.add_middleware(BodySizeLimit, max_body_bytes=limit)
    return app


def test_an_oversized_body_is_a_413_naming_the_limit():
    asyncio.run(_oversized_bodies())


async def _oversized_bodies() -> None:
    transport = httpx.ASGITransport(app=limited_app(1024))
    async with httpx.AsyncClient(transport=transport, base_url="http://studio") as client:
        assert (await client.post("/echo", content=b"x" * 1024)).json() == {"n": 1024}
        declared = await client.post("/echo", content=b"x" * 5000)
        assert declared.status_code == 413
        error = declared.json()["error"]
        assert (
            error["code"] == "request_too_large" and "5,000 bytes" in error["message"] and "1,024" in error["message"]
        )

        async def chunks():
            for _ in range(10):
                yield b"y" * 400

        streamed = await client.post("/echo", content=chunks())  # no Content-Length: counted as it arrives
        assert streamed.status_code == 413 and "more than" in streamed.json()["error"]["message"]


def test_body_limit_and_auto_download_settings(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("max_body_bytes = 4096\nauto_download = true\n")
    s = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_CONFIG": str(config)})
    assert (s.max_body_bytes, s.auto_download) == (4096, True)
    defaults = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path / "none")})
    assert (defaults.max_body_bytes, defaults.auto_download) == (32 * 1024 * 1024, False)
    env = Settings.from_env(
        {
            "GGUF_STUDIO_HOME": str(tmp_path),
            "GGUF_STUDIO_CONFIG": str(config),
            "GGUF_STUDIO_MAX_BODY_BYTES": "65536",
            "GGUF_STUDIO_AUTO_DOWNLOAD": "0",
        }
    )
    assert (env.max_body_bytes, env.auto_download) == (65536, False)
    with pytest.raises(ValueError, match="max_body_bytes"):
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path / "none"), "GGUF_STUDIO_MAX_BODY_BYTES": "lots"})
