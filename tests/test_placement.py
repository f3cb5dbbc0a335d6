"""Placement and the resident lifecycle as tables: no processes."""

from __future__ import annotations

import pytest

from studio.residency.lifecycle import TRANSITIONS, ResidentState
from studio.residency.placement import (
    TOTAL,
    Holder,
    base_available,
    choose_evictions,
    holders_in_words,
    shortfall,
    with_evicted,
)

MIB = 2**20
S = ResidentState


def h(
    name: str,
    mib: int,
    last_used: float,
    *,
    busy: bool = False,
    pinned: bool = False,
    reclaim: int | None = None,
    device: str = "CPU",
) -> Holder:
    return Holder(
        name=name,
        held={device: mib * MIB},
        reclaim={device: (mib if reclaim is None else reclaim) * MIB},
        last_used=last_used,
        busy=busy,
        pinned=pinned,
    )


def test_every_state_has_a_row_and_the_table_allows_only_the_life_of_a_model():
    assert set(TRANSITIONS) == set(ResidentState)
    assert TRANSITIONS[S.UNLOADED] == frozenset()  # gone is final
    assert S.LOADING not in TRANSITIONS[S.READY]  # a ready model restarts only through a crash or an unload
    assert TRANSITIONS[S.DRAINING] == {S.UNLOADING}  # draining never goes back to serving
    assert S.READY not in TRANSITIONS[S.FAILED]  # a failed start is retried as a new resident, not revived
    assert TRANSITIONS[S.CRASHED] == {S.LOADING, S.FAILED, S.UNLOADING}
    # every state can reach "unloaded": nothing is stuck
    reach = {s for s in ResidentState if S.UNLOADED in _reachable(s)}
    assert reach == set(ResidentState) - {S.UNLOADED}


def _reachable(start: ResidentState) -> set[ResidentState]:
    seen, todo = set(), [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize(
    "need, holders, expect",
    [
        # fits without evicting anything
        (100, [h("a", 100, 1)], ()),
        # the least recently used of two idle models goes
        (250, [h("a", 100, 1), h("b", 100, 2)], ("a",)),
        # one bigger model rather than two small ones: the fewest that free enough
        (200, [h("a", 100, 1), h("b", 100, 2), h("c", 200, 3)], ("c",)),
        # busy and pinned models are never chosen
        (250, [h("a", 100, 1, busy=True), h("b", 100, 2)], ("b",)),
        (250, [h("a", 100, 1, pinned=True), h("b", 100, 2)], ("b",)),
        # nothing evictable frees enough
        (350, [h("a", 100, 1, busy=True), h("b", 100, 2, pinned=True)], None),
        # two must go; among pairs, the one whose latest use is oldest
        (290, [h("a", 100, 1), h("b", 100, 2), h("c", 100, 3)], ("a", "b")),
    ],
)
def test_choose_evictions_fewest_then_least_recently_used(need, holders, expect):
    base = base_available(budget={"CPU": 400 * MIB}, free={}, holders=holders)
    assert choose_evictions({"CPU": need * MIB}, base, holders, budgeted=True) == expect


def test_no_needless_eviction_when_the_new_model_fits():
    holders = [h("a", 100, 1), h("b", 100, 2)]
    base = base_available(budget={"CPU": 1000 * MIB}, free={}, holders=holders)
    assert choose_evictions({"CPU": 700 * MIB}, base, holders, budgeted=True) == ()


def test_max_resident_forces_an_eviction_even_when_memory_suffices():
    holders = [h("a", 10, 1), h("b", 10, 2)]
    base = base_available(budget={"CPU": 1000 * MIB}, free={}, holders=holders)
    assert choose_evictions({"CPU": 10 * MIB}, base, holders, budgeted=True, max_count=2) == ("a",)
    assert choose_evictions({"CPU": 10 * MIB}, base, holders, budgeted=True, max_count=3) == ()


def test_a_total_budget_counts_every_device_together():
    holders = [Holder("a", {"CPU": 100 * MIB, "CUDA0": 100 * MIB}, {"CPU": 100 * MIB, "CUDA0": 100 * MIB}, 1)]
    base = base_available(budget={TOTAL: 500 * MIB, "CPU": 500 * MIB, "CUDA0": 500 * MIB}, free={}, holders=holders)
    assert base[TOTAL] == 300 * MIB
    assert shortfall({"CPU": 200 * MIB, "CUDA0": 200 * MIB}, base) == {TOTAL: 100 * MIB}
    assert choose_evictions({"CPU": 200 * MIB, "CUDA0": 200 * MIB}, base, holders, budgeted=True) == ("a",)


def test_without_a_budget_free_memory_counts_and_an_unload_gives_back_what_it_reclaims():
    # mapped weights are page cache: free memory already counts them, so unloading returns only the rest
    a = h("a", 300, 1, reclaim=100)
    loading = h("b", 50, 2, busy=True)
    base = base_available(budget=None, free={"CPU": 1000 * MIB}, holders=[a], loading=[loading])
    assert base == {"CPU": 950 * MIB}  # a loading model has not taken its memory yet: set it aside
    assert with_evicted(base, [a], budgeted=False) == {"CPU": 1050 * MIB}


def test_what_holds_the_memory_is_named_in_words():
    words = holders_in_words([h("a", 100, 1, busy=True), h("b", 50, 2, pinned=True), h("c", 10, 3)])
    assert words == ("a (busy, 100 MiB)", "b (pinned, 50 MiB)")
