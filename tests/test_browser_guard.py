"""The browser guard on the real app: Host, Origin, CORS preflights and body types, on every route.

The app is the real one around a real model manager with an empty catalog: no
llama-server is started, so a request that gets through ends in the studio's own
"no model" or "not found" answers, which is what tells it from a refused one.
The Chromium test (``test_browser.py``) shows the same from a real browser.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.websockets import WebSocket, WebSocketDisconnect

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.http.clients.ollama_app import create_ollama_app
from studio.http.errors import dialect_of
from studio.http.guards.access import AccessPolicy
from studio.http.guards.browser_guard import BrowserGuard
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from tests.helpers import free_port, wait_for

BASE = "http://127.0.0.1:8080"
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture
def manager(llama_server_bin, tmp_path):
    supervisors = supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token()))
    return ModelManager(
        catalog=Catalog([tmp_path / "models"]),
        binary=llama_server_bin,
        make_supervisor=supervisors,
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
    )


@pytest.fixture
def app(manager):
    return create_app(manager, access=AccessPolicy.create(allowed_origins=["http://localhost:3000"]))


@pytest.fixture
def client(app):
    with TestClient(app, base_url=BASE) as c:
        yield c


def every_route(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app has (its OpenAPI, and the docs pages), path parameters filled in."""
    out = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, operations in app.openapi()["paths"].items()
        for method in operations
    ]
    for route in app.routes:
        if isinstance(route, Route):
            out += [(method, route.path) for method in sorted(route.methods or ())]
    return out


def test_a_foreign_host_is_refused_on_every_route(app, client):
    """The DNS-rebinding defence: every route, /health and /docs too, and paths that do not exist."""
    routes = every_route(app) + [("GET", "/no-such-path"), ("OPTIONS", "/v1/chat/completions")]
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/health") in routes and len(routes) > 15
    for method, path in routes:
        for host in ("evil.example", "evil.example:8080"):
            resp = client.request(method, path, headers={"host": host}, json=CHAT if method == "POST" else None)
            assert resp.status_code == 403, (method, path, resp.status_code)
            if method == "HEAD":
                continue
            error = resp.json()["error"]
            if dialect_of(path) == "anthropic":  # in the shape of the route's clients: Anthropic's has no code
                assert error["type"] == "permission_error" and "Host header" in error["message"], (method, path)
            else:
                assert error["code"] == "host_not_allowed", (method, path)


@pytest.mark.parametrize("host", ["localhost:8080", "127.0.0.1:8080", "[::1]:8080", "localhost"])
def test_loopback_hosts_are_answered(client, host):
    assert client.get("/health", headers={"host": host}).json() == {"status": "ok"}
    assert client.get("/api/status", headers={"host": host}).json()["state"] == "unloaded"


def test_a_page_from_a_foreign_origin_is_refused_whatever_it_asks(client):
    for method, path, headers, body in [
        ("GET", "/api/status", {}, {}),
        ("GET", "/v1/models", {}, {}),
        ("GET", "/api/logs", {}, {}),
        ("POST", "/api/unload", {}, {}),
        ("POST", "/v1/chat/completions", {}, {"json": CHAT}),
        ("POST", "/v1/chat/completions", {"content-type": "text/plain"}, {"content": b"{}"}),
        ("POST", "/api/load", {}, {"data": {"model": "x"}}),
        ("GET", "/health", {}, {}),
    ]:
        for origin in ("http://evil.example", "http://127.0.0.1:3000", "http://localhost:8080", "null"):
            resp = client.request(method, path, headers={"origin": origin, **headers}, **body)
            assert resp.status_code == 403, (method, path, origin)
            assert resp.json()["error"]["code"] == "origin_not_allowed"
            assert "access-control-allow-origin" not in resp.headers  # the page cannot even read why


def test_the_own_page_and_an_allowed_page_get_through(client):
    own = client.post("/v1/chat/completions", json=CHAT, headers={"origin": BASE})
    assert own.status_code == 400 and own.json()["error"]["param"] == "model"  # reached the proxy: no model loaded
    assert "access-control-allow-origin" not in own.headers  # same-origin: nothing to allow
    friend = client.get("/api/status", headers={"origin": "http://localhost:3000"})
    assert friend.status_code == 200 and friend.json()["state"] == "unloaded"
    assert friend.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "Origin" in friend.headers["vary"]


def test_preflights_are_answered_only_for_allowed_origins(client):
    ask = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization, x-stainless-os",
    }
    ok = client.options("/v1/chat/completions", headers={"origin": "http://localhost:3000", **ask})
    assert ok.status_code == 204
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert ok.headers["access-control-allow-headers"] == "content-type, authorization, x-stainless-os"
    assert int(ok.headers["access-control-max-age"]) > 0
    refused = client.options("/v1/chat/completions", headers={"origin": "http://evil.example", **ask})
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    private = client.options(
        "/api/status",
        headers={
            "origin": "http://localhost:3000",
            "access-control-request-method": "GET",
            "access-control-request-private-network": "true",
        },
    )
    assert private.headers["access-control-allow-private-network"] == "true"


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
    ],
)
def test_a_body_that_is_not_declared_json_is_a_415(client, content_type):
    """What a browser sends cross-site without a preflight never reaches a JSON route: from a page (``Origin``), or
    from an old browser's form, which sent no ``Origin`` but a browser's ``User-Agent`` the page cannot change."""
    page = {"origin": "http://localhost:3000"}
    old_form = {"user-agent": "Mozilla/5.0 (X11; Linux x86_64; rv:68.0) Gecko/20100101 Firefox/68.0"}
    for path in ("/v1/chat/completions", "/api/load", "/api/unload", "/api/chat", "/api/plan"):
        for sender in (page, old_form):
            resp = client.post(path, content=b'{"model": "x"}', headers={"content-type": content_type, **sender})
            assert resp.status_code == 415, (path, content_type, sender)
            assert resp.json()["error"]["code"] == "unsupported_media_type"
            assert "application/json" in resp.json()["error"]["message"]


def test_curl_d_without_a_content_type_is_read_as_json_as_ollama_reads_it(app):
    """``curl -d '{...}'`` declares a form; Ollama's own documentation calls it so, and Ollama reads the JSON. A
    client that is no browser (no ``Origin``, not a browser's ``User-Agent``) has its body read as JSON on both
    ports; the same form from a browser is still a 415, in the port's own error shape."""
    curl = {"content-type": "application/x-www-form-urlencoded", "user-agent": "curl/8.5.0"}
    browser = {**curl, "user-agent": "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36"}
    ollama_app = create_ollama_app(app)
    with TestClient(app, base_url=BASE) as studio, TestClient(ollama_app, base_url=BASE) as ollama:
        chat = studio.post("/v1/chat/completions", content=b'{"messages": []}', headers=curl)
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"  # read: it names no model
        asked = b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}'
        missing = ollama.post("/api/chat", content=asked, headers=curl)
        assert missing.status_code == 404 and "no-such-model" in missing.json()["error"]
        refused = ollama.post("/api/chat", content=asked, headers=browser)
        assert refused.status_code == 415 and "application/json" in refused.json()["error"]
        assert studio.post("/v1/chat/completions", content=b"{}", headers=browser).status_code == 415


def test_refusals_are_shaped_for_the_routes_dialect(app):
    """The guard's answers read as the client's own errors: Anthropic's on its routes, Ollama's on its port."""
    ollama_app = create_ollama_app(app)
    foreign = {"origin": "http://evil.example"}
    with TestClient(app, base_url=BASE) as studio, TestClient(ollama_app, base_url=BASE) as ollama:
        anthropic = studio.post("/v1/messages", json=CHAT, headers=foreign)
        assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"
        assert "evil.example" in anthropic.json()["error"]["message"]
        host = studio.post("/v1/messages", json=CHAT, headers={"host": "evil.example"})
        assert host.status_code == 403 and host.json()["error"]["type"] == "permission_error"
        assert "Host header" in host.json()["error"]["message"]
        on_ollama = ollama.post("/api/chat", json=CHAT, headers=foreign)
        assert on_ollama.status_code == 403 and "evil.example" in on_ollama.json()["error"]
        preflight = ollama.options("/api/chat", headers={**foreign, "access-control-request-method": "POST"})
        assert preflight.status_code == 403 and "evil.example" in preflight.json()["error"]
        openai_there = ollama.post("/v1/chat/completions", json=CHAT, headers=foreign)
        assert openai_there.json()["error"]["code"] == "origin_not_allowed"  # OpenAI's routes: OpenAI's shape


def test_json_with_parameters_and_untyped_bodies_still_work(client):
    typed = client.post(
        "/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": "Application/JSON; charset=utf-8"}
    )
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "model"
    assert client.post("/api/unload").json()["state"] == "unloaded"  # no body, no type: as before


def test_a_route_named_as_taking_other_bodies_is_left_to_itself():
    async def upload(request):
        return JSONResponse({"got": (await request.body()).decode()})

    app = Starlette(
        routes=[Route("/v1/upload", upload, methods=["POST"]), Route("/v1/other", upload, methods=["POST"])]
    )
    guarded = BrowserGuard(app, AccessPolicy.create(), other_bodies=frozenset({"/v1/upload"}))
    with TestClient(guarded, base_url=BASE) as client:
        form = {"content-type": "multipart/form-data; boundary=x"}
        assert client.post("/v1/upload", content=b"--x--", headers=form).json() == {"got": "--x--"}
        from_a_page = {**form, "user-agent": "Mozilla/5.0 (X11; Linux x86_64; rv:68.0) Gecko/20100101 Firefox/68.0"}
        assert client.post("/v1/other", content=b"--x--", headers=from_a_page).status_code == 415
        # the origin rule still holds there: a foreign page's form cannot upload
        assert (
            client.post("/v1/upload", content=b"--x--", headers={**form, "origin": "http://evil.example"}).status_code
            == 403
        )


def test_api_token_by_bearer_or_x_api_key_and_preflights_need_none(manager):
    app = create_app(manager, api_token="s3cret", access=AccessPolicy.create(allowed_origins=["http://localhost:3000"]))
    with TestClient(app, base_url=BASE) as client:
        assert client.get("/api/status").status_code == 401
        assert client.get("/api/status", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/api/status", headers={"authorization": "bearer s3cret"}).status_code == 200
        assert client.get("/api/status", headers={"x-api-key": "s3cret"}).status_code == 200
        assert client.get("/api/status", headers={"x-api-key": "s3cre"}).status_code == 401
        assert client.get("/api/status", headers={"authorization": "Basic s3cret"}).status_code == 401
        assert client.post("/v1/messages", json=CHAT, headers={"x-api-key": "wrong"}).status_code == 401
        preflight = client.options(
            "/v1/chat/completions",
            headers={
                "origin": "http://localhost:3000",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization",
            },
        )
        assert preflight.status_code == 204  # a browser sends no token with a preflight
        # a foreign Host learns nothing else, not even that a token is needed
        assert client.get("/api/status", headers={"host": "evil.example"}).status_code == 403


def test_a_websocket_from_a_foreign_page_or_host_never_opens(manager):
    app = create_app(manager)

    @app.websocket("/ws-probe")
    async def probe_socket(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text("open")
        await ws.close()

    with TestClient(app, base_url=BASE) as client:
        with client.websocket_connect("ws://127.0.0.1:8080/ws-probe", headers={"origin": BASE}) as ws:
            assert ws.receive_text() == "open"
        for url, origin in [
            ("ws://127.0.0.1:8080/ws-probe", "http://evil.example"),
            ("ws://evil.example:8080/ws-probe", "http://evil.example:8080"),
        ]:
            with pytest.raises(WebSocketDisconnect) as info:
                with client.websocket_connect(url, headers={"origin": origin}) as ws:
                    ws.receive_text()
            assert info.value.code == 1008


def test_an_allowed_cross_origin_stream_is_not_buffered():
    """Pure ASGI: the first chunk reaches the page while the app is still producing the rest."""
    release = threading.Event()

    async def stream_app(scope, receive, send):
        async def chunks():
            yield b"data: first\n\n"
            while not release.is_set():
                await asyncio.sleep(0.02)
            yield b"data: last\n\n"

        await StreamingResponse(chunks(), media_type="text/event-stream")(scope, receive, send)

    guarded = BrowserGuard(stream_app, AccessPolicy.create(allowed_origins=["http://localhost:3000"]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(guarded, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=30, what="uvicorn to start")
        with httpx.stream(
            "GET", f"http://127.0.0.1:{port}/events", headers={"origin": "http://localhost:3000"}, timeout=30
        ) as resp:
            assert resp.headers["access-control-allow-origin"] == "http://localhost:3000"
            lines = resp.iter_lines()
            t0 = time.monotonic()
            assert next(lines) == "data: first"
            assert time.monotonic() - t0 < 10
            release.set()
            assert "data: last" in list(lines)
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
