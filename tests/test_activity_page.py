"""The page's Activity view in a real Chromium: after two clients' requests that force a swap (two models, room
for one), its timeline shows both lanes, the load and the eviction, and each request's phases; its table the
same records."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import sync_playwright

from studio.settings import ModelDefaults, ResidencySettings
from tests.support.activity_page import MODELS, open_activity, two_clients_swap
from tests.support.browser import CHROMIUM, chromium
from tests.support.studio import RunningStudio, running_studio

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make chromium` installs it"),
]


@pytest.fixture
def studio(llama_server_bin, smollm_model, gemma_model, tmp_path) -> Iterator[RunningStudio]:
    with running_studio(
        tmp_path / "studio",
        llama_server_bin,
        {"smollm": smollm_model, "gemma": gemma_model},
        defaults={m: ModelDefaults(n_ctx=2048, spec="off") for m in MODELS},
        residency=ResidencySettings(max_resident=1),
    ) as s:
        yield s


def test_the_timeline_shows_both_lanes_the_load_the_eviction_and_each_requests_phases(studio, tmp_path):
    assert httpx.put(f"{studio.url}/api/activity/captures", json={"mode": "all"}, timeout=30).status_code == 200
    two_clients_swap(studio.url)
    profile = tmp_path / "profile"
    with sync_playwright() as pw:
        context = chromium(pw, profile, viewport={"width": 1280, "height": 800})
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        page.goto(f"{studio.url}/")
        open_activity(page)
        chart = page.locator("#activity-chart")
        gemma, smollm = (
            chart.locator("g.lane-group[data-model='gemma']"),
            chart.locator("g.lane-group[data-model='smollm']"),
        )
        assert gemma.locator("rect.residency.load[data-kind='load']").count() == 1
        assert smollm.locator("rect.residency[data-kind='eviction']").count() == 1
        assert smollm.locator("rect.residency.load[data-kind='load']").count() == 1  # its own first load
        assert smollm.locator("g.request").count() == 2 and gemma.locator("g.request").count() == 1
        waited = gemma.locator("g.request rect.phase")
        assert sorted(waited.evaluate_all("rs => rs.map(r => r.dataset.phase)")) == sorted(
            ["queued", "load_wait", "prefill", "decode"]
        ) or {"load_wait", "prefill", "decode"} <= set(waited.evaluate_all("rs => rs.map(r => r.dataset.phase)"))
        for bar in smollm.locator("g.request").all():
            assert {"prefill", "decode"} <= set(
                bar.locator("rect.phase").evaluate_all("rs => rs.map(r => r.dataset.phase)")
            )
        title = gemma.locator("rect.residency.load title").text_content()
        assert "evicted smollm" in title, title
        rows = page.locator("#activity-table tbody tr")
        assert rows.count() >= 3 + 3  # three requests; two loads and an eviction
        assert page.locator("#activity-table tbody tr[data-kind='request'] td", has_text="client-b/1.0").count() == 1
        page.locator("#activity-table button.capture").first.click()
        page.wait_for_selector("#activity-capture:not([hidden])")
        assert '"messages"' in page.locator("#activity-capture").text_content()
        page.screenshot(path=str(tmp_path / "activity.png"))
        assert not errors, errors
        context.close()
    shutil.rmtree(profile, ignore_errors=True)
