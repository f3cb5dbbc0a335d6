"""Downloads through the service (/api/pull) against the local Hub stand-in, through the real huggingface_hub."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.errors import ModelNotFoundError
from studio.http.app import create_app
from studio.library import hub
from studio.library.catalog import Catalog
from studio.library.default_model import ensure_default_model
from studio.library.downloads import DownloadManager
from studio.residency.manager import ModelManager, supervisor_factory
from studio.residency.requests import LoadRequest
from studio.settings import ModelDefaults
from tests.helpers import free_port, wait_for
from tests.support.projectors import SMOLLM2_WIDTH, write_vision_projector
from tests.test_hub import hf_env, model_bytes, server  # noqa: F401 (fixtures)

MIB = 1 << 20
REPO = "acme/eye-GGUF"


def big_model(tmp_path: Path, mib: int) -> bytes:
    """A GGUF of ``mib`` MiB at SmolLM2's width: big enough for several progress reports (one per 10 MiB)."""
    return model_bytes(tmp_path, n_embd=SMOLLM2_WIDTH, floats=mib * MIB // 4)


@pytest.fixture
def vision_repo(server, tmp_path):
    """A vision repo: two variants of 24 MiB and 12 MiB and one projector (F16) of their width."""
    repo = server.repo(REPO)
    repo.add("eye-Q8_0.gguf", big_model(tmp_path, 24))
    repo.add("eye-Q4_K_M.gguf", big_model(tmp_path, 12))
    repo.add("mmproj-eye-F16.gguf", write_vision_projector(tmp_path / "mmproj.gguf"))
    server.chunk_delay = 0.03  # seconds per MiB: a 24 MiB file takes about 0.7 s
    return repo


@pytest.fixture
def studio(llama_server_bin, hf_env, tmp_path):
    """A real uvicorn studio whose downloads go to the stand-in (HF_ENDPOINT) and its cache."""
    manager = ModelManager(
        catalog=Catalog([tmp_path / "models"], hf_cache=hf_env.cache_dir),
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
        model_defaults={f"{REAL}:Q4_1": ModelDefaults(n_ctx=1024, spec="off")},
    )
    port = free_port()
    service = uvicorn.Server(uvicorn.Config(create_app(manager), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    wait_for(lambda: service.started, timeout=30, what="uvicorn to start")
    yield f"http://127.0.0.1:{port}", manager
    service.should_exit = True
    thread.join(30)


def stream_pull(base: str, spec: str) -> list[dict]:
    with httpx.stream("POST", f"{base}/api/pull", json={"model": spec}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_a_pull_streams_progress_per_file_and_fetches_the_projector(studio, server, vision_repo):
    base, _ = studio
    before, server.chunk_delay = server.chunk_delay, 0.08  # ~2 s for the model file, not 0.7: on a quiet
    try:  # machine 0.7 s gave one progress event in the middle of the file
        events = stream_pull(base, f"{REPO}:Q8_0")
    finally:
        server.chunk_delay = before
    progress, last = events[:-1], events[-1]
    assert last["type"] == "done" and last["state"] == "done" and last["variant"] == "Q8_0"
    assert [f["path"] for f in last["files"]] == ["eye-Q8_0.gguf", "mmproj-eye-F16.gguf"]
    assert all(f["state"] == "done" and f["done"] == f["size"] for f in last["files"])
    assert last["done_bytes"] == last["total_bytes"] == sum(f["size"] for f in last["files"])
    assert Path(last["path"]).is_file() and Path(last["mmproj"]).name == "mmproj-eye-F16.gguf"
    moving = [e for e in progress if 0 < e["done_bytes"] < e["total_bytes"]]
    assert len(moving) >= 2 and all(e["rate_bytes_per_s"] > 0 and e["eta_s"] is not None for e in moving)
    assert [e["done_bytes"] for e in progress] == sorted(e["done_bytes"] for e in progress)
    assert any(f["state"] == "downloading" and 0 < f["done"] < f["size"] for e in moving for f in e["files"])
    assert sorted(p.rsplit("/", 1)[-1] for p in server.downloads()) == ["eye-Q8_0.gguf", "mmproj-eye-F16.gguf"]
    listed = httpx.get(f"{base}/api/pulls", timeout=10).json()
    assert [(d["id"], d["state"]) for d in listed] == [(last["id"], "done")]


def test_two_clients_asking_for_the_same_files_share_one_download(studio, server, vision_repo):
    base, _ = studio
    server.chunk_delay = 0.08
    first: list[dict] = []
    worker = threading.Thread(target=lambda: first.extend(stream_pull(base, f"{REPO}:Q8_0")))
    worker.start()
    wait_for(
        lambda: first or httpx.get(f"{base}/api/pulls", timeout=10).json(),
        timeout=30,
        what="the first download to start",
    )
    second = stream_pull(base, f"{REPO}:Q8_0")
    worker.join(60)
    assert second[0]["joined"] is True and second[-1]["id"] == first[-1]["id"]
    assert first[-1]["type"] == second[-1]["type"] == "done"
    gets = [p.rsplit("/", 1)[-1] for p in server.downloads()]
    assert sorted(gets) == ["eye-Q8_0.gguf", "mmproj-eye-F16.gguf"]  # each file fetched once


def test_a_cancelled_pull_stops_and_leaves_no_partial_file(studio, server, hf_env, vision_repo):
    base, _ = studio
    server.chunk_delay = 0.1  # 2.4 s for the model file
    started = httpx.post(f"{base}/api/pull", json={"model": f"{REPO}:Q8_0", "stream": False}, timeout=30)
    assert started.status_code == 202 and started.json()["state"] == "running"
    pull_id = started.json()["id"]
    assert httpx.delete(f"{base}/api/pulls/{pull_id}", timeout=10).status_code == 200
    ended = wait_for(
        lambda: (d := httpx.get(f"{base}/api/pulls/{pull_id}", timeout=10).json())["state"] != "running" and d,
        timeout=30,
        what="the download to stop",
    )
    assert ended["state"] == "cancelled" and "cancelled" in ended["error"]["message"]
    assert ended["files"][0]["state"] == "downloading" and ended["done_bytes"] < ended["total_bytes"]
    sizes = {len(data) for data in vision_repo.files.values()}
    left = [p for p in (hub.repo_folder(hf_env.cache_dir, REPO) / "blobs").glob("*") if p.is_file()]
    assert all(p.stat().st_size in sizes for p in left)  # complete files only: the partial one is gone
    with httpx.stream("GET", f"{base}/api/pulls/{pull_id}/events", timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "cancelled"


def test_errors_come_before_any_event(studio, server, vision_repo, monkeypatch):
    base, _ = studio
    unknown = httpx.post(f"{base}/api/pull", json={"model": "acme/nothing-here"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "repo_not_found"
    variant = httpx.post(f"{base}/api/pull", json={"model": f"{REPO}:Q2_K"}, timeout=30)
    assert variant.status_code == 404 and "Q4_K_M" in variant.json()["error"]["message"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = httpx.post(f"{base}/api/pull", json={"model": f"{REPO}:Q8_0"}, timeout=30)
    assert offline.status_code == 404 and offline.json()["error"]["code"] == "not_cached"
    assert httpx.delete(f"{base}/api/pulls/pull-999", timeout=10).status_code == 404


def test_ensure_available_downloads_only_when_allowed_and_only_once(server, hf_env, vision_repo):
    spec = f"{REPO}:Q4_K_M"
    with pytest.raises(ModelNotFoundError, match="POST /api/pull") as info:
        asyncio.run(DownloadManager().ensure_available(spec))
    assert info.value.code == "not_downloaded" and server.downloads() == []
    path = asyncio.run(DownloadManager(auto_download=True).ensure_available(spec))
    assert path.name == "eye-Q4_K_M.gguf" and path.is_file()
    server.clear()
    assert asyncio.run(DownloadManager().ensure_available(spec)) == path  # cached: no download, none asked for
    assert server.downloads() == []


def test_download_waiters_hold_no_threads(server, hf_env, vision_repo):
    """A caller waiting for a download (a load with ``auto_download``, a non-streamed Ollama pull) held a thread
    of the default executor (``to_thread`` around ``Event.wait``) until the download ended: a handful of them
    took all of its min(32, cpus + 4) threads, and every other ``to_thread`` call of the studio (header reads,
    capabilities) waited for the download. A waiter that leaves must not stop it for the others either."""
    server.chunk_delay = 0.1  # seconds per MiB: the 24 MiB model file takes 2.4 s
    downloads = DownloadManager()

    async def main() -> None:
        download, _ = await asyncio.to_thread(downloads.start, f"{REPO}:Q8_0")
        before = threading.active_count()
        waiters = [asyncio.create_task(downloads.wait(download)) for _ in range(20)]
        await asyncio.sleep(0.3)
        grown = threading.active_count() - before
        began = time.monotonic()
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "read"), 30) == "read"
        took = time.monotonic() - began
        assert grown <= 1, f"{grown} more threads with 20 waiters"
        assert took < 1, f"a to_thread call waited {took:.1f} s for the download"
        assert download.active, "the download ended before the waiters were measured: make it slower"
        for leaving in waiters[:10]:  # their clients left
            leaving.cancel()
        ended = await asyncio.wait_for(asyncio.gather(*waiters[10:]), 60)
        assert all(d is download for d in ended) and download.state.value == "done"
        assert all(w.cancelled() for w in waiters[:10])

    asyncio.run(main())


def test_the_largest_variant_that_fits_is_suggested(server, hf_env, vision_repo):
    downloads = DownloadManager()
    assert downloads.suggest_variant(REPO, lambda size, label: True) == f"{REPO}:Q8_0"
    asked = []
    assert (
        downloads.suggest_variant(REPO, lambda size, label: asked.append((label, size)) or size < 20 * MIB)
        == f"{REPO}:Q4_K_M"
    )
    projector = len(vision_repo.files["mmproj-eye-F16.gguf"])
    assert dict(asked)["Q4_K_M"] == len(vision_repo.files["eye-Q4_K_M.gguf"]) + projector  # the projector counts
    assert downloads.suggest_variant(REPO, lambda size, label: False) is None


# ---------------------------------------------------------------- a real model pulled, then loaded offline

REAL = "acme/SmolLM2-135M-Instruct-GGUF"


@pytest.mark.slow
def test_a_pulled_vision_repo_loads_offline_from_the_cache(
    studio,
    server,
    settings,
    tmp_path,
    monkeypatch,
):
    base, manager = studio
    repo = server.repo(REAL)
    repo.add("SmolLM2-135M-Instruct-Q4_1.gguf", ensure_default_model(settings.models_dir))
    repo.add("mmproj-SmolLM2-F32.gguf", write_vision_projector(tmp_path / "mmproj.gguf"))
    events = stream_pull(base, f"{REAL}:Q4_1")
    assert events[-1]["type"] == "done" and events[-1]["mmproj"], events[-1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server.clear()
    resp = httpx.post(f"{base}/api/load", json={"model": f"{REAL}:Q4_1"}, timeout=300)
    assert resp.status_code == 200, resp.text
    status = resp.json()
    assert status["state"] == "ready" and status["capabilities"]["vision"] is True
    assert Path(status["mmproj"]).name == "mmproj-SmolLM2-F32.gguf" and server.requests == []
    httpx.post(f"{base}/api/unload", timeout=60)


@pytest.mark.parametrize("auto", [False, True])
def test_a_load_of_an_uncached_repo_downloads_it_first_only_with_auto_download_and_a_plan_never_does(
    llama_server_bin, server, hf_env, settings, tmp_path, auto
):
    repo = server.repo(REAL)
    repo.add("SmolLM2-135M-Instruct-Q4_1.gguf", ensure_default_model(settings.models_dir))
    repo.add("mmproj-SmolLM2-F32.gguf", write_vision_projector(tmp_path / "mmproj.gguf"))
    downloads = DownloadManager(auto_download=auto)
    manager = ModelManager(
        catalog=Catalog([tmp_path / "models"], hf_cache=hf_env.cache_dir),
        binary=llama_server_bin,
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        downloads=downloads,
    )
    app = create_app(manager, hub_headers=tmp_path / "headers")
    with TestClient(app, base_url="http://127.0.0.1") as client:
        resp = client.post("/api/plan", json={"model": f"{REAL}:Q4_1", "n_ctx": 1024})  # from the headers alone
        assert resp.status_code == 200, resp.text
        assert resp.json()["hub"]["downloaded"] is False
        assert resp.json()["model"]["mmproj"].endswith("mmproj-SmolLM2-F32.gguf")
        assert client.get("/api/pulls").json() == []
        assert all(r.range for r in server.requests if r.method == "GET" and "/resolve/" in r.path)
        load = LoadRequest(f"{REAL}:Q4_1", n_ctx=1024)  # what a load resolves the model with
        if not auto:
            with pytest.raises(ModelNotFoundError) as info:
                client.portal.call(manager.preview, load)  # type: ignore[union-attr]
            assert info.value.code == "not_downloaded" and "POST /api/pull" in info.value.message
            assert client.get("/api/pulls").json() == []
            return
        placed = client.portal.call(manager.preview, load)  # type: ignore[union-attr]
        pulls = client.get("/api/pulls").json()
    assert placed.plan.model.mmproj is not None and placed.plan.model.mmproj.name == "mmproj-SmolLM2-F32.gguf"
    assert [(p["model"], p["state"]) for p in pulls] == [(f"{REAL}:Q4_1", "done")]
