#!/usr/bin/env python3
"""Two resident models on one CPU, both generating at once: total tokens/s with the planner's threads
against each llama-server taking every core (what each got before the planner divided them).

Gemma 3 270M and SmolLM2-135M run as two llama-servers, planned as the studio plans them on this machine
(CPU only, ``-c 2048``, one slot, no speculation), with the command the studio builds. Each configuration
starts both, warms them up, then lets both generate back to back for ``--seconds`` (``--tokens`` tokens a
request, end of sequence ignored) and sums what each generated over its own time. The configurations:

- ``planned``: the threads the planner gives each of two models sharing the CPU (``cpu_sharers=2``);
- ``every core``: each takes all the usable physical cores;
- ``load order``: what a studio that loads one, then the other, gives them today: the first was planned
  alone (every core), the second as the second sharer (its share);
- ``load order, pinned``: the same threads, each server's threads pinned to its own CPUs
  (``launcher.platform.pin_to_cpus``): the second gets its share of the CPUs, the first the rest.

It also prints what the other way to the ``planned`` division costs once the first model runs: restarting
the first with its share (the time its llama-server takes to stop and start again, slot save aside), and
with ``--studio-loads N`` what the studio's second load takes (Gemma chatted, then SmolLM2 loaded, medians
of N): with the restart of Gemma it makes (its slot saved), and without it (Gemma's ``threads`` asked for).
With ``--alone``, Gemma alone at its share of two and at every core: what its restart gives it back once the
other model left (``placement.rebalance``).

The configurations alternate for ``--rounds`` rounds, so a neighbour's load on the machine touches each
alike. Target: ``planned`` at least 1.2x ``every core``.

    .venv/bin/python scripts/bench_threads.py [--seconds 20] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.build import ensure_built
from launcher.capabilities import Capabilities, probe
from launcher.command import build_command
from launcher.devices import Inventory, discover
from launcher.planner import ModelInfo, PlanRequest, load_model, plan
from studio.library.default_model import ensure_default_model, ensure_gemma
from studio.settings import Settings

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle. Once upon a time,"
TARGET = 1.2


def _serve(
    stack: ExitStack,
    model: ModelInfo,
    threads: int,
    inventory: Inventory,
    caps: Capabilities,
    binary: Path,
    logs: Path,
    cpus: frozenset[int] = frozenset(),
) -> tuple[str, dict[str, str]]:
    """Start one llama-server for ``model`` with ``threads`` threads (on ``cpus`` only, when given); its URL and
    auth headers."""
    launch = plan(model, inventory, caps, PlanRequest(n_ctx=2048, spec="off", threads=threads))
    command = stack.enter_context(build_command(launch, caps, binary=binary, files_root=logs / "run"))
    server = command.server(logs / f"{model.path.stem}-{threads}.log")
    server.start()
    stack.callback(server.stop)
    server.wait_ready(timeout=120)
    if cpus and not (server.pid and pin_to_cpus(server.pid, cpus)):
        raise SystemExit(f"could not pin {model.path.stem} to CPUs {sorted(cpus)} (Linux only)")
    return server.url, command.auth_headers


def pin_to_cpus(pid: int, cpus: frozenset[int]) -> bool:
    """Run every thread of process ``pid`` on ``cpus`` only; False where it cannot (not Linux, the process is gone).

    Linux's ``sched_setaffinity`` sets one thread's mask, and a running llama-server's threads already exist:
    each task under ``/proc/PID/task`` is pinned. The studio does not pin (the bench shows why), so this lives
    here rather than in ``launcher.platform``.
    """
    if not sys.platform.startswith("linux") or not cpus:
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    pinned = False
    for tid in tids:
        with suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
            pinned = True
    return pinned


def _generate(url: str, headers: dict[str, str], tokens: int) -> int:
    body = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "temperature": 0.8, "seed": -1}
    answer = httpx.post(f"{url}/completion", json=body, headers=headers, timeout=300)
    answer.raise_for_status()
    return int(answer.json()["timings"]["predicted_n"])


def _run(servers: Sequence[tuple[str, dict[str, str]]], seconds: float, tokens: int) -> list[float]:
    """Tokens/s of each server while all generate at once."""
    for url, headers in servers:
        _generate(url, headers, 8)  # warm-up: first-request costs stay out of the window
    start = threading.Barrier(len(servers))
    rates = [0.0] * len(servers)

    def client(i: int) -> None:
        url, headers = servers[i]
        start.wait()
        began = time.monotonic()
        made = 0
        while time.monotonic() - began < seconds:
            made += _generate(url, headers, tokens)
        rates[i] = made / (time.monotonic() - began)

    workers = [threading.Thread(target=client, args=(i,)) for i in range(len(servers))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="generation window per configuration")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", action="append", help="run only this configuration (repeat for more)")
    parser.add_argument("--studio-loads", type=int, default=0, help="rounds of the studio's second load (0: none)")
    parser.add_argument("--alone", action="store_true", help="the first model alone at its share, then every core")
    args = parser.parse_args()
    settings = Settings.from_env()
    binary = ensure_built(settings.home).llama_server
    caps = probe(binary, cache_dir=settings.home / "cache")
    inventory = discover(llama_server=binary)
    models = [load_model(ensure_gemma(settings.models_dir)), load_model(ensure_default_model(settings.models_dir))]
    planned = [plan(m, inventory, caps, PlanRequest(n_ctx=2048, spec="off", cpu_sharers=2)) for m in models]
    alone = plan(models[0], inventory, caps, PlanRequest(n_ctx=2048, spec="off", cpu_sharers=1))
    cores = inventory.cpu.cores or 1
    configs = {
        "planned": [p.threads or cores for p in planned],
        "every core": [cores, cores],
        "load order": [alone.threads or cores, planned[1].threads or cores],
        "load order, pinned": [alone.threads or cores, planned[1].threads or cores],
    }
    configs = {name: threads for name, threads in configs.items() if not args.only or name in args.only}
    cpus = sorted(os.sched_getaffinity(0))
    second = planned[1].threads or 1
    pinned = [frozenset(cpus[: len(cpus) - second]), frozenset(cpus[len(cpus) - second :])]
    print(f"{cores} usable physical cores; the planner says: {next(r for r in planned[0].reasons if 'threads' in r)}")
    totals: dict[str, list[float]] = {name: [] for name in configs}
    firsts: dict[str, list[float]] = {
        name: [] for name in configs
    }  # the first model's own: a total hides a starved one
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as scratch:
        for round_ in range(1, args.rounds + 1):
            for name, threads in configs.items():
                pin = "pinned" in name
                with ExitStack() as stack:
                    servers = [
                        _serve(stack, m, t, inventory, caps, binary, Path(scratch), p if pin else frozenset())
                        for m, t, p in zip(models, threads, pinned, strict=True)
                    ]
                    rates = _run(servers, args.seconds, args.tokens)
                totals[name].append(sum(rates))
                firsts[name].append(rates[0])
                each = ", ".join(f"{m.path.stem} {r:.1f}" for m, r in zip(models, rates, strict=True))
                split = "+".join(map(str, threads))
                print(f"round {round_}  {name:18}  threads {split}: {sum(rates):6.1f} tok/s ({each})")
    mean = {name: statistics.mean(v) for name, v in totals.items()}
    print()
    for name, threads in configs.items():
        split = "+".join(map(str, threads))
        first = f"{models[0].path.stem} {statistics.mean(firsts[name]):.1f}"
        print(f"{name:18}  threads {split}: {mean[name]:6.1f} tok/s in total, {first} (mean of {args.rounds})")
    for name, against in (("planned", "every core"), ("load order", "every core"), ("load order, pinned", "planned")):
        if name in mean and against in mean:
            met = f" (target >= {TARGET}x): {'met' if mean[name] / mean[against] >= TARGET else 'NOT met'}"
            print(f"{name} / {against}: {mean[name] / mean[against]:.2f}x" + (met if name == "planned" else ""))
    restart = _restart_seconds(models[0], second, inventory, caps, binary)
    print(f"restart of {models[0].path.stem} with its share: {restart}")
    if args.alone:  # what the grow-back restart gives a model left alone, against what it costs (printed above)
        with tempfile.TemporaryDirectory(prefix="bench-threads-") as scratch:
            for round_ in range(1, args.rounds + 1):
                for threads in (second, cores):
                    with ExitStack() as stack:
                        server = _serve(stack, models[0], threads, inventory, caps, binary, Path(scratch))
                        [rate] = _run([server], args.seconds, args.tokens)
                    print(f"round {round_}  {models[0].path.stem} alone, threads {threads}: {rate:6.1f} tok/s")
    if args.studio_loads:
        paths = {"gemma": models[0].path, "smollm": models[1].path}
        for asked in (None, cores):
            took = _second_load_seconds(binary, paths, args.studio_loads, asked)
            how = "without the restart (gemma's threads asked)" if asked else "with gemma's restart"
            print(f"studio's second load, {how}: {took}")


def _second_load_seconds(binary: Path, paths: dict[str, Path], rounds: int, threads: int | None) -> str:
    """Median seconds of ``/api/load`` of smollm once gemma (``threads`` asked, or not) answered a chat."""
    from studio.residency.slot_cache import SlotCache
    from studio.settings import ModelDefaults
    from tests.support.studio import running_studio

    took = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="bench-threads-") as scratch:
            root = Path(scratch)
            cache = SlotCache(root / "slots", binary=binary, disk_budget=1 << 30)
            defaults = {n: ModelDefaults(n_ctx=2048, spec="off") for n in paths}
            with running_studio(root, binary, paths, defaults=defaults, slot_cache=cache) as s:
                load = {"model": "gemma", **({"threads": threads} if threads else {})}
                httpx.post(f"{s.url}/api/load", json=load, timeout=300).raise_for_status()
                chat = {"model": "gemma", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
                httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=300).raise_for_status()
                began = time.monotonic()
                httpx.post(f"{s.url}/api/load", json={"model": "smollm"}, timeout=300).raise_for_status()
                took.append(time.monotonic() - began)
                threads_now = sorted((r.name, r.plan.threads) for r in s.manager.residents)
    return f"{statistics.median(took):.2f} s (median of {rounds}; threads {threads_now})"


def _restart_seconds(model: ModelInfo, threads: int, inventory: Inventory, caps: Capabilities, binary: Path) -> str:
    """Median seconds to stop ``model``'s llama-server and have it ready again with ``threads`` threads."""
    took = []
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as scratch:
        for _ in range(5):
            with ExitStack() as stack:
                _serve(stack, model, threads + 1, inventory, caps, binary, Path(scratch))
                began = time.monotonic()
                stack.close()
                _serve(stack, model, threads, inventory, caps, binary, Path(scratch))
                took.append(time.monotonic() - began)
    return f"{statistics.median(took):.2f} s (median of 5)"


if __name__ == "__main__":
    main()
