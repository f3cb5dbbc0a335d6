"""Streamed requests waiting for a cold load hear from the studio, in every dialect, through the official SDKs.

The llama-server is the real one with SmolLM2; its start is slowed by a stand-in in front of it (a shell
script that sleeps, then execs the real binary), as a large model on a slow disk would be. The clients
are the official ``openai``, ``anthropic`` and ``ollama`` SDKs; a transport under each records when
every piece of the answer arrived, so the test sees the keep-alive lines the SDK itself skips.
"""

from __future__ import annotations

import json
import re
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import ollama
import openai
import pytest

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.http.clients.load_wait import loading_comment, reading_comment
from studio.http.clients.ollama_app import create_ollama_app
from studio.http.server import Listeners
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import ModelDefaults
from tests.helpers import assert_no_children, free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

#: Seconds the stand-in holds each start back before the real llama-server begins its own load.
DELAY = 4.0
HI = [{"role": "user", "content": "Say hi."}]
COMMENT = re.compile(r"^: (loading smol( \d+%)?|smol is reading the prompt)$")

#: Runs the real llama-server, after ``DELAY`` s unless it is asked what it is; a start whose argv names
#: the ``broken`` model exits with an error after the delay, as a corrupt model found late would.
STAND_IN = """#!/bin/sh
for arg in "$@"; do
  case "$arg" in --help|--version|--list-devices) exec "{real}" "$@";; esac
done
sleep {delay}
case "$*" in *broken*) echo "error: failed to load model (the stand-in refuses it)" >&2; exit 1;; esac
exec "{real}" "$@"
"""


class Timed:
    """When the headers and each piece of a response body arrived, noted by a transport under an SDK's client."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.headers_at = 0.0
        self.pieces: list[tuple[float, bytes]] = []

    def transport(self, http: Any = httpx) -> Any:
        """A transport of ``http`` (``httpx``, or ``httpx2`` under the anthropic SDK) that notes the times."""
        timed = self

        class Stream(http.SyncByteStream):  # type: ignore[misc,name-defined]
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __iter__(self) -> Iterator[bytes]:
                for piece in self.inner:
                    timed.pieces.append((time.monotonic(), piece))
                    yield piece

            def close(self) -> None:
                self.inner.close()

        class Transport(http.HTTPTransport):  # type: ignore[misc,name-defined]
            def handle_request(self, request: Any) -> Any:
                timed.sent = time.monotonic()
                response = super().handle_request(request)
                timed.headers_at = time.monotonic()
                return http.Response(
                    response.status_code,
                    headers=response.headers,
                    stream=Stream(response.stream),
                    extensions=response.extensions,
                )

        return Transport()

    def comments(self) -> list[str]:
        text = b"".join(p for _, p in self.pieces).decode()
        return [line for line in text.splitlines() if line.startswith(":")]

    def longest_silence_before(self, answer_begins: bytes) -> float:
        """The longest gap between the request, its headers and each piece, up to the one with ``answer_begins``."""
        times = [self.sent, self.headers_at]
        for at, piece in self.pieces:
            times.append(at)
            if answer_begins in piece:
                break
        return max(b - a for a, b in zip(times, times[1:], strict=False))


@pytest.fixture(scope="module")
def studio(llama_server_bin, smollm_model, gemma_model, tmp_path_factory):
    """Both listeners over one manager whose llama-servers start ``DELAY`` s late; ``broken`` fails then."""
    root = tmp_path_factory.mktemp("keepalive")
    stand_in = root / "llama-server"
    stand_in.write_text(STAND_IN.format(real=llama_server_bin, delay=DELAY))
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    models = root / "models"
    models.mkdir()
    (models / "smol.gguf").symlink_to(smollm_model)
    (models / "broken.gguf").symlink_to(gemma_model)  # another file: two links to one file are one model
    manager = ModelManager(
        catalog=Catalog([models]),
        binary=stand_in,
        make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
        caps=probe(stand_in, cache_dir=root / "cache"),
        model_defaults={name: ModelDefaults(n_ctx=1024, spec="off") for name in ("smol", "broken")},
    )
    app = create_app(manager)
    port, ollama_port = free_port(), free_port()
    listeners = Listeners(app, host="127.0.0.1", port=port, ollama_app=create_ollama_app(app), ollama_port=ollama_port)
    thread = threading.Thread(target=listeners.run, daemon=True)
    thread.start()
    wait_for(lambda: listeners.started, timeout=30, what="both listeners")
    yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ollama_port}"
    listeners.stop()
    thread.join(30)
    assert_no_children()


@pytest.fixture
def cold(studio) -> tuple[str, str]:
    """The studio with nothing resident: the next request for a model waits for its load."""
    httpx.post(f"{studio[0]}/api/unload", json={}, timeout=60).raise_for_status()
    return studio


def assert_kept_company(timed: Timed, answer_begins: bytes) -> None:
    assert timed.headers_at - timed.sent < 2.0, "the headers came only with the answer"
    comments = timed.comments()
    assert len(comments) >= 2 and all(COMMENT.match(c) for c in comments), comments
    reading = [c.endswith("reading the prompt") for c in comments]
    assert reading == sorted(reading), comments  # once the model has the request, never "loading" again
    assert timed.longest_silence_before(answer_begins) <= 2.0, [
        (round(at - timed.sent, 2), piece[:40]) for at, piece in timed.pieces[:12]
    ]


def test_a_streamed_chat_waiting_for_a_cold_load_hears_loading_comments_and_the_openai_sdk_gets_its_answer(cold):
    timed = Timed()
    with openai.OpenAI(
        base_url=f"{cold[0]}/v1", api_key="none", http_client=httpx.Client(transport=timed.transport())
    ) as client:
        stream = client.chat.completions.create(model="smol", messages=HI, max_tokens=8, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip()
    assert_kept_company(timed, b"data: ")


def test_a_responses_stream_waiting_for_a_cold_load_hears_loading_comments(cold):
    timed = Timed()
    with openai.OpenAI(
        base_url=f"{cold[0]}/v1", api_key="none", http_client=httpx.Client(transport=timed.transport())
    ) as client:
        # the SDK's own helper, which builds the response from the indexes the studio adds to b11434's events
        with client.responses.stream(model="smol", input="Say hi.", max_output_tokens=8) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
    assert text.strip() and final.output_text == text
    assert_kept_company(timed, b"data: ")


def test_an_anthropic_stream_waiting_for_a_cold_load_hears_loading_comments(cold):
    timed = Timed()
    http_client = httpx2.Client(transport=timed.transport(httpx2))
    with anthropic.Anthropic(base_url=cold[0], api_key="none", http_client=http_client) as client:
        with client.messages.stream(model="smol", messages=HI, max_tokens=8) as stream:
            text = "".join(stream.text_stream)
    assert text.strip()
    assert_kept_company(timed, b"event: ")


def test_an_ollama_chat_waiting_for_a_cold_load_gets_empty_chunks_the_ollama_sdk_adds_as_nothing(cold):
    timed = Timed()
    with ollama.Client(host=cold[1], transport=timed.transport()) as client:
        parts = list(client.chat(model="smol", messages=HI, stream=True, options={"num_predict": 8}))
    text = "".join(p.message.content or "" for p in parts)
    assert text.strip() and parts[-1].done
    waiting = [p for p in parts if not p.done and not p.message.content]
    assert len(waiting) >= 2  # the keep-alives: parsed by the SDK as chunks with nothing in them
    assert timed.headers_at - timed.sent < 2.0
    first_text = next(t for t, piece in timed.pieces if _says_something(piece))
    times = [timed.sent, timed.headers_at, *(t for t, _ in timed.pieces if t <= first_text)]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) <= 2.0


def _says_something(piece: bytes) -> bool:
    """Whether an NDJSON piece holds a chunk with text (or the last one)."""
    chunks = [json.loads(line) for line in piece.splitlines() if line.strip()]
    return any(c.get("done") or (c.get("message") or {}).get("content") for c in chunks)


def test_a_load_that_fails_after_the_headers_ends_each_stream_with_its_dialects_error(cold):
    with openai.OpenAI(base_url=f"{cold[0]}/v1", api_key="none") as client:
        with pytest.raises(openai.APIError, match="failed to load"):
            for _ in client.chat.completions.create(model="broken", messages=HI, max_tokens=8, stream=True):
                pass
    with anthropic.Anthropic(base_url=cold[0], api_key="none") as claude:
        with pytest.raises(anthropic.APIError, match="failed to load"):
            with claude.messages.stream(model="broken", messages=HI, max_tokens=8) as stream:
                "".join(stream.text_stream)
    with ollama.Client(host=cold[1]) as local, pytest.raises(ollama.ResponseError, match="failed to load"):
        list(local.chat(model="broken", messages=HI, stream=True))


def test_a_stream_for_an_unknown_model_is_still_a_plain_404(cold):
    response = httpx.post(
        f"{cold[0]}/v1/chat/completions", json={"model": "nowhere", "messages": HI, "stream": True}, timeout=30
    )
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_client_that_leaves_during_the_load_holds_nothing_once_the_model_is_ready(cold):
    with httpx.stream(
        "POST",
        f"{cold[0]}/v1/chat/completions",
        json={"model": "smol", "messages": HI, "max_tokens": 8, "stream": True},
        timeout=30,
    ) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        assert COMMENT.match(next(stream.iter_lines()))
    # the load goes on for the next client; the one that left holds no request on the model

    def settled() -> bool:
        models = httpx.get(f"{cold[0]}/api/status", timeout=10).json()["models"]
        return any(m["model"] == "smol" and m["state"] == "ready" and m["in_flight"] == 0 for m in models)

    wait_for(settled, timeout=60, what="smol ready, with no request in flight")


def test_the_loading_comment_names_the_share_loaded_when_known():
    assert loading_comment("smol", 0.456) == b": loading smol 46%\n\n"
    assert loading_comment("smol", None) == b": loading smol\n\n"


def test_the_beat_after_the_load_says_the_prompt_is_being_read_not_loading():
    assert reading_comment("smol") == b": smol is reading the prompt\n\n"
    assert COMMENT.match(reading_comment("smol").decode().strip())
