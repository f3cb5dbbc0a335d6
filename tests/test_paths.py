"""Where API clients may load models from: the library's folders, not any file on the disk.

The files here are not GGUF models: a path the rule lets through reaches the
manager, which answers 400 "not a GGUF file"; a refused one is a 403 before
anything is read. That difference is what the app-level tests look at.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from launcher.capabilities import probe
from launcher.client_flags import CLIENT_FLAGS
from launcher.extra_args import MANAGED_FLAGS
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.error_table import outcome
from studio.errors import PathNotAllowedError
from studio.http.app import create_app
from studio.library.catalog import Catalog
from studio.library.paths import PathPolicy
from studio.residency.manager import ModelManager, supervisor_factory
from studio.residency.requests import LoadRequest


@pytest.fixture
def disk(tmp_path):
    """models/ (a model folder), home/ (the studio home), hf/ (the HF cache) and outside/, with a file in each."""
    for folder in ("models", "home/zoo", "hf", "outside"):
        (tmp_path / folder).mkdir(parents=True)
    for path in ("models/mine.gguf", "home/zoo/tiny.gguf", "outside/stray.gguf", "outside/linked.gguf"):
        (tmp_path / path).write_text("not a model")
    (tmp_path / "models/link.gguf").symlink_to(tmp_path / "outside/linked.gguf")  # the user's own link
    (tmp_path / "models/escape").symlink_to(tmp_path / "outside", target_is_directory=True)
    return tmp_path


@pytest.fixture
def catalog(disk):
    return Catalog([disk / "models"], hf_cache=disk / "hf")


def test_files_under_the_folders_the_cache_and_the_home_are_allowed(disk, catalog):
    policy = PathPolicy.for_catalog(catalog, home=disk / "home")
    for path in ("models/mine.gguf", "home/zoo/tiny.gguf", "models/link.gguf", "outside/linked.gguf"):
        policy.check(str(disk / path), catalog)  # the last two: a link the user put in a model folder
    policy.check("mine", catalog)  # a name: the catalog's business
    policy.check("no-such-model", catalog)  # not a file: the catalog answers 404
    policy.check(None, catalog)


@pytest.mark.parametrize(
    "path",
    ["outside/stray.gguf", "models/../outside/stray.gguf", "models/escape/stray.gguf", "home/../outside/stray.gguf"],
)
def test_files_elsewhere_are_refused_even_through_dots_and_links(disk, catalog, path):
    policy = PathPolicy.for_catalog(catalog, home=disk / "home")
    with pytest.raises(PathNotAllowedError) as info:
        policy.check(str(disk / path), catalog)
    assert (outcome(info.value).status, outcome(info.value).code) == (403, "path_not_allowed")
    assert "allow_any_path = true" in info.value.message and "model_dirs" in info.value.message
    assert info.value.path == str(disk / "outside/stray.gguf")


def test_a_relative_path_is_resolved_against_the_working_directory(disk, catalog, monkeypatch):
    monkeypatch.chdir(disk / "models")
    policy = PathPolicy.for_catalog(catalog)
    policy.check("mine.gguf", catalog)
    with pytest.raises(PathNotAllowedError):
        policy.check("../outside/stray.gguf", catalog)


@pytest.mark.parametrize("model", ["a\x00b", "~no-such-user/x.gguf", "x" * 5000, "owner/repo:Q4_K_M", ""])
def test_strings_that_are_no_file_are_left_to_the_catalog(catalog, model):
    PathPolicy.for_catalog(catalog).check(model, catalog)  # no crash, no refusal: the catalog answers 404


def test_allow_any_path_and_files_named_on_the_command_line(disk, catalog):
    PathPolicy.for_catalog(catalog, allow_any=True).check(str(disk / "outside/stray.gguf"), catalog)
    PathPolicy.for_catalog(catalog, files=[disk / "outside/stray.gguf"]).check(
        str(disk / "outside/stray.gguf"), catalog
    )


@pytest.fixture
def client(llama_server_bin, disk, catalog):
    manager = ModelManager(
        catalog=catalog,
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(disk / "logs", ChildRegistry(disk / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=disk / "cache"),
    )
    with TestClient(
        create_app(manager, paths=PathPolicy.for_catalog(catalog, home=disk / "home")), base_url="http://127.0.0.1:8080"
    ) as c:
        yield c


def test_every_api_route_that_takes_a_model_refuses_a_stray_path(client, disk, monkeypatch):
    monkeypatch.chdir(disk / "outside")  # /api/models/{name} takes no slashes: a file in the studio's folder
    stray, mine = str(disk / "outside/stray.gguf"), str(disk / "models/mine.gguf")
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for method, path, body in [
        ("POST", "/api/load", {"model": stray}),
        ("POST", "/api/plan", {"model": stray}),
        ("POST", "/api/chat", {"model": stray, **chat}),
        ("POST", "/v1/chat/completions", {"model": stray, **chat}),
        ("POST", "/v1/completions", {"model": stray, "prompt": "x"}),
        ("POST", "/v1/embeddings", {"model": stray, "input": "x"}),
        ("GET", "/api/models/stray.gguf", None),
    ]:
        resp = client.request(method, path, json=body)
        assert resp.status_code == 403, (path, resp.text)
        error = resp.json()["error"]
        assert (
            error["code"] == "path_not_allowed" and error["param"] == "model" and "allow_any_path" in error["message"]
        )
    # the same routes with a file from a model folder go on to read it (and find it is no GGUF)
    assert client.post("/api/load", json={"model": mine}).status_code == 400
    assert client.post("/api/plan", json={"model": mine}).status_code == 400
    resp = client.post("/v1/chat/completions", json={"model": mine, **chat})
    assert resp.status_code == 400 and "not a GGUF file" in resp.json()["error"]["message"]


@pytest.mark.slow
def test_a_model_the_cli_loaded_from_elsewhere_stays_usable_by_its_path(client, disk, zoo_dir):
    """`serve --model /anywhere/x.gguf` loads through the manager; API clients may then use it as it is named."""
    outside = disk / "outside" / "tiny.gguf"
    outside.symlink_to(zoo_dir / "llama-dense.gguf")
    chat = {"model": str(outside), "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 403  # not resident: the rule holds
    manager = client.app.state.manager
    client.portal.call(manager.load, LoadRequest(model=str(outside), n_ctx=256, spec="off"))
    try:
        resp = client.post("/v1/chat/completions", json=chat)
        assert resp.status_code == 200, resp.text
        assert client.post("/api/load", json={"model": str(outside), "n_ctx": 256, "spec": "off"}).status_code == 200
    finally:
        client.portal.call(manager.unload)
    assert client.post("/v1/chat/completions", json=chat).status_code == 403  # gone: refused again


ALLOWED = [group for groups in CLIENT_FLAGS.values() for group in groups]


def test_every_allowed_flag_is_a_whole_declaration_of_the_pinned_llama_server(real):
    """A typo would leave a flag out; a spelling missing from its group would be refused under it."""
    assert [group for group in ALLOWED if set(group) != set(real.aliases_of(group[0]))] == []


def test_no_allowed_flag_is_one_the_studio_manages():
    managed = {flag for group in MANAGED_FLAGS for flag in group}
    assert [flag for group in ALLOWED for flag in group if flag in managed] == []


@pytest.mark.parametrize(
    "args",
    [
        ["--future-flag", "1"],  # one a newer llama-server adds: refused until it is classified
        ["--props"],
        ["--cors-origins", "*"],
        ["--sleep-idle-seconds", "1"],
        ["-ot", ".*=CPU"],
        ["--temp", "0.7", "--slot-save-path", "/tmp"],
    ],
)
def test_an_unclassified_flag_is_refused_for_api_clients_not_only_known_unsafe_ones(args):
    """The rule was a list of unsafe flags: any flag not on it, a new one included, went through."""
    with pytest.raises(PathNotAllowedError) as info:
        PathPolicy(roots=()).check_extra_args(args)
    flag = next(a for a in args if a not in ("--temp", "0.7"))
    assert info.value.path == flag and info.value.code == "flag_not_allowed" and info.value.param == "extra_args"
    assert f"extra_args: {flag} is not among" in info.value.message and "[models.NAME]" in info.value.message


def test_allowed_flags_pass_under_every_spelling_and_with_negative_values():
    PathPolicy(roots=()).check_extra_args(
        ["--temp", "0.7", "--top_k", "20", "--seed", "-1", "-ub", "256", "--repeat-penalty=1.1", "--no-cont-batching"]
    )
    PathPolicy(roots=()).check_extra_args(["--reasoning-format", "deepseek", "--reasoning-budget", "-1", "-bs"])


def test_a_spelling_is_judged_as_the_flag_the_binary_declares_it_with():
    declared = {"--tempo": ("--temp", "--tempo"), "--dump-slots": ("--slot-save-path", "--dump-slots")}

    def aliases_of(flag: str) -> tuple[str, ...]:
        return declared.get(flag, (flag,))

    policy = PathPolicy(roots=())
    policy.check_extra_args(["--tempo", "0.5"], aliases_of)  # another build's alias of an allowed flag
    for args in (["--dump-slots", "/tmp"], ["--dump_slots=/tmp"], ["-md", "/x.gguf"], ["--slot_save_path=/tmp"]):
        with pytest.raises(PathNotAllowedError):
            policy.check_extra_args(args, aliases_of)


@pytest.mark.parametrize(
    "args",
    [
        ["--lora", "/etc/x.gguf"],
        ["--model_draft", "/x.gguf"],
        ["-hfd", "owner/repo"],
        ["--tools", "all"],
        ["-ag"],
        ["--log-file", "/tmp/x.log"],
        ["--video-ffmpeg-dir", "/tmp/bin"],
        ["--slot-save-path=/tmp"],
        ["--future-flag"],
    ],
)
def test_extra_args_off_the_allowlist_are_refused_on_the_api(client, disk, args):
    for path in ("/api/load", "/api/plan"):
        resp = client.post(path, json={"model": str(disk / "models/mine.gguf"), "extra_args": args})
        assert resp.status_code == 403, (path, resp.text)
        error = resp.json()["error"]
        assert error["code"] == "flag_not_allowed" and error["param"] == "extra_args" and args[0] in error["message"]
        assert "[models.NAME]" in error["message"] and "allow_any_path" in error["message"]


def test_allowed_extra_args_and_allow_any_path_go_on(client, disk, catalog):
    mine = str(disk / "models/mine.gguf")
    args = ["--temp", "0.7", "--top-k", "20", "--seed", "-1", "-ub", "256", "--reasoning-budget", "0"]
    resp = client.post("/api/plan", json={"model": mine, "extra_args": args})
    assert resp.status_code == 400 and "not a GGUF file" in resp.json()["error"]["message"]  # on to the manager
    PathPolicy.for_catalog(catalog, allow_any=True).check_extra_args(["--lora", "/x.gguf", "--future-flag"])


class SlowPolicy(PathPolicy):
    """The path rule on a slow file system (a network mount): each check takes a while; the checks are counted."""

    calls: list[str] = []

    def check(self, model, catalog):
        type(self).calls.append(model)
        time.sleep(0.3)
        super().check(model, catalog)


def test_a_fan_out_to_a_model_that_is_not_resident_checks_its_path_once_not_once_per_request(
    llama_server_bin, disk, catalog
):
    """32 simultaneous requests for a model that was not resident each started a thread for the same check."""
    manager = ModelManager(
        catalog=catalog,
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(disk / "logs", ChildRegistry(disk / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=disk / "cache"),
    )
    SlowPolicy.calls = []
    policy = SlowPolicy(PathPolicy.for_catalog(catalog, home=disk / "home").roots)
    stray = str(disk / "outside/stray.gguf")
    chat = {"messages": [{"role": "user", "content": "x"}]}
    with TestClient(create_app(manager, paths=policy), base_url="http://127.0.0.1:8080") as client:

        def ask(model: str) -> int:
            return client.post("/v1/chat/completions", json={"model": model, **chat}).status_code

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, [stray] * 16 + ["no-such-model"] * 16))
    assert answers == [403] * 16 + [404] * 16  # every request still gets its own answer
    assert sorted(set(SlowPolicy.calls)) == sorted({stray, "no-such-model"})
    assert len(SlowPolicy.calls) <= 4, SlowPolicy.calls  # 32 before; a request arriving after a check ended checks anew
