"""The MoE expert split (``--n-cpu-moe``) checked for real, with an RPC worker standing in for the GPU.

A ``ggml-rpc-server`` on loopback is a non-CPU device for llama-server: weights, KV cache and compute
buffers placed on it are logged under its own name (``RPC0[127.0.0.1:port]``), apart from the CPU's.
For each of the zoo's MoE models at real expert proportions (``tests.support.wide_zoo.SPLIT_MOE_SHAPES``:
Qwen3-30B-A3B's 128 experts with 8 routed, OLMoE's 64 with 8, GPT-OSS's 32 with 4), this:

- runs every ``--n-cpu-moe N`` from 0 to every block, with every block offloaded (``-ngl all``), at two
  server settings, and compares the estimator's bill with the buffers llama-server logs, per device;
- plans the model onto the worker given a budget too small for the model fully offloaded but large
  enough for the experts of one block on the CPU (``stand_in_gpu``), runs the plan as the studio would
  (``launcher.command``), and compares the same way.

Targets per device and case: weights exact (the log's 0.01 MiB), KV exact, compute within 10 %, the
logged total within 2 % or 32 MiB. The last line reads ``moe-split: weights_exact=N/M kv_exact=N/M
compute_within_10pct=N/M total_within_2pct=N/M planned_split=N/M device_compute_within_10pct=N/M``
(compute summed over the devices, as ``scripts/memory_accuracy.py`` counts it, then per device).

Usage: ``.venv/bin/python scripts/moe_split.py [--models qwen3moe-moe-128x8,...]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf
from launcher.allocations import parse_allocations
from launcher.bill import MemoryBill
from launcher.capabilities import Capabilities
from launcher.devices import Device, Inventory
from launcher.memory import MemoryOptions, estimate, for_file
from launcher.planner import LaunchPlan, PlanRequest, load_model, plan
from launcher.rpc_worker import RpcWorker
from launcher.units import MIB
from tests.support.dry_run import LISTENING, load_report

#: The server settings each N runs at: the context and slots of a small chat, and the studio's GPU default.
SETTINGS: tuple[tuple[str, MemoryOptions], ...] = (
    ("c2048-np1", MemoryOptions(n_ctx=2048, n_parallel=1)),
    ("c8192-np4-unified", MemoryOptions(n_ctx=8192, n_parallel=4, kv_unified=True)),
)
SERVER_TIMEOUT_S = 120
#: The line after which every allocation has been printed.
DONE_MARKERS = ("sched_reserve: reserve took", LISTENING)


@dataclass(frozen=True)
class Case:
    """One run: the model, the blocks whose experts stay on the CPU, and the bills side by side."""

    model: str
    setting: str
    n_cpu_moe: int
    predicted: MemoryBill
    actual: MemoryBill | None
    error: str = ""

    def devices(self) -> list[str]:
        return sorted({d.device for d in self.predicted.devices} | set(self.actual_devices()))

    def actual_devices(self) -> tuple[str, ...]:
        return tuple(d.device for d in self.actual.devices) if self.actual else ()

    def check(self, device: str) -> dict[str, bool]:
        """The four targets on one device."""
        if self.actual is None:
            return {"weights": False, "kv": False, "compute": False, "total": False}
        p, a = self.predicted.device(device), self.actual.device(device)
        logged = p.total - p.process - p.growth
        return {
            "weights": abs(p.weights - a.weights) <= 0.0051 * MIB,
            "kv": abs(p.kv + p.recurrent - a.kv - a.recurrent) <= 0.0101 * MIB,
            "compute": abs(p.compute - a.compute) <= max(0.10 * a.compute, 0.0051 * MIB),
            "total": abs(logged - a.total) <= max(0.02 * a.total, 32 * MIB),
        }

    def ok(self, part: str) -> bool:
        """The target holds on every device; compute on the sum, as ``scripts/memory_accuracy.py`` counts it."""
        if self.actual is None:
            return False
        if part == "compute":
            p, a = self.predicted.sum_of("compute"), self.actual.sum_of("compute")
            return abs(p - a) <= max(0.10 * a, 0.0051 * MIB)
        return all(self.check(d)[part] for d in self.devices())


def argv(options: MemoryOptions, n_cpu_moe: int, endpoint: str) -> list[str]:
    """llama-server's flags for ``options`` with every block on the worker and N blocks' experts on the CPU."""
    out = ["-c", str(options.n_ctx), "-np", str(options.n_parallel), "-fit", "off", "--rpc", endpoint]
    out += ["-ngl", "all", "--n-cpu-moe", str(n_cpu_moe), "-t", "2"]
    return out + (["--kv-unified"] if options.kv_unified else [])


def run_n(binary: Path, path: Path, worker: RpcWorker, setting: str, options: MemoryOptions, n: int) -> Case:
    """Run ``path`` with the experts of its first ``n`` blocks on the CPU and compare the bill with the log."""
    endpoint, buffer = worker.endpoint, f"RPC0[{worker.endpoint}]"
    model = gguf.read(path)
    options = for_file(model, replace(options, n_gpu_layers=-1, split_names=(buffer,), n_cpu_moe=n))
    predicted = estimate(model.facts, options)
    log, _ = load_report(binary, path, argv(options, n, endpoint), until=DONE_MARKERS, timeout=SERVER_TIMEOUT_S)
    try:
        actual = parse_allocations(log)
    except ValueError as exc:
        return Case(path.stem, setting, n, predicted, None, f"{exc}: {log.strip()[-300:]!r}")
    return Case(path.stem, setting, n, predicted, actual)


@contextmanager
def fresh_worker(binary: Path, logs: Path) -> Iterator[tuple[RpcWorker, Inventory]]:
    """A ggml-rpc-server on a free loopback port, and the inventory with its device; stopped after.

    One per case: a worker serves one client at a time, and one whose last client was stopped mid-load may not
    take the next for a while.
    """
    from launcher.devices import discover
    from launcher.rpc import RpcWorkers
    from tests.helpers import free_port

    worker = RpcWorker(binary, host="127.0.0.1", port=free_port(), threads=1, log_path=logs / "worker.log")
    worker.start()
    try:
        worker.wait_ready()
        yield worker, discover(llama_server=binary.with_name("llama-server"), workers=RpcWorkers((worker.endpoint,)))
    finally:
        worker.stop()


def stand_in_gpu(worker: Device, budget: int) -> Device:
    """The worker's device as a GPU worker with ``budget`` bytes free would report it: free below total.

    A CPU worker reports all its RAM free (ggml does not measure it), and the planner spreads layers over
    it and the local CPU; a GPU worker reports its free VRAM, below the total, and is planned like a GPU.
    """
    return replace(worker, free_bytes=budget, total_bytes=max(worker.total_bytes, budget + 1))


def split_budget(path: Path, caps: Capabilities, cpu: Device, worker: Device, request: PlanRequest) -> int:
    """Free bytes for the stand-in (or a real GPU) that hold the model with one block's experts on the CPU, not
    with none."""
    inventory = Inventory((stand_in_gpu(worker, 1 << 40), cpu), ())
    full = plan(load_model(path), inventory, caps, request)
    whole = full.devices[0].bill.total
    facts = gguf.read(path).facts
    one = facts.expert_weight_bytes[0]
    # halfway between "everything" and "everything less one block's experts", over the planner's 90 % share
    return int((whole - one // 2) / 0.9)


def planned(
    binary: Path, path: Path, caps: Capabilities, cpu: Device, worker: Device, request: PlanRequest, logs: Path
) -> tuple[LaunchPlan, Case]:
    """Plan ``path`` onto the stand-in GPU sized by ``split_budget``, run the plan, and compare."""
    from launcher.command import build_command
    from launcher.registry import ChildRegistry
    from launcher.supervisor import Supervisor, owner_token

    budget = split_budget(path, caps, cpu, worker, request)
    inventory = Inventory((stand_in_gpu(worker, budget), cpu), ())
    lp = plan(load_model(path), inventory, caps, request)
    supervisor = Supervisor(logs_dir=logs / "logs", registry=ChildRegistry(logs / "run", owner_token()))
    try:
        with build_command(lp, caps, binary=binary) as command, supervisor:
            actual = supervisor.start(command.launch_spec(start_timeout=SERVER_TIMEOUT_S)).allocations
    except Exception as exc:  # noqa: BLE001 - the table says what failed, whatever it was
        return lp, Case(path.stem, "planned", lp.n_cpu_moe, lp.bill, None, f"{type(exc).__name__}: {exc}")
    return lp, Case(path.stem, "planned", lp.n_cpu_moe, lp.bill, actual)


def table(cases: Sequence[Case]) -> None:
    print(
        f"{'model':22} {'setting':18} {'N':>2} {'device':26} {'weights pred/log':>19} {'kv pred/log':>15} "
        f"{'compute pred/log':>17} {'total pred/log':>19}  flags"
    )
    for c in cases:
        if c.actual is None:
            print(f"{c.model:22} {c.setting:18} {c.n_cpu_moe:>2} ERROR {c.error}")
            continue
        for name in c.devices():
            p, a, ok = c.predicted.device(name), c.actual.device(name), c.check(name)
            logged = p.total - p.process - p.growth
            flags = "".join(
                f if ok[k] else "-" for k, f in (("weights", "W"), ("kv", "K"), ("compute", "C"), ("total", "T"))
            )
            print(
                f"{c.model:22} {c.setting:18} {c.n_cpu_moe:>2} {name[:26]:26} "
                f"{_mib(p.weights):>9}/{_mib(a.weights):<9} {_mib(p.kv):>7}/{_mib(a.kv):<7} "
                f"{_mib(p.compute):>8}/{_mib(a.compute):<8} {_mib(logged):>9}/{_mib(a.total):<9}  {flags}"
            )


def summary(cases: Sequence[Case], plans: Sequence[LaunchPlan]) -> str:
    m = len(cases)
    count = lambda part: sum(c.ok(part) for c in cases)  # noqa: E731
    split = sum(p.n_cpu_moe > 0 and p.n_gpu_layers == p.model.facts.block_count + 1 for p in plans)
    # compute per device too: a bill right in sum can still put a buffer on the wrong device
    rows = [(c, d) for c in cases for d in c.devices()]
    per_device = sum(c.actual is not None and c.check(d)["compute"] for c, d in rows)
    return (
        f"moe-split: weights_exact={count('weights')}/{m} kv_exact={count('kv')}/{m} "
        f"compute_within_10pct={count('compute')}/{m} total_within_2pct={count('total')}/{m} "
        f"planned_split={split}/{len(plans)} device_compute_within_10pct={per_device}/{len(rows)}"
    )


def _mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def main(argv_: Sequence[str] | None = None) -> int:
    import tempfile

    from launcher.build import ensure_built
    from launcher.capabilities import probe
    from launcher.discovery import find_rpc_server
    from studio.settings import Settings
    from tests.support.wide_zoo import ensure_split_moe_zoo
    from tests.support.zoo import ensure_zoo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: every one)")
    args = parser.parse_args(argv_)
    settings = Settings.from_env()
    build = ensure_built(settings.home)
    zoo = ensure_zoo(build, settings.home)
    paths = ensure_split_moe_zoo(zoo, build.llama_server, zoo.with_name(f"{zoo.name}-moe-split"))
    wanted = [m for m in args.models.split(",") if m]
    paths = [p for p in paths if not wanted or p.stem in wanted]
    caps = probe(build.llama_server)
    request = PlanRequest(n_ctx=2048, spec="off", threads=2, cache_ram_mib=0)
    cases: list[Case] = []
    plans: list[LaunchPlan] = []
    rpc_server = find_rpc_server(home=settings.home).path
    with tempfile.TemporaryDirectory(prefix="moe-split-") as tmp:
        logs = Path(tmp)
        for path in paths:
            blocks = gguf.read(path).facts.block_count
            for setting, options in SETTINGS:
                for n in range(blocks + 1):
                    with fresh_worker(rpc_server, logs) as (worker, _):
                        cases.append(run_n(build.llama_server, path, worker, setting, options, n))
            with fresh_worker(rpc_server, logs) as (_, inventory):
                lp, case = planned(build.llama_server, path, caps, inventory.cpu, inventory.rpc[0], request, logs)
            plans.append(lp)
            cases.append(case)
            print(f"{path.stem}: planned with --n-cpu-moe {lp.n_cpu_moe}, -ngl {lp.n_gpu_layers}")
            for reason in lp.reasons:
                if "n-cpu-moe" in reason:
                    print(f"  {reason}")
    table(cases)
    print(summary(cases, plans))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
