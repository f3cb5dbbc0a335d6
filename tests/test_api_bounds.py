"""Bounds where a client reaches the studio: strict bodies on its own API, body limits on both listeners.

The studio's own ``/api`` bodies refuse fields they do not know, naming them (a misspelt
``ctx`` was dropped and the load went ahead with the default context); the forwarded
dialects' bodies pass unknown fields on to llama-server. Both listeners refuse a body over
``max_body_bytes`` without reading it whole. Runs the real apps around the stand-in manager
(``tests.standin_manager``) and the replay upstream: no llama-server is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from studio.http.app import create_app
from studio.http.clients.ollama_app import create_ollama_app
from tests.helpers import serving
from tests.replay_upstream import Answer
from tests.standin_manager import StandInManager, StandInModel

BASE = "http://127.0.0.1:8080"
LIMIT = 1024 * 1024
CHUNK = 64 * 1024


def studio_app(url: str = "http://127.0.0.1:9") -> FastAPI:
    return create_app(StandInManager(StandInModel(name="replay", url=url)), max_body_bytes=LIMIT)


@pytest.fixture(scope="module")
def client():
    with TestClient(studio_app(), base_url=BASE) as c:
        yield c


def test_load_body_with_unknown_field_is_refused_naming_it(client):
    """``ctx`` for ``n_ctx`` was dropped: the load went ahead with the default context, saying nothing."""
    resp = client.post("/api/load", json={"model": "replay", "ctx": 8192})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["param"] == "ctx" and error["type"] == "invalid_request_error"
    assert error["message"] == "ctx: unknown field; did you mean n_ctx?"


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/api/plan", {"model": "replay", "n_context": 4096}, "n_context"),
        ("/api/unload", {"model": "replay", "grace_seconds": 1}, "grace_seconds"),
        ("/api/pin", {"model": "replay", "pin": True}, "pin"),
        ("/api/ttl", {"model": "replay", "ttl": 5, "seconds": 5}, "seconds"),
        ("/api/pull", {"model": "owner/repo:Q4_K_M", "rev": "main"}, "rev"),
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "tool_limits": {"max_iteration": 3}}, None),
    ],
)
def test_every_body_of_the_studios_own_api_refuses_an_unknown_field(client, path, body, field):
    resp = client.post(path, json=body)
    assert resp.status_code == 422, (path, resp.text)
    error = resp.json()["error"]
    param = field or "tool_limits.max_iteration"
    assert error["param"] == param and error["message"].startswith(f"{param}: unknown field; ")


def test_an_unknown_field_far_from_every_known_one_lists_them(client):
    error = client.post("/api/pin", json={"model": "replay", "zzz": 1}).json()["error"]
    assert error["message"] == "zzz: unknown field; the fields are model, pinned"


def test_an_unknown_field_in_an_openai_chat_body_still_reaches_llama_server(replay):
    """The forwarded dialects are llama-server's: a field the studio does not know is its business."""
    with serving(studio_app(replay.url)) as base:
        replay.script(Answer.text("ok"))
        body = {"messages": [{"role": "user", "content": "x"}], "n_probs": 2, "future_sampler": {"k": 1}}
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 200
    sent = replay.requests[-1]
    assert sent["n_probs"] == 2 and sent["future_sampler"] == {"k": 1}


# -- body limits ----------------------------------------------------------------------------------------


async def _post_big(app: FastAPI, path: str, *, declared: bool) -> tuple[httpx.Response, int]:
    """POST 40 MiB to ``path``: with ``Content-Length``, or streamed; the answer and the bytes pulled from the body."""
    pulled = 0
    size = 40 * 1024 * 1024

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(size // CHUNK):
            pulled += CHUNK
            yield b"a" * CHUNK

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:11434") as http:
        headers = {"content-type": "application/json"}
        if declared:
            return await http.post(path, content=b"a" * size, headers=headers), size
        return await http.post(path, content=chunks(), headers=headers), pulled


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
def test_ollama_listener_refuses_oversized_body_with_413(declared):
    """It read a 40 MiB body whole and answered 404 (no such model); the main listener answers 413."""
    ollama = create_ollama_app(studio_app())
    resp, pulled = asyncio.run(_post_big(ollama, "/api/generate", declared=declared))
    assert resp.status_code == 413, resp.text
    message = resp.json()["error"]  # Ollama's shape: {"error": "message"}
    assert isinstance(message, str) and "1,048,576" in message and "max_body_bytes" in message
    if not declared:
        assert pulled <= LIMIT + 2 * CHUNK  # refused as the limit passed, not after reading 40 MiB


@pytest.mark.parametrize(
    "listener, path, shape",
    [
        ("studio", "/v1/chat/completions", "openai"),
        ("studio", "/v1/messages", "anthropic"),
        ("studio", "/api/chat", "openai"),
        ("ollama", "/v1/chat/completions", "openai"),
        ("ollama", "/api/chat", "ollama"),
    ],
)
def test_an_oversized_body_is_refused_in_the_routes_error_shape(listener, path, shape):
    studio = studio_app()
    app = create_ollama_app(studio) if listener == "ollama" else studio
    resp, pulled = asyncio.run(_post_big(app, path, declared=False))
    assert resp.status_code == 413 and pulled <= LIMIT + 2 * CHUNK
    body = resp.json()
    if shape == "openai":
        assert body["error"]["code"] == "request_too_large"
    elif shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    else:
        assert isinstance(body["error"], str)
