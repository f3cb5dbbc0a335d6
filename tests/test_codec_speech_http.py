"""POST /v1/audio/speech with an Orpheus model: the route, the codec engine, the real llama-server and onnxruntime."""

from __future__ import annotations

import io
import wave

import openai
import pytest

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from tests.helpers import assert_no_children, serving
from tests.support.orpheus_model import write_orpheus_model
from tests.test_codec_speech import codec_hub  # noqa: F401


@pytest.mark.slow
def test_an_orpheus_model_speaks_through_openais_speech_route(tmp_path, llama_server_bin, codec_hub):
    (tmp_path / "models").mkdir()
    write_orpheus_model(tmp_path / "models" / "tiny-orpheus.gguf")
    manager = ModelManager(
        catalog=Catalog([tmp_path / "models"]),
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
        files_root=tmp_path / "run",
        model_defaults={"tiny-orpheus": ModelDefaults(n_ctx=512, n_parallel=1)},
    )
    text = "Hi there. Bye."
    with serving(create_app(manager)) as base:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            raw = client.audio.speech.with_raw_response.create(
                model="tiny-orpheus", input=text, voice="alloy", response_format="wav"
            )
    wav = raw.content
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        codes = int(raw.headers["x-audio-codes"])
        assert w.getnframes() == codes * 2048
    assert codes > 0
    assert_no_children()
