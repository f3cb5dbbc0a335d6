"""The studio page in a real Chromium against a real studio and llama-server.

One studio serves the page with two models in its library: SmolLM2 (the `make run`
default, with the same built-in settings) for real text, and the zoo's tiny llama. The
flow a person goes through is driven with the keyboard and the mouse: open the page,
load a model through the dialog (the predicted memory follows the context slider), see
progress reach ready, chat and see the answer stream, stop a long answer (llama-server's
own ``/slots`` and ``/metrics`` show it stopped decoding), read the live log, unload.
The browser must log no error on the way. Each step leaves a screenshot in the test's
temporary directory (``step-*.png``). Gemma 3 270M is in the library as a base model (no chat
template of its own); the tiny llama has none either, but its config table gives it one.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from studio.library.default_model import (
    CHAT_FILENAME,
    CHATML,
    GEMMA_FILENAME,
    builtin_model_defaults,
    ensure_default_model,
)
from studio.settings import ModelDefaults, ResidencySettings
from tests.helpers import assert_no_children, wait_for
from tests.support.browser import CHROMIUM, FLAGS
from tests.support.studio import running_studio

ROOT = Path(__file__).resolve().parent.parent
SMOL = CHAT_FILENAME.removesuffix(".gguf")
TINY = "llama-dense"
GEMMA = GEMMA_FILENAME.removesuffix(".gguf")  # a base model: no chat template of its own
WIDE = {"width": 1280, "height": 800}
NARROW = {"width": 420, "height": 800}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shared_processes,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make chromium` installs it"),
]


@pytest.fixture(scope="module")
def studio(llama_server_bin, zoo_dir, gemma_model, settings, tmp_path_factory):
    models = {SMOL: ensure_default_model(settings.models_dir), TINY: zoo_dir / f"{TINY}.gguf", GEMMA: gemma_model}
    # one model at a time, so that the load dialog has an eviction to show
    with running_studio(
        tmp_path_factory.mktemp("page-studio"),
        llama_server_bin,
        models,
        defaults=builtin_model_defaults({TINY: ModelDefaults(chat_template=CHATML)}),
        residency=ResidencySettings(max_resident=1),
    ) as s:
        yield s
    assert_no_children()


@pytest.fixture(scope="module")
def browser(studio, tmp_path_factory):
    """Headless Debian Chromium (never a downloaded one) with a new, empty profile; closed before the studio
    stops, which then checks that no process is left."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=FLAGS, viewport=WIDE
        )
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


class Watched:
    """A page with what the browser reported: console errors, uncaught exceptions, every request."""

    def __init__(self, page: Page, shots: Path) -> None:
        self.page = page
        self.shots = shots
        self.errors: list[str] = []
        self.requests: list[tuple[str, str, str | None]] = []
        self.step = 0
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("request", lambda r: self.requests.append((r.method, r.url, r.headers.get("content-type"))))

    def shot(self, name: str) -> Path:
        self.step += 1
        path = self.shots / f"step-{self.step:02d}-{name}.png"
        self.page.screenshot(path=str(path))
        return path


@pytest.fixture
def watched(browser, studio, tmp_path):
    page = browser.new_page()
    page.set_viewport_size(WIDE)
    w = Watched(page, tmp_path)
    # each test starts a new chat: the page would open the one the previous test left (tests/test_history_page.py)
    page.add_init_script("localStorage.removeItem('ggstudio-conversation')")
    page.goto(f"{studio.url}/")
    page.wait_for_selector(f"li.card.model[data-model='{TINY}']")
    yield w
    page.close()


def slots_busy(studio, model: str) -> bool:
    loaded = studio.manager.find(model).loaded
    slots = httpx.get(f"{loaded.url}/slots", headers=loaded.auth_headers, timeout=10).json()
    return any(slot["is_processing"] for slot in slots)


def predicted_tokens(studio, model: str) -> int:
    loaded = studio.manager.find(model).loaded
    text = httpx.get(f"{loaded.url}/metrics", headers=loaded.auth_headers, timeout=10).text
    return int(float(re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.M)[1]))


def answer_lengths(page: Page) -> None:
    """Record the last answer's length at every change, in ``window.lengths``, to tell a stream from one write."""
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const bodies = document.querySelectorAll('#messages .msg.assistant .body');
            const last = bodies[bodies.length - 1];
            if (last) window.lengths.push(last.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")


def test_every_file_of_the_page_ships_as_package_data():
    """The page is served from the installed package: a file the package data leaves out is missing there."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["studio.web"]
    web = ROOT / "studio" / "web"
    shipped = {p for pattern in patterns for p in web.glob(pattern)}
    files = {p for p in web.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert files and files == shipped


def test_the_library_names_each_model_as_a_load_takes_it(studio):
    """The file's general.name used to overwrite ``name``: the page offered the zoo model as "n/a"."""
    models = {m["name"]: m for m in httpx.get(f"{studio.url}/api/models", timeout=30).json()}
    assert set(models) == {SMOL, TINY, GEMMA}
    assert models[SMOL]["general_name"] != SMOL and models[SMOL]["architecture"] == "llama"


def test_the_page_is_served_with_a_strict_content_security_policy(studio):
    page = httpx.get(f"{studio.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "media-src blob:" in csp  # a speaking model's answer plays from the WAV the page fetched
    assert "unsafe-inline" not in csp and "<script>" not in page.text
    assert not re.search(r"\son[a-z]+=", page.text)  # no inline event handlers
    script = httpx.get(f"{studio.url}/static/js/main.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    for missing in ("/static/js/nope.js", "/static/../http/page.py", "/static/%2e%2e/http/page.py"):
        assert httpx.get(f"{studio.url}{missing}").status_code == 404, missing


def test_every_control_has_a_name_and_both_layouts_fit(watched, studio):
    page = watched.page
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea')]
        .filter((e) => {
            const labelled = e.labels && [...e.labels].some((l) => l.textContent.trim());
            const by = e.getAttribute('aria-labelledby');
            const named = labelled || e.getAttribute('aria-label') || (by && document.getElementById(by))
                || (e.tagName === 'BUTTON' && e.textContent.trim()) || e.title;
            return !named;
        }).map((e) => e.outerHTML.slice(0, 80))""")
    assert unnamed == []
    send = page.locator("#send").bounding_box()
    assert send["y"] + send["height"] <= WIDE["height"]  # at 1280x800 the chat box is on screen, unscrolled
    watched.shot("wide")
    page.set_viewport_size({"width": 400, "height": 860})
    assert page.evaluate("document.documentElement.scrollWidth") <= 400  # nothing sticks out sideways
    page.screenshot(path=str(watched.shots / "narrow.png"), full_page=True)
    assert watched.errors == []


def test_load_chat_stop_log_and_unload_in_a_real_browser(watched, studio):
    page = watched.page
    watched.shot("open")
    assert page.locator(f"li.card.model[data-model='{SMOL}'] .facts").inner_text().startswith("llama")

    # the load dialog, from the keyboard: the predicted memory follows the context slider
    page.focus(f"li.card.model[data-model='{SMOL}'] button")
    page.keyboard.press("Enter")
    page.wait_for_selector("#load-bill li.device")
    automatic = page.locator("#load-bill .mem-text").first.inner_text()
    assert "budget" in page.locator("#load-bill").inner_text()
    assert "Largest safe context" in page.locator("#load-ctx-safe").inner_text()
    assert page.locator("#load-reasons li").count() > 0
    # the dialog leaves the slots to the planner (it asked for 1, "as requested", whatever the devices)
    assert "slots: 4 on a unified KV cache" in page.locator("#load-reasons").text_content()  # folded: not inner_text
    page.focus("#load-ctx")
    page.keyboard.press("Home")
    for _ in range(3):
        page.keyboard.press("ArrowRight")  # 256 -> 1024 tokens
    assert page.locator("#load-ctx-value").inner_text() == "1,024 tokens"
    wait_for(
        lambda: page.locator("#load-bill .mem-text").first.inner_text() != automatic,
        timeout=30,
        what="the predicted memory to follow the slider",
    )
    assert "KV" in page.locator("#load-bill .parts").first.inner_text()
    watched.shot("load-dialog")
    page.focus("#load-submit")
    page.keyboard.press("Enter")

    card = f"li.resident[data-model='{SMOL}']"
    # SmolLM2 can load within a second, before the page's first progress event: then it goes straight to ready
    page.wait_for_selector(f"{card}[data-state='loading'] progress, {card}[data-state='ready']", timeout=60_000)
    if page.locator(f"{card}[data-state='loading']").count():
        watched.shot("loading")
    page.wait_for_selector(f"{card}[data-state='ready']", timeout=180_000)
    assert page.locator(f"{card} .progress-line").is_hidden()
    wait_for(
        lambda: (
            "actual" in page.locator(f"{card} .mem-text").inner_text()
            and "–" not in page.locator(f"{card} .mem-text").inner_text()
        ),
        timeout=30,
        what="the actual memory",
    )
    assert studio.manager.find(SMOL).loaded.n_ctx == 1024
    watched.shot("ready")

    # what loading another model would evict
    page.click(f"li.card.model[data-model='{TINY}'] button")
    page.wait_for_selector("#load-evicts:not([hidden])")
    assert SMOL in page.locator("#load-evicts").inner_text()
    watched.shot("would-evict")
    page.keyboard.press("Escape")
    assert not page.locator("#load-dialog").is_visible()

    # a chat whose answer streams, at temperature 0
    page.click("#chat-options summary")
    page.fill("#opt-temperature", "0")
    page.fill("#opt-max-tokens", "60")
    page.select_option("#chat-model", SMOL)
    answer_lengths(page)
    page.fill("#chat-input", "What is the capital of France?")
    page.keyboard.press("Enter")
    page.wait_for_selector("#messages .msg.assistant .stats:not(:empty)", timeout=180_000)
    answer = page.locator("#messages .msg.assistant .body").last.inner_text()
    assert "Paris" in answer and "capital of France?" not in answer
    grew = [n for n in page.evaluate("window.lengths") if n]
    assert len(set(grew)) >= 3 and grew == sorted(grew), grew  # it came in pieces, as it was written
    stats = page.locator("#messages .msg.assistant .stats").last.inner_text()
    assert re.search(r"\d+ tokens · [\d.]+ tokens/s", stats), stats
    watched.shot("answered")

    # a long answer, stopped: llama-server stops decoding
    page.click("#chat-new")
    page.fill("#opt-temperature", "")
    page.fill("#opt-max-tokens", "1500")
    before = predicted_tokens(studio, SMOL)
    page.fill("#chat-input", "Write a long story about a dragon who learns to fly.")
    page.keyboard.press("Enter")
    wait_for(
        lambda: len(page.locator("#messages .msg.assistant .body").last.inner_text()) > 20,
        timeout=120,
        what="the story to start",
    )
    assert slots_busy(studio, SMOL)
    watched.shot("streaming")
    page.click("#stop")
    wait_for(lambda: not slots_busy(studio, SMOL), timeout=15, what="llama-server to stop decoding")
    stopped_at = predicted_tokens(studio, SMOL)
    time.sleep(1.5)
    assert predicted_tokens(studio, SMOL) == stopped_at < before + 1500
    assert page.locator("#messages .msg.assistant .stats").last.inner_text() == "Stopped."
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    wait_for(lambda: studio.manager.find(SMOL).in_flight == 0, timeout=10, what="the request to end")
    watched.shot("stopped")

    # the live log
    page.click(f"{card} button:text('Log')")
    # the last 100 lines, then new ones: after a chat, the slots' own lines (the start-up's are further back with
    # four slots)
    wait_for(lambda: "slot" in page.locator("#log-lines").inner_text(), timeout=30, what="log lines")
    watched.shot("log")
    page.keyboard.press("Escape")
    assert not page.locator("#log-dialog").is_visible()

    # unload
    page.click(f"{card} button:text('Unload')")
    page.wait_for_selector(card, state="detached", timeout=60_000)
    wait_for(lambda: not studio.manager.residents, timeout=60, what="the model to be unloaded")
    assert page.locator("#residents-empty").is_visible()
    watched.shot("unloaded")

    assert watched.errors == []
    foreign = [url for _, url, _ in watched.requests if not url.startswith(f"{studio.url}/")]
    assert foreign == []
    posts = [(url, kind) for method, url, kind in watched.requests if method == "POST"]
    assert posts and all(kind == "application/json" for _, kind in posts), posts


def test_a_studio_with_a_token_serves_the_page_which_asks_for_it(browser, llama_server_bin, tmp_path):
    """The page's files are open (they hold no data); the API is not, so the page asks for the token once."""
    with running_studio(tmp_path / "studio", llama_server_bin, {}, api_token="s3cret") as s:
        assert httpx.get(f"{s.url}/").status_code == 200
        assert httpx.get(f"{s.url}/static/js/api.js").status_code == 200
        assert httpx.get(f"{s.url}/api/load-options").status_code == 401
        page = browser.new_page()
        w = Watched(page, tmp_path)
        try:
            page.goto(f"{s.url}/")
            page.wait_for_selector("#token-dialog[open]")
            w.shot("token")
            page.fill("#token-input", "s3cret")
            page.keyboard.press("Enter")
            page.wait_for_selector("#model-list li.note")  # the library answered: no models yet
            wait_for(
                lambda: page.locator("#connection").inner_text().startswith("connected"), timeout=10, what="the status"
            )
            assert page.locator("#load-cache option").count() > 3  # /api/load-options, with the token
            # the refused calls before the token: Chromium logs each 401 as a failed resource
            assert all("401" in e for e in w.errors), w.errors
        finally:
            page.close()


def sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events)


def test_the_pull_box_shows_progress_and_says_plainly_when_the_studio_cannot_pull(watched, studio):
    """``/api/pull`` is a stand-in here (Hugging Face is out of reach): once as a studio without the route
    answers (its 404), once with the events the download service streams (``progress`` with the download's
    snapshot, then ``done``)."""
    page = watched.page
    page.route(
        f"{studio.url}/api/pull",
        lambda route: route.fulfill(
            status=404,
            content_type="application/json",
            body=json.dumps({"error": {"message": "no such route: POST /api/pull", "type": "not_found_error"}}),
        ),
    )
    page.fill("#pull-input", "not a repo")
    page.keyboard.press("Enter")
    assert "owner/repo" in page.locator("#pull-status").inner_text()  # checked before anything is sent
    page.fill("#pull-input", "unsloth/gemma-3-4b-it-GGUF:Q4_K_M")
    page.click("#pull-start")
    wait_for(lambda: "cannot pull" in page.locator("#pull-status").inner_text(), timeout=10, what="the message")
    watched.shot("pull-missing")
    page.unroute(f"{studio.url}/api/pull")
    snapshot = {
        "id": "d1",
        "model": "unsloth/gemma-3-4b-it-GGUF:Q4_K_M",
        "variant": "Q4_K_M",
        "state": "running",
        "done_bytes": 512 << 20,
        "total_bytes": 2 << 30,
        "rate_bytes_per_s": 25 << 20,
        "eta_s": 60,
    }
    page.route(
        f"{studio.url}/api/pull",
        lambda route: route.fulfill(
            status=200,
            content_type="text/event-stream",
            body=sse(
                {"type": "progress", **snapshot},
                {"type": "done", **snapshot, "state": "done", "done_bytes": 2 << 30, "path": "/hf/gemma.gguf"},
            ),
        ),
    )
    refreshed = len([u for _, u, _ in watched.requests if u.endswith("/api/models")])
    page.click("#pull-start")
    wait_for(lambda: "is in the library" in page.locator("#pull-status").inner_text(), timeout=10, what="done")
    assert page.locator("#pull-progress").evaluate("p => p.value === p.max")
    wait_for(
        lambda: len([u for _, u, _ in watched.requests if u.endswith("/api/models")]) > refreshed,
        timeout=10,
        what="the library to be read again",
    )
    watched.shot("pull-done")
    assert [e for e in watched.errors if "404" not in e] == []  # Chromium logs the stand-in's 404


def test_reasoning_tool_events_and_speculative_numbers_render(watched, studio):
    """A stand-in ``/api/chat`` stream with every event the studio sends (``studio.http.gui.gui_chat`` and
    ``studio.chat.tool_loop``): no model here reasons, runs the tool loop and speculates in one answer."""
    page = watched.page
    page.route(
        f"{studio.url}/api/chat",
        lambda route: route.fulfill(
            status=200,
            content_type="text/event-stream",
            body=sse(
                {"type": "reasoning", "text": "The user wants 6*7. "},
                {"type": "reasoning", "text": "Use python."},
                {"type": "tool_call", "index": 0, "id": "c1", "function": {"name": "python", "arguments": ""}},
                {"type": "tool_call", "index": 0, "function": {"arguments": '{"code": "print(6*7)"}'}},
                {"type": "tool_start", "id": "c1", "name": "python", "arguments": '{"code": "print(6*7)"}'},
                {"type": "tool_end", "id": "c1", "name": "python", "ok": True, "result": "42", "seconds": 0.21},
                {"type": "status", "reason": "repeated_call", "message": "the model repeated python; telling it so"},
                {"type": "content", "text": "<b>42</b>"},
                {
                    "type": "done",
                    "finish_reason": "stop",
                    "usage": {"completion_tokens": 12, "prompt_tokens": 30},
                    "timings": {"draft_n": 10, "draft_n_accepted": 7},
                    "tokens_per_second": 31.5,
                    "draft_acceptance": 0.7,
                    "iterations": 2,
                },
            ),
        ),
    )
    page.fill("#chat-input", "What is 6*7?")
    page.keyboard.press("Enter")
    page.wait_for_selector("#messages .msg.assistant .stats:not(:empty)")
    reasoning = page.locator("#messages .reasoning")
    assert reasoning.is_visible() and not reasoning.evaluate("d => d.open")  # shown collapsed
    assert not page.locator("#messages .reasoning-text").is_visible()
    tools = page.locator("#messages .tool-events").inner_text()
    assert 'The model calls python({"code": "print(6*7)"})' in tools and "python answered in 0.2 s: 42" in tools
    assert "repeated python" in tools
    assert page.locator("#messages .msg.assistant .body").inner_text() == "<b>42</b>"  # text, never markup
    stats = page.locator("#messages .stats").inner_text()
    assert stats == "12 tokens · 31.5 tokens/s · speculative acceptance 70 % (7 of 10 drafted) · 2 model calls"
    page.click("#messages .reasoning summary")
    assert "Use python." in page.locator("#messages .reasoning-text").inner_text()
    watched.shot("events")
    assert watched.errors == []


def test_a_reply_that_only_reasoned_shows_its_reasoning_as_the_answer(watched, studio):
    """It showed "(no answer)" with the reasoning collapsed; the reference backend shows the reasoning as the
    answer. A stand-in ``/api/chat`` stream: no model here can be made to reason without answering."""
    page = watched.page
    chats: list[dict] = []

    def answer(route) -> None:
        chats.append(json.loads(route.request.post_data or "{}"))
        events = [{"type": "reasoning", "text": "Paris is the capital. "}, {"type": "reasoning", "text": "Say so."}]
        if len(chats) > 1:
            events = [{"type": "content", "text": "Yes."}]
        route.fulfill(status=200, content_type="text/event-stream", body=sse(*events, {"type": "done", "usage": {}}))

    page.route(f"{studio.url}/api/chat", answer)
    page.fill("#chat-input", "Capital of France?")
    page.keyboard.press("Enter")
    page.wait_for_selector("#messages .msg.assistant[aria-busy='false']")
    assert page.locator("#messages .msg.assistant .body").inner_text() == "Paris is the capital. Say so."
    assert not page.locator("#messages .reasoning").is_visible()  # shown once, as the answer
    page.fill("#chat-input", "Sure?")
    page.keyboard.press("Enter")
    # Playwright runs the route's handler only inside its own calls: wait in one, not in a sleep
    wait_for(lambda: page.wait_for_timeout(50) or len(chats) == 2, timeout=10, what="the second message")
    assert chats[1]["messages"][1] == {"role": "assistant", "content": "Paris is the capital. Say so."}
    assert watched.errors == []


def test_an_attached_image_goes_as_an_image_part_and_a_refusal_reads_plainly(watched, studio, llama_src):
    page = watched.page
    page.set_input_files("#image-input", str(llama_src / "tools" / "mtmd" / "test-1.jpeg"))
    page.wait_for_selector("#attachments img")
    page.select_option("#chat-model", TINY)  # no vision projector: llama-server refuses the image
    page.fill("#chat-input", "What is in the picture?")
    with page.expect_request(f"{studio.url}/api/chat") as sent:
        page.keyboard.press("Enter")
    parts = sent.value.post_data_json["messages"][-1]["content"]
    assert parts[0] == {"type": "text", "text": "What is in the picture?"}
    assert parts[1]["type"] == "image_url" and parts[1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    problem = page.locator("#messages .msg.assistant .error")
    problem.wait_for(timeout=120_000)
    text = problem.inner_text()
    # llama-server's refusal (a 500), or the studio's own once it checks media (a 400)
    assert re.match(r"The model (could not answer|refused the request)\. \S", text), text
    assert "image" in text.lower() and text.endswith(".") and "{" not in text, text
    assert page.locator("#chat-input").input_value() == "What is in the picture?"  # given back to try again
    watched.shot("image-refused")
    httpx.post(f"{studio.url}/api/unload", json={}, timeout=60)


def test_a_loaded_model_is_shown_as_loaded_and_offers_unload_not_load(watched, studio):
    """The library offered "Load…" on a model already loaded: its card says Loaded, and its button unloads it."""
    page = watched.page
    tiny = f"li.card.model[data-model='{TINY}']"
    assert page.locator(f"{tiny} button").inner_text() == "Load…" and page.locator(f"{tiny} .badge").is_hidden()
    status = httpx.post(f"{studio.url}/api/load", json={"model": TINY}, timeout=120).json()
    assert status["state"] == "ready"
    assert status["capabilities"]["fallback_template"] is False  # its config table gives it a template
    page.wait_for_selector(f"{tiny} .badge:text-is('Loaded')", timeout=10_000)  # from the next status poll
    assert page.locator(f"{tiny} button").inner_text() == "Unload"
    assert page.locator(f"li.card.model[data-model='{SMOL}'] button").inner_text() == "Load…"
    watched.shot("loaded-in-library")
    page.click(f"{tiny} button")
    wait_for(lambda: not studio.manager.residents, timeout=60, what="the model to be unloaded")
    page.wait_for_selector(f"{tiny} button:text-is('Load…')", timeout=10_000)
    assert page.locator(f"{tiny} .badge").is_hidden() and page.locator("#load-dialog").is_hidden()
    assert watched.errors == []


# The placeholders of the visible one-line fields whose text is wider than the field's room for it (a number
# field keeps room for its spin buttons): [id, placeholder, text width, room].
CUT_PLACEHOLDERS = """() => {
    const pen = document.createElement('canvas').getContext('2d');
    return [...document.querySelectorAll('input[placeholder]')].filter((e) => e.checkVisibility()).map((e) => {
        const s = getComputedStyle(e);
        pen.font = `${s.fontStyle} ${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
        const room = e.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight)
            - (e.type === 'number' ? 16 : 0);
        return [e.id, e.placeholder, Math.ceil(pen.measureText(e.placeholder).width), Math.floor(room)];
    }).filter(([, , width, room]) => width > room);
}"""


def test_no_placeholder_is_cut(watched, studio):
    """The max-tokens field showed "up to the conte": every placeholder fits its field, wide and at 420 px,
    in the chat's options and in the load dialog."""
    page = watched.page
    page.click("#chat-options summary")
    for size in (WIDE, NARROW):
        page.set_viewport_size(size)
        assert page.locator("#opt-max-tokens").is_visible()
        assert page.evaluate(CUT_PLACEHOLDERS) == [], size
        page.click(f"li.card.model[data-model='{TINY}'] button")
        page.wait_for_selector("#load-bill li.device")
        assert page.locator("#load-ttl").is_visible()
        assert page.evaluate(CUT_PLACEHOLDERS) == [], size
        page.keyboard.press("Escape")
    assert watched.errors == []


def test_at_420_px_the_chat_comes_first_and_stays_on_the_first_screen(watched, studio):
    """At 420 px the page put the chat below the library, the resident models and the chats: the chat comes first,
    its messages, box and Send button on the first screen, even with a long conversation."""
    page = watched.page
    page.set_viewport_size(NARROW)
    page.evaluate("window.scrollTo(0, 0)")
    watched.shot("narrow-420")
    assert page.evaluate("document.documentElement.scrollWidth") <= NARROW["width"]  # nothing sticks out sideways
    chat = page.locator("#chat").bounding_box()
    for panel in ("#library", "#residents", "#history"):
        assert page.locator(panel).bounding_box()["y"] > chat["y"] + chat["height"], panel

    def on_first_screen(selector: str) -> None:
        box = page.locator(selector).bounding_box()
        assert box["y"] >= 0 and box["y"] + box["height"] <= NARROW["height"], (selector, box)

    for selector in ("#chat-model", "#messages", "#chat-input", "#send"):
        on_first_screen(selector)
    assert page.locator("#messages").bounding_box()["height"] >= 150
    page.evaluate("""() => {  // forty turns' worth of messages, as a long chat leaves them
        const list = document.getElementById('messages');
        for (let i = 0; i < 40; i++) {
            const m = document.createElement('li');
            m.className = `msg ${i % 2 ? 'assistant' : 'user'}`;
            m.textContent = `message ${i} `.repeat(12);
            list.append(m);
        }
    }""")
    for selector in ("#messages", "#chat-input", "#send"):
        on_first_screen(selector)
    watched.shot("narrow-420-long-chat")
    assert watched.errors == []


def test_a_base_model_is_named_as_such_before_the_first_message(watched, studio):
    """A base model was marked only by a small "no chat template" tag: before the first message the chat says it
    borrows llama-server's fallback template, that answers may ramble, and what to use instead."""
    models = {m["name"]: m for m in httpx.get(f"{studio.url}/api/models", timeout=30).json()}
    assert models[GEMMA]["chat_template"] is None and models[GEMMA]["fallback_template"] is True
    assert models[TINY]["chat_template"] is None and models[TINY]["fallback_template"] is False  # its config's
    assert models[SMOL]["chat_template"] and models[SMOL]["fallback_template"] is False
    assert httpx.get(f"{studio.url}/api/models/{GEMMA}", timeout=30).json()["fallback_template"] is True

    page = watched.page
    note = page.locator("#messages .model-note")
    page.select_option("#chat-model", GEMMA)
    note.wait_for()
    text = note.inner_text()
    assert f"{GEMMA} is a base model" in text and "fallback template, ChatML" in text and "ramble" in text, text
    assert "instruct model" in text and "/v1/completions" in text, text
    assert "base model" in page.locator(f"li.card.model[data-model='{GEMMA}'] .chips").inner_text()
    watched.shot("base-model")
    page.select_option("#chat-model", TINY)  # no template in its file, but one from its config
    note.wait_for(state="detached")
    assert "base model" not in page.locator(f"li.card.model[data-model='{TINY}'] .chips").inner_text()
    page.select_option("#chat-model", GEMMA)
    note.wait_for()
    page.click(f"#messages .model-note button:text-is('Chat with {SMOL} instead')")
    note.wait_for(state="detached")
    assert page.locator("#chat-model").input_value() == SMOL
    page.wait_for_timeout(1500)  # a status poll later, the choice holds
    assert page.locator("#chat-model").input_value() == SMOL and note.count() == 0
    assert watched.errors == []


def test_the_option_fields_show_the_models_sampling_defaults(watched, studio):
    """A field left empty sends nothing and the model's defaults apply: the field shows which (SmolLM2's authors'
    temperature 0.2 from the studio's table for it, the answer limit capped at the context)."""
    page = watched.page
    page.click("#chat-options summary")  # the Options panel
    page.select_option("#chat-model", SMOL)
    temperature = page.locator("#opt-temperature")
    page.wait_for_function("document.querySelector('#opt-temperature').placeholder === '0.2'")
    assert "from config" in (temperature.get_attribute("title") or "")
    page.select_option("#chat-model", GEMMA)  # no sampling of its own: llama-server's default
    page.wait_for_function("document.querySelector('#opt-temperature').placeholder === '0.8'")
    assert page.locator("#opt-max-tokens").get_attribute("placeholder") == "4096"
    assert watched.errors == []
