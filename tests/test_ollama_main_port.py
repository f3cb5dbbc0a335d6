"""An Ollama client pointed at the studio's main port (issue 55): the 404 says where the Ollama API is.

The Ollama API has a listener of its own (``--ollama-port``, off by default), since its routes live under
``/api``, as the studio's own API does. On ``b5a9904`` the main port answered ``GET /api/tags`` with a bare
"no such route". The app here is the real one around a stand-in manager (``tests.standin_manager``): a 404
needs no model. ``tests/test_serve_ollama_port.py`` checks the same through ``ggstudio serve --ollama-port``.
"""

from __future__ import annotations

import functools

import pytest
from fastapi.testclient import TestClient

from studio.http.app import create_app
from studio.http.clients.ollama_app import main_port_hint
from tests.standin_manager import StandInManager, StandInModel

#: What Ollama clients ask first (``ollama list``, ``ollama ps``, ``ollama show``, ``ollama run``, embeddings).
OLLAMA_ROUTES = [
    ("GET", "/api/tags"),
    ("GET", "/api/ps"),
    ("GET", "/api/version"),
    ("POST", "/api/show"),
    ("POST", "/api/generate"),
    ("POST", "/api/embed"),
    ("POST", "/api/embeddings"),
    ("DELETE", "/api/delete"),
]


def main_port(ollama_port: int | None = None) -> TestClient:
    """The studio's main port, as ``ggstudio serve`` builds it (no ``ollama_port``: the Ollama listener is off)."""
    manager = StandInManager(StandInModel(name="standin", url="http://127.0.0.1:9"))
    hint = functools.partial(main_port_hint, ollama_port=ollama_port)
    return TestClient(create_app(manager, not_found_hint=hint), base_url="http://127.0.0.1:8080")


@pytest.mark.parametrize("method, path", OLLAMA_ROUTES)
def test_an_ollama_route_on_the_main_port_says_how_to_turn_the_ollama_port_on(method, path):
    with main_port() as client:
        resp = client.request(method, path, json={"model": "standin"} if method != "GET" else None)
    assert resp.status_code == 404
    error = resp.json()["error"]  # the main port's (OpenAI's) error shape
    assert error["type"] == "not_found_error" and error["message"].startswith(f"no such route: {method} {path}; ")
    assert "`--ollama-port 11434`" in error["message"] and "GGUF_STUDIO_OLLAMA_PORT=11434" in error["message"]


@pytest.mark.parametrize("method, path", OLLAMA_ROUTES)
def test_an_ollama_route_on_the_main_port_names_the_ollama_port(method, path):
    with main_port(ollama_port=11434) as client:
        resp = client.request(method, path, json={"model": "standin"} if method != "GET" else None)
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert "point Ollama clients at http://127.0.0.1:11434" in message and "`--ollama-port`" in message, message


def test_the_studios_own_api_routes_and_other_paths_get_no_ollama_hint():
    """``/api/chat`` is the page's chat on the main port and Ollama's on its own: the studio's route answers."""
    with main_port(ollama_port=11434) as client:
        assert client.get("/api/status").status_code == 200
        assert client.get("/api/chat").status_code == 405  # the page's chat route, which takes POST
        for path in ("/api/chat", "/api/no-such-route", "/v1/no-such-route", "/no-such-page"):
            answer = client.get(path).json()["error"]["message"]
            assert "Ollama" not in answer, (path, answer)
