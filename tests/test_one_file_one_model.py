"""One model file is one model, however it is reached: a link under another name, a hard link, a path, one
Hugging Face blob under two names.

People share one file between LM Studio, Ollama and the studio with a symlink under another name in the
models folder (``smol.gguf -> SmolLM2-135M-Instruct.Q4_1.gguf``). Before, each name was a model of its
own: ``serve --model SmolLM2-135M-Instruct.Q4_1`` then ``ggstudio run smol`` ran two llama-servers on the
same file, and an unload by one name left the other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import psutil
import pytest

from studio.library import hub
from studio.library.catalog import Catalog, names_by_model
from studio.residency.requests import LoadRequest
from studio.settings import ModelDefaults
from tests.support.studio import running_studio
from tests.test_hub import hf_env, mmproj_bytes, model_bytes, server  # noqa: F401 (fixtures)

SMOL = "SmolLM2-135M-Instruct.Q4_1"


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def link(path: Path, target: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


# -- the rule, in the catalog ------------------------------------------------------------------------


def test_every_name_of_one_file_is_an_alias_of_its_model(tmp_path):
    """Links, a hard link and a path all reach the model of the file's own name; a copy is a model of its own."""
    first, models = tmp_path / "first", tmp_path / "models"
    real = put(models / "real-Q4_K_M.gguf", model_bytes(tmp_path))
    link(models / "smol.gguf", real)  # the case: a link under another name beside the file
    link(first / "a-link.gguf", real)  # found first (the first folder), but a link: the file's own name wins
    os.link(real, models / "z-hard.gguf")  # a name of the file itself too, after it in the library's order
    put(models / "copy.gguf", real.read_bytes())  # the same bytes in a file of their own: another model
    outside = link(tmp_path / "outside" / "mine.gguf", real)
    catalog = Catalog([first, models], aliases={"fav": "smol", "by-path": str(outside)})

    entries = catalog.entries()
    assert names_by_model(entries) == {
        "copy": ["copy"],
        "real-Q4_K_M": ["a-link", "by-path", "fav", "real-Q4_K_M", "smol", "z-hard"],
    }
    assert {e.path for e in entries if e.model == "real-Q4_K_M"} == {real}  # one path: one instance key
    for name in ("smol", "fav", "by-path", "a-link", "z-hard", str(models / "smol.gguf"), str(real), str(outside)):
        assert catalog.resolve(name).model == "real-Q4_K_M", name
    assert catalog.resolve("copy").model == "copy" and catalog.resolve("copy").path == models / "copy.gguf"


def test_a_file_reached_only_through_links_goes_by_its_first_name(tmp_path):
    outside = put(tmp_path / "outside" / "weights.gguf", model_bytes(tmp_path))
    models = tmp_path / "models"
    for name in ("zeta", "alpha", "mid"):
        link(models / f"{name}.gguf", outside)
    catalog = Catalog([models])
    assert names_by_model(catalog.entries()) == {"alpha": ["alpha", "mid", "zeta"]}
    assert catalog.resolve(str(outside)).name == "alpha"  # a path outside the library to a file it holds


def test_one_file_beside_another_projector_is_another_model(tmp_path):
    """The library pairs each folder's own projector: the same weights with one launch with other flags."""
    real = put(tmp_path / "plain" / "eye-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=64))
    link(tmp_path / "vision" / "eye-vision.gguf", real)
    projector = put(tmp_path / "vision" / "mmproj-eye-F16.gguf", mmproj_bytes(tmp_path, 64))
    catalog = Catalog([tmp_path / "plain", tmp_path / "vision"])
    by_name = {e.name: e for e in catalog.entries()}
    assert names_by_model(catalog.entries()) == {"eye-Q4_K_M": ["eye-Q4_K_M"], "eye-vision": ["eye-vision"]}
    assert by_name["eye-vision"].mmproj == projector and by_name["eye-Q4_K_M"].mmproj is None


def test_one_hugging_face_blob_under_two_names_is_one_model_and_two_blobs_are_two(server, hf_env, tmp_path):
    """Snapshot files are links into the repo's blobs: two names of one blob are one model, other files not."""
    repo = server.repo("acme/twin-GGUF")
    weights = model_bytes(tmp_path)
    repo.add("twin-Q4_K_M.gguf", weights)
    repo.add("twin-Q8_0.gguf", weights)  # the same bytes uploaded twice: one blob in the cache
    repo.add("twin-Q2_K.gguf", model_bytes(tmp_path, floats=96))
    server.repo("acme/other-GGUF").add("other-Q4_K_M.gguf", weights)  # the same bytes, another repo's blob
    for spec in ("acme/twin-GGUF:Q4_K_M", "acme/twin-GGUF:Q8_0", "acme/twin-GGUF:Q2_K", "acme/other-GGUF"):
        hub.pull(spec)
    catalog = Catalog([], hf_cache=hf_env.cache_dir)

    assert names_by_model(catalog.entries()) == {
        "acme/other-GGUF:Q4_K_M": ["acme/other-GGUF:Q4_K_M"],
        "acme/twin-GGUF:Q2_K": ["acme/twin-GGUF:Q2_K"],
        "acme/twin-GGUF:Q4_K_M": ["acme/twin-GGUF:Q4_K_M", "acme/twin-GGUF:Q8_0"],
    }
    model = catalog.resolve("acme/twin-GGUF:Q8_0")
    assert model.model == "acme/twin-GGUF:Q4_K_M" and model.path.name == "twin-Q4_K_M.gguf"  # the snapshot's link
    snapshot_path = catalog.resolve("acme/twin-GGUF:Q4_K_M").path
    assert catalog.resolve(str(snapshot_path.resolve())).name == "acme/twin-GGUF:Q4_K_M"  # the blob's own path


# -- the rule, in a running studio ---------------------------------------------------------------------


def llama_servers() -> int:
    return sum(1 for p in psutil.Process().children(recursive=True) if p.name() == "llama-server")


def residents(url: str) -> list[str]:
    return [m["model"] for m in httpx.get(f"{url}/api/status", timeout=10).json()["models"] if m["state"] != "unloaded"]


@pytest.mark.slow
def test_a_symlinked_model_is_one_resident(tmp_path, llama_server_bin, smollm_model):
    """Loaded by its name (as ``serve --model`` does), asked for by a link's name and by path, SmolLM2 is one
    resident on one llama-server, listed once; an unload by the link's name unloads it."""
    models = tmp_path / "models"
    models.mkdir()
    own = models / f"{SMOL}.gguf"
    try:  # the file itself in the models folder, as a download leaves it (a hard link costs no copy)
        os.link(smollm_model, own)
    except OSError:
        shutil.copyfile(smollm_model, own)
    (models / "smol.gguf").symlink_to(own)
    (models / "smol-too.gguf").symlink_to(own)  # a name no request uses before the unload
    small = ModelDefaults(n_ctx=512, spec="off")
    with running_studio(tmp_path, llama_server_bin, {}, defaults={SMOL: small}, preload=[LoadRequest(SMOL)]) as s:
        with httpx.Client(base_url=s.url, timeout=120) as http:
            answered = []
            for name in ("smol", str(models / "smol.gguf"), str(own), SMOL):
                body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
                reply = http.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                answered.append(reply.json()["model"])
            assert residents(s.url) == [SMOL] and llama_servers() == 1  # before: SmolLM2 and smol, two processes
            assert answered == [SMOL] * 4  # the model's own name answers, whichever name asked

            listed = http.get("/v1/models").json()["data"]
            names = [SMOL, "smol", "smol-too"]
            assert [(m["id"], m["aliases"], m["status"]["value"]) for m in listed] == [(SMOL, names, "loaded")]
            assert [(m["name"], m["aliases"]) for m in http.get("/api/models").json()] == [(SMOL, names)]

            for name in ("smol", SMOL):  # its embedding instance is one too
                assert http.post("/v1/embeddings", json={"model": name, "input": "Hi"}).status_code == 200
            assert residents(s.url) == [SMOL, f"{SMOL} (embeddings)"] and llama_servers() == 2

            for name in ("smol (embeddings)", "smol-too"):
                assert http.post("/api/unload", json={"model": name}).status_code == 200
            assert residents(s.url) == [] and llama_servers() == 0
