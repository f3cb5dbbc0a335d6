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
  alone (every core), the second as the second sharer (its share).

The configurations alternate for ``--rounds`` rounds, so a neighbour's load on the machine touches each
alike. Target: ``planned`` at least 1.2x ``every core``.

    .venv/bin/python scripts/bench_threads.py [--seconds 20] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
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
    stack: ExitStack, model: ModelInfo, threads: int, inventory: Inventory, caps: Capabilities, binary: Path, logs: Path
) -> tuple[str, dict[str, str]]:
    """Start one llama-server for ``model`` with ``threads`` threads; its URL and auth headers."""
    launch = plan(model, inventory, caps, PlanRequest(n_ctx=2048, spec="off", threads=threads))
    command = stack.enter_context(build_command(launch, caps, binary=binary, files_root=logs / "run"))
    server = command.server(logs / f"{model.path.stem}-{threads}.log")
    server.start()
    stack.callback(server.stop)
    server.wait_ready(timeout=120)
    return server.url, command.auth_headers


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
    }
    print(f"{cores} usable physical cores; the planner says: {next(r for r in planned[0].reasons if 'threads' in r)}")
    totals: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as scratch:
        for round_ in range(1, args.rounds + 1):
            for name, threads in configs.items():
                with ExitStack() as stack:
                    servers = [
                        _serve(stack, m, t, inventory, caps, binary, Path(scratch))
                        for m, t in zip(models, threads, strict=True)
                    ]
                    rates = _run(servers, args.seconds, args.tokens)
                totals[name].append(sum(rates))
                each = ", ".join(f"{m.path.stem} {r:.1f}" for m, r in zip(models, rates, strict=True))
                split = "+".join(map(str, threads))
                print(f"round {round_}  {name:10}  threads {split}: {sum(rates):6.1f} tok/s ({each})")
    mean = {name: statistics.mean(v) for name, v in totals.items()}
    print()
    for name, threads in configs.items():
        split = "+".join(map(str, threads))
        print(f"{name:10}  threads {split}: {mean[name]:6.1f} tok/s in total (mean of {args.rounds})")
    ratio = mean["planned"] / mean["every core"]
    print(f"planned / every core: {ratio:.2f}x (target >= {TARGET}x): {'met' if ratio >= TARGET else 'NOT met'}")
    print(f"load order / every core: {mean['load order'] / mean['every core']:.2f}x")


if __name__ == "__main__":
    main()
