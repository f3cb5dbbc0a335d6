"""The history sidebar in a real Chromium against a real studio and llama-server (the zoo's tiny llama).

A chat typed into the page is stored as it streams; a reload of the page, and a restart of
the studio on the same history folder and port, show the same conversation with its settings;
the sidebar renames, searches and deletes. The browser must log no error on the way.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from studio.settings import ModelDefaults
from tests.helpers import assert_no_children, free_port, wait_for
from tests.support.browser import CHROMIUM, chromium
from tests.support.studio import running_studio

TINY = "llama-dense"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make chromium` installs it"),
]


@pytest.fixture
def browser(tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = chromium(pw, profile, viewport={"width": 1280, "height": 800})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)
    assert_no_children()  # Chromium and both studios' llama-servers


def studio(root, binary, zoo_dir, port):
    return running_studio(
        root, binary, {TINY: zoo_dir / f"{TINY}.gguf"}, defaults={TINY: ModelDefaults(n_ctx=512, spec="off")}, port=port
    )


def shown(page: Page) -> list[str]:
    """The conversation as the page shows it: each message's text."""
    return page.locator("#messages .msg .body").all_inner_texts()


def test_a_reload_and_a_restart_of_the_studio_keep_the_conversation_and_its_settings(
    browser, llama_server_bin, zoo_dir, tmp_path
):
    port = free_port()
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    with studio(tmp_path, llama_server_bin, zoo_dir, port) as s:
        page.goto(f"{s.url}/")
        page.wait_for_selector(f"#chat-model option[value='{TINY}']", state="attached")
        page.select_option("#chat-model", TINY)
        page.click("#chat-options summary")
        page.fill("#opt-max-tokens", "12")
        page.fill("#opt-temperature", "0.3")
        page.fill("#chat-input", "Tell me about pelicans and their beaks")
        page.keyboard.press("Enter")
        page.wait_for_selector("#messages .msg.assistant .stats:not(:empty)", timeout=180_000)
        before = shown(page)
        assert before[0] == "Tell me about pelicans and their beaks" and len(before) == 2
        page.wait_for_selector("#history-list li.conv.current")
        assert page.locator("#history-list li.conv.current .conv-open").inner_text() == (
            "Tell me about pelicans and their beaks"
        )

        page.reload()
        wait_for(lambda: shown(page) == before, timeout=30, what="the stored conversation after a reload")
        assert page.locator("#opt-max-tokens").input_value() == "12"
        assert page.locator("#opt-temperature").input_value() == "0.3"
        wait_for(lambda: page.locator("#chat-model").input_value() == TINY, timeout=10, what="the chat's model")

    with studio(tmp_path, llama_server_bin, zoo_dir, port) as s:  # the studio restarted on the same history
        page.reload()
        wait_for(lambda: shown(page) == before, timeout=30, what="the stored conversation after a restart")
        # the page polled while the studio was down; those refusals are reported until the reload, so only
        # after it can they all be set aside
        errors[:] = [e for e in errors if "ERR_CONNECTION_REFUSED" not in e]

        # continuing it: the next turn goes to the same conversation, with its stored options
        page.fill("#chat-input", "And their wings?")
        page.keyboard.press("Enter")
        wait_for(lambda: page.locator("#messages .msg.assistant .stats:not(:empty)").count() == 2, timeout=180)
        (listed,) = httpx.get(f"{s.url}/api/conversations", timeout=10).json()["conversations"]
        stored = httpx.get(f"{s.url}/api/conversations/{listed['id']}", timeout=10).json()
        assert [m["content"] for m in stored["messages"] if m["role"] == "user"] == [
            "Tell me about pelicans and their beaks",
            "And their wings?",
        ]
        assert stored["model"] == TINY and stored["options"]["max_tokens"] == 12 and stored["load"]["n_ctx"] == 512

        # rename, search, new, delete from the sidebar
        page.click("#history-list li.conv.current button:text('Rename')")
        page.fill("#history-list input.conv-title", "Birds")
        page.keyboard.press("Enter")
        wait_for(lambda: page.locator("#history-list .conv-open").all_inner_texts() == ["Birds"], timeout=10)
        page.click("#history-new")
        assert shown(page) == []
        page.fill("#history-search", "pelic")
        wait_for(lambda: page.locator("#history-list li.conv .snippet").count() == 1, timeout=10, what="a hit")
        page.fill("#history-search", "walrus")
        wait_for(lambda: page.locator("#history-note").inner_text() == "No chat matches.", timeout=10)
        page.fill("#history-search", "")
        wait_for(lambda: page.locator("#history-list li.conv").count() == 1, timeout=10)
        page.click("#history-list li.conv .conv-open")
        wait_for(lambda: len(shown(page)) == 4, timeout=10, what="the chat to open again")
        delete = page.locator("#history-list li.conv button:text('Delete')")
        delete.click()
        page.locator("#history-list li.conv button:text('Delete?')").click()
        wait_for(lambda: page.locator("#history-list li.conv").count() == 0, timeout=10, what="the chat to go")
        assert shown(page) == [] and httpx.get(f"{s.url}/api/conversations").json()["conversations"] == []
        page.close()  # before the studio stops: a poll after it would be refused
    assert errors == []
