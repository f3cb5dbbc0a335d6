"""``ggstudio rm`` and ``DELETE /api/models/{name}``: a model leaves the library whole, and nothing else does.

The Hugging Face cache is filled by the real huggingface_hub from the local Hub stand-in
(``tests/hub_server.py``); what goes is checked file by file against a listing taken before.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import ollama
import pytest

from studio.library import hub
from studio.residency.lifecycle import ResidentState
from tests.helpers import free_port, wait_for
from tests.support.home_studio import cli_in, home_env, serving
from tests.support.studio import running_studio
from tests.test_cli import CLI, Terminal
from tests.test_hub import add_shards, hf_env, mmproj_bytes, model_bytes, server  # noqa: F401 (fixtures)


def listing(root: Path) -> set[str]:
    """Every file, link and folder under ``root``, relative."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_rm_of_a_hugging_face_cache_model_removes_its_blobs_and_refs_and_nothing_else(
    server, hf_env, tmp_path, llama_server_bin
):
    lib = server.repo("acme/lib-GGUF")
    lib.add("lib-Q4_K_M.gguf", model_bytes(tmp_path))
    add_shards(lib, tmp_path, "BF16/lib-BF16", 2)
    lib.add("mmproj-lib-F16.gguf", mmproj_bytes(tmp_path, 64))
    server.repo("acme/other-GGUF").add("other-Q4_K_M.gguf", model_bytes(tmp_path, floats=96))
    hub.pull("acme/lib-GGUF:Q4_K_M")
    hub.pull("acme/lib-GGUF:BF16")
    hub.pull("acme/other-GGUF")
    cache = hf_env.cache_dir
    repo_dir = hub.repo_folder(cache, "acme/lib-GGUF")
    env = home_env(tmp_path / "home", llama_server_bin)
    before = listing(cache)

    # BF16 shares its revision with Q4_K_M: only its links, and the blobs no other link points at, go
    out = cli_in(env, "rm", "acme/lib-GGUF:BF16", "--json")
    assert out.returncode == 0, out.stderr
    removed = json.loads(out.stdout)
    assert removed["removed"] and removed["source"] == "hf-cache" and removed["revisions"] == []
    assert removed["kept_projector"].endswith("mmproj-lib-F16.gguf")  # Q4_K_M pairs with it too: it stays
    gone = before - listing(cache)
    snap = next(p for p in gone if p.endswith("lib-BF16-00001-of-00002.gguf")).split("/BF16/")[0]
    blob_names = {p for p in gone if p.startswith("models--acme--lib-GGUF/blobs/")}
    assert gone == {f"{snap}/BF16/lib-BF16-0000{i}-of-00002.gguf" for i in (1, 2)} | blob_names
    assert len(blob_names) == 2
    assert (repo_dir / "refs" / "main").is_file()  # the revision still holds Q4_K_M
    listed = json.loads(cli_in(env, "ls", "--json").stdout)
    assert sorted(e["name"] for e in listed) == ["acme/lib-GGUF:Q4_K_M", "acme/other-GGUF:Q4_K_M"]

    # Q4_K_M (and its projector) are all its revision holds now: the revision goes, refs and blobs with it
    before = listing(cache)
    out = cli_in(env, "rm", "acme/lib-GGUF:Q4_K_M")
    assert out.returncode == 0 and out.stdout.startswith("removed acme/lib-GGUF:Q4_K_M ("), out.stderr
    gone = before - listing(cache)
    assert all(p.startswith("models--acme--lib-GGUF") for p in gone)
    assert not any(p.startswith("models--acme--lib-GGUF/") for p in listing(cache))  # refs, blobs, snapshots
    assert {p for p in before if p.startswith("models--acme--other-GGUF")} <= listing(cache)  # untouched
    assert [e["name"] for e in json.loads(cli_in(env, "ls", "--json").stdout)] == ["acme/other-GGUF:Q4_K_M"]


def test_rm_of_a_folder_model_removes_its_shards_and_a_projector_no_other_model_pairs_with(tmp_path, llama_server_bin):
    home = tmp_path / "home"
    models = home / "models"
    for i in (1, 2):
        put(models / "split" / f"big-Q8_0-{i:05d}-of-00002.gguf", model_bytes(tmp_path, split=(i - 1, 2)))
    put(models / "vision" / "eye-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=64))
    put(models / "vision" / "eye-Q8_0.gguf", model_bytes(tmp_path, n_embd=64, floats=80))
    put(models / "vision" / "mmproj-eye-F16.gguf", mmproj_bytes(tmp_path, 64))
    put(models / "solo-Q4_K_M.gguf", model_bytes(tmp_path))
    put(models / "solo-Q4_K_M.gguf.ok", b"{}")
    put(models / "notes.txt", b"mine")
    env = home_env(home, llama_server_bin)
    before = listing(models)

    out = cli_in(env, "rm", "big-Q8_0", "--json")
    assert out.returncode == 0, out.stderr
    assert before - listing(models) == {f"split/big-Q8_0-0000{i}-of-00002.gguf" for i in (1, 2)}

    out = cli_in(env, "rm", "eye-Q4_K_M", "--json")  # eye-Q8_0 pairs with the projector too: it stays
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kept_projector"].endswith("mmproj-eye-F16.gguf")
    assert (models / "vision" / "mmproj-eye-F16.gguf").exists() and not (models / "vision" / "eye-Q4_K_M.gguf").exists()
    out = cli_in(env, "rm", str(models / "vision" / "eye-Q8_0.gguf"))  # by path; now the projector goes too
    assert out.returncode == 0, out.stderr
    assert not (models / "vision" / "mmproj-eye-F16.gguf").exists()

    out = cli_in(env, "rm", "solo-Q4_K_M")  # with the marker the embedded models keep beside their file
    assert out.returncode == 0, out.stderr
    assert listing(models) == {"split", "vision", "notes.txt"}


def test_rm_of_an_unknown_model_or_a_file_outside_the_library_is_one_error_and_deletes_nothing(
    tmp_path, llama_server_bin
):
    home = tmp_path / "home"
    put(home / "models" / "kept-Q4_K_M.gguf", model_bytes(tmp_path))
    outside = put(tmp_path / "elsewhere" / "stray-Q4_K_M.gguf", model_bytes(tmp_path))
    env = home_env(home, llama_server_bin)
    before = listing(tmp_path)

    unknown = cli_in(env, "rm", "no-such-model")
    assert unknown.returncode == 3 and unknown.stderr.startswith("error: model 'no-such-model' not found")
    stray = cli_in(env, "rm", str(outside))
    assert stray.returncode == 1 and stray.stderr.startswith(f"error: {outside} is not a model of the library")
    text = cli_in(env, "rm", str(home / "config.toml"))  # not there at all: unknown
    assert text.returncode == 3
    for out in (unknown, stray, text):
        assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert listing(tmp_path) == before


def test_rm_on_a_terminal_asks_first_and_a_no_keeps_the_model(tmp_path, llama_server_bin):
    home = tmp_path / "home"
    model = put(home / "models" / "asked-Q4_K_M.gguf", model_bytes(tmp_path))
    env = home_env(home, llama_server_bin, TERM="dumb")
    term = Terminal([CLI, "rm", "asked-Q4_K_M"], env)
    try:
        term.expect(r"remove it\? \[y/N\]: ", timeout=60)
        assert str(model) in term.text
        term.send("n\r")
        assert term.wait(timeout=30) == 1
        assert "nothing removed" in term.text and model.exists()
    finally:
        term.close()
    term = Terminal([CLI, "rm", "asked-Q4_K_M"], env)
    try:
        term.expect(r"remove it\? \[y/N\]: ", timeout=60)
        term.send("y\r")
        assert term.wait(timeout=30) == 0
        assert not model.exists()
    finally:
        term.close()


@pytest.mark.slow
def test_rm_through_the_running_studio_refuses_a_resident_model_unless_forced(zoo_dir, llama_server_bin, tmp_path):
    home = tmp_path / "home"
    model = home / "models" / "tiny-dense.gguf"
    model.parent.mkdir(parents=True)
    shutil.copy(zoo_dir / "llama-dense.gguf", model)
    env = home_env(home, llama_server_bin)
    with serving(env, model) as (_, ready):
        url = ready["url"]
        wait_for(lambda: httpx.get(f"{url}/api/status", timeout=10).json()["state"] == "ready", timeout=60)
        refused = cli_in(env, "rm", "tiny-dense")
        assert (
            refused.returncode == 1 and "tiny-dense is resident" in refused.stderr and "Traceback" not in refused.stderr
        )
        assert model.exists()
        answer = httpx.delete(f"{url}/api/models/tiny-dense", timeout=30)
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "model_resident"
        dry = httpx.delete(f"{url}/api/models/tiny-dense?dry_run=true", timeout=30).json()
        assert dry["removed"] is False and dry["files"] == [str(model)] and model.exists()
        outside = httpx.delete(f"{url}/api/models/{zoo_dir / 'llama-dense.gguf'}", timeout=30)
        assert outside.status_code == 403 and (zoo_dir / "llama-dense.gguf").exists()
        assert httpx.delete(f"{url}/api/models/no-such", timeout=30).status_code == 404

        forced = cli_in(env, "rm", "tiny-dense", "--force", "--json")
        assert forced.returncode == 0, forced.stderr
        assert json.loads(forced.stdout)["files"] == [str(model)] and not model.exists()
        status = httpx.get(f"{url}/api/status", timeout=10).json()
        assert status["models"] == [] and status["state"] == "unloaded"


@pytest.mark.slow
def test_ollama_rm_removes_a_library_model_and_refuses_a_resident_one(zoo_dir, llama_server_bin, tmp_path):
    """``ollama rm`` was a 501; it is ``ggstudio rm`` now, and a model in use is not deleted under its llama-server."""
    models = tmp_path / "home" / "models"
    resident, spare = models / "tiny-dense.gguf", models / "spare-dense.gguf"
    models.mkdir(parents=True)
    for model in (resident, spare):
        shutil.copy(zoo_dir / "llama-dense.gguf", model)
    env = home_env(tmp_path / "home", llama_server_bin)
    port = free_port()
    with serving(env, resident, "--ollama-port", str(port)) as (_, ready):
        wait_for(lambda: httpx.get(f"{ready['url']}/api/status", timeout=10).json()["state"] == "ready", timeout=60)
        with ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60) as client:
            with pytest.raises(ollama.ResponseError) as refused:
                client.delete("tiny-dense")
            assert refused.value.status_code == 409 and "`ollama stop tiny-dense`" in refused.value.error
            assert client.delete("spare-dense:latest").status == "success"
            assert resident.exists() and not spare.exists()
            assert [m.model for m in client.list().models] == ["tiny-dense"]
            with pytest.raises(ollama.ResponseError) as missing:
                client.delete("spare-dense")
            assert missing.value.status_code == 404 and "spare-dense" in missing.value.error


@pytest.mark.slow
def test_a_removal_during_a_load_of_the_model_is_refused_and_the_load_goes_on(tmp_path, llama_server_bin, gemma_model):
    """The removal looks at the loads as well as the residents: a model on its way in is not deleted under it."""
    model = tmp_path / "gemma-copy.gguf"  # a copy: a removal that went through would delete the file itself
    shutil.copy(gemma_model, model)
    answers: list[httpx.Response] = []
    with running_studio(tmp_path / "studio", llama_server_bin, {"gemma": model}) as s:

        def load() -> None:
            answers.append(httpx.post(f"{s.url}/api/load", json={"model": "gemma", "n_ctx": 2048}, timeout=120))

        thread = threading.Thread(target=load)
        thread.start()
        wait_for(lambda: any(r.state is ResidentState.LOADING for r in s.manager.residents), timeout=30, what="loading")
        refused = httpx.delete(f"{s.url}/api/models/gemma", timeout=30)
        thread.join(120)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_resident"
        (loaded,) = answers
        assert loaded.status_code == 200 and model.exists()
        assert httpx.get(f"{s.url}/api/status", timeout=10).json()["state"] == "ready"
