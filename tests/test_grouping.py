"""Requests grouped by model under a budget that fits one: fewer swaps, and none waits behind more than two.

The manager is the real one over zoo models whose llama-servers are fake (``tests.fake_llama``): what is
tested is when requests get their model and when models are swapped, not what they answer. A request
is an ``acquire``, a hold of its lease for the time an answer takes, and the release; a client sends
its requests one after another, as a chat client does.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from studio.residency.manager import AdmissionEvent, ModelManager, ResidencyEvent
from tests.fake_llama import fake_children
from tests.manager_harness import ZOO, fake_manager, zoo_bill

pytestmark = pytest.mark.slow

A, B = ZOO[:2]


@pytest.fixture(scope="module")
def zoo_models(zoo_dir):
    return {name: zoo_dir / f"{name}.gguf" for name in (A, B)}


@pytest.fixture(scope="module")
def one_model(real, zoo_models) -> int:
    """A budget that fits one of the two models, not both."""
    return int(max(zoo_bill(real, p) for p in zoo_models.values()) * 1.5)


@dataclass
class Served:
    model: str
    asked: float
    began: float


async def run_clients(
    manager: ModelManager, clients: list[list[tuple[str, float]]], *, think: float = 0.0
) -> tuple[list[Served], list[float]]:
    """Each client's (model, seconds its answer takes) one after another; what was served when, and the swaps."""
    swaps: list[float] = []

    def heard(event: ResidencyEvent) -> None:
        if event.kind == "evicted":
            swaps.append(time.monotonic())

    manager.listeners.append(heard)
    served: list[Served] = []

    async def client(requests: list[tuple[str, float]]) -> None:
        for model, seconds in requests:
            asked = time.monotonic()
            _, lease = await manager.acquire(model)
            served.append(Served(model, asked, time.monotonic()))
            await asyncio.sleep(seconds)
            await lease()
            await asyncio.sleep(think)

    await asyncio.wait_for(asyncio.gather(*(client(c) for c in clients)), 120)
    return served, swaps


def swaps_waited(request: Served, swaps: list[float]) -> int:
    return sum(request.asked < t <= request.began for t in swaps)


def test_two_clients_alternating_models_are_served_in_groups_with_a_few_swaps(tmp_path, real, zoo_models, one_model):
    """Without groups, each of the 16 requests was a swap (AB AB ...): the waiting load took the memory at once."""

    async def run(group_size: int) -> tuple[list[Served], list[float]]:
        with fake_children() as children:
            manager = fake_manager(
                tmp_path / str(group_size),
                children,
                real,
                zoo_models,
                budget=one_model,
                busy_wait=30,
                group_size=group_size,
            )
            try:
                return await run_clients(manager, [[(A, 0.05)] * 8, [(B, 0.05)] * 8])
            finally:
                await manager.aclose()

    grouped, swaps = asyncio.run(run(4))
    assert len(swaps) <= 4, swaps
    assert max(swaps_waited(r, swaps) for r in grouped) <= 2
    _, one_by_one = asyncio.run(run(0))
    assert len(one_by_one) >= 12  # the same clients without groups: a swap for nearly every request


def test_each_hold_for_a_load_is_told_as_old_new_and_why(tmp_path, real, zoo_models, one_model):
    """The admission events of two alternating clients chain (each one's old is the last one's new) and say why:
    a model held back for the other's load takes new requests again once that load is done, or goes."""
    heard: list[AdmissionEvent] = []

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, zoo_models, budget=one_model, busy_wait=30, group_size=2)
            shown: list[bool] = []  # /api/status' row agrees with each event as it is heard

            def hear(event: AdmissionEvent) -> None:
                heard.append(event)
                resident = manager.find(event.model)
                shown.append(resident is not None and resident.status()["admission"] == event.new)

            manager.admission_listeners.append(hear)
            try:
                await run_clients(manager, [[(A, 0.05)] * 6, [(B, 0.05)] * 6])
            finally:
                await manager.aclose()
            assert shown and all(shown), shown

    asyncio.run(run())
    events_a, events_b = ([e for e in heard if e.model == model] for model in (A, B))
    for events in (events_a, events_b):
        assert events, heard
        assert [e.old for e in events] == ["accepting"] + [e.new for e in events[:-1]]
    moves = {(e.old, e.new) for e in heard}
    assert ("accepting", "grouping") in moves and ("grouping", "paused_for_load") in moves, moves
    waits = {e.reason for e in heard if e.new == "grouping"}
    assert waits <= {f"{A} waits for its memory", f"{B} waits for its memory"}, waits
    # every hold ends: the load is done, or the held model is the one evicted for it (it drains)
    assert all(e.new == "accepting" for e in (events_a[-1], events_b[-1])), heard
    ends = {e.reason for e in heard if e.new == "accepting"}
    assert ends <= {f"{m} is draining" for m in (A, B)} | {f"{m} is loaded" for m in (A, B)}, ends


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_no_request_waits_behind_more_than_two_swaps(tmp_path_factory, real, zoo_models, one_model, seed):
    """Three clients, each sending six requests for A or B at random, with random answer and think times."""
    rng = random.Random(seed)
    clients = [[(rng.choice((A, B)), rng.uniform(0, 0.04)) for _ in range(6)] for _ in range(3)]

    async def run() -> tuple[list[Served], list[float]]:
        with fake_children() as children:
            manager = fake_manager(
                tmp_path_factory.mktemp("grouping"), children, real, zoo_models, budget=one_model, busy_wait=30
            )
            try:
                return await run_clients(manager, clients, think=rng.uniform(0, 0.02))
            finally:
                await manager.aclose()

    served, swaps = asyncio.run(run())
    assert len(served) == 18
    waited = {(r.model, round(r.began - r.asked, 3)): swaps_waited(r, swaps) for r in served}
    assert max(waited.values()) <= 2, (clients, waited)
