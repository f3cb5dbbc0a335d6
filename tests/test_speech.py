"""``POST /v1/audio/speech`` end to end with llama.cpp's own ``llama-tts``: real uvicorn, the real binary, the
zoo's Qwen3-TTS backbone with a projector written here (``tests.support.tts_models``), a speaker reference
spoken by Debian's espeak-ng, WAVs measured by sox; and every refusal in OpenAI's error shape."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import openai
import psutil
import pytest

import gguf
from gguf.speech import has_token
from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from launcher.tts import frame_samples
from studio.http.app import create_app
from studio.http.clients.speech_api import MAX_SENTENCE_CHARS, sentences
from studio.library.catalog import Catalog
from studio.library.default_model import ensure_default_model
from studio.residency.manager import ModelManager, supervisor_factory
from studio.speech.llama_tts import FRAMES_PER_CHAR, MIN_FRAMES
from tests.helpers import assert_no_children, serving, wait_for
from tests.support.tts_models import SAMPLE_RATE, SAMPLES_PER_FRAME, derive_qwen3tts_model, write_qwen3tts_projector
from tests.test_hub import _cli, hf_env, server  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

TTS, TEXT, BARE = "tiny-qwen3-tts", "SmolLM2-text", "tiny-qwen3-tts-bare"
AUDIO_TOOLS = ("espeak-ng", "sox", "soxi")
needs_audio_tools = pytest.mark.skipif(
    any(shutil.which(t) is None for t in AUDIO_TOOLS),
    reason="espeak-ng and sox are missing: `make setup` installs them (as root), or apt-get install espeak-ng sox",
)


@pytest.fixture(scope="module")
def studio(llama_server_bin, zoo_dir, settings, tmp_path_factory):
    """A studio whose library holds the tiny Qwen3-TTS with its projector, the same without one, and SmolLM2."""
    root = tmp_path_factory.mktemp("speech-studio")
    for name in ("tts", "bare", "text"):
        (root / name).mkdir()
    derive_qwen3tts_model(zoo_dir / "qwen3tts-dense.gguf", root / "tts" / f"{TTS}.gguf")
    write_qwen3tts_projector(root / "tts" / "mmproj-tiny-qwen3-tts-F32.gguf")
    (root / "bare" / f"{BARE}.gguf").symlink_to(root / "tts" / f"{TTS}.gguf")
    (root / "text" / f"{TEXT}.gguf").symlink_to(ensure_default_model(settings.models_dir))
    manager = ModelManager(
        catalog=Catalog([root / "tts", root / "bare", root / "text"]),
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=root / "cache"),
        files_root=root / "run",
    )
    with serving(create_app(manager)) as base:
        yield base, root
    assert_no_children()


@pytest.fixture
def client(studio):
    base, _ = studio
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def measure(wav: bytes, tmp_path: Path) -> tuple[int, int]:
    """``(sample rate, samples)`` as sox reads the file: it must parse as a WAV."""
    path = tmp_path / "answer.wav"
    path.write_bytes(wav)
    rate = int(subprocess.run(["soxi", "-r", str(path)], capture_output=True, text=True, check=True).stdout)
    samples = int(subprocess.run(["soxi", "-s", str(path)], capture_output=True, text=True, check=True).stdout)
    subprocess.run(["sox", str(path), "-n", "stat"], capture_output=True, check=True)  # every sample decodes
    return rate, samples


@needs_audio_tools
def test_speech_is_a_wav_whose_length_follows_the_frames_generated(client, tmp_path):
    text = "Hello there, this is the studio speaking."
    raw = client.audio.speech.with_raw_response.create(model=TTS, input=text, voice="alloy", response_format="wav")
    codes = int(raw.headers["x-audio-codes"])
    rate, samples = measure(raw.content, tmp_path)
    assert rate == SAMPLE_RATE
    assert 0 < codes <= max(MIN_FRAMES, FRAMES_PER_CHAR * len(text))
    assert samples == codes * SAMPLES_PER_FRAME  # 1920 samples a frame: 12.5 frames a second
    assert raw.headers["content-type"] == "audio/wav"


@needs_audio_tools
def test_a_speaker_reference_voice_is_passed_to_llama_tts(studio, client, tmp_path):
    _, root = studio
    voices = root / "voices"
    voices.mkdir(exist_ok=True)
    subprocess.run(["espeak-ng", "-w", str(voices / "narrator.wav"), "This is how I sound."], check=True)
    raw = client.audio.speech.with_raw_response.create(
        model=TTS, input="Sprich mit meiner Stimme, bitte.", voice="narrator", extra_body={"language": "de"}
    )
    _, samples = measure(raw.content, tmp_path)
    assert samples == int(raw.headers["x-audio-codes"]) * SAMPLES_PER_FRAME
    log = (root / "logs" / "llama-tts" / f"{TTS}.log").read_text()
    assert f"--tts-speaker-file {voices / 'narrator.wav'} --tts-lang de" in log
    assert "generated" in log.splitlines()[-1] or "wrote" in log


@needs_audio_tools
def test_long_input_is_spoken_sentence_by_sentence_into_one_wav(client, tmp_path):
    text = " ".join(f"Sentence number {i} is here." for i in range(3))  # each just long enough to stand alone
    raw = client.audio.speech.with_raw_response.create(model=TTS, input=text, voice="alloy")
    assert int(raw.headers["x-sentences"]) == 3
    _, samples = measure(raw.content, tmp_path)
    assert samples == int(raw.headers["x-audio-codes"]) * SAMPLES_PER_FRAME


def test_pcm_streams_each_sentence_as_it_is_spoken(studio):
    base, _ = studio
    text = "The first sentence is here. The second one follows it. And a third one ends it."
    chunks = []
    body = {"model": TTS, "input": text, "voice": "alloy", "response_format": "pcm"}
    with httpx.stream("POST", f"{base}/v1/audio/speech", json=body, timeout=300) as answer:
        assert answer.status_code == 200
        assert answer.headers["x-sample-rate"] == str(SAMPLE_RATE)
        chunks = [c for c in answer.iter_raw() if c]
    total = b"".join(chunks)
    assert len(chunks) >= 1 and len(total) % (2 * SAMPLES_PER_FRAME) == 0 and total


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": TTS, "input": "Hi there.", "response_format": "mp3"}, 400, "unsupported_response_format", None),
        ({"model": TTS, "input": "Hi there.", "speed": 1.5}, 400, "unsupported_speed", "speed"),
        ({"model": TTS, "input": "Hi there.", "voice": "nobody"}, 400, "unknown_voice", "voice"),
        ({"model": TTS, "input": "Hi there.", "voice": "../../etc/passwd"}, 400, "unknown_voice", "voice"),
        ({"model": TTS, "input": "Hi there.", "instructions": "cheerful"}, 400, "unsupported_instructions", None),
        ({"model": TTS, "input": "   "}, 400, "empty_input", "input"),
        ({"model": TTS, "input": "Hi there.", "language": "klingon"}, 400, "unsupported_language", "language"),
        ({"model": TTS, "input": "Hi there.", "language": "fr"}, 400, "unsupported_language", "language"),
        ({"model": TTS, "input": "x" * 4097}, 400, "input_too_long", "input"),
        ({"model": TEXT, "input": "Hi there."}, 400, "model_not_tts", "model"),
        ({"model": BARE, "input": "Hi there."}, 400, "missing_projector", "model"),
        ({"model": "no-such-model", "input": "Hi there."}, 404, "model_not_found", "model"),
        ({"model": TTS, "input": "Hi there.", "speed": 9}, 422, None, "speed"),
    ],
)
def test_a_speech_request_that_cannot_be_spoken_gets_a_clear_error(studio, body, status, code, param):
    base, _ = studio
    answer = httpx.post(f"{base}/v1/audio/speech", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def test_chat_with_a_tts_model_is_still_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TTS, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_is_tts"


def test_sentences_join_short_pieces_and_cut_long_ones():
    assert sentences("Hi. How are you today, my friend? I am fine, thanks for asking. Bye.") == [
        "Hi. How are you today, my friend?",
        "I am fine, thanks for asking. Bye.",
    ]
    long = "word, " * 200
    pieces = sentences(long)
    assert all(len(p) <= MAX_SENTENCE_CHARS for p in pieces) and " ".join(pieces).split() == long.split()
    assert sentences("第一句。第二句很长很长很长很长很长很长很长很长很长很长很长。") == [
        "第一句。第二句很长很长很长很长很长很长很长很长很长很长很长。"
    ]


def test_pull_of_a_tts_model_fetches_its_projector_and_inspect_says_it_speaks(server, hf_env, zoo_dir, tmp_path):
    repo = server.repo("acme/qwen3-tts-GGUF")
    repo.add("qwen3-tts-F32.gguf", derive_qwen3tts_model(zoo_dir / "qwen3tts-dense.gguf", tmp_path / "m.gguf"))
    repo.add("mmproj-qwen3-tts-F32.gguf", write_qwen3tts_projector(tmp_path / "p.gguf"))
    env = {**os.environ, "GGUF_STUDIO_HOME": str(tmp_path / "studio")}
    pulled = _cli("pull", "acme/qwen3-tts-GGUF", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert sorted(p.rsplit("/", 1)[-1] for p in server.downloads()) == [
        "mmproj-qwen3-tts-F32.gguf",
        "qwen3-tts-F32.gguf",
    ]
    [entry] = [e for e in json.loads(_cli("ls", "--json", env=env).stdout) if e["repo"] == "acme/qwen3-tts-GGUF"]
    assert entry["mmproj"].endswith("mmproj-qwen3-tts-F32.gguf")
    shown = _cli("inspect", "acme/qwen3-tts-GGUF:F32", env=env)
    assert shown.returncode == 0, shown.stderr
    assert "text-to-speech, not chat: a text-to-speech model (Qwen3-TTS)" in shown.stdout
    assert "speaks through POST /v1/audio/speech (llama-tts)" in shown.stdout


def llama_tts_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-tts"]


def test_a_client_that_leaves_stops_the_llama_tts_run(studio):
    """The WAV answer waits for every sentence: a client gone meanwhile must not leave llama-tts speaking."""
    base, root = studio
    host, port = base.removeprefix("http://").split(":")
    text = "This one long sentence goes on and on, " * 7 + "until it ends."
    body = json.dumps({"model": TTS, "input": text, "voice": "alloy"}).encode()
    head = f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(llama_tts_children, timeout=60, interval=0.02, what="llama-tts to start")
    wait_for(lambda: not llama_tts_children(), timeout=10, what="llama-tts to be stopped")
    assert ChildRegistry(root / "run", "anyone").records() == []  # its registry record went with it


def test_a_llama_server_without_llama_tts_beside_it_says_how_to_get_one(studio, llama_server_bin, tmp_path):
    """A prebuilt llama-server (LLAMA_SERVER_PATH) comes without llama-tts: the answer says what to build."""
    _, root = studio
    alone = tmp_path / "bin"
    alone.mkdir()
    (alone / "llama-server").symlink_to(llama_server_bin)
    manager = ModelManager(
        catalog=Catalog([root / "tts"]),
        binary=alone / "llama-server",
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
    )
    with serving(create_app(manager)) as base:
        answer = httpx.post(f"{base}/v1/audio/speech", json={"model": TTS, "input": "Hello there."}, timeout=60)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["code"] == "speech_failed" and "ggstudio build-llama" in error["message"], error


def test_the_frame_length_is_read_from_the_projectors_dac_strides(tmp_path):
    """llama-tts sometimes exits before its log thread writes the summary line: the frames come from the WAV."""
    projector = gguf.read(write_qwen3tts_projector(tmp_path / "p.gguf"))
    assert frame_samples({t.name: t.shape for t in projector.tensors}) == SAMPLES_PER_FRAME == 1920
    assert frame_samples({}) is None


def test_has_token_matches_whole_tokens_only(zoo_dir, tmp_path):
    model = gguf.read(derive_qwen3tts_model(zoo_dir / "qwen3tts-dense.gguf", tmp_path / "m.gguf"))
    assert all(has_token(model, t) for t in ("<|codec_0|>", "<|codec_language_german|>", "tok_5"))
    assert not has_token(model, "<|codec_0") and not has_token(model, "tok_") and not has_token(model, "codec_0|>")
