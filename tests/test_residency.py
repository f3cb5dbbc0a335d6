"""Several models resident at once: real llama-servers, real uvicorn, real sockets.

Budgets are set in MiB around the zoo models' bills (each about 7.3 MiB at -c 256), so
every placement rule shows on any machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from launcher.capabilities import probe
from launcher.devices import discover
from launcher.planner import PlanRequest, load_model, plan
from studio.library.default_model import CHATML
from studio.residency.requests import LoadRequest
from studio.residency.resident import ResidentModel
from studio.settings import MemoryBudget, ModelDefaults, ResidencySettings
from tests.helpers import wait_for
from tests.support.studio import running_studio

pytestmark = pytest.mark.slow

ZOO = ("llama-dense", "qwen2-dense", "mistral3-dense", "granite-dense")
#: No prompt cache: its automatic size follows the room a plan finds, and these tests place by exact bills.
SMALL = ModelDefaults(n_ctx=256, spec="off", cache_ram=0)
NO_CACHE_PLAN = PlanRequest(n_ctx=256, spec="off", cache_ram_mib=0)
MIB = 2**20


@pytest.fixture(scope="module")
def zoo_models(zoo_dir):
    return {name: zoo_dir / f"{name}.gguf" for name in ZOO}


@pytest.fixture(scope="module")
def bill(llama_server_bin, zoo_models):
    """The predicted total of one zoo model at -c 256 (they are all within a few KiB of each other)."""
    caps = probe(llama_server_bin)
    inventory = discover(llama_server=llama_server_bin)
    totals = [plan(load_model(p), inventory, caps, NO_CACHE_PLAN).bill.total for p in zoo_models.values()]
    assert max(totals) - min(totals) < 0.05 * max(totals)
    return max(totals)


def budget(total: float) -> ResidencySettings:
    return ResidencySettings(memory_budget=MemoryBudget(total=int(total)), busy_wait=1.0, unload_grace=2.0)


def chat(base: str, model: str, *, max_tokens: int = 2, timeout: float = 60, **extra) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        timeout=timeout,
        json={"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens, **extra},
    )


def models_of(base: str) -> dict[str, dict]:
    return {m["model"]: m for m in httpx.get(f"{base}/api/status", timeout=10).json()["models"]}


def llama_servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-server"]


def test_two_resident_models_answer_alternating_requests_without_a_load(tmp_path, llama_server_bin, zoo_models):
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={n: SMALL for n in ZOO}) as s:
        a, b = ZOO[:2]
        assert chat(s.url, a).status_code == chat(s.url, b).status_code == 200
        pids = {name: m["pid"] for name, m in models_of(s.url).items()}
        loads = s.manager.counters["loads"]
        for i in range(20):
            assert chat(s.url, (a, b)[i % 2]).status_code == 200
        now = models_of(s.url)
        assert {name: m["pid"] for name, m in now.items()} == pids and len(pids) == 2
        assert all(m["state"] == "ready" for m in now.values())
        assert s.manager.counters["loads"] == loads == 2


def test_a_third_model_over_the_budget_evicts_the_least_recently_used_idle_one(
    tmp_path, llama_server_bin, zoo_models, bill
):
    a, b, c, d = ZOO
    with running_studio(
        tmp_path, llama_server_bin, zoo_models, defaults={n: SMALL for n in ZOO}, residency=budget(2.5 * bill)
    ) as s:
        assert chat(s.url, a).status_code == 200
        assert chat(s.url, b).status_code == 200
        preview = httpx.post(f"{s.url}/api/plan", json={"model": c}, timeout=60).json()
        assert preview["evicts"] == [a] and preview["fits"]  # the preview says so and loads nothing
        assert set(models_of(s.url)) == {a, b}
        assert chat(s.url, c).status_code == 200
        assert set(models_of(s.url)) == {b, c}  # a was the least recently used
        assert s.manager.counters["evictions"] == 1
        # a pinned model stays: b is pinned, so loading d evicts c though b is older
        assert httpx.post(f"{s.url}/api/pin", json={"model": b}, timeout=10).status_code == 200
        assert chat(s.url, d).status_code == 200
        assert set(models_of(s.url)) == {b, d}
        held = sum(m["memory"]["actual"]["total"] for m in models_of(s.url).values())
        assert held <= 2.5 * bill  # what llama-server allocated stays within the budget


def test_a_streaming_model_is_never_evicted_and_nothing_evictable_is_a_503_naming_the_holders(
    tmp_path, llama_server_bin, zoo_models, gemma_model, bill
):
    gemma = "gemma"
    caps = probe(llama_server_bin)
    gemma_bill = plan(
        load_model(gemma_model),
        discover(llama_server=llama_server_bin),
        caps,
        PlanRequest(n_ctx=2048, spec="off", cache_ram_mib=0),
    ).bill.total
    a, b = ZOO[:2]
    with running_studio(
        tmp_path,
        llama_server_bin,
        {**zoo_models, gemma: gemma_model},
        defaults={**{n: SMALL for n in ZOO}, gemma: ModelDefaults(n_ctx=2048, spec="off", cache_ram=0)},
        residency=budget(gemma_bill + 1.5 * bill),
    ) as s:
        assert chat(s.url, a).status_code == 200
        assert httpx.post(f"{s.url}/api/pin", json={"model": a}, timeout=10).status_code == 200
        with httpx.stream(
            "POST",
            f"{s.url}/v1/completions",  # raw text: a base model's chat would stop at its borrowed turn markers
            timeout=120,
            json={"model": gemma, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True},
        ) as stream:
            lines = stream.iter_lines()  # held: dropping the iterator would close the stream
            # streaming now: the first data line (a slow load first sends ": loading" comments)
            while not next(lines).startswith("data: "):
                pass
            assert models_of(s.url)[gemma]["in_flight"] == 1
            t0 = time.monotonic()
            refused = chat(s.url, b)
            waited = time.monotonic() - t0
        assert refused.status_code == 503 and refused.headers["Retry-After"].isdigit()
        message = refused.json()["error"]["message"]
        assert "gemma (busy" in message and f"{a} (pinned" in message, message
        assert waited >= 0.9  # it waited the bounded busy_wait for them to go idle first
        assert set(models_of(s.url)) == {a, gemma}  # nothing resident was disturbed
        # once gemma is idle again, it is what goes (a is pinned)
        assert chat(s.url, b).status_code == 200
        assert set(models_of(s.url)) == {a, b}


def test_a_load_waiting_for_a_busy_model_is_not_starved_by_new_requests_to_it(
    tmp_path, llama_server_bin, zoo_models, gemma_model, bill
):
    """Found with bench_residency: four clients kept Gemma busy, so a load waiting for its memory got a 503."""
    caps = probe(llama_server_bin)
    gemma_bill = plan(
        load_model(gemma_model),
        discover(llama_server=llama_server_bin),
        caps,
        PlanRequest(n_ctx=2048, n_parallel=2, spec="off", cache_ram_mib=0),
    ).bill.total
    b = ZOO[1]
    residency = ResidencySettings(memory_budget=MemoryBudget(total=int(gemma_bill + 0.5 * bill)), busy_wait=120)
    with running_studio(
        tmp_path,
        llama_server_bin,
        {**zoo_models, "gemma": gemma_model},
        defaults={b: SMALL, "gemma": ModelDefaults(n_ctx=2048, n_parallel=2, spec="off", cache_ram=0)},
        residency=residency,
    ) as s:
        assert chat(s.url, "gemma").status_code == 200
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(chat, s.url, "gemma", max_tokens=48, timeout=300)
            wait_for(lambda: models_of(s.url)["gemma"]["in_flight"] == 1, timeout=30, what="gemma to be busy")
            waiting = pool.submit(chat, s.url, b, timeout=300)  # needs gemma's memory
            time.sleep(0.5)
            later = pool.submit(chat, s.url, "gemma", max_tokens=2, timeout=300)  # in gemma's group, before the swap
            assert first.result().status_code == 200
            assert waiting.result().status_code == 200  # the group ended, and b got gemma's memory
            assert later.result().status_code == 200
        assert s.manager.counters["evictions"] >= 1


def test_a_model_that_cannot_fit_even_alone_is_a_400_naming_it(tmp_path, llama_server_bin, zoo_models, bill):
    with running_studio(
        tmp_path, llama_server_bin, zoo_models, defaults={n: SMALL for n in ZOO}, residency=budget(bill / 2)
    ) as s:
        resp = httpx.post(f"{s.url}/api/load", json={"model": ZOO[0]}, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "does_not_fit" and ZOO[0] in error["message"] and "MiB" in error["message"]
        assert llama_servers() == []


def test_ttl_unloads_an_idle_model_on_time_and_a_pinned_one_stays(tmp_path, llama_server_bin, zoo_models):
    a, b = ZOO[:2]
    with running_studio(
        tmp_path,
        llama_server_bin,
        zoo_models,
        defaults={
            a: ModelDefaults(n_ctx=256, spec="off", ttl=2),
            b: ModelDefaults(n_ctx=256, spec="off", ttl=2, pinned=True),
        },
    ) as s:
        assert chat(s.url, b).status_code == 200
        assert chat(s.url, a).status_code == 200
        done = time.monotonic()
        status = models_of(s.url)
        assert 0 < status[a]["ttl_left"] <= 2 and status[b]["ttl_left"] is None and status[b]["pinned"]
        wait_for(lambda: a not in models_of(s.url), timeout=10, what="the TTL to unload the idle model")
        assert 1.8 <= time.monotonic() - done <= 5
        time.sleep(1)
        assert models_of(s.url)[b]["state"] == "ready"


def test_keep_alive_style_ttl_change_and_bad_values(tmp_path, llama_server_bin, zoo_models):
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert chat(s.url, a).status_code == 200
        assert httpx.post(f"{s.url}/api/ttl", json={"model": a, "ttl": -1}, timeout=10).status_code == 422
        missing = httpx.post(f"{s.url}/api/pin", json={"model": "not-resident"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_resident"
        assert httpx.post(f"{s.url}/api/ttl", json={"model": a, "ttl": 0.5}, timeout=10).status_code == 200
        wait_for(lambda: a not in models_of(s.url), timeout=10, what="the new TTL to unload it")


def test_a_preloaded_model_serves_its_first_request_without_a_load(tmp_path, llama_server_bin, zoo_models):
    a = ZOO[0]
    with running_studio(
        tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}, preload=[LoadRequest(model=a)]
    ) as s:
        wait_for(lambda: models_of(s.url).get(a, {}).get("state") == "ready", timeout=60, what="the preload")
        pid = models_of(s.url)[a]["pid"]
        reply = chat(s.url, a, temperature=0.5, max_tokens=3)  # per-request options do not restart it
        assert reply.status_code == 200
        assert models_of(s.url)[a]["pid"] == pid and s.manager.counters["loads"] == 1


def test_eight_concurrent_first_requests_start_exactly_one_llama_server(tmp_path, llama_server_bin, zoo_models):
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: chat(s.url, a).status_code, range(8)))
        assert replies == [200] * 8
        assert len(llama_servers()) == 1 and s.manager.counters["loads"] == 1


def test_a_request_option_change_does_not_restart_but_an_explicit_new_context_does(
    tmp_path, llama_server_bin, zoo_models
):
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert chat(s.url, a, max_tokens=1, top_k=5).status_code == 200
        pid = models_of(s.url)[a]["pid"]
        assert httpx.post(f"{s.url}/api/load", json={"model": a}, timeout=60).json()["pid"] == pid  # equal settings
        reloaded = httpx.post(f"{s.url}/api/load", json={"model": a, "n_parallel": 2}, timeout=60).json()
        assert reloaded["pid"] != pid and reloaded["state"] == "ready"
        assert len(llama_servers()) == 1


# -- defects found on 01c15d7, each pinned -----------------------------------------------------


def test_an_idle_timer_that_fires_before_the_ttl_is_not_lost(tmp_path, llama_server_bin, zoo_models):
    """A model with a 0.5 s TTL was still resident 11 s later (CI): uvloop runs timers on the loop's cached
    clock, so the expiry timer could fire a little before the TTL had passed, and that early look was dropped."""
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert chat(s.url, a).status_code == 200
        assert httpx.post(f"{s.url}/api/ttl", json={"model": a, "ttl": 2}, timeout=10).status_code == 200
        resident = s.manager.find(a)

        def fire_early() -> None:  # what the timer does when it fires before its time
            resident._cancel_expiry()
            resident._expire()

        s.server._loop.call_soon_threadsafe(fire_early)
        wait_for(lambda: a not in models_of(s.url), timeout=15, what="the TTL to unload it after all")


def test_non_streamed_request_whose_client_leaves_frees_the_slot(tmp_path, llama_server_bin, gemma_model):
    """The slot stayed busy 38 s after the client left: the studio kept reading the answer to max_tokens."""
    with running_studio(
        tmp_path,
        llama_server_bin,
        {"gemma": gemma_model},
        defaults={"gemma": ModelDefaults(n_ctx=2048, spec="off", cache_ram=0)},
    ) as s:
        assert chat(s.url, "gemma").status_code == 200
        loaded = s.manager.find("gemma").loaded
        with pytest.raises(httpx.ReadTimeout):  # raw text: a base model's chat ends at its borrowed turn markers
            httpx.post(
                f"{s.url}/v1/completions",
                json={"model": "gemma", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True},
                timeout=2,
            )

        def busy() -> bool:
            slots = httpx.get(f"{loaded.url}/slots", headers=loaded.auth_headers, timeout=5).json()
            return any(slot["is_processing"] for slot in slots)

        # llama-server looks at a non-streamed request's connection when its 1 s wait for a result times out
        # (HTTP_POLLING_SECONDS), and every result of any task, /slots' own too, starts that wait again: polled
        # faster than once a second, it never looks. Unloaded it stops within about 1 s; the bound leaves room
        # for a busy machine (it used to be never).
        wait_for(
            lambda: not busy(), timeout=20, interval=1.5, what="llama-server to stop decoding for a client that left"
        )
        assert models_of(s.url)["gemma"]["in_flight"] == 0


def test_unload_with_requests_in_flight_ends_them_with_a_clear_error_after_the_grace(
    tmp_path, llama_server_bin, gemma_model
):
    """They got 502 "llama-server did not answer: llama-server did not answer: _ClosedBeforeAnswer(...)"."""
    with running_studio(
        tmp_path,
        llama_server_bin,
        {"gemma": gemma_model},
        # ChatML as its template: a base model's borrowed one would stop its long answers at a turn marker
        defaults={"gemma": ModelDefaults(n_ctx=4096, n_parallel=2, spec="off", chat_template=CHATML)},
    ) as s:
        assert chat(s.url, "gemma").status_code == 200
        results: dict[str, object] = {}

        def non_streamed() -> None:
            results["plain"] = chat(s.url, "gemma", max_tokens=1500, timeout=120)

        def streamed() -> None:
            with httpx.stream(
                "POST",
                f"{s.url}/v1/chat/completions",
                timeout=120,
                json={
                    "model": "gemma",
                    "messages": [{"role": "user", "content": "Write a long story."}],
                    "max_tokens": 1500,
                    "stream": True,
                },
            ) as resp:
                results["stream"] = [line for line in resp.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=non_streamed), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        wait_for(lambda: models_of(s.url)["gemma"]["in_flight"] == 2, timeout=30, what="both requests to run")
        t0 = time.monotonic()
        unloaded = httpx.post(f"{s.url}/api/unload", json={"model": "gemma", "grace": 1}, timeout=60)
        for t in threads:
            t.join(60)
        assert unloaded.status_code == 200 and 0.9 <= time.monotonic() - t0 < 15
        plain = results["plain"]
        assert plain.status_code == 503
        error = plain.json()["error"]
        assert error["type"] == "model_unloaded" and error["message"] == "gemma was unloaded while this request ran"
        last = json.loads(results["stream"][-1][6:])
        assert last["error"]["type"] == "model_unloaded" and "gemma was unloaded" in last["error"]["message"]
        for text in (plain.text, results["stream"][-1]):
            assert "_Closed" not in text and "did not answer: llama-server did not answer" not in text
        assert llama_servers() == []


def test_unload_lets_a_request_within_the_grace_finish(tmp_path, llama_server_bin, zoo_models):
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert chat(s.url, a).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, s.url, a, max_tokens=64)
            wait_for(
                lambda: models_of(s.url)[a]["in_flight"] == 1 or pending.done(), timeout=30, what="the request to start"
            )
            assert httpx.post(f"{s.url}/api/unload", json={"model": a, "grace": 30}, timeout=60).status_code == 200
            assert pending.result().status_code == 200
        assert models_of(s.url) == {}


def test_a_start_whose_props_cannot_be_read_stops_its_llama_server(tmp_path, llama_server_bin, zoo_models, monkeypatch):
    """The state became failed but the started llama-server kept running.

    llama-server always answers /props once healthy, so the read is made to fail here.
    """

    async def unreadable(self, status):
        raise RuntimeError("llama-server started but its /props could not be read: injected")

    monkeypatch.setattr(ResidentModel, "_effective_context", unreadable)
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        resp = httpx.post(f"{s.url}/api/load", json={"model": a}, timeout=60)
        assert resp.status_code == 500 and "/props could not be read" in resp.json()["error"]["message"]
        assert models_of(s.url)[a]["state"] == "failed"
        wait_for(lambda: not llama_servers(), timeout=10, what="the started llama-server to be stopped")


def test_a_load_whose_key_file_cannot_be_written_fails_and_is_not_stuck_loading(tmp_path, llama_server_bin, zoo_models):
    """The state stayed "loading" forever when writing the key file failed."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the key files' folder should be")
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}, files_root=blocker) as s:
        resp = httpx.post(f"{s.url}/api/load", json={"model": a}, timeout=60)
        assert resp.status_code == 500 and "launch files" in resp.json()["error"]["message"]
        status = httpx.get(f"{s.url}/api/status", timeout=10).json()
        assert status["state"] == "unloaded" and status["models"] == []
        assert llama_servers() == []


def test_a_crashed_model_restarts_on_a_new_port_and_requests_follow_it(tmp_path, llama_server_bin, zoo_models):
    """The supervisor restarted on a new port while the manager kept sending to the old one."""
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert chat(s.url, a).status_code == 200
        old = s.manager.find(a).loaded
        os.kill(models_of(s.url)[a]["pid"], signal.SIGKILL)
        wait_for(
            lambda: models_of(s.url)[a]["restarts"] == 1 and models_of(s.url)[a]["state"] == "ready",
            timeout=30,
            what="the restart",
        )
        assert chat(s.url, a).status_code == 200
        new = s.manager.find(a).loaded
        assert new.url != old.url and len(llama_servers()) == 1


def test_a_restart_back_off_is_cut_short_by_an_unload(tmp_path, llama_server_bin, zoo_models):
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert chat(s.url, a).status_code == 200
        resident = s.manager.find(a)
        resident.restarts = 5  # the next back-off is 16 s
        resident.max_restarts = 9
        os.kill(models_of(s.url)[a]["pid"], signal.SIGKILL)
        wait_for(lambda: models_of(s.url)[a]["state"] == "crashed", timeout=10, what="the crash")
        t0 = time.monotonic()
        assert httpx.post(f"{s.url}/api/unload", json={"model": a}, timeout=60).status_code == 200
        assert time.monotonic() - t0 < 3 and models_of(s.url) == {} and llama_servers() == []


def test_an_absurd_context_is_refused_before_llama_server_sees_it(tmp_path, llama_server_bin, zoo_models):
    """n_ctx 1e12 reached llama-server: 500 "exited with code 1 while loading: to show complete usage"."""
    with running_studio(tmp_path, llama_server_bin, zoo_models) as s:
        resp = httpx.post(f"{s.url}/api/load", json={"model": ZOO[0], "n_ctx": 10**12}, timeout=30)
        assert resp.status_code == 422 and resp.json()["error"]["param"] == "n_ctx"
        resp = httpx.post(f"{s.url}/api/load", json={"model": ZOO[0], "ttl": -3}, timeout=30)
        assert resp.status_code == 422 and resp.json()["error"]["param"] == "ttl"
        assert llama_servers() == []


def test_unknown_routes_and_models_answer_in_the_openai_error_shape(tmp_path, llama_server_bin, zoo_models):
    """They answered FastAPI's {"detail": ...}."""
    with running_studio(tmp_path, llama_server_bin, zoo_models) as s:
        for method, path, status in [
            ("GET", "/no/such/route", 404),
            ("GET", "/api/models/unknown-model", 404),
            ("GET", "/api/models/owner/repo", 404),
            ("DELETE", "/api/status", 405),
        ]:
            resp = httpx.request(method, f"{s.url}{path}", timeout=10)
            assert resp.status_code == status, (path, resp.text)
            body = resp.json()
            assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body


def test_three_idle_models_cost_the_studio_next_to_no_cpu(tmp_path, llama_server_bin, zoo_models):
    """One idle model cost 2 % of a core: a new httpx client (TLS context and all) every health check.

    The CPU counted is that of the threads this studio started: in the full suite this process also runs what
    earlier tests left (0.3-0.4 % of a core once, not found yet), which is not this studio's idle cost."""
    me = psutil.Process()
    earlier = {t.id for t in me.threads()}

    def studio_cpu() -> float:
        return sum(t.user_time + t.system_time for t in me.threads() if t.id not in earlier)

    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={n: SMALL for n in ZOO}) as s:
        for name in ZOO[:3]:
            assert chat(s.url, name).status_code == 200
        time.sleep(1)
        before, t0 = studio_cpu(), time.monotonic()
        time.sleep(10)
        share = (studio_cpu() - before) / (time.monotonic() - t0)
        assert share < 0.005, f"{share:.2%} of a core while idle"  # the benchmark's target is 0.1 %


def test_health_answers_while_a_slow_plan_runs(tmp_path, llama_server_bin, zoo_models):
    """A plan ran on the event loop: a hostile file stalled /health and every chat for over a minute."""
    gate = threading.Event()

    def slow_planner(*args):
        gate.wait(30)  # a plan made slow on purpose: the test hook, not a sleep in the product
        return plan(*args)

    with running_studio(tmp_path, llama_server_bin, zoo_models, planner=slow_planner, work_timeout=20) as s:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{s.url}/api/plan", json={"model": ZOO[0]}, timeout=60)
            time.sleep(0.5)
            times = []
            for _ in range(10):
                t0 = time.monotonic()
                assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200
                times.append(time.monotonic() - t0)
            gate.set()
            assert pending.result().status_code == 200
        assert sorted(times)[len(times) // 2] < 0.1, times


def test_a_plan_over_its_time_limit_is_a_clear_error_and_the_studio_serves_on(tmp_path, llama_server_bin, zoo_models):
    gate = threading.Event()

    def stuck_planner(*args):
        gate.wait(30)
        return plan(*args)

    with running_studio(tmp_path, llama_server_bin, zoo_models, planner=stuck_planner, work_timeout=1) as s:
        try:
            resp = httpx.post(f"{s.url}/api/plan", json={"model": ZOO[0]}, timeout=30)
            assert resp.status_code == 504 and "took longer than 1 s" in resp.json()["error"]["message"]
            assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200
        finally:
            gate.set()


def test_the_lifespan_unloads_every_model_at_shutdown(tmp_path, llama_server_bin, zoo_models):
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={n: SMALL for n in ZOO}) as s:
        for name in ZOO[:2]:
            assert chat(s.url, name).status_code == 200
        assert len(llama_servers()) == 2
    wait_for(lambda: not llama_servers(), timeout=15, what="every llama-server to stop with the studio")


def test_resident_transitions_go_through_the_table(tmp_path, llama_server_bin, zoo_models):
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert chat(s.url, a).status_code == 200
        resident = s.manager.find(a)
        future = asyncio.run_coroutine_threadsafe(_illegal(resident), _loop_of(s))
        assert "illegal resident transition ready -> loading" in future.result(10)


async def _illegal(resident: ResidentModel) -> str:
    from studio.residency.lifecycle import ResidentState

    try:
        resident._set(ResidentState.LOADING)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _loop_of(s) -> asyncio.AbstractEventLoop:
    return s.manager.find(ZOO[0])._loop
