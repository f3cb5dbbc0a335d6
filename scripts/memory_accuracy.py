"""How close ``launcher.memory.estimate`` comes to what llama-server really allocates.

For Gemma 3 270M and every zoo model, and a grid of server options, this starts
the pinned llama-server on the CPU (``-lv 4 --no-warmup -fit off``), stops it
once the compute buffer is reserved, parses the allocations
(``launcher.allocations``) and compares them with the estimate.

The grid (``CONFIGS``) runs in full for Gemma and for one model of each memory
layout (``LAYOUT_MODELS``); every other zoo model runs the first two configs
(default f16 cache, and q8_0 K+V with flash attention on), which keeps the whole
run to a few minutes on 2 cores. The last line reads::

    kv_exact=N/M kv_within_1pct=N/M compute_within_10pct=N/M total_within_2pct=N/M

after the ``process:`` line of the process-line check.

Before that table, the same comparison runs on the zoo widened 8x
(``tests.support.wide_zoo``: n_embd 2048, n_ff 6144, weights as holes), where compute buffers
are tens of MiB and set by tensor sizes as in real models, not by where ggml's
allocator happens to place a tiny model's tensors; it ends with a ``wide:`` line
of the same counts (``--no-wide`` skips it).

``kv`` covers the KV, recurrent-state and DeepSeek-V4 compressor-state buffers;
exact means every cache and state equal at the log's 0.01 MiB precision; total
is the bill's logged part (``MemoryBill.logged_total``: its buffers, not the process
line) against the buffers the log prints, within 2 % or 32 MiB, whichever is larger.

The process line (``launcher.memory.process_bytes``: the binary, its libraries and heap, on no line of
the log) is held against what it stands for, once per model (Gemma and each zoo model, first config):
the server's RSS after one prompt, less the buffers its log prints. The bill counts each buffer whole, but
a page of it joins the RSS only once written, and a prompt leaves parts of the compute buffer unwritten (a
MoE graph's peak, the reserve's other slots): so every buffer llama.cpp allocates (``ggml_aligned_malloc``)
is written in full as it is allocated (``RESIDENT_SHIM``, preloaded), and the RSS less the logged buffers
is then exactly what the log does not print. It ends with a ``process:`` line, the target being within 10 %.

Before both, three zoo MoE models rewritten at real MoE proportions (``REAL_MOE_SHAPES``: Qwen3-30B-A3B's
128 experts with 8 routed, OLMoE's 64 with 8, GPT-OSS-20B's 32 with 4) run the whole grid, ending with a
``moe:`` line: fine-grained experts set the peak with their down projections, which the widened zoo (2 experts)
never shows.

The same models with their experts split between a device and the CPU (``--n-cpu-moe``) are checked by
``scripts/moe_split.py``, over an RPC worker standing in for the GPU.

``--every`` runs every zoo model over the whole grid instead (the issue's acceptance line is the default run's);
``--widen FxG`` widens the zoo to other proportions (4x9: n_embd 1024, n_ff 3456; 8x2: FFNs narrower than
n_embd, like fine-grained MoE experts) to check the estimate on shapes its weights were not fitted on.

Usage: ``.venv/bin/python scripts/memory_accuracy.py [--quick] [--every] [--no-wide | --widen 8x16] [--no-process]
[--process-only] [--jobs 2] [--models deepseek4-moe,...]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf
from launcher.allocations import parse_allocations
from launcher.memory import MemoryBill, MemoryOptions, MemoryPlanError, estimate, for_file
from launcher.units import MIB
from tests.support.dry_run import LISTENING, load_report
from tests.support.wide_zoo import ensure_moe_zoo, ensure_wide_zoo

SERVER_TIMEOUT_S = 60
#: The default model: its BPE merges are the process line's third term, which neither Gemma nor the zoo has.
SMOLLM = "smollm2-135m"
#: The process line is measured after a prompt that fills the context but for these tokens: every KV cell
#: and the whole compute buffer are touched then, so the RSS holds each logged buffer whole.
PROCESS_PROMPT_SPARE = 8
#: How much wider than the zoo the realistic-width section's models are: n_embd 2048 and, to give the
#: FFN-to-embedding ratio of Llama-like models (3.0; the zoo's is 1.5), n_ff 6144.
WIDE, WIDE_FFN = 8, 16
#: Preloaded into the process check's llama-server: ggml's CPU buffers (``ggml_aligned_malloc``, the only caller
#: of ``posix_memalign`` with a 64-byte alignment) are written in full when allocated, so each logged buffer is
#: resident whole, as the bill counts it, whatever pages a prompt happens to write.
RESIDENT_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>
int posix_memalign(void **out, size_t alignment, size_t size) {
    static int (*real)(void **, size_t, size_t);
    if (!real) real = (int (*)(void **, size_t, size_t)) dlsym(RTLD_NEXT, "posix_memalign");
    int status = real(out, alignment, size);
    if (status == 0 && alignment == 64) memset(*out, 0, size);
    return status;
}
"""
#: The line after which every allocation has been printed.
DONE_MARKERS = ("sched_reserve: reserve took", LISTENING)


@dataclass(frozen=True)
class Config:
    """One llama-server setting of the grid, and the flags that ask for it."""

    name: str
    options: MemoryOptions

    def argv(self) -> list[str]:
        o = self.options
        out = [
            "-c",
            str(o.n_ctx),
            "-b",
            str(o.n_batch),
            "-ub",
            str(o.n_ubatch),
            "-fa",
            o.flash_attn,
            "-ctk",
            o.cache_type_k,
            "-ctv",
            o.cache_type_v,
        ]
        if o.n_parallel >= 0:
            out += ["-np", str(o.n_parallel)]
        if o.kv_unified:
            out.append("--kv-unified")
        if o.swa_full:
            out.append("--swa-full")
        if o.n_gpu_layers:  # the estimator's -1 is every layer; llama-server's -1 is "auto"
            out += ["-ngl", "all" if o.n_gpu_layers < 0 else str(o.n_gpu_layers)]
        if o.n_cpu_moe:
            out += ["--n-cpu-moe", str(o.n_cpu_moe)]
        if o.spec == "mtp":
            out += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(o.spec_n_max)]
        elif o.spec_n_max:
            out += ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", str(o.spec_n_max)]
        return out


CONFIGS: tuple[Config, ...] = (
    Config("c1000-auto", MemoryOptions(n_ctx=1000)),
    Config("c2048-q8-fa", MemoryOptions(n_ctx=2048, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")),
    Config("c3000-np2-split", MemoryOptions(n_ctx=3000, n_parallel=2, kv_unified=False)),
    Config("c4096-np3-unified-swafull", MemoryOptions(n_ctx=4096, n_parallel=3, kv_unified=True, swa_full=True)),
    Config("c700-np1-nofa", MemoryOptions(n_ctx=700, n_parallel=1, flash_attn="off")),
    Config("c5000-np4-split-ub256", MemoryOptions(n_ctx=5000, n_parallel=4, kv_unified=False, n_ubatch=256)),
    # What the studio runs by default: the native context in one slot (32k for Gemma).
    Config("c32768-np1", MemoryOptions(n_ctx=32768, n_parallel=1)),
    # Speculative decoding: verifying a draft needs a logits row per drafted token (64 is --spec-default's).
    Config("c1000-auto-spec64", MemoryOptions(n_ctx=1000, spec_n_max=64)),
    Config("c4096-np2-split-spec16", MemoryOptions(n_ctx=4096, n_parallel=2, kv_unified=False, spec_n_max=16)),
)
QUICK_CONFIGS = 2
#: One model per memory layout runs the whole grid (plain GQA, MQA, per-layer heads, SWA, MLA, sparse
#: indexers, DeepSeek-V4, hybrid, recurrent, MoE).
LAYOUT_MODELS = (
    "llama-dense",
    "gemma3-dense",
    "deepseek2-moe",
    "jamba-dense",
    "qwen35-dense",
    "granitehybrid-dense",
    "mamba-dense",
    "mamba2-dense",
    "qwen3moe-moe",
    "gpt-oss-moe",
    "qwen3-dense",
    "lfm2-dense",
    "deepseek32-moe",
    "deepseek4-moe",
)


@dataclass(frozen=True)
class Outcome:
    """One (model, config) comparison."""

    model: str
    config: str
    predicted: MemoryBill | None
    actual: MemoryBill | None
    error: str = ""
    rejected_alike: bool = False  # both the estimator and llama-server refused the options, for the same reason

    def _kv(self, bill: MemoryBill) -> int:
        return bill.sum_of("kv") + bill.sum_of("recurrent")

    @property
    def kv_exact(self) -> bool:
        if not self.ok:
            return False
        p, a = self.predicted, self.actual
        caches = [(c.label, c.cells, c.streams, c.layers, _mib(c.k_bytes), _mib(c.v_bytes)) for c in p.caches]
        states = [(r.rows, r.layers, _mib(r.r_bytes), _mib(r.s_bytes)) for r in p.recurrent]
        comp = [(s.name, s.rows, s.width, s.streams, s.rs_seq, s.layers, _mib(s.nbytes)) for s in p.states]
        return (
            caches == [(c.label, c.cells, c.streams, c.layers, _mib(c.k_bytes), _mib(c.v_bytes)) for c in a.caches]
            and states == [(r.rows, r.layers, _mib(r.r_bytes), _mib(r.s_bytes)) for r in a.recurrent]
            and comp == [(s.name, s.rows, s.width, s.streams, s.rs_seq, s.layers, _mib(s.nbytes)) for s in a.states]
        )

    @property
    def kv_within_1pct(self) -> bool:
        if not self.ok:
            return False
        # the actual side sums figures the log rounds to 0.01 MiB (K and V per cache, r/s/p per state, each
        # compressor state): a few-MiB bill can be off by their half-units together, which kv_exact already allows
        a = self.actual
        figures = 2 * len(a.caches) + 3 * len(a.recurrent) + len(a.states)
        return _close(self._kv(self.predicted), self._kv(a), 0.01, max(figures, 1) * 0.0051 * MIB)

    @property
    def compute_within_10pct(self) -> bool:
        return self.ok and _close(self.predicted.sum_of("compute"), self.actual.sum_of("compute"), 0.10, 0.0051 * MIB)

    @property
    def total_within_2pct(self) -> bool:
        # the log prints buffers only: the process line is held against the RSS (``ProcessOutcome``)
        return self.ok and _close(self.predicted.logged_total, self.actual.total, 0.02, 32 * MIB)

    @property
    def ok(self) -> bool:
        return self.predicted is not None and self.actual is not None


@dataclass(frozen=True)
class ProcessOutcome:
    """One model's process line: predicted, and measured as RSS after a prompt less the logged buffers."""

    model: str
    predicted: int
    measured: int | None  # None: the server or the request failed (``error``)
    rss: int = 0
    logged: int = 0
    error: str = ""

    @property
    def within_10pct(self) -> bool:
        return self.measured is not None and _close(self.predicted, self.measured, 0.10, 0)


def build_resident_shim(folder: Path) -> Path:
    """Compile ``RESIDENT_SHIM`` into ``folder`` with the C compiler that builds llama.cpp."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("the process check needs a C compiler (cc) for its preloaded shim; --no-process skips it")
    source, shim = folder / "resident_buffers.c", folder / "resident_buffers.so"
    source.write_text(RESIDENT_SHIM)
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True)
    return shim


def measure_process(binary: Path, name: str, path: Path, config: Config, shim: Path) -> ProcessOutcome:
    """Start llama-server on ``path`` with every buffer resident (``shim``), send one prompt, and read its RSS
    beyond the buffers its log printed.

    The prompt cache and the context checkpoints are off (``-cram 0 -ctxcp 0``): both grow with prompts, not at
    start (the prompt cache has its own line; a hybrid or SWA model's checkpoints none yet).
    """
    import os

    import httpx
    import psutil

    model = gguf.read(path)
    predicted = estimate(model.facts, for_file(model, config.options)).sum_of("process")
    rss: list[int] = []
    n_prompt = min(config.options.n_ctx, model.facts.context_length or config.options.n_ctx) - PROCESS_PROMPT_SPARE
    tokens = [(7 * i + 3) % model.facts.vocab_size for i in range(n_prompt)]

    def prompt_then_rss(pid: int, port: int) -> None:
        body = {"prompt": tokens, "n_predict": 1, "cache_prompt": False}
        httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=SERVER_TIMEOUT_S).raise_for_status()
        rss.append(psutil.Process(pid).memory_info().rss)

    try:
        log, _ = load_report(
            binary,
            path,
            [*config.argv(), "-cram", "0", "-ctxcp", "0"],
            timeout=SERVER_TIMEOUT_S,
            then=prompt_then_rss,
            env={**os.environ, "LD_PRELOAD": str(shim)},
        )
        logged = parse_allocations(log).total
    except (httpx.HTTPError, psutil.Error, ValueError) as exc:
        return ProcessOutcome(name, predicted, None, error=f"{type(exc).__name__}: {exc}")
    if not rss:
        return ProcessOutcome(name, predicted, None, error=f"no prompt answered: {log.strip()[-200:]!r}")
    return ProcessOutcome(name, predicted, rss[0] - logged, rss[0], logged)


def _mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def _close(predicted: int, actual: int, rel: float, floor: float) -> bool:
    return abs(predicted - actual) <= max(rel * abs(actual), floor)


def compare(binary: Path, name: str, path: Path, config: Config) -> Outcome:
    model = gguf.read(path)
    log, _ = load_report(binary, path, config.argv(), until=DONE_MARKERS, timeout=SERVER_TIMEOUT_S)
    refused = next((line.split(": ", 1)[-1] for line in log.splitlines() if " E llama_init_from_model:" in line), "")
    try:
        predicted = estimate(model.facts, for_file(model, config.options))
    except MemoryPlanError as exc:
        return Outcome(name, config.name, None, None, f"refused: {exc}", rejected_alike=str(exc) == refused)
    if refused:
        return Outcome(name, config.name, predicted, None, f"llama-server refused: {refused}")
    try:
        actual = parse_allocations(log)
    except ValueError as exc:
        return Outcome(name, config.name, predicted, None, f"server: {exc}: {log[-300:]!r}")
    if not actual.sum_of("compute"):
        return Outcome(
            name,
            config.name,
            predicted,
            None,
            f"llama-server stopped before reserving its compute buffer: {log.strip().splitlines()[-1][:200]!r}",
        )
    return Outcome(name, config.name, predicted, actual)


def plan(
    zoo: Path, gemma: Path, quick: bool, models: Sequence[str] = (), every: bool = False, smollm: Path | None = None
) -> list[tuple[str, Path, Config]]:
    """The (model, file, config) runs; ``models`` names the only ones to run, each over the whole grid; ``every``
    runs every zoo model over the whole grid."""
    if models:
        paths = {
            "gemma-3-270m": gemma,
            **({SMOLLM: smollm} if smollm else {}),
            **{p.stem: p for p in zoo.glob("*.gguf")},
        }
        unknown = [m for m in models if m not in paths]
        if unknown:
            raise SystemExit(f"unknown model(s): {', '.join(unknown)}")
        return [(m, paths[m], c) for m in models for c in (CONFIGS[:QUICK_CONFIGS] if quick else CONFIGS)]
    runs = [("gemma-3-270m", gemma, c) for c in CONFIGS]
    for path in sorted(zoo.glob("*.gguf")):
        full = (every or path.stem in LAYOUT_MODELS) and not quick
        runs += [(path.stem, path, c) for c in (CONFIGS if full else CONFIGS[:QUICK_CONFIGS])]
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    from launcher.build import ensure_built
    from studio.library.default_model import ensure_default_model, ensure_gemma
    from studio.settings import Settings
    from tests.support.zoo import ensure_zoo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first two configs for every model")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated zoo names (or gemma-3-270m) to run over the whole grid, e.g. deepseek4-moe",
    )
    parser.add_argument(
        "--no-wide",
        action="store_true",
        help="skip the widened zoo and the real-proportion MoE models (tests.support.wide_zoo)",
    )
    parser.add_argument(
        "--no-process",
        action="store_true",
        help="skip the process line's check (one llama-server and one prompt per model)",
    )
    parser.add_argument(
        "--process-only",
        action="store_true",
        help="only the process line's check (no grid, no widened or MoE models)",
    )
    parser.add_argument(
        "--widen",
        default=f"{WIDE}x{WIDE_FFN}",
        metavar="FxG",
        help="widen the zoo F times (n_embd) and its FFNs G times, e.g. 4x9 or 8x2 to check "
        "proportions the weights were not fitted on (default %(default)s)",
    )
    parser.add_argument(
        "--every",
        action="store_true",
        help="every zoo model over the whole grid (about 1150 "
        "runs, a minute more), not only one model per memory layout",
    )
    args = parser.parse_args(argv)
    try:
        factor, ffn_factor = (int(x) for x in args.widen.split("x"))
    except ValueError:
        parser.error(f"--widen takes two factors like 8x16, not {args.widen!r}")
    settings = Settings.from_env()
    build = ensure_built(settings.home)
    zoo, gemma = ensure_zoo(build, settings.home), ensure_gemma(settings.models_dir)
    smollm = ensure_default_model(settings.models_dir)
    models = [m for m in args.models.split(",") if m]
    runs = plan(zoo, gemma, args.quick, models, args.every, smollm)
    process_runs = list({name: (name, path, CONFIGS[0]) for name, path, _ in runs}.values())
    if not models:  # the grid leaves SmolLM2 out (the zoo covers its layout); its vocabulary is the process line's
        process_runs.insert(1, (SMOLLM, smollm, CONFIGS[0]))
    if args.process_only:
        runs, args.no_wide = [], True
    wide_runs = (
        []
        if args.no_wide or models
        else [
            (p.stem, p, c)
            for p in ensure_wide_zoo(
                zoo,
                build.llama_server,
                zoo.with_name(f"{zoo.name}-wide{factor}x{ffn_factor}"),
                factor=factor,
                ffn_factor=ffn_factor,
            )
            for c in (
                CONFIGS if p.stem.removesuffix("-wide") in LAYOUT_MODELS and not args.quick else CONFIGS[:QUICK_CONFIGS]
            )
        ]
    )
    moe_runs = (
        []
        if args.no_wide or models
        else [
            (p.stem, p, c)
            for p in ensure_moe_zoo(zoo, build.llama_server, zoo.with_name(f"{zoo.name}-moe"))
            for c in (CONFIGS[:QUICK_CONFIGS] if args.quick else CONFIGS)
        ]
    )
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(pool.map(lambda r: compare(build.llama_server, *r), runs))
        wide = list(pool.map(lambda r: compare(build.llama_server, *r), wide_runs))
        moe = list(pool.map(lambda r: compare(build.llama_server, *r), moe_runs))
    # one at a time: a neighbour's prompt would not change the RSS, but it would slow this one past its timeout
    with tempfile.TemporaryDirectory() as folder:
        shim = build_resident_shim(Path(folder)) if process_runs and not args.no_process else Path()
        processes = [measure_process(build.llama_server, *r, shim) for r in ([] if args.no_process else process_runs)]

    if moe:
        print(f"zoo MoE models at real MoE proportions (tests.support.wide_zoo.REAL_MOE_SHAPES), {len(moe)} runs:")
        _table(moe)
        print(f"moe: {_summary(moe)}")
        print()
    if wide:
        print(
            f"zoo widened (n_embd {256 * factor}, n_ff {384 * ffn_factor}: compute buffers of realistic size), "
            f"{len(wide)} runs:"
        )
        _table(wide)
        print(f"wide: {_summary(wide)}")
        print()
    if outcomes:
        _grid_report(outcomes)
    if processes:
        print()
        _process_table(processes)
        print(_process_summary(processes))
    return 0


def _grid_report(outcomes: Sequence[Outcome]) -> None:
    """The grid's table, the refusals both sides agree on, and the counts line."""
    _table(outcomes)
    m = len([o for o in outcomes if not o.error.startswith("refused")])
    print(
        f"refusals matching llama-server: {sum(o.rejected_alike for o in outcomes)}/{len(outcomes) - m} "
        "(left out of the counts below)"
    )
    print(_summary(outcomes))


def _process_table(processes: Sequence[ProcessOutcome]) -> None:
    print(
        "process line: RSS after a prompt that fills the context, less the logged buffers, each made resident "
        f"({CONFIGS[0].name})"
    )
    print(f"{'model':28} {'predicted':>10} {'measured':>10} {'RSS':>10} {'logged':>10}  flag")
    for p in processes:
        if p.measured is None:
            print(f"{p.model:28} {_mib(p.predicted):>10} ERROR {p.error}")
            continue
        print(
            f"{p.model:28} {_mib(p.predicted):>10} {_mib(p.measured):>10} {_mib(p.rss):>10} {_mib(p.logged):>10}  "
            + ("P" if p.within_10pct else "-")
        )


def _process_summary(processes: Sequence[ProcessOutcome]) -> str:
    """The process line's own figure: predicted within 10 % of the measured RSS beyond the logged buffers, over the
    models that answered a prompt (the diffusion models' servers answer no completion)."""
    measured = [p for p in processes if p.measured is not None]
    left_out = len(processes) - len(measured)
    return f"process: within_10pct={sum(p.within_10pct for p in measured)}/{len(measured)}" + (
        f" ({left_out} answered no prompt, left out)" if left_out else ""
    )


def _table(outcomes: Sequence[Outcome]) -> None:
    print(f"{'model':28} {'config':26} {'kv MiB pred/act':>22} {'compute pred/act':>20} {'logged pred/act':>20}  flags")
    rejected = [o for o in outcomes if o.error.startswith("refused")]
    outcomes = [o for o in outcomes if not o.error.startswith("refused")]
    for o in rejected:
        print(
            f"{o.model:28} {o.config:26} {'same refusal as llama-server' if o.rejected_alike else 'MISMATCH'}: "
            f"{o.error}"
        )
    for o in outcomes:
        if not o.ok:
            print(f"{o.model:28} {o.config:26} ERROR {o.error}")
            continue
        p, a = o.predicted, o.actual
        flags = "".join(
            (
                "K" if o.kv_exact else ("k" if o.kv_within_1pct else "-"),
                "C" if o.compute_within_10pct else "-",
                "T" if o.total_within_2pct else "-",
            )
        )
        note = "; ".join(p.reasons) if p.approximate else ""
        print(
            f"{o.model:28} {o.config:26} "
            f"{_mib(o._kv(p)):>10}/{_mib(o._kv(a)):<10} "
            f"{_mib(p.sum_of('compute')):>9}/{_mib(a.sum_of('compute')):<9} "
            f"{_mib(p.logged_total):>9}/{_mib(a.total):<9}  {flags} {note}"
        )


def _summary(outcomes: Sequence[Outcome]) -> str:
    """The counts line over every run but the refusals both sides agree on."""
    counted = [o for o in outcomes if not o.error.startswith("refused")]
    m = len(counted)
    count = lambda attr: sum(getattr(o, attr) for o in counted)  # noqa: E731
    return (
        f"kv_exact={count('kv_exact')}/{m} kv_within_1pct={count('kv_within_1pct')}/{m} "
        f"compute_within_10pct={count('compute_within_10pct')}/{m} total_within_2pct={count('total_within_2pct')}/{m}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
