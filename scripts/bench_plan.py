"""How long a launch plan takes, per model set: the zoo, the widened zoo, the real-proportion MoE zoo, the deep zoo.

Every plan asks the memory estimator for a bill per candidate (a context, a layer
split, a set of GPUs), so a plan costs (estimate calls) x (one estimate, linear in
the blocks). This times ``launcher.planner.plan`` for every model of each set on
four machines (CPU only; one GPU; two GPUs too small for any model, so the layers
are split; eight GPUs of 1-8 GiB, so each set of GPUs is searched) and two requests
(an automatic context; 4096 tokens in 2 slots with a q8_0 cache), best of
``--repeat`` runs each, and counts the estimate calls.

The sets: Gemma 3 270M and every zoo model (2-6 blocks); the widened zoo
(``tests.support.wide_zoo``, n_embd 2048) and the real-proportion MoE zoo, when
generated (``scripts/memory_accuracy.py`` or ``scripts/predictions.py`` make them);
and the zoo deepened to ``--deep`` blocks (``tests.support.deep_zoo``; 512, llama.cpp's
limit, by default), written to a temporary folder.

Per set it prints the plans' median, p90 and max milliseconds (of this process's CPU time, so other programs
on a busy machine do not inflate them), the most estimate
calls one plan made, and the median time to read a header and derive its facts
(done once per file, then cached); then the slowest plan.

Usage: ``.venv/bin/python scripts/bench_plan.py [--repeat 3] [--deep 512] [--sets zoo,wide,moe,deep]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf
from launcher import planner
from launcher.capabilities import Capabilities, probe
from launcher.errors import LauncherError
from launcher.planner import ModelInfo
from tests.support.machines import CPU_ONLY, EIGHT_GPUS, ONE_GPU, REQUESTS, TWO_SMALL_GPUS

MACHINES = {"cpu-only": CPU_ONLY, "one-gpu": ONE_GPU, "two-small-gpus": TWO_SMALL_GPUS, "eight-gpus": EIGHT_GPUS}


def model_sets(names: Sequence[str], deep: int, tmp: Path) -> Iterator[tuple[str, list[Path]]]:
    """(set name, files) for each set asked for that exists here."""
    from launcher.build import ensure_built
    from studio.library.default_model import ensure_gemma
    from studio.settings import Settings
    from tests.support.deep_zoo import deepen_model
    from tests.support.zoo import ensure_zoo

    settings = Settings.from_env()
    zoo = ensure_zoo(ensure_built(settings.home), settings.home)
    zoo_models = sorted(zoo.glob("*.gguf"))
    if "zoo" in names:
        yield "zoo", [ensure_gemma(settings.models_dir), *zoo_models]
    for name, folder in (("wide", zoo.with_name(f"{zoo.name}-wide8x16")), ("moe", zoo.with_name(f"{zoo.name}-moe"))):
        if name in names:
            found = sorted(folder.glob("*.gguf"))
            if found:
                yield name, found
            else:
                print(f"({name}: {folder} is not generated; scripts/predictions.py generates it)")
    if "deep" in names:
        yield f"deep{deep}", [p for src in zoo_models if (p := deepen_model(src, tmp / src.name, deep)) is not None]


def timed(run: Callable[[], Any], repeat: int) -> float:
    """The least CPU time of ``repeat`` runs, in seconds (CPU time: other programs on a busy machine do not count)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def bench(paths: Sequence[Path], caps: Capabilities, repeat: int) -> tuple[list[tuple[float, int, str]], list[float]]:
    """((seconds, estimate calls, what) per plan, seconds per header read and facts)."""
    calls = [0]
    real_estimate = planner.estimate

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real_estimate(*args, **kwargs)

    plans, reads = [], []
    planner.estimate = counted  # the planner's one way to the estimator
    try:
        for path in paths:
            reads.append(timed(lambda: gguf.read(path, cache=False).facts, repeat))
            info = ModelInfo.from_gguf(gguf.read(path))
            for machine, inventory in MACHINES.items():
                for label, request in REQUESTS:

                    def run() -> None:
                        try:
                            planner.plan(info, inventory, caps, request)
                        except LauncherError:  # options llama-server refuses for this model: still a plan's work
                            pass

                    calls[0] = 0
                    run()
                    n_calls = calls[0]
                    what = f"{path.stem} on {machine}, {label}"
                    plans.append((timed(run, repeat), n_calls, what))
    finally:
        planner.estimate = real_estimate
    return plans, reads


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per plan; the best counts (default 3)")
    parser.add_argument("--deep", type=int, default=512, help="blocks of the deep zoo (default 512)")
    parser.add_argument("--sets", default="zoo,wide,moe,deep", help="comma-separated model sets")
    args = parser.parse_args(argv)
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    from launcher.build import ensure_built
    from studio.settings import Settings

    settings = Settings.from_env()
    caps = probe(ensure_built(settings.home).llama_server, cache_dir=settings.home / "cache")
    slowest: tuple[float, int, str] = (0.0, 0, "")
    print(
        f"{'set':10} {'models':>6} {'plans':>6} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'max estimates':>14} "
        f"{'read+facts ms (median)':>23}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, paths in model_sets(args.sets.split(","), args.deep, Path(tmp)):
            plans, reads = bench(paths, caps, args.repeat)
            ms = sorted(1000 * s for s, _, _ in plans)
            p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
            print(
                f"{name:10} {len(paths):6} {len(plans):6} {statistics.median(ms):10.2f} {p90:8.2f} {ms[-1]:8.2f} "
                f"{max(n for _, n, _ in plans):14} {1000 * statistics.median(reads):23.2f}",
                flush=True,
            )
            slowest = max(slowest, max(plans))
    print(f"slowest plan: {slowest[2]}: {1000 * slowest[0]:.2f} ms, {slowest[1]} estimates")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
