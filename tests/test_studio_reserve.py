"""The studio's own memory is kept out of the memory budget, and each llama-server's process line is on its bill.

Before, the bills counted llama-server's buffers only: the studio's process tree (every llama-server and
the studio itself) held up to 1.37x the sum of the bills under a budget the bills said it kept (#30).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import gguf
from launcher.devices import Device, Inventory
from launcher.memory import estimate, for_file
from launcher.memory_options import MemoryOptions
from launcher.units import MIB
from studio.errors import DoesNotFitError
from studio.residency.lifecycle import ResidentState
from studio.residency.placement import RESERVE_FLOOR, RESERVE_HEADROOM, TOTAL, budget_map, studio_reserve
from studio.residency.requests import LoadRequest
from studio.views.residency import status_json
from tests.fake_llama import fake_children
from tests.manager_harness import ZOO, fake_manager, zoo_bill

A, B = ZOO[:2]
GIB = 1024 * MIB


def machine() -> Inventory:
    cpu = Device("CPU", None, "Test CPU", 64 * GIB, 64 * GIB, "psutil")
    return Inventory((cpu, Device("CUDA", 0, "Test GPU", 24 * GIB, 24 * GIB, "nvidia-smi")), ())


def test_the_reserve_comes_off_the_total_and_the_hosts_share_never_a_gpus():
    assert budget_map(6 * GIB, {}, machine(), reserve=100 * MIB) == {
        TOTAL: 6 * GIB - 100 * MIB,
        "CPU": 6 * GIB - 100 * MIB,
        "CUDA0": 6 * GIB,
    }
    per_device = {"CPU": 2 * GIB, "CUDA0": 20 * GIB}
    assert budget_map(None, per_device, machine(), reserve=100 * MIB) == {"CPU": 2 * GIB - 100 * MIB, "CUDA0": 20 * GIB}
    assert budget_map(None, {"CPU": 50 * MIB}, machine(), reserve=100 * MIB)["CPU"] == 0  # never negative


def test_the_reserve_is_the_studios_rss_and_headroom_at_least_the_floor():
    assert studio_reserve(10 * MIB) == RESERVE_FLOOR
    assert studio_reserve(300 * MIB) == 300 * MIB + RESERVE_HEADROOM


@pytest.mark.parametrize("name", ["llama-dense", "gemma3-dense", "qwen2-dense"])
def test_the_hosts_bill_has_a_process_line_in_its_total_but_not_in_what_the_log_prints(zoo_dir, name):
    file = gguf.read(zoo_dir / f"{name}.gguf")
    bill = estimate(file.facts, for_file(file, MemoryOptions(n_ctx=512)))
    cpu = bill.device("CPU")
    assert cpu.process > 0 and bill.sum_of("process") == cpu.process  # on the host only
    assert cpu.total == cpu.weights + cpu.kv + cpu.recurrent + cpu.compute + cpu.output + cpu.process
    assert bill.logged_total == bill.startup_total - cpu.process


def _rss(nbytes: int):
    return lambda: nbytes


def test_a_budget_that_fits_two_models_beside_a_small_studio_fits_one_beside_a_large_one(tmp_path, real, zoo_dir):
    models = {name: zoo_dir / f"{name}.gguf" for name in (A, B)}
    bills = [zoo_bill(real, p) for p in models.values()]
    two = sum(bills) + RESERVE_FLOOR + 8 * MIB  # both beside the studio's floor, with 8 MiB to spare

    async def run(rss: int) -> tuple[list[str], dict[str, Any]]:
        with fake_children() as children:
            manager = fake_manager(tmp_path / str(rss), children, real, models, budget=two, own_memory=_rss(rss))
            try:
                await manager.load(LoadRequest(A))
                await manager.load(LoadRequest(B))
                return sorted(r.name for r in manager.residents if r.state is ResidentState.READY), status_json(manager)
            finally:
                await manager.aclose()

    small, status = asyncio.run(run(40 * MIB))  # the floor: both fit
    assert small == [A, B] and status["memory_budget"]["reserve"] == RESERVE_FLOOR
    large = RESERVE_FLOOR + max(bills) - RESERVE_HEADROOM  # a model's bill more than the floor: room for one
    one, status = asyncio.run(run(large))
    assert one == [B] and status["memory_budget"]["reserve"] == large + RESERVE_HEADROOM  # B's load evicted A


def test_a_model_that_fits_the_budget_but_not_beside_the_studio_is_refused(tmp_path, real, zoo_dir):
    models = {A: zoo_dir / f"{A}.gguf"}
    one = zoo_bill(real, models[A])

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, models, budget=one + 50 * MIB, own_memory=_rss(200 * MIB))
            try:
                placed = await manager.preview(LoadRequest(A))
                assert any(r.startswith("reserve: the studio's own 216 MiB") for r in placed.plan.reasons)
                with pytest.raises(DoesNotFitError):
                    await manager.load(LoadRequest(A))
            finally:
                await manager.aclose()

    asyncio.run(run())
