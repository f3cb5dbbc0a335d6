"""The activity records on the real llama-server: what a request met on its way (a queue, a load and the eviction
it made, a restored slot, its client leaving, its llama-server killed under it), how long each is kept, and the
captures' bound.

One studio with SmolLM2 and Gemma 3 and room for one model at a time, so that asking the other model is a swap.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil
import pytest

from studio.activity.store import Retention
from studio.residency.slot_cache import SlotCache
from studio.settings import ModelDefaults, ResidencySettings
from tests.helpers import wait_for
from tests.support.studio import RunningStudio, running_studio
from tests.test_slot_cache import TURN1

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

MODELS = ("smollm", "gemma")


@pytest.fixture(scope="module")
def studio(llama_server_bin, smollm_model, gemma_model, tmp_path_factory) -> Iterator[RunningStudio]:
    root = tmp_path_factory.mktemp("activity")
    cache = SlotCache(root / "slots", binary=llama_server_bin, disk_budget=1 << 30)
    defaults = {m: ModelDefaults(n_ctx=2048, spec="off") for m in MODELS}
    with running_studio(
        root,
        llama_server_bin,
        {"smollm": smollm_model, "gemma": gemma_model},
        defaults=defaults,
        residency=ResidencySettings(max_resident=1),
        slot_cache=cache,
    ) as s:
        yield s


@pytest.fixture
def base(studio) -> Iterator[str]:
    """The studio's URL, its records deleted, and its retention and captures as they were after the test."""
    activity = studio.server.config.app.state.activity
    assert httpx.delete(f"{studio.url}/api/activity", timeout=30).status_code == 200
    yield studio.url
    activity.retention = Retention()
    activity.captures.default, activity.captures.models = "off", {}


def chat(base: str, model: str, messages: list[dict[str, Any]], *, stream: bool = False, **options: Any) -> str:
    """The answer's text (streamed or whole)."""
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "stream": stream, **options}
    if not stream:
        resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                text += (choices[0].get("delta", {}).get("content") or "") if choices else ""
    return text


def records(base: str, **filters: Any) -> list[dict[str, Any]]:
    resp = httpx.get(f"{base}/api/activity", params=filters, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["records"]


def wait_records(
    base: str, pick: Callable[[list[dict[str, Any]]], Any], what: str, timeout: float = 60, **filters: Any
) -> Any:
    return wait_for(lambda: pick(records(base, **filters)), timeout=timeout, interval=0.2, what=what)


def loaded(studio: RunningStudio, model: str) -> None:
    """``model`` resident (the other evicted), its records then deleted."""
    chat(studio.url, model, [{"role": "user", "content": "Hi"}])
    assert httpx.delete(f"{studio.url}/api/activity", timeout=30).status_code == 200


def test_a_request_that_forced_a_swap_shows_its_wait_the_load_and_the_eviction(studio, base):
    loaded(studio, "smollm")
    chat(base, "gemma", [{"role": "user", "content": "Say hello."}], stream=True)
    request = wait_records(base, lambda rs: rs and rs[0], "the request's record", kind="request", model="gemma")
    load = next(r for r in records(base, kind="load") if r["model"] == "gemma")
    eviction = next(r for r in records(base, kind="eviction") if r["model"] == "smollm")

    assert request["outcome"] in ("finished", "length") and request["stream"] and request["status"] == 200
    assert request["load"] == {"id": load["id"], "model": "gemma", "evicted": ["smollm"]}
    phases = request["phases"]
    assert phases["load_wait"] >= load["seconds"] * 0.9, (phases, load["seconds"])
    assert phases["prefill"] > 0 and phases["decode"] >= 0
    times = request["times"]
    assert times["arrived"] <= times["acquired"] <= times["sent"] <= times["first_byte"] <= times["ended"], times
    assert request["tokens"]["generated"] > 0 and request["tokens"]["prompt_processed"] > 0
    assert request["decode_tps"] > 0
    assert request["client"]["user_agent"].startswith("python-httpx")

    assert load["evicted"] == ["smollm"] and load["eviction_ids"] == [eviction["id"]]
    assert [s["step"] for s in load["steps"]] == ["evict smollm", "start"]
    assert load["memory"]["predicted"]["total"] > 0 and load["memory"]["actual"]["total"] > 0
    assert load["plan"]["context"] == 2048
    assert eviction["reason"] == "evicted" and eviction["times"]["ended"] <= load["times"]["ended"]

    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert 'ggstudio_request_phase_seconds_count{model="gemma",phase="load_wait",route="/v1/chat/completions"}' in (
        metrics
    )


def test_the_pages_own_chat_is_recorded_with_its_phases_tokens_and_outcome(studio, base):
    loaded(studio, "smollm")
    asked = [{"role": "user", "content": "Write a long poem about the sea."}]
    # greedy: a sampled answer of six tokens may hold no visible text, and then no first byte
    body = {"model": "gemma", "messages": asked, "max_tokens": 6, "temperature": 0}
    with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] in ("length", "stop"), events[-3:]
    request = wait_records(base, lambda rs: rs and rs[0], "the chat's record", kind="request", route="/api/chat")

    # the model may end its turn before the limit: the record says what the page was told
    outcome = {"length": "length", "stop": "finished"}[done["finish_reason"]]
    assert request["model"] == "gemma" and request["stream"] and request["outcome"] == outcome
    assert request["load"] is not None and request["load"]["evicted"] == ["smollm"]
    phases = request["phases"]
    assert phases["load_wait"] > 0 and phases["prefill"] > 0 and phases["decode"] > 0, phases
    times = request["times"]
    assert times["arrived"] <= times["acquired"] <= times["sent"] <= times["first_byte"] <= times["ended"], times
    assert request["tokens"]["generated"] == done["usage"]["completion_tokens"] > 1
    assert request["tokens"]["prompt_processed"] > 0 and request["decode_tps"] > 0
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert 'ggstudio_request_phase_seconds_count{model="gemma",phase="decode",route="/api/chat"}' in metrics

    refused = httpx.post(f"{base}/api/chat", json={**body, "model": "nope"}, timeout=30)
    assert refused.status_code == 404
    error = wait_records(base, lambda rs: rs and rs[0], "the refused chat", route="/api/chat", outcome="error")
    assert error["asked"] == "nope" and error["error"]["code"] == "model_not_found"


def test_a_request_whose_saved_slot_was_restored_says_how_many_tokens_came_back(studio, base):
    first = chat(base, "smollm", TURN1)
    loaded(studio, "gemma")  # smollm evicted: its slot is saved
    turn2 = [*TURN1, {"role": "assistant", "content": first}, {"role": "user", "content": "And the cat's name?"}]
    chat(base, "smollm", turn2)
    request = wait_records(base, lambda rs: rs and rs[0], "the request's record", kind="request", model="smollm")
    tokens = request["tokens"]
    assert tokens["restored"] > 100, tokens
    assert tokens["prompt_cached"] >= 0.9 * (tokens["prompt_cached"] + tokens["prompt_processed"]), tokens
    assert request["load"] is not None and request["load"]["evicted"] == ["gemma"]


def test_a_stream_its_client_left_is_recorded_as_cancelled(studio, base):
    loaded(studio, "smollm")
    body = {
        "model": "smollm",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i == 6:
                break
    request = wait_records(base, lambda rs: rs and rs[0], "the cancelled record", kind="request", outcome="cancelled")
    assert request["model"] == "smollm" and request["load"] is None
    assert request["phases"]["load_wait"] == 0 and request["phases"]["decode"] > 0
    assert records(base, outcome="finished") == []


def test_a_request_sent_again_after_its_llama_server_was_killed_names_the_cause(studio, base):
    loaded(studio, "smollm")
    server = psutil.Process(studio.manager.find("smollm").supervisor.status().pid)
    server.suspend()  # the request reaches it and waits: sent, not answered
    answers: list[httpx.Response] = []
    body = {"model": "smollm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    asking = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120))
    )
    asking.start()
    time.sleep(1.0)
    server.kill()
    asking.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    request = wait_records(base, lambda rs: rs and rs[0], "the retried record", kind="request", outcome="retried")
    assert request["retries"] == 1 and request["outcome"] in ("finished", "length")
    assert "died" in request["retried_after"][0], request["retried_after"]
    assert any(r["model"] == "smollm" for r in records(base, kind="crash"))


def test_an_unknown_model_is_an_error_with_its_cause_and_no_metric_label(studio, base):
    resp = httpx.post(f"{base}/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=30)
    assert resp.status_code == 404
    request = wait_records(base, lambda rs: rs and rs[0], "the error record", kind="request", outcome="error")
    assert request["asked"] == "nope" and request["error"]["status"] == 404
    assert request["error"]["code"] == "model_not_found"
    assert 'model="nope"' not in httpx.get(f"{base}/metrics", timeout=30).text


def test_records_are_kept_by_count_and_by_age(studio, base):
    activity = studio.server.config.app.state.activity
    activity.retention = Retention(max_records=3)
    for _ in range(5):
        assert httpx.post(f"{base}/tokenize", json={"model": "smollm", "content": "hi"}, timeout=60).status_code == 200
    assert len(records(base)) == 3
    activity.retention = Retention(max_age=1.0)
    time.sleep(1.5)
    assert httpx.post(f"{base}/tokenize", json={"model": "smollm", "content": "hi"}, timeout=60).status_code == 200
    kept = records(base)
    assert len(kept) == 1 and kept[0]["route"] == "/tokenize"


def test_captures_are_off_by_default_keep_failed_bodies_and_stay_within_their_bound(studio, base):
    activity = studio.server.config.app.state.activity
    long = "word " * 3000  # past the 2048-token context: llama-server refuses it
    body = {"model": "smollm", "messages": [{"role": "user", "content": long}], "max_tokens": 4}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 400
    assert wait_records(base, lambda rs: rs and rs[0], "the refused request", outcome="error")["captured"] is None

    switched = httpx.put(f"{base}/api/activity/captures", json={"mode": "failed", "model": "smollm"}, timeout=30)
    assert switched.json()["models"] == {"smollm": "failed"}
    chat(base, "smollm", [{"role": "user", "content": "Hi"}])
    assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 400
    failed = wait_records(base, lambda rs: rs and rs[0], "the refused request", outcome="error")
    assert failed["captured"] > len(long)
    kept = httpx.get(f"{base}/api/activity/captures/{failed['id']}", timeout=30).json()
    assert long in kept["request"] and "context" in kept["answer"]
    finished = records(base, outcome="finished")[0]
    assert finished["captured"] is None
    assert httpx.get(f"{base}/api/activity/captures/{finished['id']}", timeout=30).status_code == 404

    activity.retention = Retention(capture_bytes=3000)
    assert httpx.put(f"{base}/api/activity/captures", json={"mode": "all"}, timeout=30).status_code == 200
    everything = {"mode": "all", "model": "smollm"}  # a model's own switch goes before the default: now the same
    assert httpx.put(f"{base}/api/activity/captures", json=everything, timeout=30).json()["models"] == {}
    for i in range(6):
        text = f"Say {i}. " + "please " * 100
        chat(base, "smollm", [{"role": "user", "content": text}], max_tokens=2)
    captured = [r["captured"] for r in records(base) if r["captured"]]
    assert 0 < sum(captured) <= 3000, captured
    assert records(base)[0]["captured"], "the latest capture went first"


def test_the_activity_routes_follow_the_access_rules(studio, base):
    foreign = httpx.get(f"{base}/api/activity", headers={"Origin": "http://evil.example"}, timeout=30)
    assert foreign.status_code == 403
    deleted = httpx.delete(f"{base}/api/activity", headers={"Origin": "http://evil.example"}, timeout=30)
    assert deleted.status_code == 403
    export = httpx.get(f"{base}/api/activity/export", timeout=30)
    assert export.status_code == 200 and "attachment" in export.headers["content-disposition"]


def test_with_a_token_the_activity_routes_want_it(tmp_path, llama_server_bin):
    with running_studio(tmp_path, llama_server_bin, {}, api_token="s3cret") as s:
        assert httpx.get(f"{s.url}/api/activity", timeout=30).status_code == 401
        assert httpx.get(f"{s.url}/api/activity/events", timeout=30).status_code == 401
        assert httpx.delete(f"{s.url}/api/activity", timeout=30).status_code == 401
        resp = httpx.get(f"{s.url}/api/activity", headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert resp.status_code == 200 and resp.json()["records"] == []
