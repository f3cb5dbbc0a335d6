#!/usr/bin/env python3
"""Residency under pressure: random chats, streams, loads and unloads from several clients, one budget.

Runs a real studio (uvicorn in a thread, real llama-servers) over Gemma, zoo models and
widened zoo models, with a memory budget smaller than their sum, and one of them
pinned. Four clients send random operations; a monitor samples the llama-server
processes and the studio's status every 50 ms. Prints:

- failed requests and loads (target 0): anything but a 200, except a request for a model that a
  client's own unload cancelled while it was loading (the unload's promise: counted on its own line);
- evictions of busy or pinned models (target 0): a request cut by an eviction, or the
  pinned model gone;
- needless evictions (target 0): a placement that evicted although its plan fit the
  memory left without evicting;
- moments with two instances of one model (target 0);
- the largest actual resident total against the budget (target <= budget);
- the median time to first token for a request to a resident model and for one that
  needed a load, measured in the same run;
- a model switch through the studio (one model resident, ``max_resident = 1``, a streamed chat to the
  other) against the same switch by hand (stop the running llama-server, start the other with the argv
  the studio uses, stream the same chat), first streamed token, medians of ``--switches`` (target 1.10x).

    .venv/bin/python scripts/bench_residency.py [--ops 200] [--clients 4] [--seed 1] [--switches 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.build import ensure_built
from launcher.capabilities import probe
from launcher.devices import discover
from launcher.planner import PlanRequest, load_model, plan
from launcher.process import LlamaServer, free_port
from studio.library.default_model import ensure_gemma
from studio.residency import manager as manager_module
from studio.residency import placement
from studio.residency.requests import LoadRequest
from studio.settings import MemoryBudget, ModelDefaults, ResidencySettings, Settings
from tests.support.studio import running_studio
from tests.support.wide_zoo import ensure_wide_zoo
from tests.support.zoo import ensure_zoo

ZOO = ("llama-dense", "qwen2-dense", "mistral3-dense")
WIDE = ("llama-dense-wide", "qwen2-dense-wide")
PINNED = "qwen2-dense"
#: What a request waiting for a load hears when a client unloads that model meanwhile: the unload's promise.
CANCELLED = "was unloaded while it was loading"
#: The switch measured against the same switch by hand: from the first to the second.
SWITCH = ("llama-dense", "gemma")
SWITCH_TARGET = 1.10


def models_and_bills(
    settings: Settings, binary: Path
) -> tuple[dict[str, Path], dict[str, ModelDefaults], dict[str, int]]:
    build = ensure_built(settings.home)
    zoo = ensure_zoo(build, settings.home)
    wide = {p.stem: p for p in ensure_wide_zoo(zoo, binary, settings.home / "zoo" / f"{build.layout.tag}-wide8x16")}
    files = {name: zoo / f"{name}.gguf" for name in ZOO}
    files.update({name: wide[name] for name in WIDE if name in wide})
    files["gemma"] = ensure_gemma(settings.models_dir)
    defaults = {name: ModelDefaults(n_ctx=256, spec="off") for name in files}
    defaults["gemma"] = ModelDefaults(n_ctx=2048, n_parallel=2, spec="off")
    caps, inventory = probe(binary), discover(llama_server=binary)
    bills = {
        name: plan(
            load_model(path),
            inventory,
            caps,
            PlanRequest(n_ctx=defaults[name].n_ctx, n_parallel=defaults[name].n_parallel or 1, spec="off"),
        ).bill.total
        for name, path in files.items()
    }
    return files, defaults, bills


class Monitor(threading.Thread):
    """Samples the llama-servers (instances per model file) and the studio's resident total."""

    def __init__(self, manager: manager_module.ModelManager) -> None:
        super().__init__(daemon=True)
        self.manager = manager
        self.stop = threading.Event()
        self.doubles = 0
        self.largest = 0
        self.pinned_seen = False
        self.pinned_gone = 0

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(0.05):
            paths = Counter()
            for p in me.children(recursive=True):
                try:
                    if p.name() == "llama-server":
                        argv = p.cmdline()
                        paths[argv[argv.index("-m") + 1]] += 1
                except (psutil.Error, ValueError, IndexError):
                    continue
            self.doubles += sum(1 for n in paths.values() if n > 1)
            total = 0
            names = set()
            for r in list(self.manager.residents):
                names.add(r.name)
                actual = r.actual
                if actual is not None:
                    total += actual.total
            self.largest = max(self.largest, total)
            if PINNED in names:
                self.pinned_seen = True
            elif self.pinned_seen:  # no client unloads it: only an eviction could take it away
                self.pinned_gone += 1
                self.pinned_seen = False


def first_token(url: str, model: str, headers: dict[str, str] | None = None) -> float:
    """Seconds from sending a streamed chat to its first token (content or reasoning) arriving; a model that
    ends its turn at once has its end as its first token."""
    asked = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    body = {"model": model, "messages": asked, "max_tokens": 8, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            delta = choices[0].get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or choices[0].get("finish_reason"):
                return time.monotonic() - t0
    raise RuntimeError(f"{model} streamed no token")


def switches(files: dict[str, Path], defaults: dict[str, ModelDefaults], binary: Path, rounds: int) -> None:
    """A switch through the studio against the same switch by hand, in one run, rounds alternating."""
    first, second = SWITCH
    root = Path(tempfile.mkdtemp(prefix="bench-switch-"))
    models = {name: files[name] for name in SWITCH}
    studio_s: list[float] = []
    by_hand: list[float] = []
    with running_studio(root, binary, models, defaults=defaults, residency=ResidencySettings(max_resident=1)) as s:
        commands = {}
        for name in SWITCH:  # the commands the studio runs for each, planned with nothing else resident
            placed = asyncio.run(s.manager.preview(LoadRequest(model=name)))
            commands[name] = s.manager.launch_command(placed)
        try:
            for _ in range(rounds):
                httpx.post(f"{s.url}/api/unload", json={}, timeout=60)
                first_token(s.url, first)  # resident, warmed up
                studio_s.append(first_token(s.url, second))  # evicts it, loads the other
                httpx.post(f"{s.url}/api/unload", json={}, timeout=60)
                by_hand.append(_switch_by_hand(commands[first], commands[second], root))
        finally:
            for command in commands.values():
                command.cleanup()
    for i, (a, b) in enumerate(zip(studio_s, by_hand, strict=True), 1):
        print(f"switch round {i}: studio {a * 1000:,.0f} ms, by hand {b * 1000:,.0f} ms")
    ratio = statistics.median(studio_s) / statistics.median(by_hand)
    print(
        f"switch {first} -> {second}, first streamed token: studio {statistics.median(studio_s) * 1000:,.0f} ms, "
        f"by hand {statistics.median(by_hand) * 1000:,.0f} ms (medians of {rounds}): {ratio:.2f}x "
        f"(target <= {SWITCH_TARGET}x)"
    )


def _switch_by_hand(running: Any, other: Any, root: Path) -> float:
    """Start ``running``'s llama-server and chat once; then time: stop it, start ``other``'s, its first token."""

    def start(command: Any) -> LlamaServer:
        port = free_port()
        server = command.server(root / f"by-hand-{port}.log", port=port)
        server.start()
        server.wait_ready(timeout=120)
        return server

    server = start(running)
    try:
        first_token(server.url, "x", running.auth_headers)
    finally:
        t0 = time.monotonic()
        server.stop()
    server = start(other)
    try:
        return time.monotonic() - t0 + first_token(server.url, "x", other.auth_headers)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget-share", type=float, default=0.6, help="budget as a share of all bills together")
    parser.add_argument("--switches", type=int, default=5, help="rounds of the switch against the by-hand switch")
    args = parser.parse_args()
    settings = Settings.from_env()
    binary = ensure_built(settings.home).llama_server
    files, defaults, bills = models_and_bills(settings, binary)
    budget = int(sum(bills.values()) * args.budget_share)
    budget = max(budget, max(bills.values()) + bills[PINNED] + 1)  # the pinned one and the largest fit together
    defaults[PINNED] = ModelDefaults(n_ctx=256, spec="off", pinned=True)
    print(f"models: {', '.join(f'{n} {b / 2**20:,.1f} MiB' for n, b in bills.items())}")
    print(f"budget: {budget / 2**20:,.1f} MiB ({budget / sum(bills.values()):.0%} of their sum)")

    needless: list[str] = []
    evictions: list[str] = []
    real_decide = placement.decide

    def traced_decide(snapshot, request, plan):
        decision = real_decide(snapshot, request, plan)
        if decision.evict:
            evictions.extend(decision.evict)
            # Would the final plan have fit the room left without evicting? Then the eviction was needless.
            need = placement.physical(decision.plan.bill, decision.plan)
            if not placement.shortfall(need, snapshot.room().available) and not snapshot.max_resident:
                needless.append(f"{decision.plan.model.path.name} evicted {decision.evict}")
        return decision

    placement.decide = traced_decide  # instrumentation: every placement decision is checked
    root = Path(tempfile.mkdtemp(prefix="bench-residency-"))
    residency = ResidencySettings(memory_budget=MemoryBudget(total=budget), busy_wait=60, unload_grace=30)
    failures: list[str] = []
    ttft = {"resident": [], "load": []}
    cut = cancelled = 0
    lock = threading.Lock()
    with running_studio(root, binary, files, defaults=defaults, residency=residency) as studio:
        monitor = Monitor(studio.manager)
        monitor.start()
        names = list(files)
        rng = random.Random(args.seed)
        plan_ops = []
        for _ in range(args.ops):
            op = rng.choice(("chat", "chat", "stream", "stream", "load", "unload"))
            # a user's unload of the pinned model would be no eviction: leave it to the monitor to catch those
            plan_ops.append((op, rng.choice([n for n in names if n != PINNED or op != "unload"])))
        queue = list(enumerate(plan_ops))

        def client() -> None:
            nonlocal cut, cancelled
            with httpx.Client(base_url=studio.url, timeout=300) as http:
                while True:
                    with lock:
                        if not queue:
                            return
                        i, (op, name) = queue.pop(0)
                    resident = studio.manager.find(name)
                    kind = "resident" if resident is not None and resident.state.value == "ready" else "load"
                    t0 = time.monotonic()
                    try:
                        if op in ("chat", "stream"):
                            body = {
                                "model": name,
                                "messages": [{"role": "user", "content": "Hello there"}],
                                "max_tokens": 8,
                                "stream": op == "stream",
                            }
                            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                                first, data = None, []
                                for chunk in resp.iter_bytes():
                                    first = first or time.monotonic()
                                    data.append(chunk)
                                text = b"".join(data).decode(errors="replace")
                                if CANCELLED in text:
                                    cancelled += 1
                                elif resp.status_code != 200:
                                    failures.append(f"{op} {name}: {resp.status_code} {text[:200]}")
                                elif op == "stream" and first is not None:
                                    ttft[kind].append(first - t0)
                                if "was evicted to make room" in text:
                                    cut += 1
                        elif op == "load":
                            resp = http.post("/api/load", json={"model": name})
                            if CANCELLED in resp.text:
                                cancelled += 1
                            elif resp.status_code != 200:
                                failures.append(f"load {name}: {resp.status_code} {resp.text[:200]}")
                        else:
                            resp = http.post("/api/unload", json={"model": name})
                            if resp.status_code not in (200, 404):  # 404: it was not resident
                                failures.append(f"unload {name}: {resp.status_code} {resp.text[:200]}")
                    except httpx.HTTPError as exc:
                        failures.append(f"{op} {name}: {exc}")

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        monitor.stop.set()
        monitor.join()
        loads = studio.manager.counters["loads"]
    print(
        f"{args.ops} operations from {args.clients} clients in {elapsed:,.0f} s; {loads} loads, "
        f"{len(evictions)} evictions"
    )
    print(f"failed requests and loads:           {len(failures)}  (target 0)")
    for f in failures[:10]:
        print(f"    {f}")
    print(f"ended by their model's own unload while it loaded (intended): {cancelled}")
    print(f"evictions of busy or pinned models:  {cut + monitor.pinned_gone}  (target 0)")
    print(f"needless evictions:                  {len(needless)}  (target 0)")
    for n in needless[:10]:
        print(f"    {n}")
    print(f"moments with two instances of one model: {monitor.doubles}  (target 0)")
    print(
        f"largest actual resident total:       {monitor.largest / 2**20:,.1f} MiB of a "
        f"{budget / 2**20:,.1f} MiB budget ({monitor.largest / budget:.0%})"
    )
    for kind in ("resident", "load"):
        values = ttft[kind]
        shown = f"{statistics.median(values) * 1000:,.0f} ms over {len(values)}" if values else "none"
        print(f"median time to first token, {'resident model' if kind == 'resident' else 'needs a load  '}: {shown}")
    if ttft["resident"] and ttft["load"]:
        print(
            f"a load costs the first token "
            f"{statistics.median(ttft['load']) / statistics.median(ttft['resident']):,.0f}x"
        )

    if args.switches > 0:
        switches(files, defaults, binary, args.switches)


if __name__ == "__main__":
    main()
