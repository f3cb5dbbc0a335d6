"""Anthropic Messages, OpenAI Responses and the other forwarded routes, and /metrics, end to end.

Real uvicorn (the studio's own listener runner), real llama-server, the official ``anthropic``
and ``openai`` SDKs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.http.server import Listeners
from studio.library.catalog import Catalog
from studio.library.default_model import ensure_default_model
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from tests.helpers import assert_no_children, free_port, leave_mid_answer, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

GEMMA = "gemma-3-270m-Q4_K_M"
SMOL = "SmolLM2-135M-Instruct.Q4_1"
HI = [{"role": "user", "content": "Say hi."}]


def serve(app, **kwargs) -> tuple[Listeners, threading.Thread]:
    """Run the studio's listeners in a thread, as ``ggstudio serve`` does in the main one."""
    listeners = Listeners(app, host="127.0.0.1", **kwargs)
    thread = threading.Thread(target=listeners.run, daemon=True)
    thread.start()
    wait_for(lambda: listeners.started, timeout=30, what="the studio to listen")
    return listeners, thread


@pytest.fixture(scope="module")
def studio(llama_server_bin, gemma_model, settings, tmp_path_factory):
    """A running studio whose catalog holds Gemma 270M and SmolLM2-135M-Instruct, both at a 1024 context."""
    root = tmp_path_factory.mktemp("dialects")
    models = root / "models"
    models.mkdir()
    (models / gemma_model.name).symlink_to(gemma_model)
    smol = ensure_default_model(settings.models_dir)
    (models / smol.name).symlink_to(smol)
    manager = ModelManager(
        catalog=Catalog([models]),
        binary=llama_server_bin,
        caps=probe(llama_server_bin, cache_dir=root / "cache"),
        make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
        model_defaults={GEMMA: ModelDefaults(n_ctx=1024), SMOL: ModelDefaults(n_ctx=1024)},
    )
    port = free_port()
    listeners, thread = serve(create_app(manager), port=port)
    yield f"http://127.0.0.1:{port}", manager
    listeners.stop()
    thread.join(30)
    assert_no_children()


@pytest.fixture
def claude(studio):
    base, _ = studio
    with anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def oai(studio):
    base, _ = studio
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


# -- Anthropic Messages ------------------------------------------------------------------------------


def test_a_message(claude):
    message = claude.messages.create(model=GEMMA, max_tokens=8, messages=HI)
    assert message.model == GEMMA and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("max_tokens", "end_turn") and 0 < message.usage.output_tokens <= 8


def test_a_streamed_message(claude):
    with claude.messages.stream(model=GEMMA, max_tokens=8, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert 0 < final.usage.output_tokens <= 8


SEA = [{"role": "user", "content": "Describe the sea in two sentences."}]  # greedy, SmolLM2 writes a comma


def test_a_message_ended_by_a_stop_sequence_says_stop_sequence_whole_and_streamed(claude):
    """b11434 says "end_turn" for a stop at a stop sequence (while it names the sequence); Anthropic's answer
    says "stop_sequence", and a client that stops the model on a marker of its own tells the two apart so."""
    greedy = {"temperature": 0}  # the SDK takes no temperature: llama-server does
    kwargs = {"model": SMOL, "max_tokens": 40, "stop_sequences": [","], "messages": SEA, "extra_body": greedy}
    whole = claude.messages.create(**kwargs)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", ",")
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", ",")
    assert final.content[0].text == whole.content[0].text
    plain = claude.messages.create(model=SMOL, max_tokens=40, messages=SEA, extra_body=greedy)
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.stop_sequence is None


def test_count_tokens_is_what_the_message_then_takes(claude):
    counted = claude.messages.count_tokens(model=GEMMA, messages=HI).input_tokens
    message = claude.messages.create(model=GEMMA, max_tokens=1, messages=HI)
    assert counted > 0
    assert counted == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_an_unknown_model_is_anthropics_not_found_error(claude, studio):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=HI)
    assert info.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": info.value.body["error"]["message"]},
    }
    assert "no-such-model" in info.value.body["error"]["message"]


def test_llama_servers_own_refusal_reaches_an_anthropic_client_in_anthropics_shape(claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=GEMMA, max_tokens=8, messages=[{"role": "user", "content": "word " * 2000}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "context" in info.value.body["error"]["message"]


#: A 1x1 PNG, base64.
DOT = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


def test_an_image_for_a_model_without_vision_is_a_400_that_says_so_in_every_dialect(claude, oai):
    """llama-server answers an Anthropic or Responses image for a text-only model with a 500 naming its own
    ``mmproj`` flag; the studio says what the chat route says, in the route's shape."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": DOT}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=SMOL, max_tokens=4, messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]
        )
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
    assert "cannot read images" in refused.value.body["error"]["message"]
    parts = [{"type": "input_image", "image_url": f"data:image/png;base64,{DOT}"}, {"type": "input_text", "text": "?"}]
    with pytest.raises(openai.BadRequestError) as also:
        oai.responses.create(model=SMOL, input=[{"role": "user", "content": parts}], max_output_tokens=4)
    assert also.value.body["code"] == "model_has_no_vision" and also.value.body["param"] == "input"


def test_a_bad_body_on_the_messages_route_is_anthropic_shaped(studio):
    base, _ = studio
    resp = httpx.post(f"{base}/v1/messages", content=b"{not json", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.get(f"{base}/v1/messages", timeout=10)
    assert resp.status_code == 405 and resp.json()["type"] == "error"


@contextlib.contextmanager
def _raw_messages_stream(base: str, body: dict) -> Iterator[Iterator[bytes]]:
    with httpx.stream("POST", f"{base}/v1/messages", json=body, timeout=60) as resp:
        yield resp.iter_raw()


def test_closing_a_messages_stream_frees_the_slot(studio):
    base, manager = studio

    def busy() -> bool:
        return any(s["is_processing"] for s in _slots(manager, GEMMA))

    body = {
        "model": GEMMA,
        "max_tokens": 2000,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Write a long story."}],
    }
    leave_mid_answer(lambda: _raw_messages_stream(base, body), busy, reads=5)
    wait_for(lambda: not busy(), timeout=5, what="llama-server to stop generating after the client left")
    assert manager.find(GEMMA).in_flight == 0


def _slots(manager: ModelManager, model: str) -> list[dict]:
    loaded = manager.find(model).loaded
    return httpx.get(f"{loaded.url}/slots", headers=loaded.auth_headers, timeout=10).json()


# -- OpenAI Responses and the other forwarded routes -----------------------------------------------


def test_responses_plain(oai):
    response = oai.responses.create(model=SMOL, input="Say hi.", max_output_tokens=8)
    assert response.status == "completed" and response.model == SMOL
    assert response.output_text and 0 < response.usage.output_tokens <= 8


def test_responses_streamed(oai):
    events = list(oai.responses.create(model=SMOL, input="Say hi.", max_output_tokens=8, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_openai_sdks_responses_stream_helper_builds_the_response(oai):
    """``responses.stream()`` builds the response from the events' indexes, which b11434 leaves out: it failed at
    the first text delta (``output.content[None]``) until the studio added them."""
    with oai.responses.stream(model=SMOL, input="Say hi.", max_output_tokens=8) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas and final.output_text == deltas and final.status == "completed"


def test_a_conversation_kept_as_openais_guide_keeps_it_goes_on_past_the_second_turn(oai):
    """The guide's history: each output item as ``{"role", "content"}``, no ``type``. b11434 refused the
    assistant's item ("Cannot determine type of 'item'"), so the second turn was a 400."""
    history: list = [{"role": "user", "content": "Say hi."}]
    first = oai.responses.create(model=SMOL, input=history, max_output_tokens=4)
    history += [{"role": item.role, "content": item.content} for item in first.output if item.type == "message"]
    history.append({"role": "user", "content": "Again."})
    second = oai.responses.create(model=SMOL, input=history, max_output_tokens=4)
    assert second.status == "completed" and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the assistant's turn is in the prompt


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses/input_tokens", {"input": "Say hi."}),
        ("/responses/input_tokens", {"input": "Say hi."}),
        ("/v1/chat/completions/input_tokens", {"messages": HI}),
        ("/chat/completions/input_tokens", {"messages": HI}),
    ],
)
def test_input_token_counts_in_every_spelling(studio, path, body):
    base, _ = studio
    resp = httpx.post(f"{base}{path}", json={"model": SMOL, **body}, timeout=120)
    assert resp.status_code == 200 and resp.json()["input_tokens"] > 0


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/reranking", {"query": "a", "documents": ["b"]}),
        ("/reranking", {"query": "a", "documents": ["b"]}),
        ("/infill", {"input_prefix": "def f(", "input_suffix": "    return 1"}),
    ],
)
def test_rerank_and_infill_are_routed_by_model(studio, path, body):
    """Neither model here reranks or has FIM tokens: llama-server's own refusal comes back unchanged."""
    base, manager = studio
    unknown = httpx.post(f"{base}{path}", json={"model": "no-such-model", **body}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    resp = httpx.post(f"{base}{path}", json={"model": SMOL, **body}, timeout=120)
    assert manager.find(SMOL) is not None  # it was loaded for the request
    assert resp.status_code == 501 and resp.json()["error"]["type"] == "not_supported_error"


# -- /metrics ----------------------------------------------------------------------------------------


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def test_metrics_move_by_what_was_served(studio, claude, oai):
    base, manager = studio
    claude.messages.create(model=GEMMA, max_tokens=1, messages=HI)  # Gemma resident before the first scrape
    before = scrape(base)
    generated = 0
    for _ in range(2):
        generated += claude.messages.create(model=GEMMA, max_tokens=4, messages=HI).usage.output_tokens
    with claude.messages.stream(model=GEMMA, max_tokens=4, messages=HI) as stream:
        generated += stream.get_final_message().usage.output_tokens
    claude.messages.count_tokens(model=GEMMA, messages=HI)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    after = scrape(base)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = "ggstudio_http_requests_total"
    assert moved(requests, listener="studio", route="/v1/messages", status="200") == 3
    assert moved(requests, listener="studio", route="/v1/messages", status="404") == 1
    assert moved(requests, listener="studio", route="/v1/messages/count_tokens", status="200") == 1
    assert moved("ggstudio_http_request_duration_seconds_count", listener="studio", route="/v1/messages") == 4
    assert moved("ggstudio_generated_tokens_total", listener="studio", model=GEMMA, route="/v1/messages") == generated
    assert (
        moved("ggstudio_time_to_first_token_seconds_count", listener="studio", model=GEMMA, route="/v1/messages") == 1
    )
    # tokens/s: the stream's own clock; llama-server's Anthropic answers carry no timings to read it from
    assert moved("ggstudio_generation_tokens_per_second_count", model=GEMMA) == 1
    assert moved("ggstudio_model_loads_total", model=GEMMA, outcome="ok") == 0  # it stayed resident
    assert value(after, "ggstudio_model_resident", model=GEMMA) == 1
    assert value(after, "ggstudio_requests_in_flight", model=GEMMA) == 0

    [status] = [m for m in httpx.get(f"{base}/api/status", timeout=10).json()["models"] if m["model"] == GEMMA]
    for kind in ("predicted", "actual"):
        for device, total in status["memory"][kind]["by_device"].items():
            assert value(after, "ggstudio_model_memory_bytes", model=GEMMA, device=device, kind=kind) == total
    assert value(after, "ggstudio_llama_server_crashes_total", model=GEMMA) == 0

    loaded = manager.find(GEMMA).loaded  # the speculative counters are llama-server's own
    own = httpx.get(f"{loaded.url}/metrics", headers=loaded.auth_headers, timeout=10).text
    drafted = {s.name: s.value for f in text_string_to_metric_families(own) for s in f.samples}
    assert (
        value(after, "ggstudio_speculative_draft_tokens_total", model=GEMMA)
        == drafted["llamacpp:spec_decode_num_draft_tokens_total"]
    )


def test_metrics_count_loads_and_unloads_with_their_durations(studio, claude, oai):
    base, manager = studio

    def settled() -> None:
        """Left alone on the CPU, the other model may be restarted with every core (``placement.rebalance``)."""
        wait_for(
            lambda: not manager.dividing_cores and all(r.state.value == "ready" for r in manager.residents),
            timeout=120,
            what="the residents serving again",
        )

    if manager.find(SMOL) is not None:
        httpx.post(f"{base}/api/unload", json={"model": SMOL}, timeout=60)
    settled()
    before = scrape(base)
    oai.responses.create(model=SMOL, input="Say hi.", max_output_tokens=2)  # loaded on demand
    loaded = scrape(base)
    assert httpx.post(f"{base}/api/unload", json={"model": SMOL}, timeout=60).status_code == 200
    settled()
    after = scrape(base)

    def moved(metrics: dict, name: str, **labels: str) -> float:
        return value(metrics, name, **labels) - value(before, name, **labels)

    assert moved(loaded, "ggstudio_model_loads_total", model=SMOL, outcome="ok") == 1
    assert moved(loaded, "ggstudio_model_load_duration_seconds_count", model=SMOL) == 1
    assert moved(loaded, "ggstudio_model_load_duration_seconds_sum", model=SMOL) > 0
    assert value(loaded, "ggstudio_model_resident", model=SMOL) == 1
    assert moved(after, "ggstudio_model_evictions_total", model=SMOL, reason="unload") == 1
    assert moved(after, "ggstudio_model_eviction_duration_seconds_count", model=SMOL) == 1
    assert value(after, "ggstudio_model_resident", model=SMOL) == 0
    assert value(after, "ggstudio_model_resident", model=GEMMA) == value(before, "ggstudio_model_resident", model=GEMMA)


def test_metrics_count_a_crash_and_the_restart_after_it(studio, claude):
    base, manager = studio
    claude.messages.create(model=GEMMA, max_tokens=1, messages=HI)
    before = scrape(base)
    resident = manager.find(GEMMA)
    os.kill(resident.supervisor.status().pid, signal.SIGKILL)
    wait_for(
        lambda: resident.restarts == 1 and resident.state.value == "ready", timeout=120, what="the automatic restart"
    )
    after = scrape(base)
    for name in ("ggstudio_llama_server_crashes_total", "ggstudio_llama_server_restarts_total"):
        assert value(after, name, model=GEMMA) - value(before, name, model=GEMMA) == 1
    assert (
        value(after, "ggstudio_model_loads_total", model=GEMMA, outcome="ok")
        - value(before, "ggstudio_model_loads_total", model=GEMMA, outcome="ok")
        == 1
    )  # the restart's start
    assert claude.messages.create(model=GEMMA, max_tokens=2, messages=HI).content  # and it serves again


# -- the token, as Anthropic and OpenAI clients send it -----------------------------------------------


def test_the_token_as_each_official_sdk_sends_it(llama_server_bin, tmp_path):
    """No model is loaded: an accepted token gets as far as the unknown model, a wrong one no further."""
    manager = ModelManager(
        catalog=Catalog([tmp_path]),
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
    )
    port = free_port()
    listeners, thread = serve(create_app(manager, api_token="s3cret"), port=port)
    base = f"http://127.0.0.1:{port}"
    try:
        with anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0) as client:
            with pytest.raises(anthropic.AuthenticationError) as info:
                client.messages.create(model="m", max_tokens=1, messages=HI)
            assert info.value.body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=base, api_key="s3cret", max_retries=0) as client:
            with pytest.raises(anthropic.NotFoundError):  # x-api-key accepted
                client.messages.create(model="m", max_tokens=1, messages=HI)
        with openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError):  # the bearer token accepted
                client.responses.create(model="m", input="x")
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"x-api-key": "s3cret"}, timeout=10).status_code == 200
    finally:
        listeners.stop()
        thread.join(30)
