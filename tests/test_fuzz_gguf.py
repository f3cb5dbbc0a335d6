"""The header fuzz, quick profile: mutated real headers through read -> facts -> estimate -> plan -> argv.

``scripts/fuzz_gguf.py`` runs as its own process (its address space capped, each case
under a watchdog) over the real Gemma header and six zoo models; only the studio's own
errors may come out, no case may take a second of CPU, memory stays bounded. The long
profile is the same script with ``--cases 20000``.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fuzz_gguf import map_header

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_gguf.py"


def test_the_header_map_finds_each_field_where_the_reader_reads_it(gemma_model):
    import gguf

    head = gguf.read(gemma_model).shards[0]
    with gemma_model.open("rb") as f:
        data = f.read(head.data_offset)
    fields, end = map_header(data)
    by_what = {(f.kind, f.what): f for kind in fields.values() for f in kind}
    for what, expected in (("gemma3.block_count", 18), ("gemma3.context_length", 32768)):
        f = by_what[("hparam", what)]
        assert struct.unpack_from("<" + f.fmt, data, f.offset)[0] == expected
    assert struct.unpack_from("<Q", data, by_what[("counts", "tensor count")].offset)[0] == len(head.tensors)
    for t in (head.tensors[0], head.tensors[-1]):
        dims = [f for f in fields["tensor_dim"] if f.what.startswith(f"{t.name} dim ")]
        assert [struct.unpack_from("<Q", data, f.offset)[0] for f in dims] == list(t.shape)
    assert len(fields["tensor_offset"]) == len(head.tensors) and end <= head.data_offset


def test_mutated_headers_raise_only_our_errors_quickly_in_bounded_memory():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--cases", "200", "--seed", "7", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    found = "\n".join(f"#{f['index']} {f['result']}: {f['patches']}\n{f['traceback']}" for f in report["findings"])
    assert report["foreign_exceptions"] == 0 and report["hangs_over_1s"] == 0, found
    assert out.returncode == 0, out.stderr[-2000:]
    assert report["peak_rss_mib"] < 1024
    # the mutations reach every stage: many cases get to the argv, others stop at the reader or the facts
    results = report["results"]
    assert results.get("argv", 0) >= 20 and results.get("InconsistentHeaderError", 0) >= 1, results


def test_a_child_of_a_large_process_reports_its_own_peak_memory_not_its_parents():
    """CI's full run failed the fuzz's 1 GiB bound with 1,036 MiB: ``ru_maxrss`` of a child that pytest
    (by then ~1 GiB resident) had spawned carried pytest's peak over its exec."""
    ballast = bytearray(600 * 2**20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # resident, not just reserved
    probe = "from launcher.platform import peak_rss_bytes; print(peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    del ballast
    assert int(out.stdout) < 200 * 2**20
