"""The studio service end to end: real uvicorn, real llama-server, real `openai` client."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
import uvicorn
from fastapi.testclient import TestClient

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from studio.views.residency import status_json
from tests.helpers import assert_no_children, chatting_as_before, free_port, leave_mid_answer, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

GEMMA = "gemma-3-270m-Q4_K_M"
TINY = "llama-dense"


@pytest.fixture(scope="module")
def studio(llama_server_bin, gemma_model, zoo_dir, tmp_path_factory):
    """A running studio service whose catalog holds Gemma and a tiny zoo model."""
    root = tmp_path_factory.mktemp("studio")
    models = root / "models"
    models.mkdir()
    (models / gemma_model.name).symlink_to(gemma_model)
    (models / "llama-dense.gguf").symlink_to(zoo_dir / "llama-dense.gguf")
    (models / "broken.gguf").write_text("not a model")
    supervisors = supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token()))
    manager = ModelManager(
        catalog=Catalog([models], aliases={"tiny-alias": TINY}),
        binary=llama_server_bin,
        make_supervisor=supervisors,
        caps=probe(llama_server_bin, cache_dir=root / "cache"),
        model_defaults={TINY: ModelDefaults(n_ctx=512, spec="off"), **chatting_as_before(GEMMA)},
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(manager), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn to start")
    yield f"http://127.0.0.1:{port}", manager
    server.should_exit = True
    thread.join(30)
    assert_no_children()


@pytest.fixture
def client(studio):
    base, _ = studio
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def upstream_slots(manager: ModelManager) -> list[dict]:
    loaded = manager.loaded
    return httpx.get(f"{loaded.url}/slots", headers=loaded.auth_headers, timeout=10).json()


def test_models_list_names_every_model(client):
    ids = {m.id for m in client.models.list().data}
    assert {GEMMA, TINY, "broken"} <= ids


def test_chat_non_stream_and_stream(client):
    reply = client.chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    assert reply.model == GEMMA
    chunks = list(
        client.chat.completions.create(
            model=GEMMA, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("length", "stop") or chunks[-1].choices == []


def test_a_stream_asking_for_usage_ends_with_it(client):
    """llama-server itself ends the stream with usage when asked (server-task.cpp); the relay adds nothing."""
    chunks = list(
        client.chat.completions.create(
            model=GEMMA,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens > 0
    assert last.usage.completion_tokens == last.model_extra["timings"]["predicted_n"]
    assert all(c.usage is None for c in chunks[:-1])
    unasked = list(
        client.chat.completions.create(
            model=GEMMA, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, stream=True
        )
    )
    assert all(c.usage is None for c in unasked)  # OpenAI's contract: usage only for include_usage
    assert unasked[-1].model_extra["timings"]["predicted_n"] > 0


def test_context_overflow_is_a_400_with_the_sizes(studio, client):
    base, _ = studio
    resp = httpx.post(f"{base}/api/load", json={"model": GEMMA, "n_ctx": 512, "n_parallel": 1}, timeout=120)
    assert resp.status_code == 200 and resp.json()["effective_context"] == 512
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=GEMMA, messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4
        )
    error = info.value.body
    assert info.value.status_code == 400
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 512 and error["n_prompt_tokens"] > 512


def test_closing_a_stream_frees_the_slot(studio, client):
    _, manager = studio

    def busy() -> bool:
        return any(s["is_processing"] for s in upstream_slots(manager))

    leave_mid_answer(
        lambda: client.chat.completions.create(
            model=GEMMA,
            messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=2000,
            stream=True,
            temperature=0,
        ),
        busy,
        reads=5,
    )
    t0 = time.monotonic()
    wait_for(lambda: not busy(), timeout=5, what="llama-server to stop generating after the client left")
    assert time.monotonic() - t0 < 1.5


@contextlib.contextmanager
def _gui_chat_lines(base: str, body: dict) -> Iterator[Iterator[str]]:
    with httpx.stream("POST", f"{base}/api/chat", timeout=120, json=body) as resp:
        yield resp.iter_lines()


def test_leaving_a_gui_chat_stream_frees_the_slot(studio):
    """/api/chat streams through relay.EventStream, not StreamingResponse: its watcher must still see the client go."""
    base, manager = studio

    def busy() -> bool:
        return any(s["is_processing"] for s in upstream_slots(manager))

    body = {
        "model": GEMMA,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 2000,
        "temperature": 0,
    }
    leave_mid_answer(lambda: _gui_chat_lines(base, body), busy, reads=10)
    # 2000 tokens would take minutes
    wait_for(lambda: not busy(), timeout=10, what="llama-server to stop generating after the GUI left")


def test_back_to_back_streams_do_not_reuse_the_connection_llama_server_closed(studio):
    """llama-server closes the connection after every stream; the next request reusing it was a 502."""
    base, _ = studio
    body = {"model": GEMMA, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    with httpx.Client(base_url=base, timeout=60) as http:
        statuses = []
        for _ in range(20):
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.read()
                statuses.append(resp.status_code)
    assert statuses == [200] * 20


def test_eight_concurrent_streams_complete(client):
    def one(i: int) -> str:
        chunks = client.chat.completions.create(
            model=GEMMA, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=16, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    assert all(texts)


def test_swap_between_models_cuts_no_request(studio, client):
    _, manager = studio

    def ask(model: str) -> str:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0
        )
        return reply.model

    order = [GEMMA, TINY, GEMMA, TINY, GEMMA, GEMMA, TINY, TINY]
    with ThreadPoolExecutor(4) as pool:
        answered = list(pool.map(ask, order))
    assert answered == order
    assert status_json(manager)["in_flight"] == 0


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"


def test_non_gguf_model_is_400_and_the_live_model_keeps_serving(studio, client):
    base, manager = studio
    client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    resp = httpx.post(f"{base}/api/load", json={"model": "broken"}, timeout=60)
    assert resp.status_code == 400
    assert "not a GGUF file" in resp.json()["error"]["message"]
    tiny = next(m for m in status_json(manager)["models"] if m["model"] == TINY)
    assert tiny["state"] == "ready"  # the resident models keep serving


def test_bad_bodies_get_openai_shaped_errors(studio):
    base, manager = studio
    resp = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=30,
        json={
            "model": TINY,
            "messages": [{"role": "user", "content": "x"}],
            "enable_thinking": True,
            "chat_template_kwargs": "not an object",
        },
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs"
    assert status_json(manager)["in_flight"] == 0  # the refused request released its place (a swap would wait)
    resp = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(f"{base}/api/load", json={"model": GEMMA, "n_ctx": -5}, timeout=10)
    assert resp.status_code == 422 and resp.json()["error"]["param"] == "n_ctx"
    resp = httpx.post(f"{base}/api/chat", json={"model": TINY, "messages": []}, timeout=10)
    assert resp.status_code == 422 and resp.json()["error"]["param"] == "messages"
    resp = httpx.post(f"{base}/api/chat", content=b"{not json", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_gui_flow_load_progress_status_chat_unload(studio):
    base, _ = studio
    httpx.post(f"{base}/api/unload", timeout=60)
    events: list[dict] = []

    def follow_progress():
        with httpx.stream("GET", f"{base}/api/progress", timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    loaded = threading.Thread(
        target=lambda: events.append(
            {"load": httpx.post(f"{base}/api/load", json={"model": GEMMA}, timeout=120).json()}
        )
    )
    loaded.start()
    wait_for(lambda: httpx.get(f"{base}/api/status").json()["state"] in ("resolving", "loading", "ready"), timeout=30)
    watcher = threading.Thread(target=follow_progress)
    watcher.start()
    loaded.join(120)
    watcher.join(120)
    states = [e["state"] for e in events if "state" in e]
    assert states[-1] == "ready", events
    status = httpx.get(f"{base}/api/status").json()
    assert status["model"] == GEMMA and status["native_context"] == 32768 and status["effective_context"] > 0
    assert status["progress"]["phases_seen"][-1] == "ready"
    assert status["speculative"]["requested"] == "auto" and status["speculative"]["resolved"]
    assert status["offload"]["active_on"] == ["CPU"] and status["largest_safe_context"] >= 4096
    assert status["reasons"]
    predicted, actual = status["memory"]["predicted"], status["memory"]["actual"]
    assert actual["devices"]["CPU"]["kv"] == predicted["devices"]["CPU"]["kv"] > 0  # the KV estimate is exact
    assert abs(actual["devices"]["CPU"]["weights"] - predicted["devices"]["CPU"]["weights"]) < 0.01 * 2**20
    # The whole start-up bill within 2 % (the speculative outputs' growth comes later, and is shown apart).
    assert actual["total"] == actual["startup_total"]
    assert abs(predicted["logged_total"] - actual["total"]) <= 0.02 * actual["total"], (predicted, actual)
    cpu = predicted["devices"]["CPU"]
    assert predicted["total"] - predicted["startup_total"] == cpu["output_growth"] + cpu["prompt_cache"] > 0
    # the process's own memory, which the log does not print, is on the start-up bill beside what it does
    assert predicted["startup_total"] - predicted["logged_total"] == cpu["process"] > 0
    assert actual["devices"]["CPU"]["process"] == 0
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=60,
        json={"model": GEMMA, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    logs = []
    with httpx.stream("GET", f"{base}/api/logs", params={"follow": "false"}, timeout=30) as resp:
        logs = [json.loads(line[6:])["line"] for line in resp.iter_lines() if line.startswith("data: ")]
    assert any("listening on" in line or "model loaded" in line for line in logs)
    assert httpx.post(f"{base}/api/unload", timeout=60).json()["state"] == "unloaded"
    assert httpx.get(f"{base}/api/models/{GEMMA}").json()["architecture"] == "gemma3"


def test_api_key_never_reaches_the_argv(studio, client):
    _, manager = studio
    client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    tiny = manager.find(TINY)
    pid = tiny.supervisor.status().pid
    assert tiny.loaded.api_key not in " ".join(psutil.Process(pid).cmdline())
    assert httpx.get(f"{tiny.loaded.url}/v1/models").status_code == 401  # unreachable without the key


def test_gui_chat_stream_has_typed_events_and_a_final_summary(studio):
    base, _ = studio
    events = []
    with httpx.stream(
        "POST",
        f"{base}/api/chat",
        timeout=120,
        json={"model": GEMMA, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert {e["type"] for e in events[:-1]} <= {"content", "reasoning", "tool_call"}
    assert any(e["type"] == "content" for e in events)
    done = events[-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 6
    assert done["tokens_per_second"] > 0 and done["finish_reason"] == "length"
    assert done["draft_acceptance"] is None or 0 <= done["draft_acceptance"] <= 1


def test_gui_chat_reports_overflow_as_an_error_event(studio):
    base, _ = studio
    httpx.post(f"{base}/api/load", json={"model": GEMMA, "n_ctx": 512, "n_parallel": 1}, timeout=120)
    with httpx.stream(
        "POST",
        f"{base}/api/chat",
        timeout=120,
        json={"model": GEMMA, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4},
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["status"] == 400
    assert events[-1]["error"]["type"] == "exceed_context_size_error" and events[-1]["error"]["n_ctx"] == 512


def test_api_token_guards_everything_but_health(llama_server_bin, tmp_path):
    manager = ModelManager(
        catalog=Catalog([tmp_path]),
        binary=llama_server_bin,
        caps=probe(llama_server_bin),
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
    )
    app = create_app(manager, api_token="s3cret")
    with TestClient(app, base_url="http://127.0.0.1") as client:  # TestClient's own "testserver" is no loopback name
        assert client.get("/health").status_code == 200
        assert client.get("/v1/health").status_code == 200  # llama-server's other spelling, public there too
        assert client.get("/v1/models/anything").status_code == 401
        denied = client.get("/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/api/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        chat = {"messages": [{"role": "user", "content": "x"}]}
        assert client.post("/v1/chat/completions", json=chat).status_code == 401  # the fast path is guarded too
        refused = client.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer s3cret"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"  # no model loaded
        assert client.get("/v1/chat/completions", headers={"Authorization": "Bearer s3cret"}).status_code == 405


def test_plan_preview_loads_nothing(studio):
    base, manager = studio
    before = status_json(manager)
    resp = httpx.post(f"{base}/api/plan", json={"model": GEMMA, "n_ctx": 8192, "spec": "off"}, timeout=60)
    assert resp.status_code == 200, resp.text
    plan = resp.json()
    assert plan["context"]["n_ctx"] == 8192 and plan["reasons"]
    assert status_json(manager)["pid"] == before["pid"]


def test_config_defaults_reach_the_plan_and_a_request_wins(llama_server_bin, gemma_model, tmp_path):
    defaults = ModelDefaults(spec="ngram", spec_n_max=5, cache_type_kv="q8_0")
    manager = ModelManager(
        catalog=Catalog([gemma_model.parent]),
        binary=llama_server_bin,
        caps=probe(llama_server_bin),
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        model_defaults={GEMMA: defaults},
    )
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as client:
        plan = client.post("/api/plan", json={"model": GEMMA, "n_ctx": 4096}).json()
        assert (plan["cache_type_k"], plan["cache_type_v"]) == ("q8_0", "q8_0")
        assert plan["speculative"]["requested"] == "ngram" and "5" in plan["speculative"]["argv"]
        plan = client.post(
            "/api/plan", json={"model": GEMMA, "n_ctx": 4096, "cache_type_kv": "f16", "spec": "off", "spec_n_max": 2}
        ).json()
        assert (plan["cache_type_k"], plan["speculative"]["requested"], plan["speculative"]["argv"]) == (
            "f16",
            "off",
            [],
        )


def test_bad_load_options_are_400s_naming_the_problem(studio):
    base, _ = studio
    resp = httpx.post(f"{base}/api/load", json={"model": GEMMA, "spec": "warp-drive"}, timeout=60)
    assert resp.status_code == 400 and "warp-drive" in resp.json()["error"]["message"]
    resp = httpx.post(f"{base}/api/load", json={"model": GEMMA, "extra_args": ["--port", "1"]}, timeout=60)
    # not on the API clients' allowlist (launcher.client_flags): refused before the managed-flag check
    assert resp.status_code == 403 and "--port" in resp.json()["error"]["message"]
    resp = httpx.post(f"{base}/api/load", json={"model": GEMMA, "cache_type_kv": "q3_z"}, timeout=60)
    assert resp.status_code == 422 and resp.json()["error"]["param"] == "cache_type_kv"


def test_an_alias_serves_its_model_with_the_configured_defaults(studio, client):
    base, _ = studio
    listed = httpx.get(f"{base}/v1/models").json()["data"]
    assert next(m for m in listed if m["id"] == TINY)["aliases"] == [TINY, "tiny-alias"]  # one entry, both names
    reply = client.chat.completions.create(
        model="tiny-alias", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.choices[0].message.content is not None
    status = next(m for m in httpx.get(f"{base}/api/status").json()["models"] if m["path"].endswith("llama-dense.gguf"))
    assert studio[1].find("tiny-alias").settings.n_ctx == 512  # the configured defaults reached the launch
    assert status["speculative"]["requested"] == "off" and status["cache_type_kv"] == "f16"
    # llama-server caps a slot at the model's training context (256 for the zoo models): it says so itself.
    assert status["effective_context"] == 256
