"""Issue 15: a copy of Gemma whose header claims 65535 blocks (its tensors hold 18) froze ``plan`` for minutes.

``ggstudio inspect`` accepted it and ``ggstudio plan`` ran for over a minute; through the
service one ``POST /api/plan`` blocked everything. Now the facts refuse the header before
any per-layer work: the CLI answers one line naming the key and exits non-zero, the API a
400 with the same message, in the time it takes to start (the CPU time is measured, so a
busy machine's waits do not count; the wall time has a loaded machine's headroom).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gguf.writer import rewrite
from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.errors import Exit
from studio.http.app import create_app
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from tests.test_cli import assert_one_error_line, cli, tagged_env

pytestmark = pytest.mark.slow

KEY = "'gemma3.block_count' is 65,535"


@pytest.fixture(scope="module")
def hostile_model(gemma_model, tmp_path_factory) -> Path:
    """Gemma 3 270M, byte for byte, but for ``gemma3.block_count = 65535``."""
    folder = tmp_path_factory.mktemp("hostile")
    return rewrite(gemma_model, folder / "gemma-65535-blocks.gguf", metadata_updates={"gemma3.block_count": 65535})


def timed_cli(*args: str) -> tuple[object, float, float]:
    """(the finished process, its wall seconds, its CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    out = cli(*args, env=tagged_env(), timeout=60)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_a_header_claiming_65535_blocks_is_one_line_naming_the_key_not_a_frozen_plan(hostile_model, command):
    out, wall, cpu = timed_cli(command, str(hostile_model))
    assert_one_error_line(out, Exit.ERROR, "error: ")
    assert KEY in out.stderr and "no real model has more than" in out.stderr, out.stderr
    assert cpu < 2.0 and wall < 20, f"{command} took {wall:.1f} s ({cpu:.2f} s of CPU)"


@pytest.fixture
def service(hostile_model, llama_server_bin, tmp_path):
    """The studio app over a folder holding only the hostile file (no model loaded: plans start nothing)."""
    manager = ModelManager(
        catalog=Catalog([hostile_model.parent]),
        binary=llama_server_bin,
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
        caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
    )
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as client:  # a loopback name passes the guard
        yield client


@pytest.mark.parametrize("route", ["/api/plan", "/api/load"])
def test_a_header_claiming_65535_blocks_is_a_400_naming_the_key(service, hostile_model, route):
    start = time.monotonic()
    resp = service.post(route, json={"model": hostile_model.stem})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert KEY in error["message"] and error["type"] == "invalid_request_error" and error["code"] == "invalid_gguf"
    assert time.monotonic() - start < 20
    assert service.get("/health").status_code == 200
