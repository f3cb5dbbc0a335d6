"""The forwarded-route table without a server: which request goes where, and which slot file names are refused."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from studio.errors import BadRequestError
from studio.http.ahead import MARK, AheadRoutes
from studio.http.clients.ollama_app import router as ollama_router
from studio.http.clients.openai_proxy import FORWARDED, REFUSED, check_slot_file, route_for
from studio.http.clients.openai_proxy import router as proxy_router
from studio.http.errors import error_response
from studio.http.gui.gui_chat import router as gui_chat_router


def test_every_route_llama_server_serves_for_a_model_is_a_row():
    native = {"/completion", "/completions", "/tokenize", "/detokenize", "/apply-template", "/embedding", "/props"}
    native |= {"/slots", "/slots/{id_slot}", "/lora-adapters", "/infill", "/rerank", "/v1/audio/transcriptions"}
    native |= {"/chat/completions", "/v1/chat/completions", "/v1/completions", "/metrics"}
    assert native <= FORWARDED.keys()
    assert not REFUSED.keys() & FORWARDED.keys()


@pytest.mark.parametrize(
    ("method", "path", "query", "upstream"),
    [
        ("POST", "/completions", b"", "/completion"),  # llama-server's bare /completions is its native one
        ("POST", "/chat/completions", b"", "/v1/chat/completions"),
        ("GET", "/props", b"model=m", "/props"),
        ("GET", "/props", b"", "/props"),  # the default model's
        ("POST", "/props", b"", "/props"),
        ("POST", "/slots/12", b"action=save", "/slots/12"),
        ("GET", "/metrics", b"model=m", "/metrics"),
        ("GET", "/metrics", b"", None),  # the studio's own
        ("GET", "/metrics", b"xmodel=m", None),
        ("GET", "/tokenize", b"", None),  # llama-server takes POST only
        ("POST", "/slots/first", b"", None),
        ("POST", "/slots", b"", None),
    ],
)
def test_a_request_goes_to_the_route_llama_server_serves_it_on(method, path, query, upstream):
    found = route_for(method, path, query)
    assert (found[1] if found else None) == upstream


@pytest.mark.parametrize(
    "name", ["../escaped.bin", "/tmp/escaped.bin", "sub/slot.bin", "..", ".", "", "a\\b", "C:\\slots\\x.bin"]
)
def test_a_slot_file_outside_the_slot_folder_is_refused_with_the_reason(name):
    with pytest.raises(BadRequestError, match="plain name") as refused:
        check_slot_file({"filename": name})
    assert refused.value.param == "filename"


def test_a_plain_slot_file_name_and_an_erase_without_one_pass():
    check_slot_file({"filename": "slot-1.bin"})
    check_slot_file({})
    with pytest.raises(BadRequestError, match="must be a string"):
        check_slot_file({"filename": 3})


def ahead_of(routes: list[BaseRoute]) -> AheadRoutes:
    return AheadRoutes(lambda scope, receive, send: None, routes=routes, on_error=error_response)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("routers", "chat_dialect"),
    [((proxy_router, gui_chat_router), "openai"), ((ollama_router, proxy_router), "ollama")],
    ids=["main port", "Ollama port"],
)
def test_a_route_answered_ahead_of_fastapi_is_the_one_fastapis_table_declares(routers, chat_dialect):
    """The forwarded paths' FastAPI routes used to serve only ``/docs`` and 405s while a middleware answered from a
    table of its own: now the middleware's table is read from FastAPI's, and calls the endpoint declared there."""
    routes = [route for router in routers for route in router.routes]
    served = ahead_of(routes)
    declared = {
        (method, route.path): getattr(route.endpoint, MARK)
        for route in routes
        if isinstance(route, APIRoute) and hasattr(route.endpoint, MARK) and "{" not in route.path
        for method in route.methods
    }
    assert served.exact == declared
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat", "/tokenize"):
        assert ("POST", path) in served.exact
    assert served.exact[("POST", "/v1/messages")][1] == "anthropic"
    assert served.exact[("POST", "/api/chat")][1] == chat_dialect
    assert [regex.pattern for regex, _, _ in served.templated] == [r"^/slots/(?P<id_slot>[^/]+)$"]


def test_every_path_llama_server_routes_for_a_model_is_declared_once_for_each_of_its_methods():
    declared = [(m, r.path) for r in proxy_router.routes if isinstance(r, APIRoute) for m in r.methods]
    assert len(declared) == len(set(declared))
    for path, route in FORWARDED.items():
        if route.without_model == "default":
            assert {(m, path) for m in route.methods} <= set(declared)
