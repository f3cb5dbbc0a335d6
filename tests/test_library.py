"""The local library: folders and the Hugging Face cache, shards grouped, mmproj paired, fast rescans."""

from __future__ import annotations

from pathlib import Path

import gguf
import gguf.model
from studio.library import hub
from studio.library.catalog import Catalog
from studio.library.scan import Library, scan
from tests.test_hub import add_shards, hf_env, mmproj_bytes, model_bytes, server  # noqa: F401 (fixtures)


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_folder_scan_groups_shards_pairs_mmproj_and_names_problems(tmp_path):
    models = tmp_path / "models"
    put(models / "solo-Q4_K_M.gguf", model_bytes(tmp_path))
    for i in (1, 2):
        put(models / "split" / f"big-Q8_0-{i:05d}-of-00002.gguf", model_bytes(tmp_path, split=(i - 1, 2)))
    put(models / "vision" / "eye-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=64))
    put(models / "vision" / "mmproj-eye-F16.gguf", mmproj_bytes(tmp_path, 64))
    put(models / "other" / "ear-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=64))
    put(models / "other" / "mmproj-F16.gguf", mmproj_bytes(tmp_path, 1152))  # another family's projector
    put(models / "holey" / "gap-Q2_K-00001-of-00003.gguf", model_bytes(tmp_path, split=(0, 3)))
    put(models / "broken-Q4_0.gguf", b"not a gguf at all")

    entries = {e.name: e for e in scan([models, tmp_path / "absent"])}
    assert sorted(entries) == ["big-Q8_0", "broken-Q4_0", "ear-Q4_K_M", "eye-Q4_K_M", "gap-Q2_K", "solo-Q4_K_M"]
    big = entries["big-Q8_0"]
    assert [p.name for p in big.shards] == ["big-Q8_0-00001-of-00002.gguf", "big-Q8_0-00002-of-00002.gguf"]
    assert big.size == sum(p.stat().st_size for p in big.shards) and big.error is None
    assert entries["solo-Q4_K_M"].architecture == "llama" and entries["solo-Q4_K_M"].context_length == 2048
    assert entries["eye-Q4_K_M"].mmproj == models / "vision" / "mmproj-eye-F16.gguf"
    assert entries["ear-Q4_K_M"].mmproj is None
    assert "gap-Q2_K-00002-of-00003.gguf" in entries["gap-Q2_K"].error
    assert "GGUF" in entries["broken-Q4_0"].error
    assert all(e.source == "folder" and e.repo is None for e in entries.values())


def test_hf_cache_models_are_listed_by_repo_and_variant(server, hf_env, tmp_path):
    repo = server.repo("acme/lib-GGUF")
    repo.add("lib-Q4_K_M.gguf", model_bytes(tmp_path))
    add_shards(repo, tmp_path, "BF16/lib-BF16", 2)
    repo.add("mmproj-lib-F16.gguf", mmproj_bytes(tmp_path, 64))
    hub.pull("acme/lib-GGUF")
    hub.pull("acme/lib-GGUF:BF16")
    entries = {e.name: e for e in scan([], hf_env.cache_dir)}
    assert sorted(entries) == ["acme/lib-GGUF:BF16", "acme/lib-GGUF:Q4_K_M"]
    q4 = entries["acme/lib-GGUF:Q4_K_M"]
    assert q4.source == "hf-cache" and q4.repo == "acme/lib-GGUF" and q4.variant == "Q4_K_M"
    assert q4.mmproj is not None and q4.mmproj.name == "mmproj-lib-F16.gguf"
    assert len(entries["acme/lib-GGUF:BF16"].shards) == 2
    assert q4.to_json()["path"].endswith("lib-Q4_K_M.gguf")


def test_a_rescan_of_unchanged_files_reads_no_header(tmp_path, monkeypatch):
    models = tmp_path / "models"
    one = model_bytes(tmp_path)
    for i in range(300):
        put(models / f"d{i % 10}" / f"m{i:03d}-Q4_K_M.gguf", one)
    index = tmp_path / "cache" / "library.json"
    first = scan([models], index_path=index)
    assert len(first) == 300 and index.is_file()

    reads = []
    real = gguf.model.read_header
    monkeypatch.setattr(gguf.model, "read_header", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    gguf.clear_cache()  # a new process: only the index file is left
    again = Library([models], index_path=index).scan()
    # Reading no header is what makes a rescan cost only stats (timed in no test: see the closing notes).
    assert reads == [] and [e.to_json() for e in again] == [e.to_json() for e in first]

    changed = put(models / "d3" / "m003-Q4_K_M.gguf", model_bytes(tmp_path, floats=128))
    scan([models], index_path=index)
    assert reads == [changed]


def test_catalog_serves_hf_cache_models_by_repo_and_variant(server, hf_env, tmp_path):
    repo = server.repo("acme/cat-GGUF")
    repo.add("cat-Q4_K_M.gguf", model_bytes(tmp_path))
    hub.pull("acme/cat-GGUF")
    catalog = Catalog([tmp_path / "no-models-here"], hf_cache=hf_env.cache_dir)
    assert [e.name for e in catalog.entries()] == ["acme/cat-GGUF:Q4_K_M"]
    entry = catalog.resolve("acme/cat-GGUF:Q4_K_M")
    assert entry.path.name == "cat-Q4_K_M.gguf" and gguf.read(entry.path).metadata["general.architecture"]
