"""A MoE model too large for its GPU keeps the experts of the fewest blocks on the CPU, and the bills hold.

The GPU is a real ``ggml-rpc-server`` on loopback (``scripts/moe_split.py``): a non-CPU device for
llama-server whose buffers are logged apart from the CPU's, reporting a free memory below its total
as a GPU worker does. The model is the zoo's Qwen3-MoE at Qwen3-30B-A3B's proportions (128 experts,
8 routed), small enough to send to the worker.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from launcher.capabilities import Capabilities
from launcher.command import build_command
from launcher.devices import Device, Inventory
from launcher.discovery import find_rpc_server
from launcher.planner import PlanRequest, load_model, plan
from launcher.units import GIB, MIB
from scripts.moe_split import SETTINGS, fresh_worker, planned, run_n
from studio.views.fit import badge
from studio.views.plan import plan_json, render_plan
from tests.support.wide_zoo import ensure_split_moe_zoo

REQUEST = PlanRequest(n_ctx=2048, spec="off", threads=2, cache_ram_mib=0)


@pytest.fixture(scope="module")
def qwen3_moe(zoo_dir, llama_server_bin) -> Path:
    paths = ensure_split_moe_zoo(zoo_dir, llama_server_bin, zoo_dir.with_name(f"{zoo_dir.name}-moe-split"))
    return next(p for p in paths if p.stem.startswith("qwen3moe"))


def _gpu(free: int) -> Device:
    return Device("CUDA", 0, "a small GPU", 8 * GIB, free, "nvidia-smi")


def _cpu() -> Device:
    return Device("CPU", None, "CPU", 64 * GIB, 48 * GIB, "psutil", cores=8)


def test_a_moe_model_that_fits_no_gpu_whole_keeps_only_experts_on_the_cpu(
    qwen3_moe, real: Capabilities, llama_server_bin
):
    model = load_model(qwen3_moe)
    whole = plan(model, Inventory((_gpu(8 * GIB), _cpu()), ()), real, REQUEST)
    assert whole.n_cpu_moe == 0 and whole.n_gpu_layers == whole.model.facts.block_count + 1
    gpu_bill = whole.bill.device("GPU0").total
    small = plan(model, Inventory((_gpu(int((gpu_bill - 40 * MIB) / 0.9)), _cpu()), ()), real, REQUEST)
    # every block stays on the GPU (attention and KV cache with it); the first block's experts go to the CPU
    assert small.n_cpu_moe == 1 and small.n_gpu_layers == small.model.facts.block_count + 1 and small.fits
    assert small.bill.device("GPU0").kv == whole.bill.device("GPU0").kv
    experts = model.facts.expert_weight_bytes[0]
    assert small.bill.device("CPU").weights >= whole.bill.device("CPU").weights + experts
    assert any("--n-cpu-moe 1: the routed experts of 1 of 2 MoE layers" in r for r in small.reasons)
    shown = render_plan(plan_json(small))
    assert (
        "offload    -ngl 3 on CUDA0 a small GPU; the routed experts of the first layer on the CPU (--n-cpu-moe 1)"
        in (shown)
    )
    fit = {"fits": True, "n_ctx": 2048, "devices": ["CUDA0 a small GPU"], "offload": "ngl", "evicts": []}
    assert "3/2 layers" not in badge({**fit, "n_gpu_layers": 3, "layers": 2, "n_cpu_moe": 1})
    assert "2/2 layers on CUDA0 a small GPU, the experts of 1 on the CPU" in badge(
        {**fit, "n_gpu_layers": 3, "layers": 2, "n_cpu_moe": 1}
    )
    with build_command(small, real, binary=llama_server_bin) as command:
        argv = command.argv(8080)
    assert argv[argv.index("--n-cpu-moe") + 1] == "1" and argv[argv.index("--n-gpu-layers") + 1] == "3"


def test_a_binary_without_n_cpu_moe_lowers_the_layers_as_before(qwen3_moe, real: Capabilities):
    model = load_model(qwen3_moe)
    gpu_bill = plan(model, Inventory((_gpu(8 * GIB), _cpu()), ()), real, REQUEST).bill.device("GPU0").total
    older = replace(real, flags=frozenset(f for f in real.flags if f not in ("--n-cpu-moe", "-ncmoe")))
    p = plan(model, Inventory((_gpu(int((gpu_bill - 40 * MIB) / 0.9)), _cpu()), ()), older, REQUEST)
    assert p.n_cpu_moe == 0 and (p.offload == "fit" or p.n_gpu_layers < p.model.facts.block_count + 1)


@pytest.mark.slow
def test_the_split_runs_over_a_stand_in_gpu_with_exact_bills(qwen3_moe, llama_server_bin, real, settings, tmp_path):
    with fresh_worker(find_rpc_server(home=settings.home).path, tmp_path) as (_, inventory):
        lp, case = planned(llama_server_bin, qwen3_moe, real, inventory.cpu, inventory.rpc[0], REQUEST, tmp_path)
    assert case.actual is not None, case.error
    assert lp.n_cpu_moe == 1 and lp.n_gpu_layers == lp.model.facts.block_count + 1
    worker = inventory.rpc[0].rpc_buffer_name or ""
    # the KV cache of every layer is on the stand-in GPU: every layer's attention runs there
    assert case.actual.device(worker).kv == case.actual.sum_of("kv") > 0
    for device in (worker, "CPU"):
        assert case.check(device)["weights"] and case.check(device)["kv"] and case.check(device)["total"], device
    assert case.ok("compute")


def test_gpt_oss_late_mask_lives_on_the_cpu_not_beside_the_gpu_ffn(zoo_dir, llama_server_bin, settings, tmp_path):
    """GPT-OSS's full-attention mask, first read after the CPU's experts, was billed on the wrong device."""
    paths = ensure_split_moe_zoo(zoo_dir, llama_server_bin, zoo_dir.with_name(f"{zoo_dir.name}-moe-split"))
    gpt_oss = next(p for p in paths if p.stem.startswith("gpt-oss"))
    setting, options = SETTINGS[1]  # 8192 tokens: a full-attention mask four times a hidden state
    with fresh_worker(find_rpc_server(home=settings.home).path, tmp_path) as (worker, _):
        case = run_n(llama_server_bin, gpt_oss, worker, setting, options, 1)
    assert case.actual is not None, case.error
    for device in case.devices():
        assert case.check(device)["compute"], (device, case.predicted.device(device), case.actual.device(device))
