#!/usr/bin/env python3
"""The docs' picture of the Activity view: two clients whose requests force a swap, on the real llama-server.

Starts a studio (uvicorn in a thread) with SmolLM2 and Gemma 3 270M and room for one model, sends
client A's two requests to SmolLM2 and client B's to Gemma (which evicts SmolLM2), opens the page's
Activity view in a headless Debian Chromium at 1280x800 and writes it to ``docs/activity.png``.

    .venv/bin/python scripts/activity_screenshot.py [--out docs/activity.png]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.build import ensure_built
from studio.library.default_model import GEMMA_FILENAME, ensure_default_model
from studio.settings import ModelDefaults, ResidencySettings, Settings
from tests.support.activity_page import MODELS, open_activity, two_clients_swap
from tests.support.browser import CHROMIUM, FLAGS
from tests.support.studio import running_studio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "activity.png")
    out = parser.parse_args().out
    settings = Settings.from_env()
    build = ensure_built(settings.home)
    models = {"smollm": ensure_default_model(settings.models_dir), "gemma": settings.models_dir / GEMMA_FILENAME}
    with (
        tempfile.TemporaryDirectory(prefix="ggstudio-shot-") as scratch,
        running_studio(
            Path(scratch) / "studio",
            build.llama_server,
            models,
            defaults={m: ModelDefaults(n_ctx=2048, spec="off") for m in MODELS},
            residency=ResidencySettings(max_resident=1),
        ) as studio,
        sync_playwright() as pw,
    ):
        two_clients_swap(studio.url)
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{studio.url}/")
        open_activity(page)
        page.wait_for_timeout(300)
        page.screenshot(path=str(out))
        browser.close()
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
