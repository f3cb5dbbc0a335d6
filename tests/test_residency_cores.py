"""Cores are room too: without ``max_resident`` a lone model keeps every core, and a later model on the CPU
restarts an idle one with its share, so that residents busy at once never run more threads than there are cores.

Measured on two cores before: a first resident with two threads and a second with one (three threads on two
cores) cut Gemma's generation to a fraction of its rate at one thread each (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from launcher.devices import Device, Inventory, usable_cores
from studio.residency.manager import ModelManager
from studio.residency.requests import LoadRequest
from studio.residency.slot_cache import SlotCache
from studio.settings import ModelDefaults
from tests.fake_llama import fake_children
from tests.manager_harness import ZOO, fake_manager
from tests.support.studio import running_studio
from tests.test_slot_cache import STORY

GIB = 1 << 30


def two_cores() -> Inventory:
    return Inventory((Device("CPU", None, "Test CPU", 64 * GIB, 60 * GIB, "psutil", cores=2),), ())


@contextmanager
def two_on_two_cores(tmp_path: Path, real: Any, zoo_dir: Path, **options: Any) -> Iterator[tuple[ModelManager, Any]]:
    """A manager over the zoo's first two models on a 2-core CPU, its llama-servers fake, and those children."""
    with fake_children() as children:
        models = {name: zoo_dir / f"{name}.gguf" for name in ZOO[:2]}
        yield fake_manager(tmp_path, children, real, models, discover=two_cores, **options), children


def test_a_second_model_on_the_cpu_restarts_the_first_with_its_share(tmp_path, real, zoo_dir):
    """Regression: the first resident kept both cores and the second took one: three threads on two cores."""
    a, b = ZOO[:2]

    async def run() -> None:
        with two_on_two_cores(tmp_path, real, zoo_dir) as (manager, children):
            await manager.load(LoadRequest(model=a))
            first = manager.find(a)
            assert first is not None and first.plan.threads == 2  # alone: every core
            await manager.load(LoadRequest(model=b))
            threads = {r.name: r.plan.threads for r in manager.residents}
            assert threads == {a: 1, b: 1}
            again = manager.find(a)
            assert again is not None and again is not first and again.admission.value == "accepting"
            assert first.why == "restart"
            await manager.aclose()

    asyncio.run(run())


async def _until(check, timeout: float = 10.0) -> None:
    """Wait until ``check()`` holds (the division of the cores happens after the change that asked for it)."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def test_a_model_left_alone_gets_every_core_back(tmp_path, real, zoo_dir):
    """Regression: the first resident, restarted with its share beside a second, kept that share after the
    second was unloaded: a lone model on half the cores."""
    a, b = ZOO[:2]

    async def run() -> None:
        with two_on_two_cores(tmp_path, real, zoo_dir) as (manager, children):
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            shared = manager.find(a)
            assert shared is not None and shared.plan.threads == 1
            await manager.unload(b)
            await _until(
                lambda: (r := manager.find(a)) is not None and r.plan.threads == 2 and r.state.value == "ready"
            )
            again = manager.find(a)
            assert again is not None and again is not shared and shared.why == "restart"
            assert (
                again.plan.reasons[-1]
                == "threads: 2, its share of the cores once the models beside it on the CPU changed"
            )
            assert children.starts == {f"{a}.gguf": 3, f"{b}.gguf": 1} and len(children.running()) == 1
            await manager.aclose()

    asyncio.run(run())


def test_a_busy_model_left_alone_gets_every_core_back_once_idle(tmp_path, real, zoo_dir):
    """Its request is never cut for the restart: the model is restarted once the request ended."""
    a, b = ZOO[:2]

    async def run() -> None:
        with two_on_two_cores(tmp_path, real, zoo_dir) as (manager, children):
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            _, lease = await manager.acquire(a)
            shared = manager.find(a)
            await manager.unload(b)
            await asyncio.sleep(0.2)
            assert manager.find(a) is shared and shared is not None and shared.state.value == "ready"
            assert lease.interruption is None
            await lease()
            await _until(
                lambda: (r := manager.find(a)) is not None and r.plan.threads == 2 and r.state.value == "ready"
            )
            await manager.aclose()

    asyncio.run(run())


def test_a_restart_for_the_cores_that_cannot_begin_leaves_the_model_serving(tmp_path, real, zoo_dir):
    """Its launch files cannot be written (their folder is now a file): the model serves on with its share."""
    a, b = ZOO[:2]
    launch = tmp_path / "launch"

    async def run() -> None:
        with two_on_two_cores(tmp_path, real, zoo_dir, files_root=launch) as (manager, _):
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            shared = manager.find(a)
            assert shared is not None and shared.plan.threads == 1 and any(launch.iterdir())
            launch.rename(tmp_path / "launch.gone")
            launch.write_text("not a folder")
            await manager.unload(b)
            await _until(lambda: not manager.dividing_cores and manager.find(b) is None)
            await asyncio.sleep(0.1)
            assert manager.find(a) is shared and shared.state.value == "ready"
            assert shared.admission.value == "accepting" and shared.plan.threads == 1
            _, lease = await manager.acquire(a)  # it answers
            await lease()
            await manager.aclose()

    asyncio.run(run())


def _threads() -> dict[str, int]:
    """``--threads`` of each llama-server this test started, by its model file's name."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() != "llama-server" or p.status() == psutil.STATUS_ZOMBIE:
                continue
            argv = p.cmdline()
        except psutil.Error:  # a restart's old llama-server, exiting or reaped meanwhile
            continue
        if "--model" not in argv and "-m" not in argv:  # the short --list-devices run a placement starts
            continue
        model = argv[argv.index("--model") + 1] if "--model" in argv else argv[argv.index("-m") + 1]
        out[model.rsplit("/", 1)[-1]] = int(argv[argv.index("--threads") + 1])
    return out


def _chat(base: str, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
def test_two_real_models_on_the_cpu_never_run_more_threads_than_cores(
    tmp_path, llama_server_bin, smollm_model, gemma_model
):
    """The first model restarts with its share once the second loads; its conversation comes back warm."""
    cache = SlotCache(tmp_path / "slots", binary=llama_server_bin, disk_budget=1 << 30)
    defaults = {name: ModelDefaults(n_ctx=2048, spec="off") for name in ("smollm", "gemma")}
    models = {"smollm": smollm_model, "gemma": gemma_model}
    turn1 = [{"role": "user", "content": f"{STORY}\nWho is the story about? Answer in one short sentence."}]
    with running_studio(tmp_path, llama_server_bin, models, defaults=defaults, slot_cache=cache) as s:
        first = _chat(s.url, "smollm", turn1)
        cores = usable_cores()
        assert list(_threads().values()) == [cores]  # alone: every core
        _chat(s.url, "gemma", [{"role": "user", "content": "Say hi."}])
        threads = _threads()
        assert len(threads) == 2 and sum(threads.values()) <= max(cores, len(threads)), threads
        turn2 = [*turn1, first["choices"][0]["message"], {"role": "user", "content": "And what is the cat called?"}]
        again = _chat(s.url, "smollm", turn2)
        assert again["choices"][0]["message"]["content"]
        conversation = again["timings"]["prompt_n"] + again["timings"].get("cache_n", 0)
        assert again["timings"].get("cache_n", 0) >= 0.9 * conversation, again["timings"]  # its slot came back


def _until_threads(expected: dict[str, int], timeout: float = 120.0) -> dict[str, int]:
    """Wait until the llama-servers this test started run ``expected`` threads; what they run then."""
    deadline = time.monotonic() + timeout
    while (threads := _threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return threads


@pytest.mark.slow
def test_a_real_model_left_alone_gets_every_core_back_and_its_conversation(
    tmp_path, llama_server_bin, smollm_model, gemma_model
):
    """SmolLM2 restarted with its share beside Gemma gets every core back once Gemma is unloaded; its next turn
    reads most of its prompt from the slot saved as it stopped."""
    cache = SlotCache(tmp_path / "slots", binary=llama_server_bin, disk_budget=1 << 30)
    defaults = {name: ModelDefaults(n_ctx=2048, spec="off") for name in ("smollm", "gemma")}
    models = {"smollm": smollm_model, "gemma": gemma_model}
    turn1 = [{"role": "user", "content": f"{STORY}\nWho is the story about? Answer in one short sentence."}]
    cores = usable_cores()
    with running_studio(tmp_path, llama_server_bin, models, defaults=defaults, slot_cache=cache) as s:
        first = _chat(s.url, "smollm", turn1)
        _chat(s.url, "gemma", [{"role": "user", "content": "Say hi."}])
        shared = _threads()
        assert len(shared) == 2 and sum(shared.values()) <= max(cores, 2), shared
        httpx.post(f"{s.url}/api/unload", json={"model": "gemma"}, timeout=60).raise_for_status()
        assert _until_threads({"smollm.gguf": cores}) == {"smollm.gguf": cores}
        turn2 = [*turn1, first["choices"][0]["message"], {"role": "user", "content": "And what is the cat called?"}]
        again = _chat(s.url, "smollm", turn2)
        conversation = again["timings"]["prompt_n"] + again["timings"].get("cache_n", 0)
        assert again["timings"].get("cache_n", 0) >= 0.9 * conversation, again["timings"]  # its slot came back


@pytest.mark.slow
def test_a_real_model_busy_while_another_loads_gets_its_share_once_its_stream_ends(
    tmp_path, llama_server_bin, smollm_model, gemma_model
):
    """Regression: SmolLM2, streaming while Gemma loaded, kept every core beside Gemma's share for good. The load
    waits for no stranger's answer and the stream is never cut; once it ends SmolLM2 restarts with its share."""
    defaults = {name: ModelDefaults(n_ctx=2048, spec="off") for name in ("smollm", "gemma")}
    models = {"smollm": smollm_model, "gemma": gemma_model}
    cores = usable_cores()
    body = {
        "model": "smollm",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 300,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with running_studio(tmp_path, llama_server_bin, models, defaults=defaults) as s:
        _chat(s.url, "smollm", [{"role": "user", "content": "Say hi."}])
        lines: list[str] = []
        during: dict[str, int] = {}
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if not during and line.startswith("data: {"):  # it streams: now Gemma loads beside it
                    loaded = httpx.post(f"{s.url}/api/load", json={"model": "gemma"}, timeout=120)
                    assert loaded.status_code == 200, loaded.text
                    during = _threads()
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert not [c for c in chunks if "error" in c] and "data: [DONE]" in lines, lines[-3:]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # answered to its end, never cut
        assert during == {"smollm.gguf": cores, "gemma.gguf": max(1, cores // 2)}, during  # no restart under it
        gemma = s.manager.find("gemma")
        assert gemma is not None
        assert any("until smollm restart(s) with a share of the cores" in w for w in gemma.plan.warnings)
        share = max(1, cores // 2)
        expected = {"smollm.gguf": share, "gemma.gguf": share}
        assert _until_threads(expected) == expected


def _smollm_servers() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (
                p.name() == "llama-server"
                and p.status() != psutil.STATUS_ZOMBIE
                and "smollm.gguf" in " ".join(p.cmdline())
            ):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _during_the_restart(url: str, first: psutil.Process, act: Callable[[psutil.Process], object]) -> httpx.Response:
    """Load Gemma beside SmolLM2 (whose llama-server is ``first``), and ``act`` on SmolLM2's new llama-server as
    soon as the restart the load asked for starts it; Gemma's load's answer."""
    acted = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not acted.is_set() and time.monotonic() < deadline:
            for p in _smollm_servers():
                if p.pid != first.pid:
                    act(p)
                    acted.set()
                    break
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return httpx.post(f"{url}/api/load", json={"model": "gemma"}, timeout=120)
    finally:
        watcher.join()
        assert acted.is_set(), "the restart never started a llama-server"


@pytest.mark.slow
def test_a_real_unload_during_the_restart_a_load_asked_for_ends_both(
    tmp_path, llama_server_bin, smollm_model, gemma_model
):
    """SmolLM2 unloaded while the restart Gemma's load asked for starts it again: SmolLM2 goes, none of its
    llama-servers is left, and Gemma's load still ends loaded, then alone gets every core."""
    defaults = {name: ModelDefaults(n_ctx=2048, spec="off") for name in ("smollm", "gemma")}
    models = {"smollm": smollm_model, "gemma": gemma_model}
    with running_studio(tmp_path, llama_server_bin, models, defaults=defaults) as s:
        _chat(s.url, "smollm", [{"role": "user", "content": "Say hi."}])
        [first] = _smollm_servers()
        unloaded: list[int] = []

        def unload(_: psutil.Process) -> None:
            unloaded.append(httpx.post(f"{s.url}/api/unload", json={"model": "smollm"}, timeout=60).status_code)

        loaded = _during_the_restart(s.url, first, unload)
        assert loaded.status_code == 200 and unloaded == [200], (loaded.text, unloaded)
        cores = usable_cores()
        assert _until_threads({"gemma.gguf": cores}) == {"gemma.gguf": cores}
        assert s.manager.find("smollm") is None


@pytest.mark.slow
def test_a_real_restart_killed_while_it_loads_fails_only_its_model(
    tmp_path, llama_server_bin, smollm_model, gemma_model
):
    """SIGKILL takes SmolLM2's new llama-server while the restart Gemma's load asked for loads: Gemma's load still
    ends loaded and, alone, gets every core; SmolLM2's next chat loads it anew, and both share the cores."""
    defaults = {name: ModelDefaults(n_ctx=2048, spec="off") for name in ("smollm", "gemma")}
    models = {"smollm": smollm_model, "gemma": gemma_model}
    cores = usable_cores()
    hi = [{"role": "user", "content": "Say hi."}]
    with running_studio(tmp_path, llama_server_bin, models, defaults=defaults) as s:
        _chat(s.url, "smollm", hi)
        [first] = _smollm_servers()
        killed: list[int] = []
        loaded = _during_the_restart(s.url, first, lambda p: (os.kill(p.pid, signal.SIGKILL), killed.append(p.pid)))
        assert loaded.status_code == 200 and killed, loaded.text
        smollm = s.manager.find("smollm")
        assert smollm is not None and smollm.state.value == "failed", smollm and smollm.state
        assert _until_threads({"gemma.gguf": cores}) == {"gemma.gguf": cores}  # alone: every core
        _chat(s.url, "smollm", hi)  # loaded anew
        share = max(1, cores // 2)
        assert _until_threads({"smollm.gguf": share, "gemma.gguf": share}) == {
            "smollm.gguf": share,
            "gemma.gguf": share,
        }
