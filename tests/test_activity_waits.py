"""What a request waited for, as ``/api/activity`` shows it: queued behind another client, or for its model's load.

Real llama-servers under a studio that keeps one model resident: SmolLM2 with one slot, gemma beside it in
turn, and a load that must wait for a busy model holds that model's new requests back at once (no group).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from studio.settings import ModelDefaults, ResidencySettings
from tests.helpers import wait_for
from tests.support.studio import RunningStudio, running_studio
from tests.test_activity import chat, loaded, records, wait_records

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

#: A question whose answer runs its whole ``max_tokens``: the first client keeps the one slot that long.
LONG = {"max_tokens": 160, "ignore_eos": True}


@pytest.fixture(scope="module")
def studio(llama_server_bin, smollm_model, gemma_model, tmp_path_factory) -> Iterator[RunningStudio]:
    root = tmp_path_factory.mktemp("activity-waits")
    defaults = {
        "smollm": ModelDefaults(n_ctx=2048, spec="off", n_parallel=1),
        "gemma": ModelDefaults(n_ctx=2048, spec="off"),
    }
    with running_studio(
        root,
        llama_server_bin,
        {"smollm": smollm_model, "gemma": gemma_model},
        defaults=defaults,
        residency=ResidencySettings(max_resident=1, group_size=0, busy_wait=120),  # a slow machine: no 503
    ) as s:
        yield s


@pytest.fixture
def base(studio) -> str:
    assert httpx.delete(f"{studio.url}/api/activity", timeout=30).status_code == 200
    return studio.url


def in_background(base: str, model: str, content: str, **options: Any) -> threading.Thread:
    """A client's chat, sent from a thread of its own."""
    thread = threading.Thread(target=chat, args=(base, model, [{"role": "user", "content": content}]), kwargs=options)
    thread.start()
    return thread


def queued_seconds(base: str, model: str) -> float:
    """``/metrics``' total of ``model``'s chats' queued phase."""
    name = f'ggstudio_request_phase_seconds_sum{{model="{model}",phase="queued",route="/v1/chat/completions"}} '
    lines = httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
    return next((float(line[len(name) :]) for line in lines if line.startswith(name)), 0.0)


def request_of(base: str, content_model: str, count: int) -> list[dict[str, Any]]:
    """The ``count`` request records of ``content_model``, oldest first, once all are in."""
    found = wait_records(
        base, lambda rs: rs if len(rs) >= count else None, f"{count} records", kind="request", model=content_model
    )
    return sorted(found, key=lambda r: r["times"]["arrived"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_behind_another_client_on_a_one_slot_model_shows_it_queued_not_waiting_for_a_load(
    studio, base, stream
):
    loaded(studio, "smollm")
    counted = queued_seconds(base, "smollm")
    first = in_background(base, "smollm", "Tell me a long story about a lighthouse.", **LONG)
    time.sleep(0.5)  # the first one has the slot
    chat(base, "smollm", [{"role": "user", "content": "Say hi."}], stream=stream)
    first.join(timeout=120)
    before, after = request_of(base, "smollm", 2)

    behind = before["times"]["ended"] - after["times"]["arrived"]  # what was left of the first one's answer
    assert behind > 0.5, (before["times"], after["times"])
    phases = after["phases"]
    assert phases["load_wait"] == 0 and after["load"] is None and after["waits"] == [], after
    assert behind * 0.8 - 0.1 <= phases["queued"] <= behind + 0.5, (phases, behind)
    assert phases["prefill"] < phases["queued"], phases
    assert before["phases"]["queued"] < 0.5 and before["phases"]["load_wait"] == 0, before["phases"]
    total = after["times"]["ended"] - after["times"]["arrived"]
    assert abs(sum(phases.values()) - total) < 0.05, (phases, total)
    both = phases["queued"] + before["phases"]["queued"]
    assert queued_seconds(base, "smollm") - counted == pytest.approx(both, abs=1e-3)  # /metrics has the same


def test_a_request_that_forced_a_swap_waited_for_that_load_and_was_not_queued(studio, base):
    loaded(studio, "smollm")
    chat(base, "gemma", [{"role": "user", "content": "Say hello."}], stream=True)
    request = wait_records(base, lambda rs: rs and rs[0], "the request's record", kind="request", model="gemma")
    load = next(r for r in records(base, kind="load") if r["model"] == "gemma")

    assert [(w["for"], w["model"], w["load"]) for w in request["waits"]] == [("load", "gemma", load["id"])]
    wait = request["waits"][0]
    assert request["times"]["arrived"] <= wait["began"] <= load["times"]["began"] + 0.05, (wait, load["times"])
    assert load["times"]["ended"] <= wait["ended"] <= request["times"]["acquired"] + 0.01, (wait, load["times"])
    assert request["load"] == {"id": load["id"], "model": "gemma", "evicted": ["smollm"]}
    phases = request["phases"]
    assert phases["load_wait"] >= load["seconds"] * 0.9, (phases, load["seconds"])
    assert phases["queued"] < min(0.5, phases["load_wait"] / 5), phases


def test_a_request_for_a_model_held_back_for_another_models_load_shows_it_queued_then_its_own_load(studio, base):
    """smollm serves a long answer; gemma's load waits for its memory and holds smollm's new requests back: the
    next smollm request is queued until smollm is let go, then waits for smollm's load back."""
    manager = studio.manager
    loaded(studio, "smollm")
    first = in_background(base, "smollm", "Tell me a long story about a lighthouse.", **LONG)
    time.sleep(0.5)
    other = in_background(base, "gemma", "Say hello.")
    resident = manager.find("smollm")
    assert resident is not None
    wait_for(lambda: resident.admission.value == "paused_for_load", timeout=30, interval=0.02, what="smollm held back")
    chat(base, "smollm", [{"role": "user", "content": "Say hi."}])
    first.join(timeout=120)
    other.join(timeout=120)
    before, after = request_of(base, "smollm", 2)
    smollm_load = next(r for r in records(base, kind="load") if r["model"] == "smollm")

    kinds = [(w["for"], w["model"]) for w in after["waits"]]
    assert kinds[0] == ("queued", "smollm") and ("load", "smollm") in kinds, after["waits"]
    queued = after["waits"][0]
    behind = before["times"]["ended"] - after["times"]["arrived"]
    assert queued["ended"] - queued["began"] >= behind * 0.8 - 0.1, (queued, behind)
    assert after["waits"][-1]["load"] == smollm_load["id"] and after["load"]["id"] == smollm_load["id"]
    phases = after["phases"]
    assert phases["queued"] >= behind * 0.8 - 0.1 and phases["load_wait"] >= smollm_load["seconds"] * 0.9, phases
