"""A ready resident's admission (``lifecycle.Admission``): every change by its table, each told once as
``(old, new, reason)``, and the operations a load uses (pause, a group of requests, resume) walk only it."""

from __future__ import annotations

import itertools

import pytest

from studio.residency.lifecycle import ADMISSIONS, Admission, AdmissionGate

A = Admission
#: How to reach each admission from a new gate with the operations the resident has.
REACH = {
    A.ACCEPTING: lambda gate: None,
    A.GROUPING: lambda gate: gate.pause(2, "a load waits"),
    A.PAUSED_FOR_LOAD: lambda gate: gate.pause(0, "a load reserved it"),
}


def gate_in(state: Admission) -> tuple[AdmissionGate, list[tuple[Admission, Admission, str]]]:
    heard: list[tuple[Admission, Admission, str]] = []
    gate = AdmissionGate(lambda old, new, reason: heard.append((old, new, reason)))
    REACH[state](gate)
    assert gate.state is state
    heard.clear()
    return gate, heard


def test_the_table_names_every_admission():
    assert set(ADMISSIONS) == set(Admission)
    assert all(new in Admission and new is not old for old, nexts in ADMISSIONS.items() for new in nexts)


@pytest.mark.parametrize("old, new", list(itertools.product(Admission, Admission)))
def test_every_change_is_allowed_and_told_or_refused_by_the_table(old, new):
    gate, heard = gate_in(old)
    if new in ADMISSIONS[old]:
        gate.move(new, "why")
        assert gate.state is new
        assert heard == [(old, new, "why")]
    else:
        with pytest.raises(RuntimeError, match=f"illegal admission change {old.value} -> {new.value}"):
            gate.move(new, "why")
        assert gate.state is old
        assert heard == []


def test_a_group_admits_its_requests_then_pauses_and_is_never_extended():
    gate, heard = gate_in(A.ACCEPTING)
    gate.pause(2, "B waits for its memory")
    gate.pause(5, "B waits for its memory")  # a later call never extends the group
    assert [gate.admit(), gate.admit(), gate.admit()] == [True, True, False]
    assert heard == [
        (A.ACCEPTING, A.GROUPING, "B waits for its memory"),
        (A.GROUPING, A.PAUSED_FOR_LOAD, "its group before the load is complete"),
    ]
    gate.resume("B is loaded")
    assert gate.admit() and gate.state is A.ACCEPTING
    assert heard[-1] == (A.PAUSED_FOR_LOAD, A.ACCEPTING, "B is loaded")


@pytest.mark.parametrize("state", list(Admission))
def test_operations_that_change_nothing_tell_nothing(state):
    gate, heard = gate_in(state)
    if state is A.ACCEPTING:
        gate.resume("again")
    else:
        gate.pause(3, "again")  # a group open or closed is not opened again
    if state is A.PAUSED_FOR_LOAD:
        gate.pause(0, "again")
    assert gate.state is state and heard == []


def test_a_reserved_victim_pauses_at_once_even_in_a_group():
    gate, heard = gate_in(A.GROUPING)
    gate.pause(0, "its memory is reserved for B")
    assert not gate.admit()
    assert heard == [(A.GROUPING, A.PAUSED_FOR_LOAD, "its memory is reserved for B")]
