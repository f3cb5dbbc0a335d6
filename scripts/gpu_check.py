"""GPU truth: the memory estimator and the planner measured on a real CUDA device, in one prepared command.

Three modes:

``--bundle DIR`` (here, with the studio's venv) fills DIR with what the device
machine cannot fetch (``tests.support.gpu_bundle``: the trimmed pinned sources,
the models' headers, the run path's wheels) and checks that DIR plus the
working tree fit the 64 MiB the device tool carries.

``--bundle-dir DIR --out OUT`` (on the GPU machine) restores the bundle, builds
the pinned llama-server for CUDA (``tests.support.cuda_build``: the device's
architecture only, ``llama-server`` only, every core), plans Gemma on the real
inventory (``launcher.devices.discover`` + ``launcher.planner.plan``), runs that
plan and reads what the GPU really holds (``nvidia-smi``), then runs the
memory-accuracy comparison (``scripts/memory_accuracy.compare``: the estimate
against the ``-lv 4`` allocation lines) on the subset (``ZOO``, ``WIDE``, ``MOE``,
Gemma) with every layer on the GPU and with half of them. Between the two, the
slot default (``slots_check``) and the MoE expert split as planned
(``moe_plan_check``; the grid also runs each MoE model with the experts of one
and of every block on the CPU). The slot default: the planned model runs as planned (4 slots on a
unified KV cache on a GPU), with one slot (the studio's old default), and as
llama-server's own defaults (``-np -1``), each at 1, 4 and 8 streaming clients
(``scripts/bench_concurrency.measure``: aggregate tokens/s, p50/p90 time to
first token). ``gpu_check.json`` and
``gpu_check.md`` (one row per case and device: predicted/actual weights, KV,
compute, total; KV exact, compute within 10 %, total within 2 % or 32 MiB) are
rewritten into OUT after each phase, and the build's log goes there too.

``--dry-run`` does all of that but the build with the CPU llama-server built
here (``--llama-server``), every layer on the CPU, and whatever ``nvidia-smi``
is on PATH (the tests put ``tests/fixtures/gpu-tools`` first).

The run path imports only the standard library and this repository until the
bundle's wheels are active, so a bare ``python3`` runs it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.build import BuildError, layout_for, load_pin, recipe_args
from tests.support import gpu_bundle

MIB = 1024 * 1024
#: The GPU machine's limit for one command is 10 minutes: what could not end by this many seconds after the
#: start is left out, so the report is always written. The device tool's timeout should be a little above it.
DEFAULT_DEADLINE_S = 570
#: The planner's run: a start with warm-up, one prompt, a stop.
PLANNER_TIMEOUT_S = 90
#: What one layout each (dense GQA, sliding window, MoE, MLA, two hybrids, recurrent) runs as: the tiny zoo
#: (exact KV and state figures), the zoo widened 8x16 (compute buffers of realistic size; no MLA model widens:
#: llama-server refuses every widened deepseek2), Qwen3-30B-A3B's expert proportions, and Gemma 3 270M itself.
ZOO = (
    "llama-dense",
    "gemma3-dense",
    "qwen3moe-moe",
    "deepseek2-moe",
    "granitehybrid-dense",
    "qwen35-dense",
    "mamba2-dense",
)
WIDE = ("llama-dense", "gemma3-dense", "granitehybrid-dense")
WIDE_FACTORS = (8, 16)
MOE = ("qwen3moe-moe",)
GEMMA = "gemma-3-270m"
#: The configs every model runs (memory_accuracy.CONFIGS' first two) and Gemma's extra one (the studio's default).
GEMMA_EXTRA_CONFIG = "c32768-np1"
#: A plan's run: the prompt that makes the CUDA backend take its working memory (cuBLAS, the pool).
PROMPT_TOKENS = 300
#: The slot default's check: clients at once, counted rounds each, tokens an answer (a dry run's CPU: fewer).
SLOT_CLIENTS, SLOT_ROUNDS, SLOT_TOKENS = (1, 4, 8), 2, 32
DRY_SLOT_CLIENTS, DRY_SLOT_ROUNDS, DRY_SLOT_TOKENS = (1, 4), 1, 8
#: What the slot default's check may take: three servers started, warmed up and streamed to.
SLOTS_TIMEOUT_S = 150


def say(msg: str) -> None:
    """Progress on stdout with the time since the start (the device tool returns the output's tail)."""
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


_T0 = time.monotonic()


# -- the subset ---------------------------------------------------------------------------------------------------
def subset_names() -> list[str]:
    """Every model name the bundle carries, in the order the cases run: those with real-sized compute buffers
    first, so that a run short of time still measures them."""
    from tests.support.wide_zoo import REAL_MOE_SHAPES

    moe = [f"{n}-{e}x{u}" for n, _, _, e, u in REAL_MOE_SHAPES if n in MOE]
    return [GEMMA, *(f"{n}-wide" for n in WIDE), *moe, *ZOO]


def gather_models(names: Sequence[str], scratch: Path) -> list[tuple[str, Path]]:
    """The subset's files here: Gemma, the zoo, and the widened / MoE models written (as holes) into ``scratch``."""
    from launcher.build import ensure_built
    from studio.library.default_model import ensure_gemma
    from studio.settings import Settings
    from tests.support.wide_zoo import REAL_MOE_SHAPES, widen_model, with_experts
    from tests.support.zoo import ensure_zoo

    settings = Settings.from_env()
    build = ensure_built(settings.home)
    zoo = ensure_zoo(build, settings.home)
    out = []
    for name in names:
        if name == GEMMA:
            path = ensure_gemma(settings.models_dir)
        elif name.endswith("-wide"):
            path = widen_model(
                zoo / f"{name.removesuffix('-wide')}.gguf",
                scratch / f"{name}.gguf",
                build.llama_server,
                factor=WIDE_FACTORS[0],
                ffn_factor=WIDE_FACTORS[1],
            )
        elif (shape := next((s for s in REAL_MOE_SHAPES if name == f"{s[0]}-{s[3]}x{s[4]}"), None)) is not None:
            base, factor, ffn, n_expert, n_used = shape
            narrow = widen_model(
                zoo / f"{base}.gguf", scratch / f"{base}-narrow.gguf", build.llama_server, factor=factor, ffn_factor=ffn
            )
            path = None if narrow is None else with_experts(narrow, scratch / f"{name}.gguf", n_expert, n_used)
        else:
            path = zoo / f"{name}.gguf"
        if path is None or not path.is_file():
            raise SystemExit(f"cannot make the subset's model {name} here")
        out.append((name, path))
    return out


@dataclass(frozen=True)
class Case:
    """One comparison: a model, a memory_accuracy config, and how many layers go to the GPU."""

    model: str
    config: str
    offload: str  # "all", "partial" (half the blocks), "none" (the dry run's CPU), or "experts-N" (below)
    n_gpu_layers: int  # the estimator's: -1 every layer, else the count
    n_cpu_moe: int = 0  # "experts-N": every layer offloaded but the routed experts of the first N (--n-cpu-moe)


def cases(models: dict[str, Path], offloads: Sequence[str]) -> list[Case]:
    """The grid: the first two configs for every model, plus the studio default for Gemma, each per offload; a MoE
    model with every layer offloaded also runs with the experts of one block, and of every block, on the CPU."""
    from memory_accuracy import CONFIGS, QUICK_CONFIGS

    import gguf

    out = []
    for name, path in models.items():
        configs = [c.name for c in CONFIGS[:QUICK_CONFIGS]] + ([GEMMA_EXTRA_CONFIG] if name == GEMMA else [])
        facts = gguf.read(path).facts
        blocks, experts = facts.block_count, facts.expert_weight_bytes
        for config in configs:
            for offload in offloads:
                ngl = {"all": -1, "partial": max(blocks // 2, 1), "none": 0}[offload]
                out.append(Case(name, config, offload, ngl))
            if "all" in offloads and any(experts):
                out += [Case(name, config, f"experts-{n}", -1, n) for n in sorted({1, blocks})]
    return out


# -- one comparison -----------------------------------------------------------------------------------------------
def _part(bill: Any, startup: bool) -> dict[str, float]:
    """A device bill in MiB: weights, KV (caches and recurrent state), compute, output, total."""
    total = bill.total - (bill.output_growth + bill.compute_growth if startup else 0)
    return {
        k: round(v / MIB, 2)
        for k, v in (
            ("weights", bill.weights),
            ("kv", bill.kv + bill.recurrent),
            ("compute", bill.compute),
            ("output", bill.output),
            ("total", total),
        )
    }


def run_case(binary: Path, path: Path, case: Case) -> dict[str, Any]:
    """Compare the estimate with llama-server's allocations for ``case``; the report's row."""
    from memory_accuracy import CONFIGS, Config, compare

    base = next(c for c in CONFIGS if c.name == case.config)
    config = Config(base.name, replace(base.options, n_gpu_layers=case.n_gpu_layers, n_cpu_moe=case.n_cpu_moe))
    started = time.monotonic()
    outcome = compare(binary, case.model, path, config)
    return case_row(case, config.argv(), time.monotonic() - started, outcome)


def case_row(case: Case, argv: Sequence[str], seconds: float, o: Any) -> dict[str, Any]:
    """One case's report row from its ``memory_accuracy.Outcome``: the flags, and each device predicted vs actual."""
    from memory_accuracy import _close

    row: dict[str, Any] = {
        **asdict(case),
        "argv": list(argv),
        "seconds": round(seconds, 1),
        "error": o.error,
        "rejected_alike": o.rejected_alike,
    }
    if not o.ok:
        return row
    row["flags"] = {
        "kv_exact": o.kv_exact,
        "kv_within_1pct": o.kv_within_1pct,
        "compute_within_10pct": o.compute_within_10pct,
        "total_within_2pct": o.total_within_2pct,
    }
    devices = {}
    for name in sorted({d.device for d in (*o.predicted.devices, *o.actual.devices)}):
        p, a = o.predicted.device(name), o.actual.device(name)
        p_total = p.total - p.output_growth - p.compute_growth
        devices[name] = {
            "predicted": _part(p, True),
            "actual": _part(a, False),
            "compute_ok": _close(p.compute, a.compute, 0.10, 0.0051 * MIB),
            "total_ok": _close(p_total, a.total, 0.02, 32 * MIB),
        }
    row["devices"] = devices
    row["reasons"] = list(o.predicted.reasons)
    return row


def run_cases(
    binary: Path, models: dict[str, Path], grid: Sequence[Case], jobs: int, deadline: float
) -> list[dict[str, Any]]:
    """Every case, ``jobs`` at a time; cases not started before ``deadline`` (monotonic) are marked skipped."""
    finished = itertools.count(1)

    def one(case: Case) -> dict[str, Any]:
        if time.monotonic() > deadline:
            return {**asdict(case), "error": "skipped: out of time"}
        row = run_case(binary, models[case.model], case)
        if (n := next(finished)) % 10 == 0 or n == len(grid):
            say(f"cases: {n}/{len(grid)}")
        return row

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, grid))


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts over the compared cases (refusals both sides agree on left out), overall and per device kind."""
    compared = [r for r in rows if "flags" in r]
    out: dict[str, Any] = {
        "cases": len(rows),
        "compared": len(compared),
        "errors": [
            f"{r['model']} {r['config']} {r['offload']}: {r['error']}"
            for r in rows
            if "flags" not in r and not r.get("rejected_alike")
        ],
    }
    for flag in ("kv_exact", "kv_within_1pct", "compute_within_10pct", "total_within_2pct"):
        out[flag] = sum(r["flags"][flag] for r in compared)
    for kind in ("CPU", "GPU"):
        devs = [d for r in compared for n, d in r["devices"].items() if n.startswith(kind)]
        out[f"{kind}_compute_ok"] = f"{sum(d['compute_ok'] for d in devs)}/{len(devs)}"
        out[f"{kind}_total_ok"] = f"{sum(d['total_ok'] for d in devs)}/{len(devs)}"
    return out


# -- the planner on the real inventory ----------------------------------------------------------------------------
def gpu_memory(query: str) -> list[list[str]] | str:
    """``nvidia-smi --query-<query> --format=csv,noheader,nounits`` rows, or why it could not be read."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
    if proc.returncode != 0:
        return f"unavailable: exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[:200]}"
    return [[f.strip() for f in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]


def _devices(inventory: Any) -> list[dict[str, Any]]:
    return [
        {
            "backend": d.backend,
            "index": d.index,
            "name": d.name,
            "total_mib": d.total_bytes // MIB,
            "free_mib": d.free_bytes // MIB,
            "source": d.source,
        }
        for d in inventory.devices
    ]


def planner_check(binary: Path, model_path: Path, work: Path) -> dict[str, Any]:
    """Plan ``model_path`` on this machine as the studio would, run that plan, and read what it really holds."""
    import httpx

    from launcher.allocations import parse_allocations
    from launcher.capabilities import probe
    from launcher.command import HOST, build_command
    from launcher.devices import discover
    from launcher.planner import PlanRequest, load_model, plan
    from launcher.process import LlamaServer, free_port

    caps = probe(binary, cache_dir=work / "caps")
    vendor, inventory = discover(), discover(llama_server=binary)
    lp = plan(load_model(model_path), inventory, caps, PlanRequest())
    out: dict[str, Any] = {
        "inventory_vendor_tools": _devices(vendor),
        "inventory": _devices(inventory),
        "inventory_warnings": list(inventory.warnings),
        "plan": {
            "gpus": [f"{d.backend}{d.index}" for d in lp.gpus],
            "offload": lp.offload,
            "n_gpu_layers": lp.n_gpu_layers,
            "n_ctx": lp.n_ctx,
            "n_parallel": lp.n_parallel,
            "kv_unified": lp.kv_unified,
            "flash_attn": lp.flash_attn,
            "budget_fraction": lp.budget_fraction,
            "fits": lp.fits,
            "reasons": list(lp.reasons),
            "warnings": list(lp.warnings),
            "devices": [
                {
                    "name": d.name,
                    "device": d.device.name,
                    "free_mib": d.device.free_bytes // MIB,
                    "budget_mib": d.budget_bytes // MIB,
                    "predicted": _part(d.bill, True),
                }
                for d in lp.devices
            ],
        },
    }
    before = gpu_memory("gpu=memory.used")
    cmd = build_command(lp, caps, binary=binary, files_root=work / "launch")
    port = free_port()
    log_path = work / "planned-server.log"
    server = LlamaServer(cmd.argv(port), host=HOST, port=port, log_path=log_path, env=cmd.env, api_key=cmd.api_key)
    with cmd, server:
        server.wait_ready(timeout=PLANNER_TIMEOUT_S - 30)
        loaded = gpu_memory("gpu=memory.used"), gpu_memory("compute-apps=pid,used_memory")
        with httpx.Client(timeout=60) as client:
            answer = client.post(
                f"{server.url}/completion",
                headers=cmd.auth_headers,
                json={"prompt": "the " * PROMPT_TOKENS, "n_predict": 4},
            )
        prompted = gpu_memory("gpu=memory.used"), gpu_memory("compute-apps=pid,used_memory")
        pid = server.pid
    actual = parse_allocations(log_path.read_text(errors="replace"))
    out["run"] = {
        "argv": cmd.redacted_argv(port),
        "pid": pid,
        "completion_status": answer.status_code,
        "allocations": {d.device: _part(d, False) for d in actual.devices},
        "gpu_memory_used_mib": {"before": before, "loaded": loaded[0], "after_prompt": prompted[0]},
        "compute_apps_mib": {"loaded": loaded[1], "after_prompt": prompted[1]},
    }
    # What the GPU holds beyond the allocation lines (the CUDA context, cuBLAS, the pool): the planner's margin
    on_gpu = round(sum(d.total for d in actual.devices if d.device != "CPU") / MIB)
    out["run"]["gpu_beyond_allocations_mib"] = {
        when: None if (used := _process_mib(rows, pid)) is None else used - on_gpu
        for when, rows in (("loaded", loaded[1]), ("after_prompt", prompted[1]))
    }
    return out


def slots_check(binary: Path, model_path: Path, work: Path, *, dry_run: bool) -> dict[str, Any]:
    """The slot default measured: the plan as the studio makes it, the same plan with one slot, and llama-server's
    own defaults (``-np -1``: 4 slots on a unified cache) at the same context, each with several clients at once."""
    import dataclasses

    from bench_concurrency import Target, compare, llama_server_defaults

    from launcher.capabilities import probe
    from launcher.command import HOST, build_command
    from launcher.devices import discover
    from launcher.planner import PlanRequest, load_model, plan
    from launcher.process import LlamaServer, free_port

    clients, rounds, tokens = (
        (DRY_SLOT_CLIENTS, DRY_SLOT_ROUNDS, DRY_SLOT_TOKENS) if dry_run else (SLOT_CLIENTS, SLOT_ROUNDS, SLOT_TOKENS)
    )
    caps = probe(binary, cache_dir=work / "caps")
    model, inventory = load_model(model_path), discover(llama_server=binary)
    default = plan(model, inventory, caps, PlanRequest(spec="off"))
    one = plan(model, inventory, caps, PlanRequest(n_ctx=default.n_ctx, spec="off", n_parallel=1))
    out: dict[str, Any] = {
        "default": {"n_parallel": default.n_parallel, "kv_unified": default.kv_unified, "n_ctx": default.n_ctx},
        "reason": next((r for r in default.reasons if r.startswith("slots:")), ""),
        "clients": list(clients),
        "rounds": rounds,
        "tokens": tokens,
    }
    logs = work / "slots"
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        targets = []
        for name, lp in ((f"studio default ({_slots(default)})", default), ("one slot", one)):
            cmd = stack.enter_context(build_command(lp, caps, binary=binary, files_root=logs / "launch"))
            port = free_port()
            log = logs / f"{lp.n_parallel}-slots.log"
            server = LlamaServer(cmd.argv(port), host=HOST, port=port, log_path=log, env=cmd.env, api_key=cmd.api_key)
            stack.enter_context(server)
            server.wait_ready(timeout=60)
            targets.append(Target(name, server.url, dict(cmd.auth_headers), model_path.stem))
        own = stack.enter_context(llama_server_defaults(binary, model_path, default.n_ctx, logs))
        targets.append(dataclasses.replace(own, name="llama-server -np -1"))
        results = compare(targets, clients, rounds, tokens, say=say)
    out["rows"] = [
        {
            "clients": n,
            "server": name,
            "tokens_per_s": round(t.tokens_per_s, 1),
            "ttft_p50_ms": round(t.percentile(0.5) * 1000),
            "ttft_p90_ms": round(t.percentile(0.9) * 1000),
        }
        for n, tallies in results.items()
        for name, t in tallies.items()
    ]
    return out


def moe_plan_check(binary: Path, model_path: Path, work: Path) -> dict[str, Any]:
    """The MoE expert split as the planner makes it on this GPU: the GPU's free memory set between what the model
    needs fully offloaded and that less one block's experts (``scripts/moe_split.split_budget``), the plan run,
    and its bill held against the allocations per device."""
    from moe_split import planned, split_budget

    from launcher.capabilities import probe
    from launcher.devices import discover
    from launcher.planner import PlanRequest

    caps = probe(binary, cache_dir=work / "caps")
    inventory = discover(llama_server=binary)
    if not inventory.gpus:
        return {"error": "no GPU in the inventory"}
    gpu, request = inventory.gpus[0], PlanRequest(n_ctx=2048, spec="off", cache_ram_mib=0)
    budget = split_budget(model_path, caps, inventory.cpu, gpu, request)
    lp, case = planned(binary, model_path, caps, inventory.cpu, gpu, request, work / "moe-plan")
    out: dict[str, Any] = {
        "model": model_path.stem,
        "free_mib_given": budget // MIB,
        "n_cpu_moe": lp.n_cpu_moe,
        "n_gpu_layers": lp.n_gpu_layers,
        "reasons": [r for r in lp.reasons if "n-cpu-moe" in r],
        "error": case.error,
    }
    if case.actual is not None:
        out["devices"] = {
            name: {
                "predicted": _part(lp.bill.device(name), True),
                "actual": _part(case.actual.device(name), False),
                **case.check(name),
            }
            for name in case.devices()
        }
    return out


def _slots(lp: Any) -> str:
    return f"{lp.n_parallel} slot{'s' if lp.n_parallel > 1 else ''}" + (", unified" if lp.kv_unified else "")


def _process_mib(rows: list[list[str]] | str, pid: int | None) -> int | None:
    """The MiB ``nvidia-smi --query-compute-apps=pid,used_memory`` gives ``pid``; None when it lists no such row."""
    if isinstance(rows, str):
        return None
    return next((int(r[1]) for r in rows if len(r) == 2 and r[0] == str(pid) and r[1].isdigit()), None)


# -- the report ---------------------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    """The report as a short text: the summary, one row per case and device, the planner's choice."""
    s = report.get("summary", {})
    lines = [
        f"# GPU check ({report['mode']}, llama.cpp {report['pin']})",
        "",
        f"timings (s): {json.dumps(report['timings_s'])}",
        f"bundle: {report.get('bundle_mib')} MiB + working tree {report.get('working_tree_mib')} MiB",
        "",
    ]
    if report.get("build"):
        b = report["build"]
        lines += [
            f"build: {b.get('architectures')} {'built' if b.get('built_now') else ''} {b.get('error') or ''}".rstrip(),
            "",
        ]
    if s:
        lines += [
            f"summary: kv_exact={s['kv_exact']}/{s['compared']} kv_within_1pct={s['kv_within_1pct']}/"
            f"{s['compared']} compute_within_10pct={s['compute_within_10pct']}/{s['compared']} "
            f"total_within_2pct={s['total_within_2pct']}/{s['compared']} (of {s['cases']} cases); per device: "
            f"GPU compute {s['GPU_compute_ok']}, GPU total {s['GPU_total_ok']}, CPU compute "
            f"{s['CPU_compute_ok']}, CPU total {s['CPU_total_ok']}",
            "",
        ]
    lines += [
        "MiB predicted/actual; KV = exact, C = compute within 10 %, T = total within 2 % or 32 MiB",
        "",
        "| model | config | layers | device | weights | KV | compute | total | KV= | C | T |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.get("cases", []):
        where = f"{r['offload']} ({r['n_gpu_layers']})"
        if "devices" not in r:
            lines.append(f"| {r['model']} | {r['config']} | {where} | - | {r.get('error', '')[:120]} |||||||")
            continue
        for name, d in r["devices"].items():
            p, a = d["predicted"], d["actual"]
            cell = lambda k: f"{p[k]:.2f}/{a[k]:.2f}"  # noqa: E731
            lines.append(
                f"| {r['model']} | {r['config']} | {where} | {name} | {cell('weights')} | {cell('kv')} | "
                f"{cell('compute')} | {cell('total')} | {'y' if r['flags']['kv_exact'] else 'n'} | "
                f"{'y' if d['compute_ok'] else 'n'} | {'y' if d['total_ok'] else 'n'} |"
            )
    p = report.get("planner")
    if p:
        lines += ["", "## planner", ""]
        if "error" in p:
            lines.append(f"error: {p['error']}")
        else:
            pl = p["plan"]
            lines += [
                f"chose: gpus={pl['gpus'] or 'none'} offload={pl['offload']} -ngl {pl['n_gpu_layers']} "
                f"n_ctx={pl['n_ctx']} slots={pl.get('n_parallel')}{' unified' if pl.get('kv_unified') else ''} "
                f"fits={pl['fits']}",
                *(f"- {r}" for r in pl["reasons"]),
                *(f"- warning: {w}" for w in pl["warnings"]),
            ]
            run = p.get("run", {})
            for d in pl["devices"]:
                got = run.get("allocations", {}).get(d["name"])
                parts = ", ".join(
                    f"{k} {v:.2f}/{got[k]:.2f}" if got else f"{k} {v:.2f}" for k, v in d["predicted"].items()
                )
                lines.append(
                    f"- {d['name']} ({d['device']}), MiB predicted/allocated: {parts}; budget "
                    f"{d['budget_mib']} of {d['free_mib']} free"
                )
            if run:
                lines += [
                    f"- GPU memory used (MiB): {json.dumps(run['gpu_memory_used_mib'])}",
                    f"- per process (MiB): {json.dumps(run['compute_apps_mib'])}",
                    f"- on the GPU beyond the allocation lines (MiB): {json.dumps(run['gpu_beyond_allocations_mib'])}",
                ]
    lines += _slots_markdown(report.get("slots"))
    lines += _moe_markdown(report.get("moe_plan"))
    return "\n".join(lines) + "\n"


def _moe_markdown(moe: dict[str, Any] | None) -> list[str]:
    """The planned MoE split: what the planner chose on the squeezed GPU, and each device predicted vs allocated."""
    if not moe:
        return []
    lines = ["", "## MoE expert split (planned)", ""]
    if "n_cpu_moe" not in moe:
        return [*lines, f"error: {moe.get('error') or moe.get('skipped')}"]
    lines += [
        f"{moe['model']} on {moe['free_mib_given']} MiB free: --n-cpu-moe {moe['n_cpu_moe']}, -ngl "
        f"{moe['n_gpu_layers']}" + (f"; error: {moe['error']}" if moe["error"] else ""),
        *(f"- {r}" for r in moe["reasons"]),
    ]
    for name, d in moe.get("devices", {}).items():
        p, a = d["predicted"], d["actual"]
        parts = ", ".join(f"{k} {p[k]:.2f}/{a[k]:.2f}" for k in ("weights", "kv", "compute", "total"))
        ok = "".join(f if d[k] else "-" for k, f in (("weights", "W"), ("kv", "K"), ("compute", "C"), ("total", "T")))
        lines.append(f"- {name}, MiB predicted/allocated: {parts} {ok}")
    return lines


def _slots_markdown(slots: dict[str, Any] | None) -> list[str]:
    """The slot default's table: per count of clients and server, aggregate tokens/s, TTFT p50/p90, the ratios."""
    if not slots:
        return []
    lines = ["", "## slot default", ""]
    if "error" in slots:
        return [*lines, f"error: {slots['error']}"]
    d = slots["default"]
    lines += [
        f"planned: {d['n_parallel']} slot(s){' on a unified KV cache' if d['kv_unified'] else ''}, "
        f"n_ctx {d['n_ctx']}; {slots['tokens']} tokens an answer, {slots['rounds']} round(s) per count; "
        "speculative decoding off in both studio plans",
        f"- {slots['reason']}",
        "",
        "| clients | server | aggregate tok/s | TTFT p50 (ms) | TTFT p90 (ms) | x one slot | x llama-server |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["clients"], r["server"]): r for r in slots["rows"]}
    servers = list(dict.fromkeys(r["server"] for r in slots["rows"]))
    for clients in slots["clients"]:
        one = by.get((clients, "one slot"), {}).get("tokens_per_s") or float("nan")
        own = by.get((clients, "llama-server -np -1"), {}).get("tokens_per_s") or float("nan")
        for server in servers:
            r = by.get((clients, server))
            if r is None:
                continue
            lines.append(
                f"| {clients} | {server} | {r['tokens_per_s']:.1f} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} | "
                f"{r['tokens_per_s'] / one:.2f} | {r['tokens_per_s'] / own:.2f} |"
            )
    return lines


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``gpu_check.json`` and ``gpu_check.md`` in ``out`` (rewritten after each phase, so a kill leaves one)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


# -- the modes ----------------------------------------------------------------------------------------------------
def make_bundle(bundle: Path, names: Sequence[str], sdist: Path | None) -> int:
    """``--bundle``: fill ``bundle`` with the pinned sources, the models' headers and the wheels; check the size."""
    from launcher.build import _download, _extract_tree, verify_sha256
    from studio.settings import Settings

    pin = load_pin()
    bundle.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        scratch = Path(tmp)
        studio_tree = layout_for(Settings.from_env().home, pin).source_dir
        if sdist is None and _marked_pinned(studio_tree, pin.sha256):
            tree = studio_tree
            say(f"source: the studio's verified tree {tree}")
        else:
            if sdist is None:
                sdist = _download(pin, scratch, lambda msg, *_: say(msg))
            verify_sha256(sdist, pin.sha256)
            tree = scratch / "tree"
            _extract_tree(sdist, pin, tree, scratch)
            say(f"source: {sdist.name}, sha256 verified")
        digest = gpu_bundle.pack_source(tree, bundle, pin)
        say(f"source: trimmed archive written, manifest sha256 {digest[:12]}... (the recorded one)")
        carried = gpu_bundle.pack_models(gather_models(names, scratch), bundle)
        say(f"models: {len(carried)} headers written ({', '.join(c.name for c in carried)})")
    wheels = gpu_bundle.pack_wheels(bundle)
    say(f"wheels: {', '.join(w.name for w in wheels)}")
    say(f"carry: {_carry_note(bundle)}")
    return check_size(bundle)


def _carry_note(bundle: Path) -> str:
    """How the device tool will see ``bundle``: it carries ignored folders inside the checkout, named in ``carry``."""
    try:
        rel = bundle.resolve().relative_to(REPO)
    except ValueError:
        return f"{bundle} is outside {REPO}: the device tool carries only paths inside the checkout"
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(rel)], capture_output=True)
    if ignored.returncode != 0:
        return f"{rel} is not ignored by git: it would travel twice (as untracked files and as carry)"
    return f'name "{rel}" in the device tool\'s carry'


def _marked_pinned(tree: Path, sha256: str) -> bool:
    try:
        return json.loads((tree / gpu_bundle.SOURCE_MARKER_NAME).read_text()).get("sha256") == sha256
    except (OSError, ValueError, AttributeError):
        return False


def check_size(bundle: Path) -> int:
    """Print the bundle's and the working tree's sizes against the carry limit; 1 when over it."""
    size, tree = gpu_bundle.folder_bytes(bundle), _tree_bytes()
    total = size + (tree or 0)
    say(
        f"bundle: {size / MIB:.1f} MiB + working tree {'?' if tree is None else f'{tree / MIB:.1f}'} MiB = "
        f"{total / MIB:.1f} MiB of {gpu_bundle.CARRY_LIMIT // MIB} MiB"
    )
    if total > gpu_bundle.CARRY_LIMIT:
        say("bundle: OVER the device tool's limit")
        return 1
    return 0


def _tree_bytes() -> int | None:
    try:
        return gpu_bundle.working_tree_bytes(REPO)
    except (OSError, subprocess.CalledProcessError):
        return None  # no git there (a copied tree): nothing to add


def run_check(
    bundle: Path,
    out: Path,
    work: Path,
    *,
    dry_run: bool,
    llama_server: Path | None,
    jobs: int,
    deadline_s: float,
    only: Sequence[str],
) -> int:
    """Restore, build (unless ``dry_run``), plan, compare; the report goes to ``out`` after each phase.

    Nothing starts that could outlast ``deadline_s`` (from the start): the planner's
    run needs ``PLANNER_TIMEOUT_S``, each case up to memory_accuracy's server timeout.
    """
    deadline = _T0 + deadline_s
    pin = load_pin()
    timings: dict[str, float] = {}
    report: dict[str, Any] = {
        "mode": "dry-run" if dry_run else "cuda",
        "pin": pin.tag,
        "timings_s": timings,
        "bundle_mib": round(gpu_bundle.folder_bytes(bundle) / MIB, 1),
    }
    tree = _tree_bytes()
    report["working_tree_mib"] = None if tree is None else round(tree / MIB, 1)

    def phase(name: str, start: float) -> None:
        timings[name] = round(time.monotonic() - start, 1)
        timings["total"] = round(time.monotonic() - _T0, 1)
        write_report(out, report)

    start = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    report["wheels_unpacked"] = gpu_bundle.activate_wheels(bundle, work / "site")
    home = work / "home"
    files = gpu_bundle.restore_source(bundle, layout_for(home, pin).source_dir, pin)
    models = gpu_bundle.restore_models(bundle, work / "models")
    if only:
        models = {n: p for n, p in models.items() if n in only}
    say(f"restored: {files} source files, {len(models)} models; wheels unpacked: {report['wheels_unpacked'] or 'none'}")
    phase("restore", start)

    start = time.monotonic()
    report["build"] = build = cuda_setup(home, out, dry_run)
    phase("build", start)
    if dry_run:
        binary = llama_server or layout_for(
            Path(os.environ.get("GGUF_STUDIO_HOME") or Path.home() / ".gguf-studio"), pin
        ).binary("llama-server")
    elif "binary" not in build:
        say(f"build: FAILED: {build.get('error')}")
        return 1
    else:
        binary = Path(build["binary"])
    report["llama_server"] = str(binary)

    def guarded(key: str, timeout: float, what: str, check: Callable[[], dict[str, Any]]) -> None:
        """Run one phase when it can end before the deadline; its error is the finding, and the report is written."""
        start = time.monotonic()
        if time.monotonic() + timeout < deadline:
            say(what)
            try:
                report[key] = check()
            except (Exception, SystemExit) as exc:
                report[key] = {"error": f"{type(exc).__name__}: {exc}"}
        phase(key, start)

    planned = models.get(GEMMA) or next(iter(models.values()), None)
    if planned is not None:
        guarded(
            "planner",
            PLANNER_TIMEOUT_S,
            f"planner: {planned.stem} on this machine's devices",
            lambda: planner_check(binary, planned, work),
        )
        guarded(
            "slots",
            SLOTS_TIMEOUT_S,
            f"slots: {planned.stem}, the planned slots against one and llama-server's own",
            lambda: slots_check(binary, planned, work, dry_run=dry_run),
        )
    moe = next((p for n, p in models.items() if n.startswith(MOE)), None)
    if dry_run:
        report["moe_plan"] = {"skipped": "dry run: scripts/moe_split.py checks the split over an RPC worker"}
    elif moe is not None:
        guarded(
            "moe_plan",
            PLANNER_TIMEOUT_S,
            f"moe: {moe.stem}, planned on a GPU too small for it whole",
            lambda: moe_plan_check(binary, moe, work),
        )

    from memory_accuracy import SERVER_TIMEOUT_S  # after the wheels: it imports httpx

    start = time.monotonic()
    grid = cases(models, ("none",) if dry_run else ("all", "partial"))
    say(f"cases: {len(grid)} on {binary}")
    report["cases"] = run_cases(binary, models, grid, jobs, deadline - SERVER_TIMEOUT_S)
    report["summary"] = summarize(report["cases"])
    phase("cases", start)
    print(markdown(report), flush=True)
    return 0


def cuda_setup(home: Path, out: Path, dry_run: bool) -> dict[str, Any]:
    """Find the CUDA toolchain and the device's architecture, and build (not in a dry run); the log goes to ``out``."""
    from tests.support.cuda_build import (
        CudaSetupError,
        build_args,
        build_cuda_server,
        compute_capabilities,
        find_toolchain,
    )

    result: dict[str, Any] = {"jobs": os.cpu_count()}
    try:
        result["architectures"] = arch = compute_capabilities()
        toolchain = find_toolchain()
        result["cmake_args"] = list(recipe_args(load_pin(), "cuda", build_args(toolchain, arch)))
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            [*map(str, toolchain.library_dirs), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
        )
    except CudaSetupError as exc:
        result["error"] = str(exc)
        return result
    if dry_run:
        return result
    say(f"build: CUDA llama-server for {arch} with {result['jobs']} jobs")
    log = layout_for(home, load_pin(), "cuda").log_path
    try:
        built = build_cuda_server(home, toolchain, arch, progress=_build_progress())
        result["binary"], result["built_now"] = str(built.llama_server), built.built_now
    except BuildError as exc:
        result["error"] = f"{exc}\n{exc.log_tail}"
    if log.is_file():  # the whole log comes back (the device tool returns files up to 16 MiB)
        out.mkdir(parents=True, exist_ok=True)
        (out / "build.log").write_bytes(log.read_bytes()[-8 * MIB :])
    return result


def _build_progress() -> Callable[[str, int | None, int | None], None]:
    """Print configure messages and every tenth of the compile steps."""
    last = [-1]

    def report(msg: str, done: int | None, total: int | None) -> None:
        if done is None or not total:
            say(f"build: {msg}")
        elif done * 10 // total > last[0]:
            last[0] = done * 10 // total
            say(f"build: [{done}/{total}] {msg[:100]}")

    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--bundle", type=Path, metavar="DIR", help="write the carried inputs into DIR (run here)")
    mode.add_argument("--bundle-dir", type=Path, metavar="DIR", help="run the check from the bundle in DIR")
    parser.add_argument("--out", type=Path, help="where the report goes (on the device machine: $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="no build: the CPU llama-server, no layer offload")
    parser.add_argument("--llama-server", type=Path, help="the dry run's binary (default: the studio's CPU build)")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "gguf-studio-gpu-check",
        help="scratch folder: the restored sources and models, the build (default %(default)s)",
    )
    parser.add_argument("--models", default="", help="comma-separated subset of the subset (default: all of it)")
    parser.add_argument(
        "--sdist", type=Path, help="--bundle: the pinned sdist, instead of the studio's verified tree or a download"
    )
    parser.add_argument("--jobs", type=int, default=4, help="llama-servers at a time (default %(default)s)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_DEADLINE_S,
        help="seconds after the start by which the check must end: what could not is left out (default %(default)s)",
    )
    args = parser.parse_args(argv)
    only = [m for m in args.models.split(",") if m]
    if args.bundle:
        return make_bundle(args.bundle, only or subset_names(), args.sdist)
    if args.out is None:
        parser.error("--bundle-dir needs --out")
    if check_size(args.bundle_dir) and args.dry_run:
        return 1  # here the size decides whether the bundle can travel; there it already has
    return run_check(
        args.bundle_dir,
        args.out,
        args.work,
        dry_run=args.dry_run,
        llama_server=args.llama_server,
        jobs=args.jobs,
        deadline_s=args.deadline,
        only=only,
    )


if __name__ == "__main__":
    raise SystemExit(main())
