"""/metrics' parts that need no model: token counts from answer tails, route labels, one registry per app.

Scrapes of a studio serving a real model: tests/test_dialects.py and tests/test_ollama_api.py.
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.http.metrics import RequestMetrics, StudioMetrics, generation_counts
from studio.library.catalog import Catalog
from studio.residency.manager import AdmissionEvent, ModelManager, ResidencyEvent, supervisor_factory

LOOPBACK = "http://127.0.0.1"  # a Host name the browser guard lets in

# The last bytes of b11434's answers, as the relay keeps them (recorded from llama-server).
CHAT_STREAM_END = (
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796155359,"id":"chatcmpl-x",'
    b'"model":"m","object":"chat.completion.chunk","timings":{"cache_n":0,"prompt_n":32,"prompt_ms":399.694,'
    b'"prompt_per_token_ms":12.49,"prompt_per_second":80.06,"predicted_n":5,"predicted_ms":111.309,'
    b'"predicted_per_token_ms":27.82,"predicted_per_second":35.935997987584116}}\n\n',
    b"data: [DONE]\n\n",
)
ANTHROPIC_STREAM_END = (
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
    b'"usage":{"output_tokens":3}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
)
RESPONSES_STREAM_END = (
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_x","usage":'
    b'{"input_tokens":32,"output_tokens":3,"total_tokens":35,"input_tokens_details":{"cached_tokens":31}}},'
    b'"timings":{"cache_n":31,"prompt_n":1,"predicted_n":3,"predicted_ms":41.18,"predicted_per_second":48.5}}\n\n',
)
ANTHROPIC_ANSWER = (
    b'{"id":"chatcmpl-q","type":"message","role":"assistant","content":[{"type":"text","text":"Hi"}],'
    b'"usage":{"cache_read_input_tokens":31,"input_tokens":1,"output_tokens":5}}',
)
INFILL_ANSWER = (b'{"content":"x):","tokens_predicted":4,"tokens_evaluated":9,"stop":true}',)


@pytest.mark.parametrize(
    "tail, tokens, rate",
    [
        (CHAT_STREAM_END, 5, 35.935997987584116),
        (ANTHROPIC_STREAM_END, 3, None),  # the last usage wins over message_start's output_tokens 0
        (RESPONSES_STREAM_END, 3, 48.5),
        (ANTHROPIC_ANSWER, 5, None),
        (INFILL_ANSWER, 4, None),
        ((b"data: [DONE]\n\n",), None, None),
    ],
)
def test_generation_counts_from_the_last_bytes_of_an_answer(tail, tokens, rate):
    assert generation_counts(b"".join(tail)) == (tokens, rate)


@pytest.fixture
def manager(llama_server_bin, tmp_path):
    """A real manager that loads nothing (an empty catalog)."""
    return ModelManager(
        catalog=Catalog([tmp_path / "models"]),
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
    )


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_two_apps_in_one_process_count_apart(manager):
    first, second = create_app(manager), create_app(manager)
    with TestClient(first, base_url=LOOPBACK) as a, TestClient(second, base_url=LOOPBACK) as b:
        a.get("/health")
        a.get("/health")
        b.get("/health")
        key = ("ggstudio_http_requests_total", (("listener", "studio"), ("route", "/health"), ("status", "200")))
        assert samples(a.get("/metrics").text)[key] == 2
        assert samples(b.get("/metrics").text)[key] == 1


def test_routes_are_labelled_by_template_and_unknown_paths_as_other(manager):
    with TestClient(create_app(manager), base_url=LOOPBACK) as client:
        assert client.get("/api/models/no-such-model").status_code == 404
        assert client.get("/no/such/path").status_code == 404
        assert client.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": []}).status_code == 404
        got = samples(client.get("/metrics").text)
    assert (
        got[
            (
                "ggstudio_http_requests_total",
                (("listener", "studio"), ("route", "/api/models/{name:path}"), ("status", "404")),
            )
        ]
        == 1
    )
    assert got[("ggstudio_http_requests_total", (("listener", "studio"), ("route", "other"), ("status", "404")))] == 1
    assert (
        got[("ggstudio_http_requests_total", (("listener", "studio"), ("route", "/v1/messages"), ("status", "404")))]
        == 1
    )
    assert not any(labels and ("route", "/no/such/path") in labels for _, labels in got)


def test_the_gui_chat_answered_ahead_of_the_router_is_counted_under_its_path_not_as_other(manager):
    """``/api/chat`` never reaches FastAPI's router, so it has no matched route to be labelled by."""
    with TestClient(create_app(manager), base_url=LOOPBACK) as client:
        assert client.post("/api/chat", json={"messages": []}).status_code == 422
        got = samples(client.get("/metrics").text)
    key = ("ggstudio_http_requests_total", (("listener", "studio"), ("route", "/api/chat"), ("status", "422")))
    assert got[key] == 1


def test_a_request_that_raises_counts_as_a_500(manager):
    app = FastAPI()

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    metrics = StudioMetrics(manager)
    app.add_middleware(RequestMetrics, metrics=metrics, listener="studio")
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/boom").status_code == 500
    assert metrics.requests.labels("studio", "/boom", "500")._value.get() == 1


def test_each_kind_of_residency_event_has_its_counter(manager):
    """The manager's real events, from real loads and unloads: tests/test_dialects.py and test_ollama_api.py."""
    metrics = StudioMetrics(manager)
    [listener] = manager.listeners
    for event in (
        ResidencyEvent("loaded", "m", 2.0),
        ResidencyEvent("load_failed", "m", 0.5, "error"),
        ResidencyEvent("evicted", "m", 0.3, "ttl"),
        ResidencyEvent("crashed", "m"),
        ResidencyEvent("restarted", "m"),
    ):
        listener(event)
    assert metrics.loads.labels("m", "ok")._value.get() == 1
    assert metrics.loads.labels("m", "error")._value.get() == 1
    assert metrics.evictions.labels("m", "ttl")._value.get() == 1
    assert metrics.load_seconds.labels("m")._sum.get() == 2.0
    assert metrics.eviction_seconds.labels("m")._sum.get() == 0.3
    assert metrics.crashes.labels("m")._value.get() == metrics.restarts.labels("m")._value.get() == 1


def test_each_hold_of_a_model_for_a_load_is_counted_and_its_end_is_not(manager):
    """The manager's real admission events, from real loads: tests/test_grouping.py."""
    metrics = StudioMetrics(manager)
    listener = manager.admission_listeners[-1]
    for old, new in (("accepting", "grouping"), ("grouping", "paused_for_load"), ("paused_for_load", "accepting")):
        listener(AdmissionEvent("m", old, new, "b waits for its memory"))
    listener(AdmissionEvent("m", "accepting", "paused_for_load", "its memory is reserved for b"))
    assert metrics.holds.labels("m", "grouping")._value.get() == 1
    assert metrics.holds.labels("m", "paused_for_load")._value.get() == 2
    assert metrics.holds.labels("m", "accepting")._value.get() == 0
