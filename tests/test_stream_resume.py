"""Resumable streams through the studio, against the real llama-server: ``X-Conversation-Id`` and ``/v1/stream``.

A streamed chat that carries the header is recorded by llama-server; the studio remembers which model
served it, so ``GET /v1/stream`` replays it from that model and ``DELETE /v1/stream`` stops and drops it
there. A conversation no resident model holds is a 404, and looking for one loads nothing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from studio.http.router.stream_owners import StreamOwners
from studio.library.default_model import ensure_default_model
from studio.settings import ModelDefaults
from tests.helpers import copy_of, wait_for
from tests.support.studio import RunningStudio, running_studio

SMOL, COLD, LATE = "smol", "smol-cold", "smol-late"
#: As llama.cpp's web UI names a conversation: an id and the model, slashes and colons included.
CONV = "conv-resume-test::ggml-org/tinygemma3-GGUF:Q8_0"


def test_the_conversations_remembered_are_bounded_and_a_stop_cancels_a_waiting_claim():
    owners = StreamOwners(capacity=2)
    first = owners.claim("a", "m")
    owners.claim("b", "m")
    owners.claim("c", "m")
    assert owners.owner("a") is None and owners.owner("c") is not None
    assert owners.settle("a", first, "m")  # forgotten for newer ones, not stopped: it goes on, remembered again
    assert owners.owner("a") is first
    waiting = owners.claim("d", None)
    owners.forget("d")
    assert not owners.settle("d", waiting, "m") and owners.owner("d") is None


@pytest.fixture(scope="module")
def studio(llama_server_bin, settings, tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-resume")
    small = ModelDefaults(n_ctx=1024, n_parallel=1, spec="off")
    smol = ensure_default_model(settings.models_dir)
    with running_studio(
        root,
        llama_server_bin,
        {SMOL: smol, **{name: copy_of(smol, root / "copies", name) for name in (COLD, LATE)}},
        defaults={SMOL: small, COLD: small, LATE: small},
    ) as running:
        yield running


@pytest.fixture
def http(studio: RunningStudio):
    with httpx.Client(base_url=studio.url, timeout=300) as client:
        yield client


def _chat(model: str, max_tokens: int = 16) -> dict:
    messages = [{"role": "user", "content": "Say hello."}]
    return {"model": model, "stream": True, "max_tokens": max_tokens, "messages": messages}


def _streamed_content(http: httpx.Client, conv_id: str) -> str:
    content = ""
    headers = {"X-Conversation-Id": conv_id}
    with http.stream("POST", "/chat/completions", json=_chat(SMOL), headers=headers) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                content += (choices[0]["delta"].get("content") or "") if choices else ""
    return content


def _is_openai_error(answer: httpx.Response, code: str) -> bool:
    error = answer.json()["error"]
    return set(error) == {"message", "type", "param", "code"} and error["code"] == code


@pytest.mark.slow
@pytest.mark.shared_processes
def test_a_conversation_stream_replays_from_its_model_then_a_stop_drops_it(http):
    assert _streamed_content(http, CONV)

    replay = http.get("/v1/stream", params={"conv_id": CONV, "from": 0})
    assert replay.status_code == 200, replay.text
    assert replay.headers["content-type"].startswith("text/event-stream")
    assert "data: " in replay.text and "[DONE]" in replay.text
    later = http.get("/v1/stream", params={"conv_id": CONV, "from": len(replay.content) - 10})
    assert later.status_code == 200 and later.content == replay.content[-10:]

    listed = http.post("/v1/streams/lookup", json={"conversation_ids": [CONV, "never-streamed"]}).json()
    assert [(s["conversation_id"], s["is_done"], s["total_bytes"]) for s in listed] == [
        (CONV, True, len(replay.content))
    ]

    stop = http.delete("/v1/stream", params={"conv_id": CONV})
    assert stop.status_code == 204
    assert http.post("/v1/streams/lookup", json={"conversation_ids": [CONV]}).json() == []
    gone = http.get("/v1/stream", params={"conv_id": CONV, "from": 0})
    assert gone.status_code == 404
    assert _is_openai_error(gone, "stream_not_found")


@pytest.mark.slow
@pytest.mark.shared_processes
def test_an_unknown_conversation_is_a_404_and_loads_no_model(studio, http):
    unknown = http.get("/v1/stream", params={"conv_id": "never-streamed", "from": 0})
    assert unknown.status_code == 404 and _is_openai_error(unknown, "stream_not_found")
    named = http.get("/v1/stream", params={"conv_id": "never-streamed", "model": COLD})
    assert named.status_code == 404 and _is_openai_error(named, "stream_not_found")
    assert studio.manager.find(COLD) is None
    assert http.delete("/v1/stream", params={"conv_id": "never-streamed"}).status_code == 204  # as llama-server
    assert http.post("/v1/streams/lookup", content=b"not json").json() == []
    missing = http.get("/v1/stream")
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "conv_id"


@pytest.mark.slow
@pytest.mark.shared_processes
def test_a_stop_while_the_model_loads_cancels_the_waiting_request(studio, http):
    conv_id = "conv-stop-during-load"
    answers: list[httpx.Response] = []

    def chat() -> None:
        headers = {"X-Conversation-Id": conv_id}
        with httpx.Client(base_url=studio.url, timeout=300) as client:
            answers.append(client.post("/chat/completions", json=_chat(COLD, 256), headers=headers))

    thread = threading.Thread(target=chat)
    thread.start()
    wait_for(lambda: studio.manager.find(COLD) is not None, timeout=30, what="the cold model's load to begin")
    waiting = http.get("/v1/stream", params={"conv_id": conv_id})
    assert waiting.status_code == 503 and _is_openai_error(waiting, "model_not_ready")  # no session yet: retry
    assert http.delete("/v1/stream", params={"conv_id": conv_id}).status_code == 204
    thread.join(120)
    assert "cancelled by a stop" in answers[0].text  # an HTTP 400, or the stream's error event after keep-alives
    assert http.get("/v1/stream", params={"conv_id": conv_id}).status_code == 404


@pytest.mark.slow
@pytest.mark.shared_processes
def test_a_client_that_leaves_while_the_model_loads_can_resume_its_stream(studio, http):
    conv_id = "conv-left-during-load"
    body = json.dumps(_chat(LATE))
    address = urlsplit(studio.url)
    client = socket.create_connection((address.hostname, address.port))
    client.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
        f"X-Conversation-Id: {conv_id}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    wait_for(lambda: studio.manager.find(LATE) is not None, timeout=30, what="the model's load to begin")
    client.close()  # a page reload while the model loads

    deadline, seen = time.monotonic() + 120, set()
    replay = http.get("/v1/stream", params={"conv_id": conv_id, "from": 0})
    while replay.status_code != 200 and time.monotonic() < deadline:  # 503 while it loads, until llama-server has it
        seen.add(replay.status_code)
        time.sleep(0.1)
        replay = http.get("/v1/stream", params={"conv_id": conv_id, "from": 0})
    assert replay.status_code == 200, replay.text
    assert 503 in seen  # the model was still loading when the client left
    assert "data: " in replay.text and "[DONE]" in replay.text
