"""The page with a text-to-speech model, in Debian's Chromium: the library names it, and a message to it is
answered with speech that has a play button (``/v1/audio/speech`` through the real llama-tts)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from playwright.sync_api import sync_playwright

from tests.helpers import assert_no_children
from tests.support.browser import CHROMIUM, chromium
from tests.support.studio import running_studio
from tests.support.tts_models import SAMPLE_RATE, SAMPLES_PER_FRAME, derive_qwen3tts_model, write_qwen3tts_projector

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shared_processes,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make chromium` installs it"),
]

TTS = "tiny-qwen3-tts"


@pytest.fixture(scope="module")
def studio(llama_server_bin, zoo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("speech-page")
    model = derive_qwen3tts_model(zoo_dir / "qwen3tts-dense.gguf", root / f"{TTS}-F32.gguf")
    (root / "models").mkdir()
    write_qwen3tts_projector(root / "models" / "mmproj-tiny-qwen3-tts-F32.gguf")
    with running_studio(root, llama_server_bin, {TTS: model}, files_root=root / "run") as s:
        yield s
    assert_no_children()


def test_a_message_to_a_speaking_model_is_answered_with_a_play_button(studio, tmp_path):
    [listed] = httpx.get(f"{studio.url}/api/models", timeout=30).json()
    assert listed["speech"]["engine"] == "llama-tts" and listed["tts"]["family"] == "Qwen3-TTS" and listed["mmproj"]
    profile = tmp_path / "profile"
    with sync_playwright() as pw:
        browser = chromium(pw, profile, extra_args=["--autoplay-policy=no-user-gesture-required"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.goto(f"{studio.url}/")
        card = page.locator(f"li.card.model[data-model='{TTS}']")
        card.wait_for()
        assert "text to speech" in card.locator(".chips").inner_text()
        page.select_option("#chat-model", TTS)
        page.fill("#chat-input", "Good morning, this is the studio speaking.")
        page.click("#send")
        play = page.locator("#messages .msg.assistant button.play")
        play.wait_for(timeout=120_000)
        seconds = page.evaluate("""() => new Promise((resolve) => {
            const audio = document.querySelector('#messages .msg.assistant audio');
            if (audio.readyState >= 1) resolve(audio.duration);
            audio.addEventListener('loadedmetadata', () => resolve(audio.duration));
            audio.addEventListener('error', () => resolve(-1));
            setTimeout(() => resolve(-2), 30000);
        })""")
        frames = seconds * SAMPLE_RATE / SAMPLES_PER_FRAME
        assert seconds > 0 and abs(frames - round(frames)) < 0.01  # whole frames of 1920 samples
        assert "s of speech" in page.locator("#messages .msg.assistant .stats").inner_text()
        play.click()
        page.wait_for_function("() => document.querySelector('#messages .msg.assistant audio').currentTime > 0")
        assert errors == []
        browser.close()
    shutil.rmtree(profile, ignore_errors=True)
