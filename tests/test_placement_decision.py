"""The placement decision as a table: a frozen snapshot in, what to do out, planned by the real planner.

Each row is a situation the manager meets (residents idle, busy, pinned, reserved by another load,
loads in flight, a cap on resident models) with Gemma's real header and the pinned llama-server's
flags; the decision reads nothing else, so a row is the whole story.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from launcher.devices import Device, Inventory
from launcher.planner import PlanRequest, plan
from launcher.units import MIB
from studio.residency.placement import Holder, Rebalance, Resident, Snapshot, decide, physical, rebalance
from studio.settings import MemoryBudget

GIB = 1024 * MIB
CTX = 1024


def cpu_only(cores: int | None = 2) -> Inventory:
    return Inventory((Device("CPU", None, "Test CPU", 64 * GIB, 60 * GIB, "psutil", cores=cores),), ())


@pytest.fixture(scope="module")
def planner(gemma, real):
    return lambda inventory, request: plan(gemma, inventory, real, request)


@pytest.fixture(scope="module")
def bill(planner) -> int:
    """Gemma's bytes at the test's context, as the planner bills them."""
    launch = planner(cpu_only(), PlanRequest(n_ctx=CTX, spec="off"))
    return sum(physical(launch.bill, launch).values())


def resident(name: str, share: float, last_used: float, **flags: bool) -> tuple:
    """A row's resident: ``share`` of Gemma's bill held, and its flags (busy, pinned, ready, going, loading...)."""
    return (name, share, last_used, flags)


def build(rows: tuple, bill: int) -> tuple[Resident, ...]:
    out = []
    for name, share, last_used, flags in rows:
        held = {"CPU": int(share * bill)}
        holder = Holder(name, held, held, last_used, busy=flags.get("busy", False), pinned=flags.get("pinned", False))
        out.append(
            Resident(
                holder,
                loading=flags.get("loading", False),
                ready=flags.get("ready", True),
                going=flags.get("going", False),
                on_cpu=True,
                threads=1,  # its share of the two cores
            )
        )
    return tuple(out)


ROWS = {
    # budget (in Gemma bills), residents, reservations (bills), max_resident -> fits, evict, drain, blocked
    "room for it beside an idle model: nothing goes": (3.0, [resident("a", 1.0, 1)], (), None, (True, (), (), 0)),
    "the least recently used idle model goes": (
        2.5,
        [resident("a", 1.0, 1), resident("b", 1.0, 2)],
        (),
        None,
        (True, ("a",), (), 0),
    ),
    "a busy model is not evicted; it would drain": (
        1.5,
        [resident("a", 1.0, 1, busy=True)],
        (),
        None,
        (False, (), ("a",), 1),
    ),
    "a pinned model is neither evicted nor drained": (
        1.5,
        [resident("a", 1.0, 1, pinned=True)],
        (),
        None,
        (False, (), (), 1),
    ),
    "a model another load reserved counts as busy, and will not drain": (
        1.5,
        [resident("a", 1.0, 1, going=True)],
        (),
        None,
        (False, (), (), 1),
    ),
    "a load in flight takes its reservation: nothing to evict, nothing holds it": (
        1.5,
        [],
        (1.0,),
        None,
        (False, (), (), 0),
    ),
    "max_resident evicts even when memory suffices": (
        10.0,
        [resident("a", 0.1, 1), resident("b", 0.1, 2)],
        (),
        2,
        (True, ("a",), (), 0),
    ),
}


@pytest.mark.parametrize("why", list(ROWS))
def test_the_decision_table(why, planner, bill):
    budget, rows, reserved, cap, (fits, evict, drain, blocked) = ROWS[why]
    snapshot = Snapshot(
        inventory=cpu_only(),
        residents=build(tuple(rows), bill),
        reservations=tuple(Holder(f"r{i}", {"CPU": int(s * bill)}, {}, 0, busy=True) for i, s in enumerate(reserved)),
        budget=MemoryBudget(total=int(budget * bill)),
        max_resident=cap,
    )
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert (decision.fits, decision.evict, decision.drain, len(decision.blocked_by)) == (fits, evict, drain, blocked)
    if not fits:
        assert decision.need and decision.room  # the 503's words
        assert decision.shortfall > 0 or decision.drain or decision.blocked_by


def test_the_room_is_the_budget_less_the_studios_reserve_and_the_plan_says_so(planner, bill):
    snapshot = Snapshot(inventory=cpu_only(), budget=MemoryBudget(total=4 * bill), reserve=bill)
    room = snapshot.room()
    assert room.budgeted and room.available["total"] == 3 * bill
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert any(r.startswith("reserve: the studio's own") for r in decision.plan.reasons)


def test_without_a_budget_free_memory_less_the_loads_in_flight_is_the_room(planner, bill):
    loading = Holder("l", {"CPU": 2 * GIB}, {"CPU": 2 * GIB}, 0, busy=True)
    snapshot = Snapshot(inventory=cpu_only(), reservations=(loading,))
    assert snapshot.room().available == {"CPU": 58 * GIB} and not snapshot.room().budgeted


def test_an_evicted_model_gives_its_cores_back_to_the_one_placed(planner, bill):
    snapshot = Snapshot(
        inventory=cpu_only(),
        residents=build((resident("a", 1.0, 1),), bill),
        budget=MemoryBudget(total=int(1.5 * bill)),
    )
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert decision.evict == ("a",) and decision.plan.request.cpu_sharers == 1
    beside = decide(replace(snapshot, budget=MemoryBudget(total=3 * bill)), PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert beside.evict == () and beside.plan.request.cpu_sharers == 2


@pytest.mark.parametrize("held, warned", [(2, True), (1, False), (None, True)])
def test_a_model_beside_one_that_kept_every_core_warns_of_more_threads_than_cores(planner, bill, held, warned):
    """Without max_resident a model loaded alone keeps every core: the next one's plan says both busy at once
    run more threads than there are cores, and what divides them."""
    [a] = build((resident("a", 0.1, 1),), bill)
    snapshot = Snapshot(
        inventory=cpu_only(cores=2), residents=(replace(a, threads=held),), budget=MemoryBudget(total=10 * bill)
    )
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert decision.plan.threads == 1 and decision.evict == ()
    said = [w for w in decision.plan.warnings if "threads on 2 physical cores" in w]
    assert said == (
        [
            f"{(held or 2) + 1} threads on 2 physical cores while a and this model are busy at once (a model "
            "loaded alone keeps every core until a load restarts it idle); max_resident divides them from the "
            "first load"
        ]
        if warned
        else []
    )


@pytest.mark.parametrize(
    "cap, residents, threads, evict, fits",
    [
        (None, [], 2, (), True),  # no max_resident: a lone model takes every core
        (2, [], 1, (), True),  # the division planned before the first load: its share of two
        (2, [resident("a", 0.1, 1)], 1, (), True),  # beside one with its share: the core left
        (3, [resident("a", 0.1, 1), resident("b", 0.1, 2)], 1, ("a",), True),  # no core left: an idle one goes
        (3, [resident("a", 0.1, 1, busy=True), resident("b", 0.1, 2, busy=True)], 1, (), False),  # busy: it waits
    ],
)
def test_cores_are_room_under_max_resident(planner, bill, cap, residents, threads, evict, fits):
    snapshot = Snapshot(
        inventory=cpu_only(cores=2),
        residents=build(tuple(residents), bill),
        budget=MemoryBudget(total=10 * bill),
        max_resident=cap,
    )
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert (decision.plan.threads, decision.evict, decision.fits) == (threads, evict, fits)
    if not fits:
        assert decision.drain == ("a",) and "core" in decision.need


@pytest.mark.parametrize(
    "cap, held, flags, restart",
    [
        (None, 2, {}, (("a", 1),)),  # kept every core, idle: restarted with its share first
        (None, None, {}, (("a", 1),)),  # every core by default (no count in its plan): the same
        (None, 2, {"busy": True}, ()),  # busy: never waited for, it keeps its cores (the warning says so)
        (None, 2, {"pinned": True}, (("a", 1),)),  # pinned stays resident, and a restart keeps it resident
        (None, 2, {"fixed": True}, ()),  # its threads were asked for, or it is the model's own chat instance
        (None, 1, {}, ()),  # it has its share already
        (2, 1, {}, ()),  # max_resident divided the cores from the first load
    ],
)
def test_an_idle_resident_with_every_core_restarts_with_its_share(planner, bill, cap, held, flags, restart):
    """Without max_resident a lone model keeps every core; a second model on the CPU names it to restart with
    its share, so that both busy at once never run more threads than there are cores."""
    [a] = build((resident("a", 0.1, 1, busy=flags.get("busy", False), pinned=flags.get("pinned", False)),), bill)
    a = replace(a, threads=held, restartable=not flags.get("fixed", False))
    snapshot = Snapshot(
        inventory=cpu_only(cores=2), residents=(a,), budget=MemoryBudget(total=10 * bill), max_resident=cap
    )
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert (decision.plan.threads, decision.evict, decision.restart, decision.fits) == (1, (), restart, True)
    warned = any("threads on 2 physical cores" in w for w in decision.plan.warnings)
    assert warned == (cap is None and held != 1 and not restart)


def test_a_lone_model_keeps_every_core_and_an_evicted_one_is_not_restarted(planner, bill):
    alone = decide(Snapshot(inventory=cpu_only(cores=2)), PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert (alone.plan.threads, alone.restart) == (2, ())
    [a] = build((resident("a", 1.0, 1),), bill)
    snapshot = Snapshot(
        inventory=cpu_only(cores=2),
        residents=(replace(a, threads=2, restartable=True),),
        budget=MemoryBudget(total=int(1.5 * bill)),
    )
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert (decision.evict, decision.restart, decision.plan.threads) == (("a",), (), 2)


def _cpu(name: str, threads: int | None, **flags: bool) -> Resident:
    """A CPU resident of ``rebalance``'s rows: ready, restartable unless ``fixed``, with ``threads``."""
    held = {"CPU": GIB}
    return Resident(
        Holder(name, held, held, 1.0, busy=flags.get("busy", False), pinned=flags.get("pinned", False)),
        loading=flags.get("loading", False),
        ready=not flags.get("loading", False),
        going=flags.get("going", False),
        on_cpu=not flags.get("gpu", False),
        threads=threads,
        restartable=not flags.get("fixed", False) and not flags.get("loading", False),
    )


@pytest.mark.parametrize(
    "residents, cores, extra, expected",
    [
        # a model left: the one left alone with its share gets every core back
        ([_cpu("a", 1)], 2, {}, Rebalance(restart=(("a", 2),))),
        ([_cpu("a", 1, pinned=True)], 2, {}, Rebalance(restart=(("a", 2),))),  # a restart keeps it resident
        ([_cpu("a", 1, busy=True)], 2, {}, Rebalance(once_idle=("a",))),  # busy: once its requests are done
        ([_cpu("a", 2)], 2, {}, Rebalance()),  # it has every core
        ([_cpu("a", None)], 2, {}, Rebalance()),  # every core by default
        ([_cpu("a", 1, fixed=True)], 2, {}, Rebalance()),  # its threads were asked for
        ([_cpu("a", 1), _cpu("b", 1)], 2, {}, Rebalance()),  # two on two cores: each has its share
        ([_cpu("a", 1), _cpu("b", 1), _cpu("c", 1)], 2, {}, Rebalance()),  # three on two: nothing to give
        ([_cpu("a", 1), _cpu("b", 1)], 4, {}, Rebalance(restart=(("a", 2), ("b", 2)))),  # the third of 4 left
        ([_cpu("a", 1), _cpu("b", 2, fixed=True)], 4, {}, Rebalance(restart=(("a", 2),))),
        ([_cpu("a", 1), _cpu("g", 1, gpu=True)], 2, {}, Rebalance(restart=(("a", 2),))),  # a GPU model shares none
        # a load restarted none of a busy resident: it kept every core beside the new one; once idle it gets its share
        ([_cpu("a", 2, busy=True), _cpu("b", 1)], 2, {}, Rebalance(once_idle=("a",))),
        ([_cpu("a", 2), _cpu("b", 1)], 2, {}, Rebalance(restart=(("a", 1),))),
        # a busy one above its share still runs its threads: the one below waits for them before it grows
        ([_cpu("a", 4, busy=True), _cpu("b", 1)], 4, {}, Rebalance(once_idle=("a",))),
        # a load in flight, or a resident starting or going: that load's decision owns the cores
        ([_cpu("a", 1)], 2, {"loads": 1}, Rebalance()),
        ([_cpu("a", 1), _cpu("b", 1, loading=True)], 2, {}, Rebalance()),
        ([_cpu("a", 1), _cpu("b", 1, going=True)], 2, {}, Rebalance()),
        ([_cpu("a", 1)], 2, {"max_resident": 2}, Rebalance()),  # max_resident divided them from the first load
        ([_cpu("a", 1)], None, {}, Rebalance()),  # cores not counted
    ],
)
def test_the_cores_are_divided_again_once_the_residents_changed(residents, cores, extra, expected):
    """Without a load, once a model left or a busy one turned idle: a lone model gets every core back, one that
    kept more than its share beside a newer one gets its share; busy ones wait until their requests are done."""
    snapshot = Snapshot(inventory=cpu_only(cores=cores), residents=tuple(residents), **extra)  # type: ignore[arg-type]
    assert rebalance(snapshot) == expected


def test_a_busy_resident_with_every_core_is_said_to_restart_once_its_requests_are_done(planner, bill):
    """A load never waits for a busy resident's answer to restart it: the plan says the threads exceed the cores
    until that resident, once idle, restarts with its share (``rebalance``, after the load)."""
    [a] = build((resident("a", 0.1, 1, busy=True),), bill)
    snapshot = Snapshot(
        inventory=cpu_only(cores=2),
        residents=(replace(a, threads=2, restartable=True),),
        budget=MemoryBudget(total=10 * bill),
    )
    decision = decide(snapshot, PlanRequest(n_ctx=CTX, spec="off"), planner)
    assert (decision.plan.threads, decision.restart) == (1, ())
    assert [w for w in decision.plan.warnings if "physical cores" in w] == [
        "3 threads on 2 physical cores while a and this model are busy at once, until a restart(s) with a share "
        "of the cores once their requests are done"
    ]
    after = Snapshot(
        inventory=cpu_only(cores=2),
        residents=(replace(a, threads=2, restartable=True), *build((resident("b", 0.1, 2),), bill)),
    )
    assert rebalance(after) == Rebalance(once_idle=("a",))
