#!/usr/bin/env python3
"""How fast the CLI starts: median wall time of `ggstudio --help` (target <= 300 ms).

Measured next to a bare `python -c pass` in the same run, the floor any CLI
written in Python pays.

    .venv/bin/python scripts/bench_cli.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def median_s(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    cli = str(Path(sys.executable).parent / "ggstudio")
    floor = median_s([sys.executable, "-c", "pass"], args.runs)
    for argv in ([cli, "--help"], [cli, "--version"]):
        t = median_s(argv, args.runs)
        print(f"{' '.join(['ggstudio', *argv[1:]]):20} {t * 1000:7.1f} ms  (python -c pass: {floor * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
