#!/usr/bin/env python3
"""Count the instructions the studio runs per stream, with valgrind's callgrind: a before and after that the
machine's other load does not move.

CPU time on a shared two-core machine moves by 10 % and more from one round to the next (the other core's work
shares caches and the core itself), so a 5 % question takes many runs of ``scripts/bench_proxy.py`` and may
still not settle. The instructions a process runs in user space do not depend on that load: this script runs
the studio (in front of ``bench_proxy``'s stand-in llama-server, as ``--stand-in`` does) under callgrind,
counts from after a warm-up to the end of ``--streams`` streams of ``--tokens`` tokens, 8 at a time, and
prints the instructions per stream, all threads together (the chunk pump's and the history writer's too).

What it leaves out: the kernel's work (the syscalls), and how fast each instruction runs. The count still
moves by a few percent between repeats (the event loop batches differently, a collection of young objects
lands in one count or the next), so each variant runs ``--repeat`` times, the variants taking turns, and the
medians are printed.

Variants: this checkout; ``--activity-off``: it, making no activity records (``activity_days = 0``);
``--against REV``: the studio of an earlier revision (its own C extensions built). Needs valgrind
(``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_proxy  # noqa: E402  (the stand-in, the studio's service, an earlier revision's)

#: The path of ``--activity-off``'s studio.
UNRECORDED = "no records"


class _Ready:
    """``serve_stand_in``'s pipe, for a studio that is not bench_proxy's child: it says so on stdout."""

    def send(self, _: object) -> None:
        print("READY", flush=True)


def serve(variant: str, port: int, upstream: int, root: str | None) -> None:
    """The studio of ``root`` (``None``: this checkout) in front of the stand-in on ``upstream``."""
    if root is not None:
        bench_proxy.serve_earlier(root, port, _Ready(), upstream, bench_proxy.free_port())  # type: ignore[arg-type]
    else:
        recording = variant != UNRECORDED
        bench_proxy.serve_stand_in(port, _Ready(), upstream, bench_proxy.free_port(), recording)  # type: ignore[arg-type]


def count(variant: str, root: str | None, upstream: int, n: int, tokens: int) -> float:
    """Instructions per stream of one studio, started under callgrind with its counting off until the warm-up
    is done."""
    port = bench_proxy.free_port()
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as out:
        argv = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}/callgrind.%p",
            sys.executable,
            __file__,
            "--serve",
            variant,
            str(port),
            str(upstream),
            root or "",
        ]
        studio = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert studio.stdout is not None
            if "READY" not in studio.stdout.readline():
                raise SystemExit(f"{variant}: the studio under valgrind did not start")
            route = bench_proxy.Route(
                variant, port, "/v1/chat/completions", {}, {}, bench_proxy.V1_TOKEN, True, studio.pid
            )
            asyncio.run(bench_proxy.requests(route, 24, 8, tokens=tokens))
            time.sleep(2)  # what the warm-up left (the spares, the history's first batch) is done
            subprocess.run(["callgrind_control", "-i", "on", str(studio.pid)], check=True, capture_output=True)
            asyncio.run(bench_proxy.requests(route, n, 8, tokens=tokens))
            time.sleep(2)  # the last stream's end (its record, its connection's close)
            subprocess.run(["callgrind_control", "-i", "off", str(studio.pid)], check=True, capture_output=True)
            subprocess.run(["callgrind_control", "-d", str(studio.pid)], check=True, capture_output=True)
        finally:
            studio.send_signal(signal.SIGTERM)
            try:
                studio.wait(120)
            except subprocess.TimeoutExpired:
                studio.kill()
                studio.wait(30)
        total = 0
        for dump in Path(out).glob("callgrind.*"):
            found = re.findall(r"^totals: (\d+)", dump.read_text(errors="replace"), re.M)
            total += int(found[-1]) if found else 0
    return total / n


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        variant, port, upstream, root = sys.argv[2:6]
        serve(variant, int(port), int(upstream), root or None)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=96, help="streams counted, 8 at a time")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per stream")
    parser.add_argument("--repeat", type=int, default=3, help="counts of each variant; the medians are printed")
    parser.add_argument("--activity-off", action="store_true", help="also this checkout making no activity records")
    parser.add_argument("--against", action="append", default=[], metavar="REV", help="also revision REV's studio")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    spawn = multiprocessing.get_context("spawn")
    upstream = bench_proxy.free_port()
    stand_in = spawn.Process(target=bench_proxy.stand_in_llama_server, args=(upstream, 50.0), daemon=True)
    stand_in.start()
    unpacked = tempfile.TemporaryDirectory(prefix="bench-instructions-rev-")
    variants: list[tuple[str, str | None]] = [("this checkout", None)]
    if args.activity_off:
        variants.append((UNRECORDED, None))
    for rev in args.against:
        root = Path(unpacked.name) / rev
        root.mkdir()
        variants.append((bench_proxy.unpack(rev, root), str(root)))
    counts: dict[str, list[float]] = {name: [] for name, _ in variants}
    try:
        for i in range(args.repeat):
            for name, root in variants if i % 2 == 0 else variants[::-1]:
                counts[name].append(count(name, root, upstream, args.streams, args.tokens))
                print(f"  {name}: {counts[name][-1] / 1e6:.3f} M", file=sys.stderr, flush=True)
    finally:
        stand_in.terminate()
        unpacked.cleanup()
    base = statistics.median(counts[variants[0][0]])
    print(
        f"instructions per stream ({args.streams} streams of {args.tokens} tokens, 8 at a time, user space, "
        f"all threads; medians of {args.repeat}):"
    )
    for name, values in counts.items():
        each = " ".join(f"{v / 1e6:.3f}" for v in values)
        median = statistics.median(values)
        print(f"  {name:>16}: {median / 1e6:.3f} M ({median / base:.3f}x this checkout's)   [{each}]")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(bench_proxy.REPO))
    raise SystemExit(main())
