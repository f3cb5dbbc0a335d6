"""One error translation, shaped per dialect (studio.http.errors), and the token check's dialects.

The official SDKs reading these shapes from a running studio: tests/test_dialects.py.
"""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import gguf
from launcher.capabilities import ProbeError
from launcher.errors import BinaryNotFoundError, LoadError, PortInUseError, StartAbortedError, StartTimeoutError
from launcher.extra_args import ExtraArgsError
from launcher.planner import PlanError
from launcher.speculative import SpeculativeConfigError
from studio.errors import (
    BadRequestError,
    BusyError,
    DiskSpaceError,
    DoesNotFitError,
    DownloadCancelledError,
    HubAuthError,
    HubError,
    ModelNotFoundError,
    ModelNotResidentError,
    ModelUnloadedError,
    RetriesSpentError,
    UpstreamError,
    WorkTimeoutError,
)
from studio.http.errors import (
    ErrorAnswer,
    anthropic_type,
    describe,
    dialect_of,
    error_response,
    stream_error_event,
    upstream_response,
)
from studio.http.guards.auth import BearerTokenMiddleware


@pytest.mark.parametrize(
    "exc, status, type_, code",
    [
        (
            ModelNotFoundError("no such model", param="model", code="model_not_found"),
            404,
            "not_found_error",
            "model_not_found",
        ),
        (BadRequestError("bad"), 400, "invalid_request_error", None),
        (BusyError("full"), 503, "server_busy", None),
        (DoesNotFitError("too big"), 400, "invalid_request_error", "does_not_fit"),
        (ModelNotResidentError("not resident"), 404, "not_found_error", "model_not_resident"),
        (ModelUnloadedError("unloaded meanwhile"), 503, "model_unloaded", "model_unloaded"),
        (WorkTimeoutError("slow header"), 504, "timeout_error", "timeout"),
        (HubError("hub down"), 502, "hub_error", None),
        (HubAuthError("gated"), 401, "authentication_error", None),
        (DiskSpaceError("full disk"), 507, "insufficient_storage", None),
        (DownloadCancelledError("stop"), 499, "cancelled", None),
        (UpstreamError("gone"), 502, "upstream_error", None),
        (RetriesSpentError("died 3 times", tries=3), 502, "upstream_error", "retries_spent"),
        (gguf.GGUFError("not a GGUF file"), 400, "invalid_request_error", "invalid_gguf"),
        (SpeculativeConfigError("warp"), 400, "invalid_request_error", "invalid_speculative"),
        (ExtraArgsError("--port", flags=["--port"]), 400, "invalid_request_error", "invalid_extra_args"),
        (PlanError("does not fit"), 400, "invalid_request_error", "invalid_plan"),
        (StartAbortedError("cancelled"), 409, "load_cancelled", "load_cancelled"),
        (LoadError("exited", cause="out_of_memory"), 502, "server_error", "out_of_memory"),
        (LoadError("exited"), 502, "server_error", "load_failed"),
        (StartTimeoutError("never healthy"), 502, "server_error", "load_failed"),
        (BinaryNotFoundError(["/usr/bin"]), 502, "server_error", "load_failed"),
        (PortInUseError("127.0.0.1", 8080), 502, "server_error", "load_failed"),
        (ProbeError("help unreadable", binary="/bin/llama-server"), 502, "server_error", "load_failed"),
    ],
)
def test_every_error_of_the_layers_below_has_one_answer(exc, status, type_, code):
    answer = describe(exc)
    assert (answer.status, answer.type, answer.code) == (status, type_, code)
    assert answer.message == str(exc)


def test_a_bug_is_not_described():
    assert describe(KeyError("x")) is None and error_response(KeyError("x")) is None


def test_busy_says_when_to_retry_in_every_dialect():
    for dialect in ("openai", "anthropic", "ollama"):
        assert error_response(BusyError("full", retry_after=7), dialect).headers["retry-after"] == "7"


def test_retries_spent_is_told_by_its_code_in_every_dialect():
    """Regression: a request sent again until its retries ran out was told so only in its message; the Anthropic
    and Ollama shapes have no field for a code, so every dialect's answer carries it in a header too."""
    for dialect in ("openai", "anthropic", "ollama"):
        assert error_response(RetriesSpentError("it died", tries=3), dialect).headers["x-error-code"] == "retries_spent"
    assert "x-error-code" not in error_response(BadRequestError("bad"), "anthropic").headers  # none: none sent


def test_the_three_shapes():
    exc = ModelNotFoundError("model 'x' not found", param="model", code="model_not_found")
    assert json.loads(error_response(exc, "openai").body) == {
        "error": {
            "message": "model 'x' not found",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert json.loads(error_response(exc, "anthropic").body) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model 'x' not found"},
    }
    assert json.loads(error_response(exc, "ollama").body) == {"error": "model 'x' not found"}


@pytest.mark.parametrize(
    "status, type_",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (501, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (507, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_anthropic_type_names_by_status(status, type_):
    assert anthropic_type(status) == type_


def test_llama_servers_own_errors_are_reshaped_for_anthropic_and_ollama():
    upstream = json.dumps(
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size",
                "type": "exceed_context_size_error",
                "n_ctx": 512,
            }
        }
    ).encode()
    assert upstream_response(400, upstream, "openai").body == upstream  # OpenAI's own shape passes as it came
    assert json.loads(upstream_response(400, upstream, "anthropic").body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the request exceeds the available context size"},
    }
    assert json.loads(upstream_response(400, upstream, "ollama").body) == {
        "error": "the request exceeds the available context size"
    }
    broken = upstream_response(502, b"<html>bad gateway</html>", "ollama")
    assert broken.status_code == 502 and json.loads(broken.body) == {"error": "<html>bad gateway</html>"}


def test_an_embedding_input_longer_than_a_batch_is_the_clients_400_not_llama_servers_500():
    """b11434 answers it 500, telling the client to raise ``--ubatch-size``: a flag the client has no say in."""
    upstream = json.dumps(
        {
            "error": {
                "code": 500,
                "message": "input (9001 tokens) is too large to process. increase the physical batch size "
                "(current batch size: 512)",
                "type": "server_error",
            }
        }
    ).encode()
    for dialect in ("openai", "anthropic", "ollama"):
        answer = upstream_response(500, upstream, dialect)
        assert answer.status_code == 400, dialect
        assert "9001 tokens" in answer.body.decode() and "at most 512 tokens" in answer.body.decode()
        assert "batch size" not in answer.body.decode()
    assert json.loads(upstream_response(500, upstream, "openai").body)["error"]["code"] == "input_too_long"


def test_a_broken_stream_ends_with_the_dialects_error_event():
    answer = ErrorAnswer(502, "gone", "upstream_error")
    assert stream_error_event(answer, "anthropic") == (
        b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "gone"}}\n\n'
    )
    assert stream_error_event(answer, "openai").startswith(b'data: {"error": {"message": "gone"')


def test_dialect_of_paths():
    assert dialect_of("/v1/messages") == dialect_of("/v1/messages/count_tokens") == "anthropic"
    assert dialect_of("/v1/chat/completions") == dialect_of("/v1/responses") == dialect_of("/api/status") == "openai"


@pytest.fixture
def guarded() -> TestClient:
    app = FastAPI()

    @app.get("/v1/models")
    @app.post("/v1/messages")
    async def ok() -> dict[str, str]:
        return {"ok": "yes"}

    app.add_middleware(BearerTokenMiddleware, token="s3cret")
    with TestClient(app) as client:
        yield client


def test_the_token_as_bearer_or_as_anthropics_x_api_key(guarded):
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert guarded.post("/v1/messages", headers={"x-api-key": "s3cret"}).status_code == 200
    assert guarded.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    assert guarded.get("/v1/models", headers={"Authorization": "s3cret"}).status_code == 401  # not a bearer token


def test_a_refused_token_is_shaped_for_the_paths_dialect(guarded):
    refused = guarded.post("/v1/messages", headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "authentication_error"
    assert guarded.get("/v1/models").json()["error"]["code"] == "invalid_api_key"


def test_a_form_body_on_a_studio_route_names_the_content_type_not_none():
    """curl -d sends a form's content type; /api/plan answered "None: Input should be a valid dictionary"."""
    from studio.http.app import create_app
    from tests.standin_manager import StandInManager, StandInModel

    manager = StandInManager(StandInModel(name="standin", url="http://127.0.0.1:9"))
    with TestClient(create_app(manager), base_url="http://127.0.0.1:8080") as client:
        refused = client.post("/api/plan", content=b'{"model": "standin"}')
    error = refused.json()["error"]
    assert refused.status_code == 422 and "None" not in error["message"], error
    assert "Content-Type: application/json" in error["message"] and error["param"] is None
