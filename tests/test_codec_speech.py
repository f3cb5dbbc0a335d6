"""Speech from a codec-token model, end to end: the real llama-server writes the codes, onnxruntime decodes.

The model is a tiny random-weight Orpheus (``tests.support.orpheus_model``: a byte-level BPE
vocabulary and Orpheus's ``<custom_token_N>`` tokens), loaded by a real ``ModelManager`` into the pinned llama-server;
the engine's grammar holds its noise to codec tokens, so the real ids of real codec tokens flow. The
SNAC decoder is a tiny ONNX model with the real export's inputs and output
(``tests.support.snac_model``), fetched from the Hub stand-in (``tests.hub_server``) through the real
huggingface_hub, as the real decoder is fetched from the Hub.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf.speech import SpeechFacts, speech_facts
from gguf.writer import write_gguf
from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.errors import BadRequestError
from studio.http.errors import describe
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from studio.speech import orpheus, snac
from studio.speech.codec_tts import CodecSpeech
from studio.speech.codec_weights import codec_path
from studio.speech.engine import SpeechAudio, SpeechRequest, SpeechRuntime
from studio.speech.engines import engine_for
from tests.hub_server import HubServer
from tests.support.orpheus_model import write_orpheus_model
from tests.support.snac_model import HOP, write_snac_decoder


@pytest.fixture(scope="module")
def orpheus_file(tmp_path_factory) -> Path:
    return write_orpheus_model(tmp_path_factory.mktemp("orpheus") / "tiny-orpheus.gguf")


@pytest.fixture
def codec_hub(tmp_path, monkeypatch):
    """The Hub stand-in holding the SNAC decoder where the real one is, and an empty Hugging Face cache."""
    hub = HubServer().start()
    decoder = write_snac_decoder(tmp_path / "decoder" / "decoder_model.onnx")
    hub.repo(snac.CODEC_REPO).add(snac.CODEC_FILE, decoder)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield hub
    finally:
        hub.stop()


def speak(root: Path, binary: Path, model: Path, text: str, *, n_ctx: int = 512) -> SpeechAudio:
    """``text`` spoken by ``model`` through a real manager and llama-server (stopped before returning)."""

    async def run() -> SpeechAudio:
        (root / "models").mkdir(parents=True, exist_ok=True)
        (root / "models" / "tiny-orpheus.gguf").symlink_to(model)
        manager = ModelManager(
            catalog=Catalog([root / "models"]),
            binary=binary,
            make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
            caps=probe(binary, cache_dir=root / "cache"),
            model_defaults={"tiny-orpheus": ModelDefaults(n_ctx=n_ctx, n_parallel=1)},
        )
        try:
            facts = speech_facts(gguf.read(model))
            assert facts is not None
            engine = engine_for(facts)
            assert isinstance(engine, CodecSpeech)
            runtime = SpeechRuntime(manager, root / "logs", root / "voices")
            request = SpeechRequest("tiny-orpheus", model, facts, text, "tara", runtime=runtime)
            return await engine.speak(request)
        finally:
            await manager.aclose()

    return asyncio.run(run())


@pytest.mark.slow
def test_an_orpheus_model_answers_a_wav_of_2048_samples_a_frame(tmp_path, llama_server_bin, orpheus_file, codec_hub):
    audio = speak(tmp_path, llama_server_bin, orpheus_file, "Hi.")
    assert audio.codes == orpheus.frame_budget("Hi.")  # its whole budget: the tiny model never ends its speech itself
    with wave.open(io.BytesIO(audio.wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == audio.frames == audio.codes * 2048
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    # the tiny decoder holds each fine code for 512 samples: the codes reached it in blocks of HOP
    blocks = pcm.reshape(-1, HOP)
    assert (blocks == blocks[:, :1]).all() and len(set(blocks[:, 0].tolist())) > 1
    # the decoder came from the Hub (stand-in) into huggingface_hub's cache, and stays there
    assert codec_hub.downloads() == [f"/{snac.CODEC_REPO}/resolve/main/{snac.CODEC_FILE}"]
    cached = codec_path()
    assert cached.is_relative_to(tmp_path / "hf" / "hub" / "models--onnx-community--snac_24khz-ONNX")
    assert codec_hub.downloads() == [f"/{snac.CODEC_REPO}/resolve/main/{snac.CODEC_FILE}"]


@pytest.mark.slow
def test_a_context_too_small_for_the_text_is_a_400_that_says_so(tmp_path, llama_server_bin, orpheus_file, codec_hub):
    with pytest.raises(BadRequestError, match=r"context \(256 tokens\) leaves no room to speak") as caught:
        speak(tmp_path, llama_server_bin, orpheus_file, "word " * 59 + "end.", n_ctx=256)
    assert describe(caught.value).status == 400  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("codec", "family", "missing"),
    [("BiCodec", "Spark-TTS", "sparktts"), ("DAC", "OuteTTS 1.0", "outetts")],
)
def test_bicodec_and_dac_models_get_a_400_naming_what_is_missing(codec, family, missing):
    facts = SpeechFacts(codec, family, "its vocabulary holds codec tokens")
    engine = engine_for(facts)
    assert isinstance(engine, CodecSpeech)
    with pytest.raises(BadRequestError) as caught:
        asyncio.run(engine.speak(SpeechRequest("m", Path("m.gguf"), facts, "Hello.")))
    assert missing in str(caught.value) and "SNAC models (Orpheus) speak here" in str(caught.value)
    answer = describe(caught.value)
    assert answer is not None and answer.status == 400 and answer.code == "codec_runtime_missing"


def test_without_the_speech_extra_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what Python does when the package is absent
    facts = SpeechFacts("SNAC", "Orpheus", "its vocabulary holds codec tokens")
    with pytest.raises(BadRequestError, match=r"pip install 'gguf-studio\[speech\]'") as caught:
        asyncio.run(CodecSpeech().speak(SpeechRequest("m", Path("m.gguf"), facts, "Hello.")))
    assert describe(caught.value).status == 400  # type: ignore[union-attr]


def test_a_speed_other_than_one_is_refused():
    facts = SpeechFacts("SNAC", "Orpheus", "its vocabulary holds codec tokens")
    with pytest.raises(BadRequestError, match="speaks at its own pace"):
        asyncio.run(CodecSpeech().speak(SpeechRequest("m", Path("m.gguf"), facts, "Hello.", speed=1.5)))


def test_vocoders_and_other_codecs_are_not_this_engines():
    assert engine_for(SpeechFacts("WavTokenizer", "OuteTTS", "arch", vocoder=True)) is None
    assert not CodecSpeech().serves(SpeechFacts("XCodec2", "Llasa", "vocab"))


def test_pulling_an_orpheus_model_fetches_its_snac_decoder_too(codec_hub, tmp_path):
    vocabulary = write_gguf(
        tmp_path / "orpheus-Q4_K_M.gguf",
        {
            "general.architecture": "llama",
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": ["<|eot_id|>"] + [f"<custom_token_{n}>" for n in range(300)],
        },
    )
    codec_hub.repo("acme/orpheus-GGUF").add("orpheus-Q4_K_M.gguf", vocabulary)
    env = {**os.environ, "GGUF_STUDIO_HOME": str(tmp_path / "studio")}
    exe = Path(sys.executable).with_name("ggstudio")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-c", "from studio.cli.app import main; main()"]
    pulled = subprocess.run([*argv, "pull", "acme/orpheus-GGUF"], env=env, capture_output=True, text=True, timeout=120)
    assert pulled.returncode == 0, pulled.stderr
    assert [p.split("/resolve/")[0] for p in codec_hub.downloads()] == ["/acme/orpheus-GGUF", f"/{snac.CODEC_REPO}"]
    codec_line = next(line for line in pulled.stdout.splitlines() if line.startswith("codec: "))
    assert codec_line.endswith(snac.CODEC_FILE) and Path(codec_line.removeprefix("codec: ")).is_file()
