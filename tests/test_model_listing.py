"""``GET /models`` as llama-server lists a model: once, with every name a client may send for it and its tags.

A real studio (the app under uvicorn, the real llama-server for the load) whose SmolLM2 has two
``[aliases]`` and ``tags`` in its ``[models.NAME]`` table, as ``llama-server --alias code,fim,tinyllama-2
--tags chat,fim,small`` would be.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from studio.library.default_model import ensure_default_model
from studio.settings import ModelDefaults
from tests.helpers import wait_for
from tests.support.studio import running_studio

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def studio(llama_server_bin, settings, gemma_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("model-listing")
    smol = ensure_default_model(settings.models_dir)
    defaults = {"code": ModelDefaults(n_ctx=512, spec="off", tags=("chat", "fim", "small"))}
    with running_studio(
        root,
        llama_server_bin,
        {"code": smol, "other": gemma_model},  # two files: two links to one file are one model
        defaults=defaults,
        aliases={"fim": "code", "tinyllama-2": "code"},
    ) as running:
        yield running


@pytest.mark.parametrize("route", ["/models", "/v1/models"])
def test_a_model_with_aliases_is_listed_once_with_its_aliases_and_tags(studio, route):
    listed = httpx.get(f"{studio.url}{route}", timeout=30).json()["data"]
    assert [m["id"] for m in listed] == ["code", "other"]  # the aliases are no entries of their own
    code, other = listed
    assert code["aliases"] == ["code", "fim", "tinyllama-2"] and code["tags"] == ["chat", "fim", "small"]
    assert other["aliases"] == ["other"] and other["tags"] == []


def test_a_model_loaded_under_an_alias_is_listed_loaded(studio):
    """Loaded as ``fim``, the resident goes by the model's name: the model's one entry shows it loaded."""
    with httpx.Client(base_url=studio.url, timeout=300) as http:
        reply = http.post("/v1/completions", json={"model": "fim", "prompt": "Hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        code = next(m for m in http.get("/models").json()["data"] if m["id"] == "code")
        assert code["status"]["value"] == "loaded" and code["meta"]["loaded"]
        assert http.post("/models/unload", json={"model": "fim"}).status_code == 200
        wait_for(
            lambda: (
                next(m for m in http.get("/models").json()["data"] if m["id"] == "code")["status"]["value"]
                == "unloaded"
            ),
            timeout=60,
            what="the model to unload",
        )


def test_openai_models_retrieve_finds_a_model_by_name_or_alias_and_an_unknown_one_is_a_404(studio):
    """``GET /v1/models/{model}`` (the OpenAI SDK's ``models.retrieve``) was a "no such route" 404."""
    with openai.OpenAI(base_url=f"{studio.url}/v1", api_key="unused", max_retries=0) as client:
        assert client.models.retrieve("code").id == "code"
        by_alias = client.models.retrieve("tinyllama-2")
        assert by_alias.id == "code" and by_alias.model_extra["aliases"] == ["code", "fim", "tinyllama-2"]
        with pytest.raises(openai.NotFoundError) as refused:
            client.models.retrieve("no-such-model")
    assert refused.value.body["code"] == "model_not_found" and "code, other" in refused.value.body["message"]


def test_v1_health_answers_as_llama_servers_does(studio):
    assert httpx.get(f"{studio.url}/v1/health", timeout=10).json() == {"status": "ok"}
