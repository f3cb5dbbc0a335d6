#!/usr/bin/env python3
"""How fast the CLI starts: median wall and CPU time of commands that do no work.

Targets (issue 33): ``--help`` <= 120 ms, ``serve --help`` and ``plan --help`` <= 250 ms.

Measured next to a bare ``python -c pass`` in the same run, the floor any CLI
written in Python pays (the studio's editable install adds its import hook to
every interpreter of the venv, that floor included). On a loaded machine the
wall time swings with the load; the CPU time (user + sys of the child) is
steadier, its least over the runs (the run the load disturbed least) steadier
still, and its ratio to the floor's says what the CLI itself costs.

    .venv/bin/python scripts/bench_cli.py [--runs 21]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = (["--help"], ["--version"], ["serve", "--help"], ["plan", "--help"])


#: As an installed CLI runs: with its bytecode cached (with PYTHONDONTWRITEBYTECODE a checkout compiles every start).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def measure(argv: list[str], runs: int) -> tuple[float, float, float]:
    """Median wall, median CPU and least CPU seconds of ``runs`` runs of ``argv``, after one that warms the caches.

    The caches: the OS's file cache, and the studio's ``--help`` text, as a second ``ggstudio --help`` finds it.
    """
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=ENV)
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=ENV)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus), min(cpus)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    cli = str(Path(sys.executable).parent / "ggstudio")
    floor_wall, floor_cpu, floor_least = measure([sys.executable, "-c", "pass"], args.runs)
    print(f"medians of {args.runs} runs (CPU least: the best run), load {os.getloadavg()[0]:.1f}")
    print(f"{'command':24} {'wall ms':>8} {'CPU ms':>8} {'CPU least':>10} {'x floor':>8}")
    print(
        f"{'python -c pass':24} {floor_wall * 1000:8.1f} {floor_cpu * 1000:8.1f} {floor_least * 1000:10.1f} {1:7.2f}x"
    )
    for argv in COMMANDS:
        wall, cpu, least = measure([cli, *argv], args.runs)
        print(
            f"{' '.join(['ggstudio', *argv]):24} {wall * 1000:8.1f} {cpu * 1000:8.1f} {least * 1000:10.1f} "
            f"{least / floor_least:7.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
