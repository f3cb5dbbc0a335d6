#!/usr/bin/env python3
"""The README's picture of the studio page: a real studio, SmolLM2 loaded, its first answer.

Starts a studio (uvicorn in a thread, the real llama-server) with the `make run` default
and the zoo's tiny llama in the library, loads SmolLM2 with a 2,048-token context, asks
"What is the capital of France?" at temperature 0 in a headless Debian Chromium at
1280x800, and writes the page to ``docs/page.png`` (about 90 KiB).

    .venv/bin/python scripts/page_screenshot.py [--out docs/page.png]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.build import ensure_built
from studio.library.default_model import CHAT_FILENAME, builtin_model_defaults, ensure_default_model
from studio.settings import Settings
from tests.support.browser import CHROMIUM, FLAGS
from tests.support.studio import running_studio
from tests.support.zoo import ensure_zoo

SMOL = CHAT_FILENAME.removesuffix(".gguf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "page.png")
    out = parser.parse_args().out
    settings = Settings.from_env()
    build = ensure_built(settings.home)
    models = {
        SMOL: ensure_default_model(settings.models_dir),
        "llama-dense": ensure_zoo(build, settings.home) / "llama-dense.gguf",
    }
    with (
        tempfile.TemporaryDirectory(prefix="ggstudio-shot-") as scratch,
        running_studio(
            Path(scratch) / "studio", build.llama_server, models, defaults=builtin_model_defaults({})
        ) as studio,
        sync_playwright() as pw,
    ):
        loaded = httpx.post(f"{studio.url}/api/load", json={"model": SMOL, "n_ctx": 2048}, timeout=600)
        loaded.raise_for_status()
        browser = pw.chromium.launch_persistent_context(
            str(Path(scratch) / "profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 800},
        )
        try:
            page = browser.new_page()
            page.goto(f"{studio.url}/")
            page.wait_for_selector(f"li.resident[data-model='{SMOL}'][data-state='ready'] .mem-text")
            page.click("#chat-options summary")
            page.fill("#opt-temperature", "0")
            page.click("#chat-options summary")
            page.fill("#chat-input", "What is the capital of France?")
            page.keyboard.press("Enter")
            page.wait_for_selector("#messages .msg.assistant .stats:not(:empty)", timeout=600_000)
            page.wait_for_timeout(1500)  # the next status poll: the request is no longer in flight
            page.locator("#chat-input").blur()
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
        finally:
            browser.close()
        httpx.post(f"{studio.url}/api/unload", json={}, timeout=120)
    print(f"{out} ({out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
