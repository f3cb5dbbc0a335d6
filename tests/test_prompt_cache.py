"""llama-server's prompt cache is on the bill: every resident gets the ``--cache-ram`` its plan counts.

llama-server b11434 keeps up to 8 GiB of cached prompts in host memory by default; a studio that
passes no ``--cache-ram`` bills none of it, and resident models outgrow the budget.
"""

from __future__ import annotations

import dataclasses

import httpx
import psutil
import pytest

from launcher.devices import Device, Inventory
from launcher.planner import PROMPT_CACHE_MAX, PlanRequest, plan
from launcher.units import MIB
from studio.settings import MemoryBudget, ModelDefaults, ResidencySettings
from tests.support.studio import running_studio
from tests.test_command import BIN, cpu_only, value

GIB = 1024 * MIB
ZOO = ("llama-dense", "qwen2-dense")


def cpu_with_budget(budget: int) -> Inventory:
    return Inventory((Device("CPU", None, "Test CPU", 64 * GIB, 60 * GIB, "psutil", budget_bytes=budget),), ())


def argv_of(p, caps, tmp_path) -> list[str]:
    from launcher.command import build_command

    command = build_command(p, caps, binary=BIN, files_root=tmp_path / "run")
    try:
        return command.argv(8080)
    finally:
        command.cleanup()


def test_the_automatic_prompt_cache_is_two_kv_copies_on_the_hosts_bill_and_in_the_argv(gemma, real, tmp_path):
    p = plan(gemma, cpu_only(), real, PlanRequest(n_ctx=4096, spec="off"))
    cpu = p.bill.device("CPU")
    assert cpu.prompt_cache == p.cache_ram_mib * MIB > 0
    assert cpu.prompt_cache == min(2 * (cpu.kv + cpu.recurrent), PROMPT_CACHE_MAX) // MIB * MIB
    assert p.bill.total == sum(d.total for d in p.bill.devices) and cpu.prompt_cache <= p.bill.total
    assert int(value(argv_of(p, real, tmp_path), "--cache-ram")) == p.cache_ram_mib
    assert any(r.startswith("prompt cache (--cache-ram)") for r in p.reasons)


def test_the_automatic_prompt_cache_takes_at_most_a_quarter_of_the_room_a_tight_budget_leaves(gemma, real):
    roomy = plan(gemma, cpu_only(), real, PlanRequest(n_ctx=4096, spec="off"))
    rest = roomy.bill.total - roomy.bill.device("CPU").prompt_cache
    budget = rest + 2 * MIB * 4  # 8 MiB left beside the model: 2 MiB for its cache
    tight = plan(gemma, cpu_with_budget(budget), real, PlanRequest(n_ctx=4096, spec="off"))
    assert tight.fits and tight.cache_ram_mib == 2
    assert any("a quarter of" in r for r in tight.reasons)


def test_an_asked_prompt_cache_is_billed_as_asked_and_zero_turns_it_off(gemma, real, tmp_path):
    for mib in (0, 300):
        p = plan(gemma, cpu_only(), real, PlanRequest(n_ctx=4096, spec="off", cache_ram_mib=mib))
        assert p.bill.device("CPU").prompt_cache == mib * MIB and p.cache_ram_mib == mib
        assert value(argv_of(p, real, tmp_path), "--cache-ram") == str(mib)


def test_a_llama_server_without_cache_ram_gets_no_flag_and_says_its_cache_is_unbounded(gemma, real, tmp_path):
    old = dataclasses.replace(real, flags=real.flags - {"--cache-ram", "-cram"})
    p = plan(gemma, cpu_only(), old, PlanRequest(n_ctx=4096, spec="off"))
    assert p.cache_ram_mib is None and p.bill.device("CPU").prompt_cache == 0
    assert "--cache-ram" not in argv_of(p, old, tmp_path)
    assert any("not bounded" in r for r in p.reasons)


@pytest.mark.slow
def test_every_resident_carries_the_cache_ram_its_bill_counts(tmp_path, llama_server_bin, zoo_dir):
    """The argv of every resident llama-server holds ``--cache-ram`` equal to its bill's prompt-cache line."""
    models = {name: zoo_dir / f"{name}.gguf" for name in ZOO}
    defaults = {ZOO[0]: ModelDefaults(n_ctx=512, spec="off"), ZOO[1]: ModelDefaults(n_ctx=256, spec="off", cache_ram=3)}
    residency = ResidencySettings(memory_budget=MemoryBudget(total=2 * GIB))
    with running_studio(tmp_path, llama_server_bin, models, defaults=defaults, residency=residency) as s:
        for name in ZOO:
            assert httpx.post(f"{s.url}/api/load", json={"model": name}, timeout=60).status_code == 200
        status = httpx.get(f"{s.url}/api/status", timeout=10).json()
        seen = {}
        for m in status["models"]:
            cmdline = psutil.Process(m["pid"]).cmdline()
            billed = m["memory"]["predicted"]["devices"]["CPU"]["prompt_cache"]
            assert int(value(cmdline, "--cache-ram")) * MIB == billed > 0
            seen[m["model"]] = billed
        assert seen[ZOO[1]] == 3 * MIB and seen[ZOO[0]] != 3 * MIB
        plan_answer = httpx.post(f"{s.url}/api/plan", json={"model": ZOO[0], "cache_ram": 64}, timeout=60).json()
        assert any(b["prompt_cache_bytes"] == 64 * MIB for b in plan_answer["bill"])
