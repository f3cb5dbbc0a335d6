"""``default_for_unknown``: a request naming a model the studio does not know, served by the default model.

A one-model llama-server ignores the request's ``model``, so clients written for it send whatever name
their SDK's example had ("gpt-3.5-turbo", "text-embedding-3-small"). With the switch on, the studio
answers those with its default model, as llama-server would; off (the default), a 404 that lists the
models, since in a studio of several models a typo silently answered by another model is worse.
Real llama-server and SmolLM2, through the official OpenAI SDK.
"""

from __future__ import annotations

import openai
import pytest

from studio.library.default_model import ensure_default_model
from studio.residency.requests import LoadRequest
from studio.settings import ModelDefaults, ResidencySettings, Settings
from tests.support.studio import running_studio

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

SMOL = "smol"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(params=[True, False], ids=["on", "off"])
def client(request, llama_server_bin, settings, tmp_path):
    smol = ensure_default_model(settings.models_dir)
    with running_studio(
        tmp_path,
        llama_server_bin,
        {SMOL: smol},
        defaults={SMOL: ModelDefaults(n_ctx=512, n_parallel=1, spec="off")},
        residency=ResidencySettings(default_for_unknown=request.param),
        preload=[LoadRequest(model=SMOL)],
    ) as running:
        with openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0) as sdk:
            yield sdk, request.param


def test_a_hard_wired_model_name_is_served_by_the_default_only_when_asked(client):
    sdk, on = client
    if on:
        answer = sdk.chat.completions.create(model="gpt-3.5-turbo", messages=HI, max_tokens=4)
        assert answer.choices[0].message.content
        assert len(sdk.embeddings.create(model="text-embedding-3-small", input="hi").data[0].embedding) == 576
    else:
        with pytest.raises(openai.NotFoundError) as info:
            sdk.chat.completions.create(model="gpt-3.5-turbo", messages=HI, max_tokens=4)
        assert "smol" in str(info.value)  # the 404 names the models there are


def test_default_for_unknown_must_be_true_or_false(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('default_for_unknown = "yes"\n')
    with pytest.raises(Exception, match="default_for_unknown must be true or false"):
        Settings.from_env({"GGUF_STUDIO_CONFIG": str(config), "GGUF_STUDIO_HOME": str(tmp_path)})
