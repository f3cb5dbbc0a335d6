"""The activity table on a real SQLite file: a record read back is the record that was kept, and the
retention walks the rowids (records in the order they ended) once the start-time index is gone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from studio import json_codec
from studio.activity.recorder import as_record
from studio.activity.store import Query, Retention, select, write_batch
from studio.activity.trace import RequestTrace
from studio.history.database import open_database

TAIL = (
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"timings":{"cache_n":3,"prompt_n":9,'
    b'"prompt_ms":3.5,"predicted_n":4,"predicted_ms":8.0,"predicted_per_second":500.0}}\n\ndata: [DONE]\n\n'
)


def finished(n: int, wall0: float) -> RequestTrace:
    trace = RequestTrace(
        f"t-{n}", "/v1/chat/completions", "openai", "m", "agent/1", None, True, time.perf_counter(), wall0
    )
    trace.got_model("m")
    trace.sending()
    trace.retrying("llama-server died (killed by SIGKILL)")
    trace.sending()
    trace.answered(trace.sent, TAIL)
    trace.status = 200
    trace.finish()
    return trace


def test_a_stored_request_reads_back_as_the_record_kept_in_memory(tmp_path: Path) -> None:
    conn = open_database(tmp_path / "history.db")
    trace = finished(1, time.time())
    write_batch(conn, [trace], [], Retention(), time.time())
    [stored] = select(conn, Query())
    kept = as_record(trace)
    assert stored["phases"] == kept["phases"] and stored["times"] == kept["times"]
    assert {k: v for k, v in stored.items() if k not in ("phases", "times")} == {
        k: v for k, v in kept.items() if k not in ("phases", "times")
    }
    assert stored["outcome"] == "length" and stored["retries"] == 1 and stored["decode_tps"] == 500.0
    assert stored["tokens"]["prompt_cached"] == 3 and stored["tokens"]["generated"] == 4


def test_a_schema_3_database_keeps_its_records_and_drops_the_oldest_by_age_and_count(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    old = open_database(path, upto=3)
    now = time.time()
    write_batch(old, [finished(i, now - 100 + i) for i in range(5)], [], Retention(), now)
    old.close()
    conn = open_database(path)
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'activity_by_started'").fetchone() is None
    assert [r["id"] for r in select(conn, Query())] == [f"t-{i}" for i in (4, 3, 2, 1, 0)]

    write_batch(conn, [finished(5, now)], [], Retention(max_age=97.5), now)
    assert [r["id"] for r in select(conn, Query())] == ["t-5", "t-4", "t-3"]  # t-2 ended 98 s ago
    write_batch(conn, [finished(6, now)], [], Retention(max_records=2), now)
    assert [r["id"] for r in select(conn, Query())] == ["t-6", "t-5"]


def test_a_request_stored_before_waits_were_recorded_reads_back_with_its_phases_split_at_its_load() -> None:
    """A row written before the waits were recorded: the state list ends at the load (its start 1 s in)."""
    timings = {"prompt_n": 9, "prompt_ms": 100.0, "predicted_n": 4, "predicted_ms": 400.0}
    load = {"id": "L1", "model": "gemma", "evicted": ["smollm"], "began_at": 1.0}
    older = ["t-old", "/v1/chat/completions", "openai", "gemma", "agent/1", None, True, False, "gemma", 1.7e9, 0]
    older += [200, "finished", None, [], timings, [3.0, 3.1, None, 3.7], load]
    record = as_record(RequestTrace.from_state(json_codec.dumps(older)))

    assert record["waits"] is None and record["load"] == {"id": "L1", "model": "gemma", "evicted": ["smollm"]}
    # before the load began: queued; then the load; of the 0.6 s upstream, llama-server's own timings say 0.5
    expected = {"queued": 1.1, "load_wait": 2.0, "prefill": 0.1, "decode": 0.4}
    assert record["phases"] == pytest.approx(expected, abs=1e-9), record["phases"]


def test_a_requests_waits_are_stored_and_read_back_with_their_phases(tmp_path: Path) -> None:
    conn = open_database(tmp_path / "history.db")
    trace = RequestTrace(
        "t-w", "/v1/chat/completions", "openai", "m", None, None, True, time.perf_counter(), time.time()
    )
    trace.waiting("queued", "m")
    trace.waited()
    trace.waiting("load", "m")
    trace.waited()
    assert trace.waits is not None
    trace.waits[-1][4] = "L7"  # the load record's id, as ``Activity.end`` finds it
    trace.got_model("m")
    trace.sending()
    trace.answered(None, TAIL)
    trace.finish()
    write_batch(conn, [trace], [], Retention(), time.time())
    [stored] = select(conn, Query())

    assert [(w["for"], w["model"], w["load"]) for w in stored["waits"]] == [("queued", "m", None), ("load", "m", "L7")]
    for read, kept in zip(stored["waits"], as_record(trace)["waits"], strict=True):
        assert (read["began"], read["ended"]) == pytest.approx((kept["began"], kept["ended"]))
    assert stored["phases"] == pytest.approx(as_record(trace)["phases"])
