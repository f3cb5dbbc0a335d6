"""The Ollama API on its own listener, end to end: the official ``ollama`` client against a real llama-server.

The studio runs as ``ggstudio serve --ollama-port`` runs it: both listeners in one event loop
(``studio.http.server.Listeners``), sharing one manager. Pulls go to the local Hugging Face
stand-in (``tests/hub_server.py``) through the real huggingface_hub.
"""

from __future__ import annotations

import json
import math
import threading
from datetime import UTC, datetime, timedelta

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.http.clients.ollama_app import create_ollama_app
from studio.http.server import Listeners
from studio.library.catalog import Catalog
from studio.library.default_model import ensure_default_model
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from tests.helpers import assert_no_children, free_port, wait_for
from tests.hub_server import HubServer

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

SMOL = "SmolLM2-135M-Instruct.Q4_1"
HI = [{"role": "user", "content": "Say hi."}]
TINY_REPO = "studio-tests/tiny-llama-GGUF"


@pytest.fixture(scope="module")
def studio(llama_server_bin, settings, zoo_dir, tmp_path_factory):
    """The studio with its Ollama listener; SmolLM2 embeds too (``--embeddings --pooling mean``)."""
    root = tmp_path_factory.mktemp("ollama")
    models = root / "models"
    models.mkdir()
    smol = ensure_default_model(settings.models_dir)
    (models / smol.name).symlink_to(smol)
    hub = HubServer().start()
    hub.repo(TINY_REPO).add("tiny-llama-Q4_K_M.gguf", zoo_dir / "llama-dense.gguf")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_HUB_CACHE", str(root / "hf" / "hub"))
        env.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.delenv(name, raising=False)
        defaults = {
            SMOL: ModelDefaults(n_ctx=1024, extra_args=("--embeddings", "--pooling", "mean")),
            f"{TINY_REPO}:Q4_K_M": ModelDefaults(n_ctx=256, spec="off"),
        }
        manager = ModelManager(
            catalog=Catalog([models], hf_cache=root / "hf" / "hub"),
            binary=llama_server_bin,
            make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
            caps=probe(llama_server_bin, cache_dir=root / "cache"),
            model_defaults=defaults,
        )
        app = create_app(manager)
        port, ollama_port = free_port(), free_port()
        listeners = Listeners(
            app, host="127.0.0.1", port=port, ollama_app=create_ollama_app(app), ollama_port=ollama_port
        )
        thread = threading.Thread(target=listeners.run, daemon=True)
        thread.start()
        wait_for(lambda: listeners.started, timeout=30, what="both listeners")
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ollama_port}", manager, hub
        listeners.stop()
        thread.join(30)
    hub.stop()
    assert_no_children()


@pytest.fixture
def client(studio):
    _, base, _, _ = studio
    with ollama.Client(host=base, timeout=180) as c:
        yield c


def test_the_server_answers_where_ollama_clients_probe(studio):
    _, base, _, _ = studio
    assert httpx.get(base, timeout=10).text == "Ollama is running"
    assert httpx.get(f"{base}/api/version", timeout=10).json()["version"].count(".") == 2


def test_the_studios_own_api_stays_on_its_own_port(studio):
    studio_base, base, _, _ = studio
    assert "models" in httpx.get(f"{studio_base}/api/status", timeout=10).json()
    refused = httpx.get(f"{base}/api/status", timeout=10)
    assert refused.status_code == 404 and refused.json() == {"error": "no such route: GET /api/status"}


def test_list(client, studio):
    models = {m.model: m for m in client.list().models}
    smol = models[SMOL]
    assert smol.details.family == "llama" and smol.details.quantization_level == "Q4_1"
    assert smol.details.parameter_size == "134.52M" and smol.details.format == "gguf"
    assert smol.size == ensure_default_model_size(studio) and smol.digest and smol.modified_at


def ensure_default_model_size(studio) -> int:
    _, _, manager, _ = studio
    return manager.catalog.resolve(SMOL).path.stat().st_size


def test_chat(client):
    reply = client.chat(model=SMOL, messages=HI, options={"num_predict": 5, "temperature": 0})
    assert reply.done and reply.done_reason in ("stop", "length") and reply.model == SMOL
    assert reply.message.role == "assistant" and reply.message.content
    assert 0 < reply.eval_count <= 5 and reply.prompt_eval_count > 0
    assert reply.total_duration >= reply.eval_duration > 0 and reply.load_duration >= 0


def test_chat_streamed(client):
    # greedy: a sampled answer may end (EOS) within 6 tokens, "stop" not "length" (seen in make test)
    options = {"num_predict": 6, "temperature": 0}
    parts = list(client.chat(model=SMOL, messages=HI, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    text = "".join(p.message.content for p in parts)
    assert text and parts[-1].message.content == ""
    assert parts[-1].eval_count == 6 and parts[-1].total_duration > 0


def test_num_predict_reaches_llama_server(client):
    """Without it the studio lets an answer run to the context's end (1024 tokens here)."""
    for n in (1, 3):
        reply = client.generate(model=SMOL, prompt="1, 2, 3, 4, 5,", raw=True, options={"num_predict": n})
        assert (reply.eval_count, reply.done_reason) == (n, "length")


def test_generate(client):
    reply = client.generate(model=SMOL, prompt="Say hi.", system="You are terse.", options={"num_predict": 5})
    assert reply.done and reply.response and reply.eval_count <= 5
    raw = client.generate(model=SMOL, prompt="One, two, three,", raw=True, options={"num_predict": 3})
    assert raw.response and raw.eval_count == 3


def test_format_as_a_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    reply = client.chat(
        model=SMOL,
        messages=[{"role": "user", "content": "What is 2+2? Reply in JSON."}],
        format=schema,
        options={"num_predict": 40, "temperature": 0},
    )
    assert isinstance(json.loads(reply.message.content)["answer"], int)


def test_embed(client):
    reply = client.embed(model=SMOL, input=["The sky is blue.", "Grass is green."])
    assert len(reply.embeddings) == 2 and len(reply.embeddings[0]) == 576  # SmolLM2-135M's width
    assert math.isclose(math.fsum(x * x for x in reply.embeddings[0]), 1.0, rel_tol=1e-3)  # normalised
    assert reply.embeddings[0] != reply.embeddings[1] and reply.prompt_eval_count > 0
    older = client.embeddings(model=SMOL, prompt="The sky is blue.")
    assert older.embedding == pytest.approx(reply.embeddings[0], abs=1e-4)


def test_an_input_longer_than_the_model_embeds_at_once_is_a_400_that_says_so(client, studio):
    """llama-server answers it with a 500 telling the client to raise its physical batch size."""
    studio_base, _, _, _ = studio
    long = "hello " * 1000
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=SMOL, input=long)
    assert refused.value.status_code == 400 and "at most 512 tokens" in refused.value.error
    with openai.OpenAI(base_url=f"{studio_base}/v1", api_key="unused", max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError) as also:
            oai.embeddings.create(model=SMOL, input=long)
    assert also.value.body["code"] == "input_too_long" and "batch size" not in also.value.body["message"]


def test_ps_and_show_report_the_resident_model(client, studio):
    studio_base, _, _, _ = studio
    client.generate(model=SMOL, prompt="Hi", options={"num_predict": 1})
    [running] = client.ps().models
    [status] = httpx.get(f"{studio_base}/api/status", timeout=10).json()["models"]
    assert running.model == SMOL and running.context_length == status["effective_context"] == 1024
    assert running.size == status["memory"]["actual"]["startup_total"] and running.size_vram == 0  # CPU only
    assert running.expires_at > datetime.now(UTC) + timedelta(days=365)  # no TTL: stays
    shown = client.show(SMOL)
    assert shown.details.family == "llama" and "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 8192 and shown.modelinfo["tokenizer.ggml.tokens"] == []
    assert shown.template.startswith("{% for message in messages %}")
    assert shown.parameters == "num_ctx 1024"


def test_an_unknown_model_is_ollamas_404(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=HI)
    assert info.value.status_code == 404 and "no-such-model" in info.value.error


def test_images_reach_llama_server_as_image_parts(client, llama_src):
    """SmolLM2 has no projector: llama-server's own refusal shows the image arrived as an image."""
    image = llama_src / "tools" / "mtmd" / "test-1.jpeg"
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=SMOL, messages=[{"role": "user", "content": "What is this?", "images": [image]}])
    assert "image" in info.value.error.lower() and info.value.status_code in (400, 500, 501)


def test_the_openai_routes_answer_on_the_ollama_port_too(studio):
    _, base, _, _ = studio
    with openai.OpenAI(base_url=f"{base}/v1", api_key="ollama", max_retries=0, timeout=120) as oai:
        reply = oai.chat.completions.create(model=SMOL, messages=HI, max_tokens=3)
    assert reply.choices[0].message.content and reply.model == SMOL


def test_leaving_a_stream_frees_the_slot(studio):
    _, base, manager, _ = studio
    body = {
        "model": SMOL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "options": {"num_predict": 2000},
    }
    with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i == 5:
                break
    loaded = manager.find(SMOL).loaded

    def busy() -> bool:
        slots = httpx.get(f"{loaded.url}/slots", headers=loaded.auth_headers, timeout=10).json()
        return any(s["is_processing"] for s in slots)

    wait_for(lambda: not busy(), timeout=5, what="llama-server to stop after the client left")
    assert manager.find(SMOL).in_flight == 0


def test_leaving_before_a_whole_answer_frees_the_slot(studio):
    """A non-streamed answer comes only once it is done: a client that gives up must stop the generation."""
    _, base, manager, _ = studio
    body = {
        "model": SMOL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "stream": False,
        # greedy: its story fills the slot's context (968 tokens, ~3.6 s here); sampled, it may end in 2.4 s
        "options": {"num_predict": 2000, "temperature": 0},
    }
    httpx.post(f"{base}/api/chat", json={**body, "options": {"num_predict": 1}}, timeout=120)  # resident first
    loaded = manager.find(SMOL).loaded

    def busy() -> bool:
        slots = httpx.get(f"{loaded.url}/slots", headers=loaded.auth_headers, timeout=10).json()
        return any(s["is_processing"] for s in slots)

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/api/chat", json=body, timeout=httpx.Timeout(10, read=1))
    # llama-server looks for the closed connection when a 1 s wait for its results times out; every result
    # it queues meanwhile, a /slots answer too, restarts that wait (server_response::recv_with_timeout), so
    # polling /slots faster than once a second would keep it from ever looking.
    wait_for(lambda: not busy(), timeout=15, interval=1.5, what="llama-server to stop after the client gave up")
    wait_for(lambda: manager.find(SMOL).in_flight == 0, timeout=5, what="the request to end")


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def test_metrics_count_the_ollama_listener(client, studio):
    studio_base, _, _, _ = studio
    client.generate(model=SMOL, prompt="Hi", options={"num_predict": 1})
    before = scrape(studio_base)
    plain = client.chat(model=SMOL, messages=HI, options={"num_predict": 3})
    streamed = list(client.chat(model=SMOL, messages=HI, options={"num_predict": 4}, stream=True))
    after = scrape(studio_base)

    def moved(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("ggstudio_http_requests_total", listener="ollama", route="/api/chat", status="200") == 2
    assert (
        moved("ggstudio_generated_tokens_total", listener="ollama", model=SMOL, route="/api/chat")
        == plain.eval_count + streamed[-1].eval_count
    )
    assert moved("ggstudio_time_to_first_token_seconds_count", listener="ollama", model=SMOL, route="/api/chat") == 1
    assert moved("ggstudio_generation_tokens_per_second_count", model=SMOL) == 2  # llama-server's timings


def test_the_guis_chats_count_in_metrics_apart_from_ollamas_on_the_same_path(client, studio):
    """The GUI's ``/api/chat`` generated tokens that ``/metrics`` never counted, and shares its path with Ollama's:
    each counts under its own listener, as do the OpenAI routes on the Ollama port."""
    studio_base, ollama_base, _, _ = studio
    client.generate(model=SMOL, prompt="Hi", options={"num_predict": 1})
    before = scrape(studio_base)
    with httpx.stream(
        "POST", f"{studio_base}/api/chat", json={"model": SMOL, "messages": HI, "max_tokens": 5}, timeout=120
    ) as resp:
        events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
    asked = client.chat(model=SMOL, messages=HI, options={"num_predict": 3}, stream=True)
    ollama_tokens = [part for part in asked][-1].eval_count
    openai_here = httpx.post(
        f"{ollama_base}/v1/chat/completions", json={"model": SMOL, "messages": HI, "max_tokens": 2}, timeout=120
    ).json()
    after = scrape(studio_base)

    def moved(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    done = events[-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] > 0
    tokens = "ggstudio_generated_tokens_total"
    first = "ggstudio_time_to_first_token_seconds_count"
    assert moved(tokens, listener="studio", model=SMOL, route="/api/chat") == done["usage"]["completion_tokens"]
    assert moved(first, listener="studio", model=SMOL, route="/api/chat") == 1
    assert moved(tokens, listener="ollama", model=SMOL, route="/api/chat") == ollama_tokens
    assert moved(first, listener="ollama", model=SMOL, route="/api/chat") == 1
    assert (
        moved(tokens, listener="ollama", model=SMOL, route="/v1/chat/completions")
        == openai_here["usage"]["completion_tokens"]
    )
    assert moved(tokens, listener="studio", model=SMOL, route="/v1/chat/completions") == 0
    assert moved("ggstudio_generation_tokens_per_second_count", model=SMOL) == 3


def test_pull_from_hugging_face_with_ndjson_progress(client, studio):
    _, _, _, hub = studio
    parts = list(client.pull(f"hf.co/{TINY_REPO}:Q4_K_M", stream=True))
    assert parts[0].status == "pulling manifest" and parts[-1].status == "success"
    progress = [p for p in parts if p.total]
    assert progress and progress[-1].completed == progress[-1].total > 0
    assert f"{TINY_REPO}:Q4_K_M" in {m.model for m in client.list().models}
    assert client.pull(f"{TINY_REPO}:Q4_K_M").status == "success"  # cached: nothing downloads twice
    assert len(hub.downloads()) == 1
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("llama3.2")
    assert info.value.status_code == 400 and "owner/repo" in info.value.error


def test_keep_alive_zero_without_a_prompt_unloads_the_model_at_once(client, studio):
    _, _, manager, _ = studio
    client.generate(model=SMOL, prompt="Hi", options={"num_predict": 1})
    assert [m.model for m in client.ps().models] == [SMOL]
    unloaded = client.generate(model=SMOL, keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload"
    assert client.ps().models == [] and manager.find(SMOL) is None
    assert client.generate(model=SMOL, keep_alive=0).done_reason == "unload"  # not resident: nothing to do
    loaded = client.chat(model=SMOL, messages=[])  # no messages: load only
    assert loaded.done_reason == "load" and [m.model for m in client.ps().models] == [SMOL]


def test_keep_alive_zero_on_a_request_unloads_the_model_once_it_is_answered(client, studio):
    _, _, manager, _ = studio
    reply = client.chat(model=SMOL, messages=HI, options={"num_predict": 2}, keep_alive=0)
    assert reply.done and reply.message.content
    wait_for(lambda: manager.find(SMOL) is None, timeout=20, what="the model to unload after its answer")
    assert client.ps().models == []


def test_keep_alive_on_a_request_is_the_models_ttl(client, studio):
    studio_base, _, manager, _ = studio
    before = scrape(studio_base)
    reply = client.chat(model=SMOL, messages=HI, options={"num_predict": 2}, keep_alive="1s")
    assert reply.done
    [running] = client.ps().models
    assert running.expires_at < datetime.now(UTC) + timedelta(seconds=5)
    wait_for(lambda: manager.find(SMOL) is None, timeout=20, what="the TTL to unload the model")
    after = scrape(studio_base)
    key = ("ggstudio_model_evictions_total", frozenset({"model": SMOL, "reason": "ttl"}.items()))
    assert after.get(key, 0) - before.get(key, 0) == 1
    reply = client.chat(model=SMOL, messages=HI, options={"num_predict": 2}, keep_alive=-1)  # back, and stays
    assert reply.done and manager.find(SMOL).ttl == 0
    assert client.ps().models[0].expires_at > datetime.now(UTC) + timedelta(days=365)
