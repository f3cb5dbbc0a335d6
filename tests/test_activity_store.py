"""The activity table on a real SQLite file: a record read back is the record that was kept, and the
retention walks the rowids (records in the order they ended) once the start-time index is gone."""

from __future__ import annotations

import time
from pathlib import Path

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
