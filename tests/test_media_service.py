"""Images and audio through the studio end to end: real uvicorn, real llama-server with the tiny projectors,
real ``openai`` client; and every refusal (wrong width, no projector, remote URL, oversized body) before a start."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from launcher.units import MIB
from studio.http.app import create_app
from studio.library.catalog import Catalog
from studio.library.default_model import ensure_default_model
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from tests.helpers import assert_no_children, free_port, wait_for
from tests.support.projectors import write_audio_projector, write_vision_projector

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

EYE, EAR, TEXT = "SmolLM2-eye", "SmolLM2-ear", "SmolLM2-text"
MAX_BODY = 512 * 1024


@pytest.fixture(scope="module")
def media(llama_src) -> dict[str, str]:
    """The pinned tree's test image and clip, base64."""
    folder = llama_src / "tools" / "mtmd"
    return {name: base64.b64encode((folder / name).read_bytes()).decode() for name in ("test-1.jpeg", "test-2.mp3")}


@pytest.fixture(scope="module")
def studio(llama_server_bin, settings, tmp_path_factory):
    """A studio whose library holds SmolLM2 three times: with the vision projector, the audio one, and none."""
    root = tmp_path_factory.mktemp("media-studio")
    smollm2 = ensure_default_model(settings.models_dir)
    for name in ("eye", "ear", "text"):
        (root / name).mkdir()
        (root / name / f"SmolLM2-{name}.gguf").symlink_to(smollm2)
    write_vision_projector(root / "eye" / "mmproj-eye-F32.gguf")
    write_audio_projector(root / "ear" / "mmproj-ear-F32.gguf")
    write_vision_projector(root / "text" / "wide-mmproj.gguf", projection_dim=640)  # Gemma 270M's width
    supervisors = supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token()))
    small = ModelDefaults(n_ctx=2048, n_parallel=1, spec="off")
    manager = ModelManager(
        catalog=Catalog([root / "eye", root / "ear", root / "text"]),
        binary=llama_server_bin,
        make_supervisor=supervisors,
        caps=probe(llama_server_bin, cache_dir=root / "cache"),
        model_defaults={EYE: small, EAR: small, TEXT: small},
    )
    port = free_port()
    app = create_app(manager, max_body_bytes=MAX_BODY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn to start")
    yield f"http://127.0.0.1:{port}", manager, root
    server.should_exit = True
    thread.join(30)
    assert_no_children()


@pytest.fixture
def client(studio):
    base, _, _ = studio
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def server_log(manager: ModelManager, model: str) -> str:
    resident = next(r for r in manager.residents if r.name == model)
    return Path(resident.supervisor.status().log_path).read_text(errors="replace")


def model_status(base: str, model: str) -> dict:
    return next(m for m in httpx.get(f"{base}/api/status", timeout=10).json()["models"] if m["model"] == model)


def check_bill(status: dict) -> None:
    """The predicted projector matches what clip.cpp logged: weights to the log's 0.01 MiB, compute within 25 %."""
    predicted, actual = status["memory"]["predicted"], status["memory"]["actual"]
    p, a = predicted["projector"], actual["projector"]
    assert p["device"] == a["device"] == "CPU"
    assert abs(p["weights"] - a["weights"]) <= 0.01 * MIB
    assert 0.75 <= p["compute"] / a["compute"] <= 1.25
    assert actual["devices"]["CPU"]["projector"] == a["total"] > 0
    assert abs(predicted["logged_total"] - actual["total"]) <= 0.02 * actual["total"]
    assert any("projector" in r for r in status["reasons"])


@pytest.mark.parametrize(
    ("model", "question", "part", "min_prompt_tokens", "kind", "capability", "other"),
    [
        pytest.param(
            EYE,
            "What is in the picture?",
            lambda media: {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{media['test-1.jpeg']}"}},
            16,  # 16 image tokens
            "image",
            "vision",
            "audio",
            id="image-vision-projector",
        ),
        pytest.param(
            EAR,
            "What is said?",
            lambda media: {"type": "input_audio", "input_audio": {"data": media["test-2.mp3"], "format": "mp3"}},
            75,  # 75 tokens a window
            "audio",
            "audio",
            "vision",
            id="clip-audio-projector",
        ),
    ],
)
def test_media_through_the_openai_client_is_encoded_by_its_projector(
    studio, client, media, model, question, part, min_prompt_tokens, kind, capability, other
):
    base, manager, root = studio
    reply = client.chat.completions.create(
        model=model,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": question}, part(media)]}],
    )
    assert reply.choices[0].message.content is not None and reply.usage.prompt_tokens > min_prompt_tokens
    log = server_log(manager, model)
    assert f"decoding {kind} batch" in log and f"{kind} decoded" in log
    status = model_status(base, model)
    assert status["capabilities"][capability] is True and status["capabilities"][other] is False
    folder = model.removeprefix("SmolLM2-")
    assert status["mmproj"] == str(root / folder / f"mmproj-{folder}-F32.gguf")
    check_bill(status)


def test_the_gui_chat_takes_an_image_too(studio, media):
    base, _, _ = studio
    with httpx.stream(
        "POST",
        f"{base}/api/chat",
        timeout=300,
        json={
            "model": EYE,
            "max_tokens": 3,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Describe it."},
                        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{media['test-1.jpeg']}"}},
                    ],
                }
            ],
        },
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1]["type"] == "done" and events[-1]["usage"]["prompt_tokens"] > 16


def residents(manager: ModelManager) -> list[tuple[str, int | None, str]]:
    return sorted((r.name, r.supervisor.status().pid, r.state.value) for r in manager.residents)


def refused_before_start(manager: ModelManager, call) -> httpx.Response:
    """Run ``call``; nothing may have been started or stopped by it."""
    before = residents(manager)
    resp = call()
    assert residents(manager) == before
    return resp


def test_a_projector_of_another_width_is_a_400_before_anything_starts(studio):
    base, manager, root = studio
    resp = refused_before_start(
        manager,
        lambda: httpx.post(
            f"{base}/api/load", timeout=60, json={"model": TEXT, "mmproj": str(root / "text" / "wide-mmproj.gguf")}
        ),
    )
    assert resp.status_code == 400
    assert "projects to 640 but the llama model's embedding length is 576" in resp.json()["error"]["message"]


def test_a_projector_outside_the_model_folders_is_a_403(studio, tmp_path):
    base, manager, _ = studio
    outside = write_vision_projector(tmp_path / "mmproj-elsewhere.gguf")
    resp = refused_before_start(
        manager, lambda: httpx.post(f"{base}/api/load", timeout=60, json={"model": TEXT, "mmproj": str(outside)})
    )
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "mmproj"
    assert "the projector file" in resp.json()["error"]["message"]


def test_media_for_a_model_without_its_projector_is_a_400_before_it_loads(studio, media):
    base, manager, _ = studio
    image = {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{media['test-1.jpeg']}"}}
    sound = {"type": "input_audio", "input_audio": {"data": media["test-2.mp3"], "format": "mp3"}}
    for model, part, code in (
        (TEXT, image, "model_has_no_vision"),
        (EAR, image, "model_has_no_vision"),
        (EYE, sound, "model_has_no_audio"),
    ):
        if manager.find(model) is not None:
            continue  # the check of a resident model is the same function, after acquiring it
        resp = refused_before_start(
            manager,
            lambda: httpx.post(
                f"{base}/v1/chat/completions",
                timeout=60,
                json={"model": model, "messages": [{"role": "user", "content": [part]}]},
            ),
        )
        assert resp.status_code == 400 and resp.json()["error"]["code"] == code, resp.text
        assert model in resp.json()["error"]["message"]


def test_a_remote_image_url_is_a_400_asking_for_the_bytes(studio, client):
    _, manager, _ = studio
    with pytest.raises(openai.BadRequestError) as info:
        refused_before_start(
            manager,
            lambda: client.chat.completions.create(
                model=EYE,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                    }
                ],
            ),
        )
    assert info.value.body["code"] == "remote_image_url" and "data:image/png;base64" in info.value.body["message"]


def test_an_oversized_body_is_a_413_before_anything_starts(studio, client, media):
    _, manager, _ = studio
    huge = "A" * (MAX_BODY + 1)
    with pytest.raises(openai.APIStatusError) as info:
        refused_before_start(
            manager,
            lambda: client.chat.completions.create(
                model=TEXT,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{huge}"}}],
                    }
                ],
            ),
        )
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
