"""Hub search with a fit per variant, from headers read with ranged requests against the local Hub stand-in.

The service is the real app (``create_app``) with a real ``ModelManager`` (``tests.manager_harness``:
the pinned build's capabilities, a fixed CPU inventory, a memory budget); huggingface_hub is the real
client; the Hub is ``tests.hub_server``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import gguf
from gguf.shards import shard_name
from gguf.writer import TensorToWrite, write_gguf
from studio.errors import HubError, HubUnreachableError
from studio.http.app import create_app
from studio.library import hub
from studio.library.catalog import Catalog
from studio.library.downloads import DownloadManager
from studio.library.hub_headers import MARGIN, fetch_header
from studio.library.hub_search import repo_variants, search, variant_headers
from studio.residency.requests import LoadRequest
from tests.fake_llama import fake_children
from tests.hub_server import HubServer
from tests.manager_harness import fake_manager
from tests.support.deep_zoo import deepen_model
from tests.test_hub import hf_env, server  # noqa: F401 (fixtures)

BASE = "http://127.0.0.1:8080"
REPO = "acme/deep-GGUF"
#: Five variants, smallest first: the deeper, the larger.
LABELS = {"Q2_K": 4, "Q3_K_M": 8, "Q4_K_M": 16, "Q5_K_M": 24, "Q8_0": 32}


@pytest.fixture
def studio(real, hf_env, tmp_path):  # noqa: F811 (a fixture)
    """The app around a manager with no model of its own; ``studio.budget`` is set per test."""

    def make(budget: int | None = None, models: dict[str, Path] | None = None):
        manager = fake_manager(tmp_path / "studio", children, real, models or {}, budget=budget)
        manager.catalog = Catalog([tmp_path / "studio" / "models"], hf_cache=hf_env.cache_dir)  # pulls count
        app = create_app(manager, downloads=DownloadManager(), hub_headers=tmp_path / "headers")
        return TestClient(app, base_url=BASE), manager

    with fake_children() as children:
        yield make


def deep_variants(zoo_dir: Path, tmp_path: Path) -> dict[str, Path]:
    """llama-dense deepened to 4..32 blocks: five sizes of one model, named as quants."""
    out = {}
    for label, blocks in LABELS.items():
        path = deepen_model(zoo_dir / "llama-dense.gguf", tmp_path / f"deep-{label}.gguf", blocks)
        assert path is not None
        out[label] = path
    return out


def deep_repo(server: HubServer, zoo_dir: Path, tmp_path: Path, **repo: int) -> dict[str, Path]:
    """The five ``deep_variants`` as the files of ``REPO`` on the Hub stand-in; returns them by label."""
    paths = deep_variants(zoo_dir, tmp_path)
    hub_repo = server.repo(REPO, **repo)
    for label, path in paths.items():
        hub_repo.add(f"deep-{label}.gguf", path)
    return paths


def bills(manager, paths: dict[str, Path]) -> dict[str, int]:
    import asyncio

    async def one(p: Path) -> int:
        return (await manager.preview(LoadRequest(model=str(p), n_ctx=256))).plan.bill.total

    async def every() -> dict[str, int]:
        return {label: await one(p) for label, p in paths.items()}

    return asyncio.run(every())


def test_five_variants_two_fit_under_a_budget_and_the_larger_is_recommended_with_a_quality_note(
    studio, server, zoo_dir, tmp_path
):
    paths = deep_repo(server, zoo_dir, tmp_path, downloads=5)
    _, probe = studio()
    sizes = bills(probe, paths)
    assert sorted(sizes.values()) == list(sizes.values())  # deeper is larger
    budget = (sizes["Q3_K_M"] + sizes["Q4_K_M"]) // 2
    client, budgeted = studio(budget=budget)
    with client:
        r = client.get("/api/hub/search", params={"q": "deep", "ctx": 256})
    assert r.status_code == 200, r.text
    # the same studio's plan of each downloaded file: its prompt cache is sized from the room the budget leaves
    downloaded = bills(budgeted, paths)
    (found,) = r.json()["repos"]
    by_label = {v["label"]: v for v in found["variants"]}
    assert {label for label, v in by_label.items() if v["fit"]["fits"]} == {"Q2_K", "Q3_K_M"}
    assert found["recommended"] == f"{REPO}:Q3_K_M"
    assert found["variants"][0]["label"] == "Q3_K_M" and found["variants"][0]["recommended"]
    assert "quality suffers" in found["recommendation"]
    q8 = by_label["Q8_0"]["fit"]
    assert q8["badge"].startswith("does not fit: needs") and q8["reason"]
    assert by_label["Q2_K"]["fit"]["badge"] == "fits at 256 ctx, on the CPU; evicts nothing"
    for v in found["variants"]:
        assert v["fit"]["memory_bytes"] == downloaded[v["label"]]  # the bill of the file itself
        assert v["fit"]["bytes_read"] <= v["fit"]["header_bytes"] + MARGIN
    assert server.downloads() and all(r.range for r in server.requests if "/resolve/" in r.path)


def test_the_fit_from_the_header_agrees_with_the_plan_after_the_download(studio, server, zoo_dir, tmp_path, hf_env):  # noqa: F811
    deep_repo(server, zoo_dir, tmp_path)
    client, manager = studio()
    with client:
        before = client.post("/api/plan", json={"model": f"{REPO}:Q4_K_M", "n_ctx": 256, "spec": "off"}).json()
        assert before["hub"]["downloaded"] is False, before
        assert before["model"]["path"] == f"{REPO}:Q4_K_M (not downloaded)"
        hub.pull(f"{REPO}:Q4_K_M", config=hf_env)
        after = client.post("/api/plan", json={"model": f"{REPO}:Q4_K_M", "n_ctx": 256, "spec": "off"}).json()
    assert "hub" not in after  # planned on the downloaded file
    for key in ("context", "n_gpu_layers", "fits", "bill", "offload"):
        assert before[key] == after[key], key


def test_every_zoo_architectures_fit_from_its_header_is_the_plan_of_its_file(studio, server, zoo_dir):
    """The downloaded file is byte for byte the zoo file: its plan is the plan after the download."""
    client, manager = studio()
    import asyncio

    with client:
        for path in sorted(zoo_dir.glob("*.gguf")):
            repo_id = f"zoo/{path.stem}-GGUF"
            server.repo(repo_id).add(f"{path.stem}-Q8_0.gguf", path)
            r = client.get("/api/hub/fit", params={"model": f"{repo_id}:Q8_0"})
            server.repos.pop(repo_id)
            assert r.status_code == 200, (path.name, r.text)
            fit = r.json()
            local = asyncio.run(manager.preview(LoadRequest(model=str(path))))
            assert fit["fits"] == local.fits, path.name
            assert (fit["n_ctx"], fit["max_ctx"], fit["n_gpu_layers"], fit["memory_bytes"], fit["spec"]) == (
                local.plan.n_ctx,
                local.plan.max_safe_ctx,
                local.plan.n_gpu_layers,
                local.plan.bill.total,
                local.plan.spec.resolved,
            ), path.name
            assert fit["bytes_read"] <= gguf.read_header(path).data_offset + MARGIN, path.name


def test_a_split_model_is_read_from_its_first_shard_and_the_others_headers_only(server, hf_env, tmp_path):  # noqa: F811
    tensors = [TensorToWrite(f"blk.{i}.w", (1024 * 64,), "F32") for i in range(3)]
    files = {}
    for i in range(3):
        meta = {"split.no": i, "split.count": 3, "split.tensors.count": 3}
        if i == 0:
            meta = {"general.architecture": "llama", "llama.block_count": 3, **meta}
        files[shard_name("split-Q4_K_M", i + 1, 3)] = write_gguf(
            tmp_path / shard_name("split-Q4_K_M", i + 1, 3), meta, [tensors[i]]
        )
    repo = server.repo("acme/split-GGUF")
    for name, path in files.items():
        repo.add(name, path)
    found = repo_variants("acme/split-GGUF", config=hf_env)
    (variant,) = found.variants
    assert variant.shards == 3
    server.clear()
    kept = variant_headers(found, variant, root=tmp_path / "headers", config=hf_env)
    assert kept.path.name == shard_name("split-Q4_K_M", 1, 3)
    ranged = [r for r in server.requests if "/resolve/" in r.path]
    assert ranged[0].path.endswith(shard_name("split-Q4_K_M", 1, 3)) and all(r.range for r in ranged)
    model = gguf.read(kept.path)  # the kept shards read as the split model
    assert model.metadata["general.architecture"] == "llama"
    assert [t.name for t in model.tensors] == ["blk.0.w", "blk.1.w", "blk.2.w"]
    assert model.file_size == sum(p.stat().st_size for p in files.values())
    assert kept.bytes_read <= kept.header_bytes + 3 * MARGIN
    for name, path in files.items():  # the header and the margin, not the 256 KiB of the tensor
        assert server.bytes_sent(name) <= gguf.read_header(path).data_offset + MARGIN < path.stat().st_size


def test_a_header_cut_short_by_the_server_is_a_clear_error_and_nothing_is_kept(server, hf_env, tmp_path):  # noqa: F811
    path = write_gguf(
        tmp_path / "m.gguf",
        {"general.architecture": "llama", "tokenizer.ggml.tokens": [f"t{i}" for i in range(20000)]},
        [TensorToWrite("w", (4096,), "F32")],
    )
    server.repo("acme/cut-GGUF").add("m-Q4_K_M.gguf", path)
    server.cut["m-Q4_K_M.gguf"] = 1000
    found = repo_variants("acme/cut-GGUF", config=hf_env)
    with pytest.raises(HubError) as info:
        variant_headers(found, found.variants[0], root=tmp_path / "headers", config=hf_env)
    assert info.value.code == "header_cut_short"
    assert "cut the header of acme/cut-GGUF/m-Q4_K_M.gguf short" in info.value.message
    assert not list((tmp_path / "headers").rglob("*.gguf"))


def test_a_server_that_ignores_ranges_is_read_only_as_far_as_asked(server, hf_env, zoo_dir, tmp_path):  # noqa: F811
    server.repo("acme/whole-GGUF").add("m.gguf", zoo_dir / "llama-dense.gguf")  # 23 KiB header, 4.5 MiB file
    server.ignore_ranges = True
    commit, files = hub.list_files("acme/whole-GGUF", config=hf_env)
    kept = fetch_header("acme/whole-GGUF", commit, files[0], root=tmp_path / "h", config=hf_env)
    assert kept.bytes_read == MARGIN and kept.header_bytes == gguf.read_header(zoo_dir / "llama-dense.gguf").data_offset
    assert gguf.read(kept.path).tensors == gguf.read(zoo_dir / "llama-dense.gguf").tensors


def test_a_file_too_short_for_a_header_is_a_truncation_error_after_one_small_read(server, hf_env, tmp_path):  # noqa: F811
    server.repo("acme/tiny-GGUF").add("m.gguf", b"GGUF")
    commit, files = hub.list_files("acme/tiny-GGUF", config=hf_env)
    server.clear()
    with pytest.raises(gguf.TruncatedError, match="a GGUF header needs at least 24"):
        fetch_header("acme/tiny-GGUF", commit, files[0], root=tmp_path / "h", config=hf_env)
    assert [r.range for r in server.requests] == ["bytes=0-3"]


def test_a_header_claiming_more_than_the_limit_is_refused_before_it_is_read(server, hf_env, tmp_path):  # noqa: F811
    path = write_gguf(
        tmp_path / "m.gguf",
        {"general.architecture": "llama", "tokenizer.ggml.tokens": [f"t{i}" for i in range(40000)]},
        [TensorToWrite("w", (4096,), "F32")],
    )
    server.repo("acme/big-GGUF").add("m.gguf", path)
    commit, files = hub.list_files("acme/big-GGUF", config=hf_env)
    with pytest.raises(HubError) as info:
        fetch_header("acme/big-GGUF", commit, files[0], root=tmp_path / "h", config=hf_env, limit=100_000)
    assert info.value.code == "header_too_large"
    assert server.bytes_sent("m.gguf") <= MARGIN


def test_the_hub_unreachable_is_a_clear_error_within_the_timeout(tmp_path, monkeypatch):
    """A host that accepts connections and never answers: list_models alone would wait for ever."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    cfg = hub.HubConfig(endpoint=endpoint, cache_dir=tmp_path / "hf", timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(HubUnreachableError) as info:
            search("gemma", config=cfg)
        assert time.monotonic() - started < 3
        assert f"the Hub at {endpoint} cannot be reached within 1 s" in info.value.message
        refused = hub.HubConfig(endpoint="http://127.0.0.1:9", cache_dir=tmp_path / "hf", timeout=1.0)
        started = time.monotonic()
        with pytest.raises(HubUnreachableError):
            fetch_header("a/b", "0" * 40, hub.HubFile("m.gguf", 10_000), root=tmp_path / "h", config=refused)
        assert time.monotonic() - started < 3
    finally:
        silent.close()


def test_a_hub_that_hangs_on_the_search_is_unreachable_within_the_timeout(server, tmp_path):  # noqa: F811
    server.search_delay = 4
    cfg = hub.HubConfig(endpoint=server.url, cache_dir=tmp_path / "hf", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(HubUnreachableError) as info:
        search("gemma", config=cfg)
    assert time.monotonic() - started < 2.5
    assert f"the Hub at {server.url} did not answer within 1 s while searching the Hub" in info.value.message


def test_the_search_answers_504_with_the_error_shape_when_the_hub_is_unreachable(studio, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    client, _ = studio()
    with client:
        r = client.get("/api/hub/search", params={"q": "x"})
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "hub_unreachable"
    assert "cannot be reached" in r.json()["error"]["message"] or "did not answer" in r.json()["error"]["message"]


def test_a_kept_header_is_not_read_twice(studio, server, zoo_dir):
    path = zoo_dir / "llama-dense.gguf"
    server.repo("acme/once-GGUF").add("once-Q4_K_M.gguf", path)
    client, _ = studio()
    with client:
        first = client.get("/api/hub/fit", params={"model": "acme/once-GGUF:Q4_K_M"}).json()
        server.clear()
        again = client.get("/api/hub/fit", params={"model": "acme/once-GGUF:Q4_K_M"}).json()
    assert first["bytes_read"] > 0 and not first["cached"]
    assert again["bytes_read"] == 0 and again["cached"]
    assert [r for r in server.requests if "/resolve/" in r.path] == []  # only the listing was asked again
    assert {k: v for k, v in first.items() if k not in ("bytes_read", "cached")} == {
        k: v for k, v in again.items() if k not in ("bytes_read", "cached")
    }


def test_search_pages_through_repos_most_downloaded_first(server, hf_env, zoo_dir):  # noqa: F811
    for i in range(5):
        server.repo(f"acme/page{i}-GGUF", downloads=i).add(f"m{i}-Q4_K_M.gguf", zoo_dir / "llama-dense.gguf")
    first = search("page", page=0, per_page=2, config=hf_env)
    last = search("page", page=2, per_page=2, config=hf_env)
    assert [r.repo for r in first.repos] == ["acme/page4-GGUF", "acme/page3-GGUF"] and first.more
    assert [r.repo for r in last.repos] == ["acme/page0-GGUF"] and not last.more
    assert first.repos[0].variants[0].label == "Q4_K_M"


# -- the command line -------------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``ggstudio`` running this checkout's packages."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "ggstudio"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "PYTHONPATH": str(Path(__file__).parent.parent), "NO_COLOR": "1"},
    )


@pytest.fixture
def cli_env(server, llama_server_bin, tmp_path) -> dict[str, str]:  # noqa: F811
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "GGUF_STUDIO_"))}
    return {
        **env,
        "HF_ENDPOINT": server.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "GGUF_STUDIO_HOME": str(tmp_path / "home"),
        "LLAMA_SERVER_PATH": str(llama_server_bin),
    }


def test_ggstudio_search_prints_a_badge_per_variant_and_plan_takes_a_variant_not_downloaded(
    server, zoo_dir, tmp_path, cli_env
):
    deep_repo(server, zoo_dir, tmp_path, downloads=7)
    out = cli("search", "deep", "--ctx", "256", env=cli_env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"{REPO}  (7 downloads)"
    assert lines[1] == "  Q8_0 is the largest variant that fits"  # 64 GiB-class machines fit them all
    assert lines[2].startswith(" *Q8_0") and "fits at 256 ctx" in lines[2]
    assert len(lines) == 2 + len(LABELS)
    planned = cli("plan", f"{REPO}:Q4_K_M", "--ctx", "256", "--json", env=cli_env)
    assert planned.returncode == 0, planned.stderr
    info = json.loads(planned.stdout)
    assert info["hub"]["downloaded"] is False and info["hub"]["cached"]  # the search kept its header
    assert info["model"]["path"] == f"{REPO}:Q4_K_M (not downloaded)" and info["context"]["n_ctx"] == 256
    assert not (tmp_path / "hf" / "hub").exists()  # nothing went to the Hugging Face cache


def test_ggstudio_search_with_the_hub_unreachable_is_one_error_line_within_the_timeout(cli_env):
    started = time.monotonic()
    out = cli("search", "gemma", env={**cli_env, "HF_ENDPOINT": "http://127.0.0.1:9"}, timeout=60)
    assert time.monotonic() - started < 30
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("error: the Hub at http://127.0.0.1:9 ") and out.stderr.count("\n") == 1, out.stderr
