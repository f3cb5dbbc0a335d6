"""Embeddings from any model: an embeddings request for a chat model starts the model's embedding instance.

A real studio (both listeners, as ``ggstudio serve --ollama-port`` runs them) and a real llama-server with
SmolLM2, whose file names no pooling: its embedding instance runs ``--embeddings --pooling mean`` beside the
chat instance, which no embeddings request touches. Under a memory budget that holds one instance, the two
evict each other as any two models do.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from launcher.capabilities import probe
from launcher.command import build_command
from launcher.devices import Device, Inventory
from launcher.planner import EMBEDDING_CTX, PlanRequest, embedding_pooling, load_model, plan
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.http.app import create_app
from studio.http.clients.ollama_app import create_ollama_app
from studio.http.server import Listeners
from studio.library.catalog import Catalog
from studio.library.default_model import ensure_default_model
from studio.residency.manager import ModelManager, supervisor_factory
from studio.residency.requests import LoadRequest
from studio.settings import MemoryBudget, ModelDefaults, ResidencySettings
from tests.helpers import assert_no_children, free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

SMOL = "SmolLM2-135M-Instruct.Q4_1"
EMBEDDING = f"{SMOL} (embeddings)"
WIDTH = 576  # SmolLM2-135M's n_embd
MIB = 1024 * 1024
HI = [{"role": "user", "content": "Say hi."}]


# -- the plan ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("declared", "pooling"),
    [(-1, "mean"), (0, "mean"), (1, "mean"), (2, "cls"), (3, "last"), (4, "mean")],
)
def test_an_embedding_instance_pools_as_the_file_says_else_by_the_mean(smollm_model, declared, pooling):
    facts = dataclasses.replace(load_model(smollm_model).facts, pooling_type=declared)
    assert embedding_pooling(facts)[0] == pooling


def _cpu_only() -> Inventory:
    return Inventory((Device("CPU", None, "Test CPU", 64 * 1024 * MIB, 32 * 1024 * MIB, "psutil", cores=2),), ())


def test_the_embedding_plan_embeds_one_batch_speculates_nothing_and_caches_no_prompt(smollm_model, real):
    model = load_model(smollm_model)
    chat = plan(model, _cpu_only(), real, PlanRequest(n_ctx=1024, spec="off"))
    embedding = plan(model, _cpu_only(), real, PlanRequest(embeddings=True))
    assert embedding.pooling == "mean" and chat.pooling is None
    assert embedding.n_ctx == EMBEDDING_CTX and embedding.spec.resolved == "off" and embedding.cache_ram_mib == 0
    argv = build_command(embedding, real, binary=Path("llama-server")).redacted_argv(0)
    assert argv[argv.index("--pooling") + 1] == "mean" and "--embeddings" in argv
    # every token of a batch is an output: 512 rows of logits in the compute buffer and the output buffer
    cpu, was = embedding.bill.device("CPU"), chat.bill.device("CPU")
    rows = (model.facts.vocab_size + model.facts.embedding_length) * 4
    assert cpu.output_growth == rows * (EMBEDDING_CTX - 1) and was.output_growth == 0
    assert cpu.compute - was.compute > model.facts.vocab_size * 4 * (EMBEDDING_CTX - 64)


def test_embeddings_among_the_extra_flags_are_billed_and_pooled_like_an_embedding_instance(smollm_model, real):
    model = load_model(smollm_model)
    given = plan(model, _cpu_only(), real, PlanRequest(n_ctx=1024, spec="off", extra_args=("--embeddings",)))
    chat = plan(model, _cpu_only(), real, PlanRequest(n_ctx=1024, spec="off"))
    assert given.pooling == "mean" and given.n_ctx == 1024
    assert given.bill.total > chat.bill.total + 150 * MIB
    argv = build_command(given, real, binary=Path("llama-server")).redacted_argv(0)
    assert argv.count("--embeddings") == 1 and argv[argv.index("--pooling") + 1] == "mean"
    own = plan(model, _cpu_only(), real, PlanRequest(extra_args=("--embeddings", "--pooling", "cls")))
    assert own.pooling == "cls"
    assert build_command(own, real, binary=Path("llama-server")).redacted_argv(0).count("--pooling") == 1


# -- the studio --------------------------------------------------------------------------------------


@contextmanager
def _studio(root: Path, smol: Path, binary: Path, residency: ResidencySettings | None = None) -> Iterator[Any]:
    """(studio URL, Ollama URL, manager) with SmolLM2's chat instance loaded as the default model."""
    models = root / "models"
    models.mkdir(parents=True)
    (models / smol.name).symlink_to(smol)
    manager = ModelManager(
        catalog=Catalog([models]),
        binary=binary,
        make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
        caps=probe(binary, cache_dir=root / "cache"),
        model_defaults={SMOL: ModelDefaults(n_ctx=1024, spec="off")},
        residency=residency,
    )
    app = create_app(manager, preload=[LoadRequest(SMOL)])
    port, ollama_port = free_port(), free_port()
    listeners = Listeners(app, host="127.0.0.1", port=port, ollama_app=create_ollama_app(app), ollama_port=ollama_port)
    thread = threading.Thread(target=listeners.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: listeners.started, timeout=30, what="both listeners")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _status(url)["state"] == "ready", timeout=120, what="SmolLM2's chat instance")
        yield url, f"http://127.0.0.1:{ollama_port}", manager
    finally:
        listeners.stop()
        thread.join(30)


def _status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/status", timeout=10).json()


def _instances(url: str) -> dict[str, dict[str, Any]]:
    return {m["model"]: m for m in _status(url)["models"] if m["state"] != "unloaded"}


@pytest.fixture(scope="module")
def studio(llama_server_bin, settings, tmp_path_factory):
    smol = ensure_default_model(settings.models_dir)
    with _studio(tmp_path_factory.mktemp("embeddings"), smol, llama_server_bin) as running:
        yield running
    assert_no_children()  # the studios of the module's other tests too (``shared_processes``)


def test_ollama_embed_on_the_default_model_starts_its_embedding_instance_and_leaves_the_chat_one(studio):
    url, ollama_url, _ = studio
    chat = _instances(url)[SMOL]
    with ollama.Client(host=ollama_url, timeout=180) as client:
        reply = client.embed(model=SMOL, input=["The sky is blue.", "Grass is green."])
        assert reply.model == SMOL
        assert len(reply.embeddings) == 2 and all(len(v) == WIDTH for v in reply.embeddings)
        assert math.isclose(math.fsum(x * x for x in reply.embeddings[0]), 1.0, rel_tol=1e-3)  # normalised
        assert reply.embeddings[0] != reply.embeddings[1]
        older = client.embeddings(model=SMOL, prompt="The sky is blue.")
        assert older.embedding == pytest.approx(reply.embeddings[0], abs=1e-4)
        instances = _instances(url)
        assert instances[SMOL]["pid"] == chat["pid"] and instances[SMOL]["instance"] == "chat"  # not restarted
        assert client.chat(model=SMOL, messages=HI, options={"num_predict": 8}).message.content
        listed = {m.model: m for m in client.ps().models}
        assert SMOL in listed and EMBEDDING in listed and listed[EMBEDDING].size > 0
    assert _instances(url)[SMOL]["pid"] == chat["pid"]


def test_openai_embeddings_and_the_native_route_use_the_embedding_instance(studio):
    url, _, _ = studio
    chat_pid = _instances(url)[SMOL]["pid"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=180)
    made = client.embeddings.create(model=SMOL, input=["The sky is blue.", "Grass is green."])
    assert made.model == SMOL and [len(d.embedding) for d in made.data] == [WIDTH, WIDTH]
    # without `model`: the default model's embedding instance
    bare = httpx.post(f"{url}/v1/embeddings", json={"input": "The sky is blue."}, timeout=180)
    assert bare.status_code == 200 and bare.json()["data"][0]["embedding"] == pytest.approx(
        made.data[0].embedding, abs=1e-4
    )
    native = httpx.post(f"{url}/embedding", json={"model": SMOL, "content": "The sky is blue."}, timeout=180)
    assert native.status_code == 200
    assert len(native.json()[0]["embedding"][0]) == WIDTH
    assert _instances(url)[SMOL]["pid"] == chat_pid
    said = client.chat.completions.create(model=SMOL, messages=HI, max_tokens=8)  # type: ignore[arg-type]
    assert said.choices[0].message.content


def test_the_embedding_instance_is_listed_and_billed_as_its_own_resident(studio):
    url, _, _ = studio
    httpx.post(f"{url}/v1/embeddings", json={"model": SMOL, "input": "x"}, timeout=180).raise_for_status()
    instances = _instances(url)
    chat, embedding = instances[SMOL], instances[EMBEDDING]
    assert embedding["instance"] == "embeddings" and embedding["pooling"] == "mean" and embedding["state"] == "ready"
    assert embedding["pid"] != chat["pid"] and embedding["effective_context"] == 512
    assert any("mean pooling" in r for r in embedding["reasons"])
    predicted = embedding["memory"]["predicted"]["devices"]["CPU"]
    # every token of a 512-token batch is an output: its logits in the compute and the output buffers
    assert predicted["compute"] > 90 * MIB and predicted["output_growth"] > 90 * MIB
    assert predicted["prompt_cache"] == 0
    actual = embedding["memory"]["actual"]["devices"]["CPU"]
    assert abs(actual["compute"] - predicted["compute"]) < 8 * MIB  # measured 102.2 MiB, predicted 104.7
    router = {m["id"]: m for m in httpx.get(f"{url}/models", timeout=10).json()["data"]}
    assert router[EMBEDDING]["status"]["value"] == "loaded" and router[EMBEDDING]["instance"] == "embeddings"
    assert router[SMOL]["status"]["value"] == "loaded"
    # by its name it is unloaded alone
    assert httpx.post(f"{url}/models/unload", json={"model": EMBEDDING}, timeout=60).json() == {"success": True}
    assert set(_instances(url)) == {SMOL}


def test_ollama_keep_alive_0_unloads_every_instance_of_the_model(studio):
    """On b5a9904 ``keep_alive: 0`` unloaded one instance and left the other, so Ollama's ``ps`` still listed the
    model; in Ollama one model is one thing to unload. An instance's own name still unloads it alone."""
    url, ollama_url, _ = studio
    with ollama.Client(host=ollama_url, timeout=180) as client:
        assert len(client.embed(model=SMOL, input="x").embeddings[0]) == WIDTH
        assert set(_instances(url)) == {SMOL, EMBEDDING}
        assert client.generate(model=SMOL, prompt="Hi", options={"num_predict": 2}, keep_alive=0).response
        wait_for(lambda: not _instances(url), timeout=30, what="both instances to unload")
        assert client.ps().models == []
        assert len(client.embed(model=SMOL, input="x", keep_alive=0).embeddings[0]) == WIDTH
        wait_for(lambda: not _instances(url), timeout=30, what="the embedding instance to unload")
        client.embed(model=SMOL, input="x")
        assert client.generate(model=SMOL, prompt="Hi", options={"num_predict": 2}).response
    assert set(_instances(url)) == {SMOL, EMBEDDING}
    assert httpx.post(f"{url}/api/unload", json={"model": SMOL}, timeout=60).status_code == 200  # by its name: both
    assert not _instances(url)


def test_an_embeddings_request_for_an_unknown_model_is_a_404_in_openais_shape(studio):
    url, _, _ = studio
    missing = httpx.post(f"{url}/v1/embeddings", json={"model": "no-such-model", "input": "x"}, timeout=30)
    assert missing.status_code == 404 and set(missing.json()["error"]) >= {"message", "type", "code"}
    named = httpx.post(f"{url}/v1/embeddings", json={"model": "no-such-model (embeddings)", "input": "x"}, timeout=30)
    assert named.status_code == 404 and "no-such-model" in named.json()["error"]["message"]


def test_a_model_loaded_with_embeddings_embeds_with_its_own_instance(llama_server_bin, settings, tmp_path):
    smol = ensure_default_model(settings.models_dir)
    with _studio(tmp_path, smol, llama_server_bin) as (url, _, _):
        loaded = httpx.post(f"{url}/api/load", json={"model": SMOL, "extra_args": ["--embeddings"]}, timeout=180)
        assert loaded.status_code == 200, loaded.text
        pid = _instances(url)[SMOL]["pid"]
        made = httpx.post(f"{url}/v1/embeddings", json={"model": SMOL, "input": "x"}, timeout=180)
        assert made.status_code == 200, made.text
        assert set(_instances(url)) == {SMOL} and _instances(url)[SMOL]["pid"] == pid
        assert _instances(url)[SMOL]["embeddings"] is True


def test_under_a_budget_for_one_the_chat_and_embedding_instances_evict_each_other(llama_server_bin, settings, tmp_path):
    smol = ensure_default_model(settings.models_dir)
    residency = ResidencySettings(memory_budget=MemoryBudget(total=460 * MIB), busy_wait=60)
    with _studio(tmp_path, smol, llama_server_bin, residency) as (url, _, manager):
        made = httpx.post(f"{url}/v1/embeddings", json={"model": SMOL, "input": "x"}, timeout=180)
        assert made.status_code == 200, made.text
        assert set(_instances(url)) == {EMBEDDING}
        said = httpx.post(
            f"{url}/v1/chat/completions", json={"model": SMOL, "messages": HI, "max_tokens": 8}, timeout=180
        )
        assert said.status_code == 200, said.text
        assert set(_instances(url)) == {SMOL}
        assert manager.counters["evictions"] == 2
