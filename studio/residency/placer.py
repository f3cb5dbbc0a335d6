"""The reading half of a placement: a model's header, the devices and the residents, frozen into a snapshot.

``studio.residency.placement.decide`` is pure; this module gathers what it decides on (header reads
and device queries off the event loop, with a time limit: a hostile file cannot stall other
clients) and runs it, so that the manager only asks "where does this go?".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
from launcher.capabilities import Capabilities
from launcher.devices import Inventory
from launcher.planner import LaunchPlan, ModelInfo, PlanRequest
from studio.blocking import run_blocking
from studio.residency import placement
from studio.residency.lifecycle import COMING_UP, HOLDS_MEMORY, ResidentState
from studio.residency.placement import Decision, Snapshot
from studio.residency.requests import LoadSettings, base_name
from studio.residency.resident import ResidentModel
from studio.residency.transaction import Load
from studio.settings import ResidencySettings

Planner = Callable[[ModelInfo, Inventory, Capabilities, PlanRequest], LaunchPlan]
#: Seconds a model whose group is open (a load waits for its memory, and it still admits requests) stays
#: after its last request ended, for the next one: a client that sends its requests one after another sends
#: the next within milliseconds of an answer, and without this pause each of its requests would be a swap.
GROUP_LINGER = 0.25


@dataclass(frozen=True, kw_only=True)
class Placed(Decision):
    """A planned load: the decision, and the header and settings it was made for."""

    model: gguf.GGUFFile
    settings: LoadSettings


@dataclass
class Placer:
    """Reads what a placement needs and runs the decision off the event loop."""

    caps: Capabilities
    discover_devices: Callable[[], Inventory]
    residency: ResidencySettings
    planner: Planner
    work_timeout: float
    own_memory: Callable[[], int] | None = None  # the studio's RSS now; None: no reserve (a manager inside a test)
    spec_measurements: Path | None = None  # ``bench-spec``'s results, which ``auto`` follows
    seen: Inventory | None = None  # the devices the last placement read: ``now`` divides their cores

    @property
    def reserve(self) -> int:
        """Bytes of host memory a memory budget keeps for the studio itself (``placement.studio_reserve``)."""
        return 0 if self.own_memory is None else placement.studio_reserve(self.own_memory())

    async def place(
        self,
        name: str,
        settings: LoadSettings,
        residents: Callable[[], Sequence[ResidentModel]],
        others: Callable[[], Sequence[Load]],
        *,
        replacing: ResidentModel | None,
    ) -> Placed:
        """Plan ``settings``' model beside the residents (less ``replacing``) as they will be once ``others`` (the
        other loads in flight) are done: the models they reserved to evict still hold their memory until they are
        gone (their load may yet be undone), and what those loads will take counts too.

        Both are read once the header and the devices are: they may have changed meanwhile.
        """
        model = await run_blocking(
            gguf.read, settings.path, timeout=self.work_timeout, what=f"reading {settings.path.name}"
        )
        inventory = await run_blocking(self.discover_devices, timeout=self.work_timeout, what="listing devices")
        self.seen = inventory
        projector = (
            await run_blocking(
                gguf.read, settings.mmproj, timeout=self.work_timeout, what=f"reading {settings.mmproj.name}"
            )
            if settings.mmproj
            else None
        )
        info = ModelInfo.from_gguf(model, mmproj=projector)
        budget = self.residency.memory_budget
        live, loads = residents(), others()
        going = {victim for other in loads for victim in other.victims}
        restarting = {r for other in loads for r, _ in other.restarts}  # they stay: busy, never evicted
        snapshot = Snapshot(
            inventory=without_busy_workers(inventory, live, replacing),
            residents=tuple(
                _seen(r, going=r in going, kin=base_name(r.name) == base_name(name), restarting=r in restarting)
                for r in live
                if r.state in HOLDS_MEMORY and r is not replacing
            ),
            reservations=tuple(other.reservation for other in loads if other.reservation is not None),
            budget=budget,
            # the studio's RSS read once per placement: the budget and the plans' reasons show the same reserve
            reserve=self.reserve if budget is not None else 0,
            max_resident=self.residency.max_resident,
        )
        request = replace(
            settings.plan_request(base_name(name)),  # an embedding instance answers as its model
            spec_measurements=self.spec_measurements,
        )

        def plan(inventory: Inventory, asked: PlanRequest) -> LaunchPlan:
            return self.planner(info, inventory, self.caps, asked)

        decision = await run_blocking(
            placement.decide, snapshot, request, plan, timeout=self.work_timeout, what=f"planning {info.path.name}"
        )
        return Placed(**vars(decision), model=model, settings=settings)

    def now(self, residents: Sequence[ResidentModel], *, loads: int) -> Snapshot | None:
        """The residents as they are, on the devices the last placement read (None before any): what
        ``placement.rebalance`` divides the cores by between loads. It reads no memory, so no device is asked again
        (a machine's cores do not change between two loads)."""
        if self.seen is None:
            return None
        live = [r for r in residents if r.state in HOLDS_MEMORY]
        return Snapshot(
            inventory=self.seen,
            # an instance beside its model's other one (chat, embeddings) is never restarted for it (``_seen``)
            residents=tuple(
                _seen(r, going=False, kin=sum(base_name(o.name) == base_name(r.name) for o in live) > 1) for r in live
            ),
            max_resident=self.residency.max_resident,
            loads=loads,
        )


def _seen(r: ResidentModel, *, going: bool, kin: bool, restarting: bool = False) -> placement.Resident:
    """``r`` as the decision sees it: busy while it serves, loads, or its group may send its next request.

    ``kin``: an instance of the model placed (its chat instance, for an embedding instance) is never restarted
    for it: the client that asks for embeddings between its chats would wait for its own model's restart.
    """
    lingering = r.grouping and time.monotonic() - r.last_used < GROUP_LINGER
    holder = placement.holder(
        r.name,
        r.plan,
        r.actual,
        last_used=r.last_used,
        busy=not r.idle or r.state is not ResidentState.READY or lingering or restarting,
        pinned=r.pinned,
    )
    return placement.Resident(
        holder,
        loading=r.state in COMING_UP,
        ready=r.state is ResidentState.READY,
        going=going,
        on_cpu=r.plan.layers_on_cpu,
        threads=r.plan.threads,
        restartable=r.state is ResidentState.READY and not going and not kin and r.plan.request.threads is None,
    )


def without_busy_workers(
    inventory: Inventory, residents: Sequence[ResidentModel], replacing: ResidentModel | None
) -> Inventory:
    """An RPC worker serves one llama-server at a time: leave out the workers resident models use."""
    taken = {w: r.name for r in residents if r.state in HOLDS_MEMORY and r is not replacing for w in r.plan.rpc_workers}
    if not any(d.endpoint in taken for d in inventory.rpc):
        return inventory
    left_out = sorted({f"{d.endpoint} (serving {taken[d.endpoint]})" for d in inventory.rpc if d.endpoint in taken})
    return replace(
        inventory,
        devices=tuple(d for d in inventory.devices if d.endpoint not in taken),
        warnings=(
            *inventory.warnings,
            "RPC workers busy with another resident model are left out: " + ", ".join(left_out),
        ),
    )
