"""The page's Hub search in a real Chromium: a badge per variant, Download on those that fit, and the pull.

A real studio (uvicorn, the real manager with the pinned build's capabilities, a memory budget)
searches the Hub stand-in (``tests.hub_server``) through the real huggingface_hub; the repo has five
variants of one zoo model (``tests.test_hub_search.deep_variants``) and the budget lets two fit.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from playwright.sync_api import sync_playwright

from studio.residency.requests import LoadRequest
from studio.settings import MemoryBudget, ResidencySettings
from tests.helpers import assert_no_children, wait_for
from tests.support.browser import CHROMIUM, FLAGS
from tests.support.studio import running_studio
from tests.test_hub import hf_env, server  # noqa: F401 (fixtures)
from tests.test_hub_search import REPO, deep_variants

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make chromium` installs it"),
]


def test_the_search_shows_a_fit_badge_per_variant_and_downloads_one_that_fits(
    llama_server_bin,
    zoo_dir,
    server,
    hf_env,
    tmp_path,  # noqa: F811
):
    paths = deep_variants(zoo_dir, tmp_path)
    repo = server.repo(REPO, downloads=3)
    for label, path in paths.items():
        repo.add(f"deep-{label}.gguf", path)
    with running_studio(tmp_path / "probe", llama_server_bin, {}) as probe:
        bills = {
            label: asyncio.run(probe.manager.preview(LoadRequest(model=str(p)))).plan.bill.total
            for label, p in paths.items()
        }
    budget = (bills["Q3_K_M"] + bills["Q4_K_M"]) // 2
    residency = ResidencySettings(memory_budget=MemoryBudget(total=budget))
    profile = tmp_path / "profile"
    with (
        running_studio(tmp_path / "studio", llama_server_bin, {}, residency=residency, hf_cache=hf_env.cache_dir) as s,
        sync_playwright() as pw,
    ):
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=FLAGS
        )
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        page.goto(f"{s.url}/")
        page.fill("#hub-search-input", "deep")
        page.keyboard.press("Enter")
        page.wait_for_selector(f"li.hub-repo[data-repo='{REPO}'] li.variant", timeout=30_000)
        variants = page.locator("li.variant")
        assert variants.count() == 5
        first = variants.nth(0)
        assert first.get_attribute("data-model") == f"{REPO}:Q3_K_M"  # the recommended one comes first
        assert "recommended" in first.inner_text()
        fitting = page.locator("li.variant[data-fits='true']")
        assert sorted(fitting.evaluate_all("ns => ns.map(n => n.dataset.model)")) == [
            f"{REPO}:Q2_K",
            f"{REPO}:Q3_K_M",
        ]
        assert page.locator("li.variant[data-fits='true'] button").count() == 2  # Download only where it fits
        assert page.locator("li.variant[data-fits='false'] button").count() == 0
        no_fit = page.locator(f"li.variant[data-model='{REPO}:Q8_0'] .badge.no-fit").inner_text()
        assert no_fit.startswith("does not fit: needs")
        assert "fits at" in first.locator(".badge.fits").inner_text()
        assert "quality suffers" in page.locator(".recommendation").inner_text()
        page.screenshot(path=str(tmp_path / "search.png"))
        first.locator("button", has_text="Download").click()
        wait_for(lambda: "is in the library" in page.locator("#pull-status").inner_text(), timeout=60, what="the pull")
        page.wait_for_selector(f"li.card.model[data-model='{REPO}:Q3_K_M']", timeout=30_000)
        assert [d for d in server.downloads() if d.endswith("deep-Q3_K_M.gguf")]
        assert errors == []
        context.close()
    shutil.rmtree(profile, ignore_errors=True)
    assert_no_children()
