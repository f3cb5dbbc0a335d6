"""Two clients whose requests force a swap, then the page's Activity view open on them: for the browser test
(``tests/test_activity_page.py``) and the docs' picture (``scripts/activity_screenshot.py``)."""

from __future__ import annotations

import threading

import httpx
from playwright.sync_api import Page

#: The two models of the studio the flow runs against (room for one at a time).
MODELS = ("smollm", "gemma")


def ask(base: str, model: str, client: str, words: str = "Say hello in five words.") -> None:
    """One streamed chat from a client named by its user agent."""
    body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 24, "stream": True}
    headers = {"User-Agent": client}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for _ in resp.iter_lines():
            pass


def two_clients_swap(base: str) -> None:
    """Client A asks SmolLM2 (a load), then client B asks Gemma while A asks again: B's load evicts SmolLM2."""
    ask(base, "smollm", "client-a/1.0")
    second = threading.Thread(target=ask, args=(base, "smollm", "client-a/1.0", "Count to five."))
    second.start()
    ask(base, "gemma", "client-b/1.0")
    second.join(300)


def open_activity(page: Page) -> None:
    """Open the Activity view and wait until it has drawn both lanes."""
    page.click("#activity-open")
    page.wait_for_selector("#activity-dialog[open]")
    for model in MODELS:
        page.wait_for_selector(f"#activity-chart g.lane-group[data-model='{model}'] g.request")
