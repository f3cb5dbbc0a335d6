"""A real ``ModelManager`` over zoo models whose llama-servers are ``tests.fake_llama`` stand-ins.

Everything but the child process is real: the catalog, the GGUF headers, the planner with the pinned
build's probed capabilities, placement, the resident models and their owners. The inventory is fixed
(``inventory``) so a budget decides what fits, as on a machine with plenty of free memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from launcher.capabilities import Capabilities
from launcher.devices import Device, Inventory
from launcher.planner import PlanRequest, load_model, plan
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager
from studio.settings import MemoryBudget, ModelDefaults, ResidencySettings
from tests.fake_llama import FakeChildren

GIB = 2**30
ZOO = ("llama-dense", "qwen2-dense", "mistral3-dense")
SMALL = ModelDefaults(n_ctx=256, spec="off")


def cpu_machine(free: int = 64 * GIB, *, cores: int | None = None) -> Inventory:
    """A CPU-only machine with ``free`` bytes free; ``cores`` counted, so models on it share them (None: not)."""
    return Inventory((Device("CPU", None, "Test CPU", free, free, "psutil", cores=cores),), ())


def zoo_bill(caps: Capabilities, path: Path) -> int:
    """The predicted total of one zoo model at -c 256 (the zoo models are within a few KiB of each other)."""
    return plan(load_model(path), cpu_machine(), caps, PlanRequest(n_ctx=256, spec="off")).bill.total


def link_models(folder: Path, models: Mapping[str, Path]) -> Catalog:
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in models.items():
        link = folder / f"{name}.gguf"
        if not link.exists():
            link.symlink_to(path)
    return Catalog([folder])


def fake_manager(
    root: Path,
    children: FakeChildren,
    caps: Capabilities,
    models: Mapping[str, Path],
    *,
    budget: int | None = None,
    busy_wait: float = 0.3,
    unload_grace: float = 0.2,
    group_size: int = 4,
    max_resident: int | None = None,
    discover: Callable[[], Inventory] = cpu_machine,
    **options: Any,
) -> ModelManager:
    """A manager (make it on the loop that will run it) whose models start as fake llama-servers."""
    return ModelManager(
        catalog=link_models(root / "models", models),
        binary=root / "llama-server",
        caps=caps,
        make_supervisor=children.factory(),
        discover_devices=discover,
        model_defaults={name: SMALL for name in models},
        residency=ResidencySettings(
            memory_budget=MemoryBudget(total=budget) if budget is not None else None,
            busy_wait=busy_wait,
            unload_grace=unload_grace,
            group_size=group_size,
            max_resident=max_resident,
        ),
        **options,
    )
