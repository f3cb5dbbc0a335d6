"""A real Chromium against a real studio: web pages elsewhere get nothing; the studio's own page works.

The studio runs under uvicorn with a real llama-server on the tiny zoo model. A
second HTTP server on another port serves ``fixtures/browser/page.html``: opened at
``http://127.0.0.1:PORT`` it is a foreign page (the attack), at
``http://localhost:PORT`` an allow-listed one. The same page at
``/test-page`` on the studio's own origin stands in for the studio's page (a route
only this test adds). A DNS-rebinding page is imitated with Chromium's host
resolver (``evil.example`` → 127.0.0.1) and a page Playwright serves under that
name on the studio's port.

Every response the studio sends is recorded by a spy around the app, so "refused"
means the studio answered 403/415, not that the browser never sent it; llama-server's
own token counters (``/metrics``) show whether the model ran.

The API docs page (``/docs``) is opened with every request to another host cut off, as on a
desktop without a network.
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from fastapi.responses import HTMLResponse
from playwright.sync_api import Page, Route, expect, sync_playwright

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.http.guards.access import AccessPolicy
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from studio.views.residency import status_json
from tests.helpers import assert_no_children, free_port, wait_for
from tests.support.browser import CHROMIUM
from tests.support.browser import FLAGS as CHROMIUM_FLAGS

PAGE = Path(__file__).parent / "fixtures" / "browser" / "page.html"
TINY = "llama-dense"
# The flags Chromium needs here (tests.support.browser), then the rebinding name, and Chrome's own
# private-network checks off: they stop a public page's requests to loopback in Chrome alone (not
# Firefox or Safari), and what is tested here is the studio's defence.
FLAGS = [
    *CHROMIUM_FLAGS,
    "--host-resolver-rules=MAP evil.example 127.0.0.1",
    "--disable-features=BlockInsecurePrivateNetworkRequests,LocalNetworkAccessChecks",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shared_processes,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make chromium` installs it"),
]


class Spy:
    """ASGI wrapper that records (method, path, origin, status) of every response the studio sends."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[tuple[str, str, str | None, int]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = dict(scope["headers"]).get(b"origin")

        async def spying(message):
            if message["type"] == "http.response.start":
                self.seen.append((scope["method"], scope["path"], origin and origin.decode(), message["status"]))
            await send(message)

        await self.app(scope, receive, spying)

    def since(self, mark: int) -> list[tuple[str, str, str | None, int]]:
        return self.seen[mark:]


@pytest.fixture(scope="module")
def elsewhere():
    """A second local web server on another port, serving the page; yields its port."""
    handler = functools.partial(_QuietHandler, directory=str(PAGE.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def studio(llama_server_bin, zoo_dir, elsewhere, tmp_path_factory):
    """The studio with the tiny model loaded, allowing the page at http://localhost:<elsewhere>.

    Yields (url, manager, spy)."""
    root = tmp_path_factory.mktemp("browser-studio")
    models = root / "models"
    models.mkdir()
    (models / f"{TINY}.gguf").symlink_to(zoo_dir / f"{TINY}.gguf")
    supervisors = supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token()))
    manager = ModelManager(
        catalog=Catalog([models]),
        binary=llama_server_bin,
        make_supervisor=supervisors,
        caps=probe(llama_server_bin, cache_dir=root / "cache"),
        model_defaults={TINY: ModelDefaults(n_ctx=256, spec="off")},
    )
    app = create_app(manager, access=AccessPolicy.create(allowed_origins=[f"http://localhost:{elsewhere}"]))

    @app.get("/test-page", include_in_schema=False)
    async def test_page() -> HTMLResponse:  # stands in for the studio's own page until it exists
        return HTMLResponse(PAGE.read_text())

    spy = Spy(app)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(spy, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn to start")
    url = f"http://127.0.0.1:{port}"
    assert httpx.post(f"{url}/api/load", json={"model": TINY}, timeout=120).json()["state"] == "ready"
    yield url, manager, spy
    server.should_exit = True
    thread.join(30)
    assert_no_children()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium (Debian's, not a downloaded one) with a new, empty profile."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=FLAGS
        )
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser):
    page = browser.new_page()
    yield page
    page.close()


def tokens(manager: ModelManager) -> tuple[int, int]:
    """(prompt tokens, generated tokens) llama-server has processed so far, from its own /metrics."""
    loaded = manager.loaded
    text = httpx.get(f"{loaded.url}/metrics", headers=loaded.auth_headers, timeout=10).text
    counts = [
        int(float(re.search(rf"^llamacpp:{name} (\S+)$", text, re.M)[1]))
        for name in ("prompt_tokens_total", "tokens_predicted_total")
    ]
    return counts[0], counts[1]


def chat_body() -> str:
    return json.dumps({"model": TINY, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})


def call(page: Page, function: str, *args: str) -> dict:
    return page.evaluate(f"(args) => {function}(...args)", list(args))


def test_a_foreign_page_can_neither_run_the_model_nor_unload_it_nor_read_anything(studio, elsewhere, page):
    url, manager, spy = studio
    page.goto(f"http://127.0.0.1:{elsewhere}/page.html")
    before, pid, mark = tokens(manager), status_json(manager)["pid"], len(spy.seen)
    foreign = f"http://127.0.0.1:{elsewhere}"

    # simple requests: sent without a preflight, the page does not care to read the answer
    assert call(page, "simplePost", f"{url}/v1/chat/completions", chat_body())["type"] == "opaque"
    assert call(page, "simplePost", f"{url}/api/unload", "")["type"] == "opaque"
    assert "error" in call(page, "simpleCorsPost", f"{url}/v1/completions", json.dumps({"prompt": "hi"}))
    # a JSON body: the preflight is refused, so the POST itself is never sent
    assert "error" in call(page, "jsonPost", f"{url}/v1/chat/completions", chat_body())
    # reads of model output and state
    for path in ("/api/status", "/v1/models", "/api/logs?follow=false"):
        assert "error" in call(page, "get", f"{url}{path}"), path
    with page.expect_navigation() as navigation:
        page.evaluate("(u) => formPost(u)", f"{url}/api/unload")
    assert navigation.value.status == 403

    # (once the form has navigated to the studio's 403, Chromium may ask it for /favicon.ico: not the page's doing)
    answered = [seen for seen in spy.since(mark) if seen[1] != "/favicon.ico"]
    assert answered == [
        ("POST", "/v1/chat/completions", foreign, 403),
        ("POST", "/api/unload", foreign, 403),
        ("POST", "/v1/completions", foreign, 403),
        ("OPTIONS", "/v1/chat/completions", foreign, 403),
        ("GET", "/api/status", foreign, 403),
        ("GET", "/v1/models", foreign, 403),
        ("GET", "/api/logs", foreign, 403),
        ("POST", "/api/unload", foreign, 403),
    ]
    assert tokens(manager) == before  # the model did not run
    assert status_json(manager)["state"] == "ready" and status_json(manager)["pid"] == pid  # nor was it unloaded


def test_a_rebinding_page_on_the_studios_port_is_refused_by_its_host_name(studio, page):
    """A page under evil.example:PORT whose name now points at 127.0.0.1 is same-origin: only Host gives it away."""
    url, manager, spy = studio
    port = url.rsplit(":", 1)[1]
    rebound = f"http://evil.example:{port}"
    page.route(f"{rebound}/page.html", lambda route: route.fulfill(body=PAGE.read_text(), content_type="text/html"))
    page.goto(f"{rebound}/page.html")
    before, mark = tokens(manager), len(spy.seen)
    status = call(page, "get", "/api/status")
    assert status["status"] == 403 and json.loads(status["body"])["error"]["code"] == "host_not_allowed"
    chat = call(page, "jsonPost", "/v1/chat/completions", chat_body())
    assert chat["status"] == 403 and json.loads(chat["body"])["error"]["code"] == "host_not_allowed"
    assert [s for *_, s in spy.since(mark)] == [403, 403]
    assert tokens(manager) == before and status_json(manager)["state"] == "ready"


def sse_types(text: str) -> list[str]:
    """The event types of the GUI's SSE stream, whatever spacing its JSON is written with."""
    return [json.loads(line[6:])["type"] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_studios_own_page_works(studio, page, host):
    url, manager, spy = studio
    own = url.replace("127.0.0.1", host)
    page.goto(f"{own}/test-page")
    before = tokens(manager)
    status = call(page, "get", "/api/status")
    assert status["status"] == 200 and json.loads(status["body"])["state"] == "ready"
    chat = call(page, "jsonPost", "/v1/chat/completions", chat_body())
    assert chat["status"] == 200, chat
    assert json.loads(chat["body"])["usage"]["completion_tokens"] >= 1
    streamed = call(page, "streamChat", "/api/chat", chat_body())
    assert streamed["status"] == 200 and "done" in sse_types(streamed["text"]), streamed
    assert tokens(manager)[1] > before[1]  # the model ran
    refused = call(page, "simpleCorsPost", "/v1/chat/completions", chat_body())  # its own page may read why
    assert refused["status"] == 415 and "application/json" in json.loads(refused["body"])["error"]["message"]


def test_an_allow_listed_page_works_across_origins(studio, elsewhere, page):
    url, manager, spy = studio
    page.goto(f"http://localhost:{elsewhere}/page.html")
    before, mark = tokens(manager), len(spy.seen)
    status = call(page, "get", f"{url}/api/status")
    assert status["status"] == 200 and status["type"] == "cors"
    chat = call(page, "jsonPost", f"{url}/v1/chat/completions", chat_body())
    assert chat["status"] == 200 and json.loads(chat["body"])["choices"], chat
    assert tokens(manager)[1] > before[1]
    methods = [(m, s) for m, _, _, s in spy.since(mark)]
    assert ("OPTIONS", 204) in methods and ("POST", 200) in methods  # a real preflight, then the request


def test_docs_page_renders_offline(studio, page, tmp_path):
    """Issue 55: Swagger UI's scripts came from a CDN, so offline ``/docs`` was a blank page. With every request
    to another host aborted, the page lists the routes, from files the studio serves itself."""
    url, _, spy = studio
    offsite: list[str] = []
    errors: list[str] = []

    def local_only(route: Route) -> None:
        if urlsplit(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            offsite.append(route.request.url)
            route.abort("internetdisconnected")

    page.route("**/*", local_only)
    page.on("pageerror", lambda error: errors.append(str(error)))
    mark = len(spy.seen)
    page.goto(f"{url}/docs")
    operation = page.get_by_text("/v1/chat/completions", exact=True).first
    try:
        expect(operation).to_be_visible(timeout=20_000)
        operation.scroll_into_view_if_needed()
    finally:
        page.screenshot(path=tmp_path / "docs-offline.png")  # blank on b5a9904
    assert offsite == [] and errors == []
    answered = [(p, status) for _, p, _, status in spy.since(mark) if p != "/favicon.ico"]
    assert ("/openapi.json", 200) in answered
    assert all(status == 200 for _, status in answered), answered
