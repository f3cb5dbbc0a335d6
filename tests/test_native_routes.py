"""llama-server's own routes and the router's model API through the studio, against the real llama-server.

Two real models (SmolLM2 and Gemma 3 270M, whose vocabularies differ) in one studio: a ``GET`` routed by
``?model=`` loads its model on demand; ``/tokenize`` answers with each model's own tokens; slot files
stay in the studio home; ``/models`` shows a model's status move loading → loaded → unloaded as a router
client (``POST /models/load``, ``POST /models/unload``, ``GET /models/sse``) sees it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from studio.library.default_model import ensure_default_model
from studio.residency.slot_cache import SlotCache
from studio.settings import ModelDefaults
from tests.helpers import copy_of, wait_for
from tests.support.projectors import write_audio_projector
from tests.support.studio import RunningStudio, running_studio

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

SMOL, GEMMA, EAR = "smol", "gemma", "smol-ear"


@pytest.fixture(scope="module")
def studio(llama_server_bin, settings, gemma_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("native-routes")
    small = ModelDefaults(n_ctx=1024, n_parallel=1, spec="off")
    projector = root / "mmproj-ear-F32.gguf"
    write_audio_projector(projector)
    smol = ensure_default_model(settings.models_dir)
    with running_studio(
        root,
        llama_server_bin,
        {SMOL: smol, GEMMA: gemma_model, EAR: copy_of(smol, root / "copies", EAR)},
        defaults={SMOL: small, GEMMA: small, EAR: small.replace(mmproj=str(projector))},
        files_root=root / "run",
        slot_cache=SlotCache(root / "slots", binary=llama_server_bin, disk_budget=1 << 30),
    ) as running:
        yield running


@pytest.fixture
def http(studio: RunningStudio):
    with httpx.Client(base_url=studio.url, timeout=300) as client:
        yield client


def _status(http: httpx.Client, model: str) -> dict:
    listed = http.get("/models").json()["data"]
    return next(m for m in listed if m["id"] == model)["status"]


def test_a_get_routed_by_model_query_loads_the_model_on_demand(studio, http):
    assert studio.manager.find(SMOL) is None
    props = http.get("/props", params={"model": SMOL})
    assert props.status_code == 200, props.text
    assert Path(props.json()["model_path"]).name == f"{SMOL}.gguf"
    assert _status(http, SMOL)["value"] == "loaded"
    slots = http.get("/slots", params={"model": SMOL})
    assert slots.status_code == 200 and len(slots.json()) == 1


def test_tokenize_on_two_models_gives_each_models_own_tokens(http):
    tokens = {}
    for model in (SMOL, GEMMA):
        answer = http.post("/tokenize", json={"model": model, "content": "Hello, studio world"})
        assert answer.status_code == 200, answer.text
        tokens[model] = answer.json()["tokens"]
        text = http.post("/detokenize", json={"model": model, "tokens": tokens[model]}).json()["content"]
        assert text.strip() == "Hello, studio world"
    assert tokens[SMOL] != tokens[GEMMA]


def test_native_completion_and_bare_chat_completions_are_served(http):
    # ignore_eos: a sampled end of text after 3 tokens answered 3 (seen once in a full run)
    native = {"model": SMOL, "prompt": "The capital of France is", "n_predict": 4, "ignore_eos": True}
    done = http.post("/completion", json=native)
    assert done.status_code == 200, done.text
    assert done.json()["tokens_predicted"] == 4
    chat = http.post(
        "/chat/completions", json={"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"


def test_slot_save_and_restore_stay_in_the_studio_home(studio, http, tmp_path):
    """A client's slot files go to the launch's own slot folder, the one the studio saves slots in before a stop."""
    prompt = {"model": SMOL, "prompt": "Once upon a time", "n_predict": 2, "id_slot": 0, "cache_prompt": True}
    assert http.post("/completion", json=prompt).status_code == 200
    saved = http.post("/slots/0", params={"action": "save"}, json={"model": SMOL, "filename": "story.bin"})
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_saved"] > 0
    resident = studio.manager.find(SMOL)
    assert resident is not None and resident.loaded is not None
    folder = studio.manager.slot_cache.folder(resident.loaded.plan)
    assert (folder / "story.bin").is_file()
    restored = http.post("/slots/0", params={"action": "restore"}, json={"model": SMOL, "filename": "story.bin"})
    assert restored.status_code == 200, restored.text
    assert restored.json()["n_restored"] == saved.json()["n_saved"]
    outside = tmp_path / "escaped.bin"
    for name in ("../../escaped.bin", str(outside), "sub/story.bin"):
        refused = http.post("/slots/0", params={"action": "save"}, json={"model": SMOL, "filename": name})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "filename"
        assert "plain name" in refused.json()["error"]["message"]
    assert not outside.exists()
    assert not (folder.parent.parent / "escaped.bin").exists()


def test_metrics_with_a_model_are_its_own_llama_server_metrics(http):
    own = http.get("/metrics", params={"model": SMOL})
    assert own.status_code == 200
    assert "llamacpp:prompt_tokens_total" in own.text and "ggstudio_" not in own.text
    assert "ggstudio_" in http.get("/metrics").text


def test_models_status_moves_loading_loaded_unloaded_for_a_router_client(studio, http):
    if studio.manager.find(GEMMA) is not None:
        assert http.post("/models/unload", json={"model": GEMMA}).json() == {"success": True}
    events: list[dict] = []
    listening = threading.Event()

    def listen() -> None:
        with httpx.Client(base_url=studio.url, timeout=120) as client, client.stream("GET", "/models/sse") as stream:
            listening.set()
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
                    if events[-1]["model"] == GEMMA and events[-1]["data"]["status"] == "unloaded":
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    listening.wait(30)
    assert _status(http, GEMMA) == {"value": "unloaded", "args": []}
    assert http.post("/models/load", json={"model": GEMMA}).json() == {"success": True}
    assert _status(http, GEMMA)["value"] == "loading"
    wait_for(lambda: _status(http, GEMMA)["value"] == "loaded", timeout=120, what="gemma to load")
    assert "--ctx-size" in _status(http, GEMMA)["args"]
    again = http.post("/models/load", json={"model": GEMMA})
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    assert http.post("/models/unload", json={"model": GEMMA}).json() == {"success": True}
    assert _status(http, GEMMA)["value"] == "unloaded"
    listener.join(30)
    mine = [e["data"]["status"] for e in events if e["model"] == GEMMA]
    assert mine == ["loading", "loaded", "unloaded"]
    assert events[-1] == {"model": GEMMA, "event": "status_change", "data": {"status": "unloaded", "exit_code": 0}}
    gone = http.post("/models/unload", json={"model": GEMMA})
    assert gone.status_code == 404


def test_routes_that_reach_files_or_programs_are_refused_with_the_reason(http):
    for method, path in (("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy")):
        refused = http.request(method, path, json={} if method == "POST" else None)
        assert refused.status_code == 403
        assert "run commands" in refused.json()["error"]["message"] or "fetches any URL" in refused.text


def test_an_audio_transcription_form_goes_to_the_model_its_model_field_names(studio, http, llama_src):
    clip = (llama_src / "tools" / "mtmd" / "test-2.mp3").read_bytes()
    answer = http.post(
        "/v1/audio/transcriptions",
        data={"model": EAR, "max_tokens": "4"},
        files={"file": ("clip.mp3", clip, "audio/mpeg")},
    )
    assert answer.status_code == 200, answer.text
    assert isinstance(answer.json()["text"], str)
    assert studio.manager.find(EAR) is not None
    text_only = http.post(
        "/v1/audio/transcriptions", data={"model": SMOL}, files={"file": ("clip.mp3", clip, "audio/mpeg")}
    )
    assert text_only.status_code != 200 and "audio" in text_only.json()["error"]["message"]
