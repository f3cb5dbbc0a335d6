"""A chat's ``messages`` checked before any load: missing or no list is the client's 400, an empty list goes on.

Runs the real proxy against ``tests.replay_upstream``, which records what would have reached llama-server.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from studio.http.app import create_app
from tests.helpers import serving
from tests.replay_upstream import Answer, ReplayUpstream
from tests.standin_manager import StandInManager, StandInModel


class CountingManager(StandInManager):
    """The stand-in manager, counting the model acquisitions (each would be a load for a model not resident)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.acquired = 0

    async def acquire(self, model: str | None, *, embeddings: bool = False) -> Any:
        self.acquired += 1
        return await super().acquire(model, embeddings=embeddings)


@pytest.fixture(scope="module")
def replay():
    with ReplayUpstream() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def manager(replay):
    return CountingManager(StandInModel(name="replay", url=replay.url))


@pytest.fixture(scope="module")
def http(manager):
    with serving(create_app(manager)) as base:
        with httpx.Client(base_url=base, timeout=30) as client:
            yield client


def test_anthropic_messages_missing_is_a_400_where_llama_server_answers_500(replay, manager, http):
    seen, acquired = len(replay.requests), manager.acquired
    resp = http.post("/v1/messages", json={"model": "replay", "max_tokens": 8})
    assert resp.status_code == 400
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "`messages` is missing" in body["error"]["message"]
    assert (len(replay.requests), manager.acquired) == (seen, acquired)  # no load, nothing sent


@pytest.mark.parametrize("messages", [None, "hi", {"role": "user", "content": "hi"}])
def test_chat_messages_missing_or_no_list_is_refused_before_any_load(replay, manager, http, messages):
    seen, acquired = len(replay.requests), manager.acquired
    body = {"model": "replay"} if messages is None else {"model": "replay", "messages": messages}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert (len(replay.requests), manager.acquired) == (seen, acquired)


def test_an_empty_messages_list_goes_on_as_llama_server_takes_it(replay, http):
    replay.script(Answer.text("ok"))
    resp = http.post("/v1/chat/completions", json={"model": "replay", "messages": []})
    assert resp.status_code == 200
    assert replay.requests[-1]["messages"] == []
