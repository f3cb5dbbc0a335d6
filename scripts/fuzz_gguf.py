"""Fuzz real GGUF headers through read -> facts -> estimate -> plan -> argv; report hangs and foreign exceptions.

The mutator is ``tests.support.fuzz_gguf`` (structure-aware: counts, type tags, scalar
values, string and array lengths, array elements, tensor names, dimensions, types and
offsets, truncation, random bytes; one to three per case). The bases are the real Gemma
3 270M header and six zoo models of other layouts, copied sparse into a temporary
folder. The process caps its address space (``--memory-gib``), so a runaway allocation
is a ``MemoryError`` (a foreign exception) rather than a swapping machine.

It prints a line every ``--progress`` cases, then the results: how cases ended, the
cases over a second of CPU (hangs), the foreign exceptions with the first tracebacks,
the slowest case, and the peak memory; ``--json`` prints the summary as JSON instead.
A case is reproduced with ``--seed S --only N``. Exit status 1 when any case hung or
raised a foreign exception.

Usage: ``.venv/bin/python scripts/fuzz_gguf.py --cases 20000 [--seed 15] [--json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.platform import peak_rss_bytes
from tests.support.fuzz_gguf import HANG_S, Outcome, fuzz, make_base, run_case

#: Zoo models next to Gemma: hybrid with arrays, MLA + MoE, SWA + MoE, Mamba + attention, chunked attention,
#: DeepSeek-V4's compressed caches, pure SSM.
ZOO_BASES = (
    "qwen35-dense",
    "deepseek2-moe",
    "gpt-oss-moe",
    "jamba-dense",
    "llama4-moe",
    "deepseek4-moe",
    "mamba2-dense",
)


def summary(outcomes: Sequence[Outcome], seconds: float) -> dict:
    """The counts the report and ``--json`` print."""
    hangs = [o for o in outcomes if o.cpu_s > HANG_S or o.result == "CaseTimeout"]
    foreign = [o for o in outcomes if o.foreign]
    slowest = max(outcomes, key=lambda o: o.cpu_s)
    return {
        "cases": len(outcomes),
        "seconds": round(seconds, 1),
        "results": dict(collections.Counter(o.result for o in outcomes).most_common()),
        "hangs_over_1s": len(hangs),
        "foreign_exceptions": len(foreign),
        "foreign_by_type": dict(collections.Counter(o.result for o in foreign)),
        "slowest": {
            "index": slowest.index,
            "base": slowest.base,
            "cpu_s": round(slowest.cpu_s, 4),
            "wall_s": round(slowest.wall_s, 4),
            "result": slowest.result,
            "patches": slowest.patches,
        },
        "max_wall_s": round(max(o.wall_s for o in outcomes), 4),
        "peak_rss_mib": round(peak_rss_bytes() / 2**20, 1),
        "findings": [
            {
                "index": o.index,
                "base": o.base,
                "result": o.result,
                "cpu_s": round(o.cpu_s, 3),
                "patches": o.patches,
                "traceback": o.detail,
            }
            for o in (hangs + foreign)[:20]
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--only", type=int, default=None, metavar="N", help="run case N alone (and show it)")
    parser.add_argument("--memory-gib", type=float, default=4.0, help="address-space cap of this process")
    parser.add_argument("--progress", type=int, default=1000, help="a progress line every N cases (0: none)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    limit = int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    from launcher.build import ensure_built
    from launcher.capabilities import probe
    from studio.library.default_model import ensure_gemma
    from studio.settings import Settings
    from tests.support.zoo import ensure_zoo

    settings = Settings.from_env()
    build = ensure_built(settings.home)
    caps = probe(build.llama_server, cache_dir=settings.home / "cache")
    zoo = ensure_zoo(build, settings.home)
    sources = [ensure_gemma(settings.models_dir), *(zoo / f"{name}.gguf" for name in ZOO_BASES)]
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as tmp:
        folder = Path(tmp)
        (folder / "files").mkdir()
        bases = [make_base(src, folder) for src in sources]
        if args.only is not None:
            headers = [b.path.read_bytes()[: b.header_end] for b in bases]
            o = run_case(args.only, args.seed, bases, headers, caps, build.llama_server, folder / "files")
            print(f"case {o.index} ({o.base}): {'; '.join(o.patches)} -> {o.result} in {o.cpu_s:.3f} s CPU")
            print(o.detail, end="")
            return int(o.foreign or o.cpu_s > HANG_S)
        start = time.monotonic()

        def progress(o: Outcome) -> None:
            if args.progress and (o.index + 1) % args.progress == 0 and not args.json:
                print(f"  {o.index + 1} cases, {time.monotonic() - start:.0f} s", flush=True)

        outcomes = fuzz(
            bases, caps, build.llama_server, folder / "files", cases=args.cases, seed=args.seed, on_outcome=progress
        )
    report = summary(outcomes, time.monotonic() - start)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"cases: {report['cases']} (seed {args.seed}, bases: gemma-3-270m, {', '.join(ZOO_BASES)}) "
            f"in {report['seconds']} s"
        )
        print("ended: " + ", ".join(f"{k} {v}" for k, v in report["results"].items()))
        print(f"hangs over {HANG_S:.0f} s of CPU: {report['hangs_over_1s']}")
        print(f"foreign exceptions: {report['foreign_exceptions']} {report['foreign_by_type'] or ''}".rstrip())
        s = report["slowest"]
        print(
            f"slowest case: #{s['index']} ({s['base']}) {s['cpu_s'] * 1000:.1f} ms CPU, "
            f"{s['wall_s'] * 1000:.1f} ms wall -> {s['result']}: {'; '.join(s['patches'])}"
        )
        print(f"slowest wall time: {report['max_wall_s'] * 1000:.1f} ms; peak memory {report['peak_rss_mib']} MiB")
        for f in report["findings"]:
            print(
                f"\n#{f['index']} ({f['base']}) {f['result']} in {f['cpu_s']} s: {'; '.join(f['patches'])}\n"
                f"{f['traceback']}",
                end="",
            )
    return int(bool(report["hangs_over_1s"] or report["foreign_exceptions"]))


if __name__ == "__main__":
    raise SystemExit(main())
