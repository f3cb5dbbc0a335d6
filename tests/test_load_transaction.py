"""A load is one transaction: checked before anything is touched, cancellable, undone on failure.

Each test is named after the defect it pins. Those that a user meets through the API run the real
studio on real llama-servers; those that need a precise interleaving drive the manager itself over
fake llama-servers (``tests.fake_llama``), with every other part real.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import psutil
import pytest

from launcher.devices import Device, Inventory
from launcher.errors import LoadError
from studio.errors import BusyError, ModelUnloadedError
from studio.residency.lifecycle import ResidentState
from studio.residency.requests import LoadRequest
from studio.residency.resident import ResidentModel
from tests.fake_llama import fake_children
from tests.helpers import wait_for
from tests.manager_harness import GIB, SMALL, ZOO, fake_manager, zoo_bill
from tests.support.studio import running_studio

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def zoo_models(zoo_dir):
    return {name: zoo_dir / f"{name}.gguf" for name in ZOO}


@pytest.fixture(scope="module")
def bill(real, zoo_models):
    return max(zoo_bill(real, p) for p in zoo_models.values())


def llama_servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-server"]


def pids_of(base: str) -> dict[str, int | None]:
    return {m["model"]: m["pid"] for m in httpx.get(f"{base}/api/status", timeout=10).json()["models"]}


def chat(base: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


# --- through the API, on real llama-servers ---------------------------------------------------------------


def test_a_load_right_after_the_preload_with_other_settings_restarts_once_instead_of_for_ever(
    tmp_path, llama_server_bin, zoo_models
):
    """The preload's instance and a GUI's load with other settings restarted each other for ever."""
    a = ZOO[0]
    preload = [LoadRequest(model=a)]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}, preload=preload) as s:
        resp = httpx.post(f"{s.url}/api/load", json={"model": a, "n_parallel": 2, "n_ctx": 512}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert s.manager.counters["loads"] <= 2  # the preload's start, then at most one restart
        (resident,) = s.manager.residents
        assert (resident.settings.n_parallel, resident.settings.n_ctx) == (2, 512)
        time.sleep(0.5)
        assert s.manager.counters["loads"] <= 2 and len(llama_servers()) == 1
        assert chat(s.url, a).status_code == 200


def test_a_refused_reload_leaves_the_running_model_and_its_settings_as_they_were(
    tmp_path, llama_server_bin, zoo_models
):
    """A reload with a bad speculative mode drained and unloaded the running model, and its bad
    settings stayed remembered: every later chat answered the same 400."""
    a = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, zoo_models, defaults={a: SMALL}) as s:
        assert httpx.post(f"{s.url}/api/load", json={"model": a}, timeout=60).status_code == 200
        pid = pids_of(s.url)[a]
        resp = httpx.post(f"{s.url}/api/load", json={"model": a, "spec": "warp-drive"}, timeout=60)
        assert resp.status_code == 400 and "warp-drive" in resp.json()["error"]["message"]
        assert pids_of(s.url)[a] == pid
        assert chat(s.url, a).status_code == 200
        assert httpx.post(f"{s.url}/api/unload", json={"model": a}, timeout=60).status_code == 200
        assert chat(s.url, a).status_code == 200  # a plain chat loads it anew, with good settings


def test_an_unload_during_a_load_cancels_it_and_nothing_stays_resident(tmp_path, llama_server_bin, gemma_model):
    """The unload answered 200, the load answered 200 too, and the model stayed resident."""
    answers: list[httpx.Response] = []
    with running_studio(tmp_path, llama_server_bin, {"gemma": gemma_model}) as s:

        def load() -> None:
            answers.append(httpx.post(f"{s.url}/api/load", json={"model": "gemma", "n_ctx": 2048}, timeout=120))

        thread = threading.Thread(target=load)
        thread.start()
        wait_for(lambda: any(r.state is ResidentState.LOADING for r in s.manager.residents), timeout=30, what="loading")
        assert httpx.post(f"{s.url}/api/unload", json={"model": "gemma"}, timeout=60).status_code == 200
        thread.join(60)
        (resp,) = answers
        assert resp.status_code == 503 and "unloaded while it was loading" in resp.json()["error"]["message"]
        assert httpx.get(f"{s.url}/api/status", timeout=10).json()["models"] == []
        wait_for(lambda: not llama_servers(), timeout=10, what="the cancelled load's llama-server to stop")


# --- the manager itself, over fake llama-servers -----------------------------------------------------------


def test_a_load_waiting_for_a_victims_request_gives_up_after_busy_wait_without_holding_other_loads(
    tmp_path, real, zoo_models, bill
):
    """A load whose victim got a request waited for it inside the placement lock, with no deadline:
    one long generation held up every load of every other model."""
    a, b, c = ZOO

    async def run() -> None:
        with fake_children() as children:

            def slow_plan(*args, **kwargs):
                from launcher.planner import plan

                time.sleep(0.2)  # the window in which a request reaches the chosen victim
                return plan(*args, **kwargs)

            manager = fake_manager(tmp_path, children, real, zoo_models, budget=int(bill * 2.5), planner=slow_plan)
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            load_c = asyncio.create_task(manager.load(LoadRequest(model=c)))  # evicts a, the least recently used
            await asyncio.sleep(0.05)
            _, lease = await manager.acquire(a)  # a long generation begins on the victim meanwhile
            started = time.monotonic()
            restart_b = asyncio.create_task(manager.load(LoadRequest(model=b, n_ctx=512)))
            with pytest.raises(BusyError, match="requests in flight"):
                await asyncio.wait_for(load_c, 10)
            assert time.monotonic() - started < 0.3 + 3  # busy_wait, plus the plans
            await asyncio.wait_for(restart_b, 10)  # another model's load went on meanwhile
            victim = manager.find(a)
            assert victim is not None and victim.state is ResidentState.READY
            loaded, second = victim.enter()  # resumed: it admits requests again
            await second()
            await lease()
            await manager.aclose()
            assert children.running() == {}

    asyncio.run(run())


def test_a_stop_on_a_gpu_waits_until_the_driver_has_released_its_memory(tmp_path, real, zoo_models):
    """The wait for the GPU driver to give memory back after a stop was no longer called: an
    evict-then-start planned against memory the driver had not released yet."""
    a = ZOO[0]
    # released in steps of 2 GiB: each more than the wait's tolerance (max(256 MiB, 2 % of 80 GiB)), as a
    # driver's release is, not a desktop's jitter
    total, held = 80 * GIB, 8 * GIB
    gpu = {"free": total}

    def inventory() -> Inventory:
        return Inventory(
            (
                Device("CUDA", 0, "Fake GPU", total, gpu["free"], "nvidia-smi", "GPU-00000000-0000"),
                Device("CPU", None, "Test CPU", 64 * GIB, 64 * GIB, "psutil"),
            ),
            (),
        )

    async def run() -> None:
        with fake_children() as children:

            def release_late(pid: int) -> None:  # the driver frees the memory in steps, after the reap
                def steps() -> None:
                    for _ in range(4):
                        time.sleep(0.15)
                        gpu["free"] += held // 4

                threading.Thread(target=steps, daemon=True).start()

            children.on_reap = release_late
            manager = fake_manager(tmp_path, children, real, {a: zoo_models[a]}, discover=inventory)
            resident_gpus = (await manager.load(LoadRequest(model=a))).plan.gpus
            assert [d.key for d in resident_gpus] == ["CUDA0"]
            gpu["free"] -= held
            await manager.unload(a)
            assert gpu["free"] == total  # the unload returned only once the memory showed as free
            await manager.aclose()

    asyncio.run(run())


def test_a_shutdown_during_a_preload_starts_nothing_again(tmp_path, real, zoo_models):
    """The shutdown did not cancel a preload still running, so the preload started its model again
    after the manager had stopped it."""
    a, b = ZOO[:2]

    async def run() -> None:
        with fake_children(load_seconds=0.3) as children:
            manager = fake_manager(tmp_path, children, real, zoo_models)
            preload = asyncio.create_task(manager.preload([LoadRequest(model=a), LoadRequest(model=b)]))
            await asyncio.sleep(0.1)  # a is starting
            assert len(children.running()) == 1
            await manager.aclose()
            await asyncio.sleep(0.8)  # time enough for the preload to start a or b again
            assert children.running() == {} and manager.residents == []
            await asyncio.wait_for(preload, 5)  # it ended, its failures logged

    asyncio.run(run())


def test_a_resident_whose_owner_task_dies_wakes_every_waiter(tmp_path, real, zoo_models, monkeypatch):
    """A resident's owner task that died left ``wait_until`` callers waiting for ever."""
    a = ZOO[0]

    async def broken(self, cause):
        raise RuntimeError("a bug in the owner")

    monkeypatch.setattr(ResidentModel, "_crashed", broken)

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, {a: zoo_models[a]})
            await manager.load(LoadRequest(model=a))
            (resident,) = manager.residents
            waiter = asyncio.create_task(resident.wait_until({ResidentState.UNLOADED}))
            assert children.supervisors[-1].crash()
            assert await asyncio.wait_for(waiter, 5) is ResidentState.UNLOADED
            assert resident.error and children.running() == {}
            await manager.load(LoadRequest(model=a))  # and the model can be loaded again
            await manager.aclose()

    asyncio.run(run())


def test_two_loads_of_one_model_with_other_settings_start_it_at_most_twice(tmp_path, real, zoo_models):
    """Two loads with different settings restarted each other for ever; the later one must win once."""
    a = ZOO[0]

    async def run() -> None:
        with fake_children(load_seconds=0.2) as children:
            manager = fake_manager(tmp_path, children, real, {a: zoo_models[a]})
            first = asyncio.create_task(manager.load(LoadRequest(model=a)))
            await asyncio.sleep(0.1)  # the first is starting its llama-server
            second = asyncio.create_task(manager.load(LoadRequest(model=a, n_parallel=2, n_ctx=512)))
            loaded = await asyncio.wait_for(asyncio.gather(first, second), 10)
            assert {(m.settings.n_parallel, m.settings.n_ctx) for m in loaded} == {(2, 512)}
            assert manager.counters["loads"] == 2 and len(children.running()) == 1
            await manager.aclose()

    asyncio.run(run())


def test_an_unload_of_a_model_waiting_for_memory_cancels_its_load(tmp_path, real, zoo_models, bill):
    """An unload of a model whose load waits for busy models' memory must end that load too."""
    a, b, c = ZOO

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, zoo_models, budget=int(bill * 2.5), busy_wait=30)
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            leases = [(await manager.acquire(m))[1] for m in (a, b)]  # both busy: c must wait
            load_c = asyncio.create_task(manager.load(LoadRequest(model=c)))
            await asyncio.sleep(0.2)
            assert manager.find(c) is None and not load_c.done()  # waiting for memory
            await asyncio.wait_for(manager.unload(c), 5)
            with pytest.raises(ModelUnloadedError, match="unloaded while it was loading"):
                await load_c
            assert sorted(r.name for r in manager.residents) == [a, b]
            for m in (a, b):  # the paused models admit requests again
                _, lease = await asyncio.wait_for(manager.acquire(m), 2)
                await lease()
            for lease in leases:
                await lease()
            await manager.aclose()
            assert children.running() == {}

    asyncio.run(run())


def test_an_unload_while_a_failed_load_is_undone_still_answers_its_waiters(tmp_path, real, zoo_models, monkeypatch):
    """A cancel that arrived while a failed load was being undone left the load's outcome unset: every
    request waiting for that load waited for ever (found by the state-machine test once stops saved slots)."""
    from studio.residency.manager import ModelManager

    a = ZOO[0]
    real_undo = ModelManager._undo

    async def slow_undo(self, load):  # an undo that takes a while, as one that stops a llama-server does
        await asyncio.sleep(0.3)
        await real_undo(self, load)

    monkeypatch.setattr(ModelManager, "_undo", slow_undo)

    async def run() -> None:
        with fake_children() as children:
            children.failing.add(f"{a}.gguf")
            manager = fake_manager(tmp_path, children, real, {a: zoo_models[a]})
            waiter = asyncio.create_task(manager.load(LoadRequest(model=a)))
            await asyncio.sleep(0.15)  # the start failed; its undo runs
            assert manager.loads, "the load should still be undoing"
            await asyncio.wait_for(manager.unload(a), 5)
            with pytest.raises(LoadError, match="injected failure"):
                await asyncio.wait_for(waiter, 5)
            assert manager.loads == [] and children.running() == {}
            await manager.aclose()

    asyncio.run(run())


def test_a_load_superseded_in_the_tick_it_began_still_answers_its_waiters(tmp_path, real, zoo_models, monkeypatch):
    """Two loads of one model with other settings, sent together (a GUI applying two settings at once):
    the first load's task was cancelled before its first step ran, so none of its code settled it, and
    its waiters (and the shutdown after them) waited for ever (found by the state-machine test)."""
    from studio.residency.lookup import Lookup

    a = ZOO[0]

    async def entry_at_once(self, model):  # a lookup that answers without a thread: the second load runs
        return self.catalog.resolve(model)  # before the first load's task took its first step

    monkeypatch.setattr(Lookup, "entry", entry_at_once)

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, {a: zoo_models[a]})
            first, second = await asyncio.wait_for(
                asyncio.gather(
                    manager.load(LoadRequest(model=a, n_ctx=256)), manager.load(LoadRequest(model=a, n_ctx=512))
                ),
                10,
            )
            assert first is second and first.settings.n_ctx == 512  # the later settings win, once
            assert manager.loads == [] and len(children.running()) == 1
            await asyncio.wait_for(manager.aclose(), 10)
            assert children.running() == {}

    asyncio.run(run())
