#!/usr/bin/env python3
"""Benchmark the GGUF reader: header + facts, cold and cached, against baselines.

Prints the median of N runs for each file ("cold": metadata cache cleared, file
in the page cache; "cold(py)": the same without the C string skipper), next to a
plain struct+seek reader measured in the same run, and PyPI ``gguf`` (GGUFReader)
from a separate venv: ``--reference-python``, or ``.venv-ref/`` when present
(``python3 -m venv .venv-ref && .venv-ref/bin/pip install gguf``). Never install
it into .venv: our own package is also called ``gguf``.

    .venv/bin/python scripts/bench_gguf.py [--runs 15] [--reference-python PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gguf
from gguf import reader
from launcher.build import layout_for, load_pin

FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def struct_seek_baseline(path: Path) -> int:
    """The straightforward reader: read each field with struct, seek past each string."""
    with path.open("rb") as fh:

        def u32() -> int:
            return struct.unpack("<I", fh.read(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", fh.read(8))[0]

        def skip_value(vtype: int) -> None:
            if vtype == 8:
                fh.seek(u64(), 1)
            elif vtype == 9:
                etype, n = u32(), u64()
                if etype in FIXED:
                    fh.seek(FIXED[etype] * n, 1)
                else:
                    for _ in range(n):
                        skip_value(etype)
            else:
                fh.seek(FIXED[vtype], 1)

        fh.read(8)
        n_tensors, n_kv = u64(), u64()
        for _ in range(n_kv):
            fh.read(u64())
            skip_value(u32())
        for _ in range(n_tensors):
            fh.read(u64())
            dims = u32()
            fh.read(8 * dims + 12)
        return fh.tell()


def ours_cold(path: Path) -> object:
    gguf.clear_cache()
    return gguf.read(path).facts


def ours_cold_pure_python(path: Path) -> object:
    """The same, with the C string skipper switched off (the fallback path)."""
    saved, reader.c_skip_strings = reader.c_skip_strings, None
    try:
        return ours_cold(path)
    finally:
        reader.c_skip_strings = saved


def ours_cached(path: Path) -> object:
    return gguf.read(path).facts


def median_ms(fn, path: Path, runs: int) -> float:
    fn(path)  # warm the page cache and imports
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


REFERENCE_SNIPPET = """
import statistics, sys, time
from gguf import GGUFReader
path, runs = sys.argv[1], int(sys.argv[2])
GGUFReader(path)
ts = []
for _ in range(runs):
    t = time.perf_counter(); GGUFReader(path); ts.append(time.perf_counter() - t)
print(statistics.median(ts) * 1000)
"""


def reference_ms(python: str, path: Path, runs: int) -> float | None:
    # cwd="/": run outside the checkout so its own `gguf` package cannot shadow PyPI's.
    out = subprocess.run(
        [python, "-c", REFERENCE_SNIPPET, str(path), str(runs)], capture_output=True, text=True, cwd="/"
    )
    return float(out.stdout.strip()) if out.returncode == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--reference-python", help="python of a separate venv with PyPI gguf installed")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    home = Path(os.environ.get("GGUF_STUDIO_HOME") or Path.home() / ".gguf-studio")
    src = layout_for(home, load_pin()).source_dir / "models"
    files = args.files or [
        src / "ggml-vocab-qwen2.gguf",
        src / "ggml-vocab-gemma-4.gguf",
        home / "models" / "gemma-3-270m-Q4_K_M.gguf",
    ]
    default_ref = Path(__file__).resolve().parent.parent / ".venv-ref" / "bin" / "python"
    ref = args.reference_python or (str(default_ref) if default_ref.exists() else None)
    print(f"C string skipper: {'built' if reader.c_skip_strings else 'NOT built (cold = pure Python)'}")
    print(
        f"{'file':32} {'baseline':>10} {'cold':>9} {'cold(py)':>9} {'cached':>9} {'base/cold':>10}"
        + (f" {'pypi gguf':>10}" if ref else "")
    )
    for path in files:
        base = median_ms(struct_seek_baseline, path, args.runs)
        cold = median_ms(ours_cold, path, args.runs)
        pure = median_ms(ours_cold_pure_python, path, args.runs)
        cached = median_ms(ours_cached, path, args.runs * 20)
        line = f"{path.name:32} {base:8.2f}ms {cold:7.2f}ms {pure:7.2f}ms {cached:7.3f}ms {base / cold:9.1f}x"
        if ref:
            r = reference_ms(ref, path, max(3, args.runs // 5))
            line += f" {r:8.1f}ms" if r is not None else "     failed"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
