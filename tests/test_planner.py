"""The launch planner: every policy branch over fake device sets and real model facts (Gemma, the zoo).

Device sizes are derived from the estimator's own bill for the model (``need``), so each row
lands in the branch it names whatever the estimator's exact numbers are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gguf
from launcher.allocations import parse_allocations
from launcher.capabilities import Capabilities
from launcher.devices import Device, Inventory, discover
from launcher.extra_args import ExtraArgsError
from launcher.memory import MemoryOptions, MemoryPlanError, estimate, for_file
from launcher.planner import (
    BUDGET_FRACTION,
    GPU_SLOTS,
    MTP_BUDGET_FRACTION,
    LaunchPlan,
    ModelInfo,
    PlanError,
    PlanRequest,
    load_model,
    plan,
    predict,
)
from launcher.speculative import SpeculativeConfigError
from launcher.units import MIB
from scripts.memory_accuracy import DONE_MARKERS
from tests.support.dry_run import load_report

FIXTURES = Path(__file__).parent / "fixtures"
CLI = str(Path(sys.executable).parent / "ggstudio")
GIB = 1024 * MIB
GEMMA_FULL = 19  # 18 blocks + the output layer


# --- inputs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_fit(real) -> Capabilities:
    """The real build as if it predated --fit."""
    return dataclasses.replace(real, flags=real.flags - {"--fit", "-fit"})


def cpu(free: int, total: int | None = None) -> Device:
    return Device("CPU", None, "Test CPU", total or max(free, 64 * GIB), free, "psutil")


def gpu(index: int, free: int, name: str = "NVIDIA H100 80GB HBM3", backend: str = "CUDA") -> Device:
    return Device(backend, index, name, max(free, 80 * GIB), free, "nvidia-smi", f"GPU-{index:08x}-0000")


def machine(*gpus: Device, ram: int = 64 * GIB) -> Inventory:
    return Inventory((*gpus, cpu(ram)), ())


def need(
    model: ModelInfo,
    caps: Capabilities,
    n_ctx: int,
    *,
    device: str = "GPU0",
    gpus: int = 1,
    request: PlanRequest = PlanRequest(),
) -> int:
    """Bytes ``device`` holds at ``n_ctx`` fully offloaded on ``gpus`` equal GPUs (or on the CPU with gpus=0)."""
    return predict(model, caps, request, n_ctx=n_ctx, gpus=tuple(gpu(i, GIB) for i in range(gpus))).device(device).total


def fitting(nbytes: int, fraction: float = BUDGET_FRACTION) -> int:
    """Free memory whose budget just holds ``nbytes``."""
    return int(nbytes / fraction) + 64 * 1024


def reasons(p: LaunchPlan) -> str:
    return "\n".join(p.reasons)


# --- CPU-only machines ----------------------------------------------------------------------------


def test_cpu_with_lots_of_ram_gets_the_native_context(gemma, real):
    p = plan(gemma, machine(), real)
    assert (p.gpus, p.offload, p.n_gpu_layers, p.n_ctx, p.n_ctx_auto) == ((), "ngl", 0, 32768, True)
    assert p.max_safe_ctx == 32768 and p.fits and not p.warnings
    assert "the native 32768 tokens fit in available RAM" in reasons(p)
    assert "no usable GPU" in reasons(p)
    assert [d.name for d in p.devices] == ["CPU"] and p.budget_fraction == BUDGET_FRACTION


def test_cpu_with_little_ram_shrinks_the_context_to_a_multiple_of_256(gemma, real):
    ram = fitting(need(gemma, real, 8192, device="CPU", gpus=0))
    p = plan(gemma, machine(ram=ram), real)
    assert p.n_ctx == 8192 and p.max_safe_ctx == 8192 and p.fits
    assert "8192 tokens, the largest that fits in available RAM (native 32768, rounded down to 256)" in reasons(p)
    assert p.devices[-1].budget_bytes == int(ram * BUDGET_FRACTION)


def test_cpu_without_room_for_4096_falls_back_to_4096_with_a_warning(gemma, real):
    p = plan(gemma, machine(ram=100 * MIB), real)
    assert (p.n_ctx, p.offload, p.n_gpu_layers) == (4096, "ngl", 0)
    assert not p.fits and p.max_safe_ctx == 0
    assert any("even 4096 tokens do not fit in available RAM" in w for w in p.warnings)
    assert any(w.startswith("CPU (Test CPU): predicted") and "over the budget" in w for w in p.warnings)


def test_a_model_with_a_small_native_context_is_not_raised_to_4096(gemma, real):
    small = dataclasses.replace(gemma, facts=dataclasses.replace(gemma.facts, context_length=2048))
    assert plan(small, machine(), real).n_ctx == 2048
    assert plan(small, machine(ram=100 * MIB), real).n_ctx == 2048  # the floor is the native context


@pytest.mark.parametrize("name", ["llama-dense", "qwen35-dense", "deepseek2-moe", "gemma3-dense"])
def test_zoo_models_plan_their_native_context(zoo_dir, real, name):
    model = load_model(zoo_dir / f"{name}.gguf")
    assert model.facts.context_length == 256
    for inv in (machine(), machine(gpu(0, 80 * GIB))):
        p = plan(model, inv, real)
        assert p.n_ctx == 256 and p.fits and p.max_safe_ctx == 256, (inv, p.reasons)


# --- GPUs: automatic context ------------------------------------------------------------------------


def test_one_big_gpu_holds_everything(gemma, real):
    p = plan(gemma, machine(gpu(0, 80 * GIB)), real)
    assert ([d.index for d in p.gpus], p.offload, p.n_gpu_layers, p.n_ctx) == ([0], "ngl", GEMMA_FULL, 32768)
    assert p.tensor_split == () and p.fit_target_mib == () and p.fits
    assert "the native 32768 tokens fit fully offloaded on CUDA0, the fewest GPUs that hold it" in reasons(p)
    assert [d.name for d in p.devices] == ["GPU0", "CPU"]
    assert p.devices[0].bill.weights > 0 and p.devices[0].budget_bytes == int(80 * GIB * BUDGET_FRACTION)


def test_fewer_gpus_are_preferred_and_the_freest_is_chosen(gemma, real):
    p = plan(gemma, machine(gpu(0, 20 * GIB), gpu(1, 70 * GIB), gpu(2, 40 * GIB)), real)
    assert [d.index for d in p.gpus] == [1] and p.n_ctx == 32768


def test_two_gpus_when_one_cannot_hold_the_native_context(gemma, real):
    free = fitting(max(need(gemma, real, 32768, gpus=2, device=d) for d in ("GPU0", "GPU1")))
    assert need(gemma, real, 32768) > free * BUDGET_FRACTION  # one alone is not enough
    p = plan(gemma, machine(gpu(0, free), gpu(1, free), gpu(3, free)), real)
    assert [d.index for d in p.gpus] == [0, 1] and p.n_ctx == 32768 and p.n_gpu_layers == GEMMA_FULL
    assert p.tensor_split == (free // MIB, free // MIB)
    assert "fit fully offloaded on 2 GPUs (CUDA0 + CUDA1)" in reasons(p)
    assert "layers split over the GPUs in proportion to free memory" in reasons(p)
    assert [d.name for d in p.devices] == ["GPU0", "GPU1", "CPU"] and p.fits


def test_one_small_gpu_shrinks_the_context(gemma, real):
    free = fitting(need(gemma, real, 8192))
    p = plan(gemma, machine(gpu(0, free)), real)
    assert (p.n_ctx, p.offload, p.n_gpu_layers, p.max_safe_ctx) == (8192, "ngl", GEMMA_FULL, 8192)
    assert "8192 tokens, the largest that fits fully offloaded (native 32768 does not fit" in reasons(p)


def test_the_gpu_set_reaching_the_largest_context_wins_when_none_holds_native(gemma, real):
    small = fitting(need(gemma, real, 4096))
    big = fitting(need(gemma, real, 8192))
    p = plan(gemma, machine(gpu(0, small), gpu(1, big)), real)
    assert [d.index for d in p.gpus] == [0, 1] and 8192 < p.n_ctx < 32768, p.reasons
    assert "the fewest GPUs that reach it" in reasons(p) and p.fits
    # A GPU too small to take even its compute buffer adds nothing: the big one alone.
    p = plan(gemma, machine(gpu(0, 40 * MIB), gpu(1, big)), real)
    assert [d.index for d in p.gpus] == [1] and p.n_ctx == 8192


def test_auto_falls_back_to_4096_and_fit_when_nothing_fits(gemma, real):
    # Without speculation: --spec-default's logits (4 slots x 65 rows) alone outgrow these GPUs.
    off = PlanRequest(spec="off")
    # Three quarters of the need each: the output layer alone (a copy of Gemma's 170 MiB tied embeddings) and a
    # few blocks fit one GPU, the whole model does not fit the two.
    free = need(gemma, real, 4096, request=off) * 3 // 4
    p = plan(gemma, machine(gpu(0, free), gpu(1, free)), real, off)
    assert ([d.index for d in p.gpus], p.offload, p.n_ctx) == ([0, 1], "fit", 4096)
    assert 0 < p.n_gpu_layers < GEMMA_FULL
    # --fit keeps the same 10 % margin the planner budgets with.
    assert len(p.fit_target_mib) == 2 and all(abs(m - free * 0.1 / MIB) <= 1 for m in p.fit_target_mib)
    assert "even 4096 tokens do not fit fully offloaded on 2 GPUs (CUDA0 + CUDA1)" in reasons(p)
    assert "--fit on: llama-server places the layers itself" in reasons(p)


def test_auto_falls_back_to_the_largest_ngl_without_fit(gemma, no_fit):
    off = PlanRequest(spec="off")
    free = need(gemma, no_fit, 4096, request=off) * 3 // 4  # the output layer (170 MiB of tied embeddings) and more
    p = plan(gemma, machine(gpu(0, free)), no_fit, off)
    assert (p.offload, p.n_ctx) == ("ngl", 4096) and 0 < p.n_gpu_layers < GEMMA_FULL
    assert (
        f"-ngl {p.n_gpu_layers}: the most layers (of 19) that fit the GPUs; this llama-server has no --fit"
        in reasons(p)
    )
    assert p.devices[0].fits  # the GPU share is within budget
    more = plan(gemma, machine(gpu(0, free)), no_fit, PlanRequest(n_ctx=4096, spec="off"))
    assert more.n_gpu_layers == p.n_gpu_layers


# --- GPUs: explicit context -------------------------------------------------------------------------


def test_explicit_context_is_honoured_on_the_fewest_gpus(gemma, real):
    inv = machine(gpu(0, 80 * GIB), gpu(1, 80 * GIB))
    p = plan(gemma, inv, real, PlanRequest(n_ctx=12000))
    assert p.n_ctx == 12000 and not p.n_ctx_auto and [d.index for d in p.gpus] == [0]
    assert "context 12000 tokens, as requested" in reasons(p)
    assert "fully offloaded on CUDA0, the fewest GPUs that hold it" in reasons(p)


def test_explicit_context_pins_as_many_gpus_as_needed(gemma, real):
    free = fitting(max(need(gemma, real, 32768, gpus=3, device=f"GPU{i}") for i in range(3)))
    assert max(need(gemma, real, 32768, gpus=2, device=f"GPU{i}") for i in range(2)) > free * BUDGET_FRACTION
    # Four GPUs, the freest first: two are not enough, three are.
    inv = machine(gpu(0, free), gpu(1, free // 4), gpu(2, free), gpu(3, free))
    p = plan(gemma, inv, real, PlanRequest(n_ctx=32768))
    assert [d.index for d in p.gpus] == [0, 2, 3] and p.n_ctx == 32768 and p.fits
    assert p.max_safe_ctx >= 32768


def test_explicit_context_that_fits_nowhere_uses_fit(gemma, real):
    free = need(gemma, real, 4096) // 3
    p = plan(gemma, machine(gpu(0, free), gpu(1, free)), real, PlanRequest(n_ctx=32768))
    assert (p.offload, p.n_ctx, [d.index for d in p.gpus]) == ("fit", 32768, [0, 1])
    assert "does not fit fully offloaded on 2 GPUs" in reasons(p)


def test_explicit_context_that_fits_nowhere_without_fit_uses_the_largest_ngl(gemma, no_fit, legacy):
    free = need(gemma, no_fit, 4096, request=PlanRequest(spec="off")) * 3 // 4
    for caps in (no_fit, legacy):
        p = plan(gemma, machine(gpu(0, free)), caps, PlanRequest(n_ctx=8192, spec="off"))
        assert p.offload == "ngl" and 0 < p.n_gpu_layers < GEMMA_FULL and p.n_ctx == 8192
        assert p.devices[0].fits


def test_explicit_context_beyond_the_native_one_is_kept_with_a_warning(gemma, real):
    p = plan(gemma, machine(), real, PlanRequest(n_ctx=65536))
    assert p.n_ctx == 65536 and p.max_safe_ctx == 32768
    assert any("beyond the model's native 32768 tokens" in w for w in p.warnings)


def test_explicit_context_on_a_small_cpu_warns_but_is_kept(gemma, real):
    p = plan(gemma, machine(ram=100 * MIB), real, PlanRequest(n_ctx=16384))
    assert p.n_ctx == 16384 and not p.fits and any("over the budget" in w for w in p.warnings)


# --- budgets, speculative decoding, parallel slots -------------------------------------------------


def test_an_engaged_mtp_draft_lowers_the_budget_to_85_percent(mtp_model, real):
    p = plan(mtp_model, machine(gpu(0, 80 * GIB)), real)
    assert p.spec.resolved == "mtp" and p.mtp_engaged and p.budget_fraction == MTP_BUDGET_FRACTION
    assert p.devices[0].budget_bytes == int(80 * GIB * MTP_BUDGET_FRACTION)
    assert (
        "budget: 85 % of free memory per device "
        "(85 %: what an MTP draft allocates after its first batch is not measured)" in reasons(p)
    )
    assert "speculative: auto: MTP model on GPU; MTP alone, 2 drafted tokens" in reasons(p)
    assert p.spec.argv == ("--spec-type", "draft-mtp", "--spec-draft-n-max", "2")


def test_the_85_percent_budget_changes_the_fit(mtp_model, gemma, real):
    # Memory that holds the native context at 90 % but not at 85 %.
    off = PlanRequest(spec="off")  # --spec-default's 64 drafted rows of logits would dwarf MTP's 2
    nbytes = need(gemma, real, 32768, request=off)
    free = int(nbytes / 0.875)
    assert plan(gemma, machine(gpu(0, free)), real, off).n_ctx == 32768
    assert plan(mtp_model, machine(gpu(0, free)), real).n_ctx < 32768
    assert plan(mtp_model, machine(gpu(0, free)), real, PlanRequest(spec="off")).n_ctx == 32768


def test_a_user_spec_type_with_mtp_also_counts_as_an_mtp_draft(mtp_model, real):
    p = plan(mtp_model, machine(), real, PlanRequest(extra_args=("--spec-type", "draft-mtp")))
    assert p.spec.resolved == "user" and p.spec.argv == () and p.mtp_engaged
    assert p.budget_fraction == MTP_BUDGET_FRACTION


def test_cpu_auto_spec_for_a_big_mtp_model_chains_ngram(mtp_model, real):
    p = plan(mtp_model, machine(), real, PlanRequest(spec="auto", spec_n_max=4))
    assert p.spec.resolved == "mtp+ngram" and p.spec.argv[:4] == (
        "--spec-type",
        "draft-mtp,ngram-mod",
        "--spec-draft-n-max",
        "4",
    )


def test_parallel_slots_share_the_context(gemma, real):
    p = plan(gemma, machine(), real, PlanRequest(n_ctx=32768, n_parallel=4))
    assert p.n_parallel == 4 and "4 parallel slots share the context: 8192 tokens each" in reasons(p)
    single = plan(gemma, machine(), real, PlanRequest(n_ctx=32768, n_parallel=1))
    assert p.bill.sum_of("output") == 4 * single.bill.sum_of("output")


# --- slots by device ---------------------------------------------------------------------------------


def test_a_gpu_plan_gets_four_slots_on_a_unified_kv_cache(gemma, real):
    """On main every model got one slot, on GPUs too, where batching several requests is the throughput."""
    p = plan(gemma, machine(gpu(0, 80 * GIB)), real)
    assert (p.n_parallel, p.kv_unified, p.n_ctx, p.slot_ctx) == (GPU_SLOTS, True, 32768, 32768)
    assert "slots: 4 on a unified KV cache, llama-server's own default: the model runs on GPUs" in reasons(p)
    one = plan(gemma, machine(gpu(0, 80 * GIB)), real, PlanRequest(n_parallel=1))
    assert (one.n_parallel, one.kv_unified, one.n_ctx) == (1, False, 32768)
    # one stream: the full-attention cache costs what one slot's does; the sliding window is kept per slot
    # (512 x 4 + the 512-token ubatch), and each slot adds a row of logits
    cells = lambda q: [(c.label, c.cells, c.streams) for c in q.bill.caches]  # noqa: E731
    assert cells(one) == [("non-SWA", 32768, 1), ("SWA", 1024, 1)]
    assert cells(p) == [("non-SWA", 32768, 1), ("SWA", 2560, 1)]
    assert p.bill.sum_of("output") == 4 * one.bill.sum_of("output")


def test_a_cpu_plan_gets_llama_servers_own_four_unified_slots(gemma, real):
    """On main a CPU plan got one slot: eight clients at once got 0.76x llama-server's own default's tokens/s."""
    p = plan(gemma, machine(), real)
    assert (p.n_parallel, p.kv_unified, p.slot_ctx) == (4, True, 32768)
    assert "slots: 4 on a unified KV cache, llama-server's own default: on the CPU too" in reasons(p)
    one = plan(gemma, machine(), real, PlanRequest(n_parallel=1))
    # the KV cache's full-attention cells are the context's either way; the SWA window is kept per slot
    assert p.bill.caches[0].total == one.bill.caches[0].total and p.bill.total > one.bill.total


def test_the_requested_slots_win_on_either_device(gemma, real):
    on_gpu = plan(gemma, machine(gpu(0, 80 * GIB)), real, PlanRequest(n_parallel=2))
    assert (on_gpu.n_parallel, on_gpu.kv_unified, on_gpu.slot_ctx) == (2, True, 32768)
    assert "slots: 2, as requested, on a unified KV cache" in reasons(on_gpu)
    on_cpu = plan(gemma, machine(), real, PlanRequest(n_parallel=2))
    assert (on_cpu.n_parallel, on_cpu.kv_unified, on_cpu.slot_ctx) == (2, False, 16384)
    assert "2 parallel slots share the context: 16384 tokens each" in reasons(on_cpu)


def test_rpc_workers_alone_get_four_slots_and_an_embedding_instance_one(gemma, real):
    rpc = Device("RPC", 0, "10.0.0.2:50052", 24 * GIB, 24 * GIB, "rpc", endpoint="10.0.0.2:50052", worker_index=0)
    with_rpc = dataclasses.replace(real, flags=real.flags | {"--rpc"})  # a build with -DGGML_RPC=ON
    over_rpc = plan(gemma, Inventory((rpc, cpu(64 * GIB)), ()), with_rpc)
    assert over_rpc.rpc_workers == ("10.0.0.2:50052",)
    assert (over_rpc.n_parallel, over_rpc.kv_unified) == (4, True)
    embedder = plan(gemma, machine(gpu(0, 80 * GIB)), real, PlanRequest(embeddings=True))
    assert (embedder.n_parallel, embedder.kv_unified) == (1, False)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smollm_model", "gemma_model"])
def test_the_gpu_slot_default_bills_what_llama_server_allocates(fixture, llama_server_bin, real, request):
    """Four slots on a unified cache, as a GPU plan has them, run on the CPU: KV exact, compute within 10 %.

    SmolLM2 has one full-attention cache; Gemma 3 a sliding-window one too, which grows with the slots.
    """
    path = request.getfixturevalue(fixture)
    p = plan(load_model(path), machine(gpu(0, 80 * GIB)), real)
    assert (p.n_parallel, p.kv_unified) == (4, True)
    file = gguf.read(path)
    for slots, flags in ((1, ["-np", "1"]), (p.n_parallel, ["-np", str(p.n_parallel), "--kv-unified"])):
        options = MemoryOptions(n_ctx=p.n_ctx, n_parallel=slots, kv_unified=slots > 1)
        predicted = estimate(file.facts, for_file(file, options))
        log, _ = load_report(llama_server_bin, path, ["-c", str(p.n_ctx), *flags], until=DONE_MARKERS)
        actual = parse_allocations(log)
        shape = lambda b: [(c.label, c.cells, c.streams, c.k_bytes, c.v_bytes) for c in b.caches]  # noqa: E731
        assert shape(predicted) == shape(actual) and predicted.sum_of("kv") == actual.sum_of("kv")
        assert predicted.sum_of("output") == slots * file.facts.vocab_size * 4
        assert f"{predicted.sum_of('output') / MIB:.2f}" == f"{actual.sum_of('output') / MIB:.2f}"  # as the log has it
        p_compute, a_compute = predicted.sum_of("compute"), actual.sum_of("compute")
        assert abs(p_compute - a_compute) <= 0.10 * a_compute, (slots, p_compute / MIB, a_compute / MIB)
    # the GPU plan's own bill holds the same KV cache and output rows
    assert p.bill.device("GPU0").kv == actual.sum_of("kv") and p.bill.sum_of("output") == predicted.sum_of("output")


def test_a_quantized_cache_turns_flash_attention_on_and_shrinks_the_kv(gemma, real):
    p = plan(gemma, machine(), real, PlanRequest(n_ctx=32768, cache_type_k="q8_0", cache_type_v="q8_0"))
    f16 = plan(gemma, machine(), real, PlanRequest(n_ctx=32768))
    assert p.flash_attn == "on" and f16.flash_attn == "auto"
    assert p.bill.sum_of("kv") < f16.bill.sum_of("kv")
    assert "flash attention on: the q8_0 cache needs it" in reasons(p)


@pytest.mark.parametrize(
    ("request_", "error", "match"),
    [
        (PlanRequest(n_ctx=0), PlanError, "positive number of tokens"),
        (PlanRequest(n_parallel=0), PlanError, "at least 1"),
        (PlanRequest(cache_type_k="q9_9"), PlanError, "unknown K cache type 'q9_9'"),  # type: ignore[arg-type]
        (PlanRequest(threads=0), PlanError, "threads must be at least 1"),
        (PlanRequest(spec="turbo"), SpeculativeConfigError, "unknown speculative mode"),
        (PlanRequest(cache_type_k="f16", cache_type_v="q4_0", n_ctx=4096), None, None),
        (
            PlanRequest(extra_args=("--port", "9", "-m", "x.gguf", "--api_key", "k", "-ngl", "3")),
            ExtraArgsError,
            r"--port .*-m .*--api_key .*-ngl ",
        ),
    ],
)
def test_bad_requests_are_refused_with_a_clear_error(gemma, real, request_, error, match):
    if error is None:
        assert plan(gemma, machine(), real, request_).flash_attn == "on"
        return
    with pytest.raises(error, match=match):
        plan(gemma, machine(), real, request_)


def test_a_cache_type_llama_cpp_refuses_is_a_memory_plan_error(gemma, real):
    facts = dataclasses.replace(gemma.facts, key_length=200, key_length_swa=200)  # q8_0 blocks of 32 do not divide
    with pytest.raises(MemoryPlanError, match="does not divide"):
        plan(dataclasses.replace(gemma, facts=facts), machine(), real, PlanRequest(cache_type_k="q8_0"))


def test_plan_is_pure_and_deterministic(gemma, real):
    inv = machine(gpu(0, 3 * GIB), gpu(1, 2 * GIB))
    assert plan(gemma, inv, real) == plan(gemma, inv, real)


def test_only_one_backend_is_planned(gemma, real):
    vk = Device("Vulkan", 0, "AMD Radeon RX 7900 XTX", 24 * GIB, 23 * GIB, "llama-server")
    p = plan(gemma, Inventory((gpu(0, 8 * GIB), vk, cpu(64 * GIB)), ()), real)
    assert [d.backend for d in p.gpus] == ["CUDA"]
    assert "planning on the CUDA GPUs only" in reasons(p) and "Vulkan0" in reasons(p)


# --- the fake nvidia-smi machines, end to end -------------------------------------------------------


@pytest.fixture
def nvidia(tmp_path, monkeypatch):
    bin_dir = tmp_path / "tools"
    bin_dir.mkdir()
    shutil.copy2(FIXTURES / "gpu-tools" / "nvidia-smi", bin_dir / "nvidia-smi")
    monkeypatch.setenv("PATH", str(bin_dir))
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)

    def machine_named(mode: str, llama_server: Path | None = None) -> Inventory:
        monkeypatch.setenv("FAKE_NVIDIA_SMI", mode)
        return discover(llama_server=llama_server)

    return machine_named


@pytest.mark.parametrize(("mode", "pinned"), [("none", []), ("one", [0]), ("two", [0]), ("four", [0])])
def test_fake_nvidia_machines(nvidia, gemma, real, mode, pinned):
    p = plan(gemma, nvidia(mode), real)
    assert [d.index for d in p.gpus] == pinned and p.n_ctx == 32768 and p.fits


def test_fake_four_gpu_machine_with_the_big_one_hidden(nvidia, gemma, real, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")  # the two RTX 4090s: 23817 and 1024 MiB free
    p = plan(gemma, nvidia("four"), real)
    assert [(d.index, d.name) for d in p.gpus] == [(1, "NVIDIA GeForce RTX 4090")]


def test_a_cpu_build_on_a_gpu_machine_plans_cpu_only(nvidia, gemma, real, llama_server_bin):
    # Regression: nvidia-smi's GPUs were pinned and given layers a CPU-only llama-server cannot offload.
    p = plan(gemma, nvidia("two", llama_server_bin), real)
    assert (p.gpus, p.n_gpu_layers, [d.name for d in p.devices]) == ((), 0, ["CPU"])
    assert "no usable GPU: everything runs on the CPU (-ngl 0)" in reasons(p)
    assert any(
        w.startswith("nvidia-smi sees 2 GPUs, but this llama-server has no CUDA backend (a cpu build)")
        for w in p.warnings
    )


def test_a_cuda_build_on_a_gpu_machine_pins_as_before(nvidia, gemma, real, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_DEVICES", "cuda")
    p = plan(gemma, nvidia("two", FIXTURES / "bin" / "llama-server"), real)
    assert [(d.index, d.source) for d in p.gpus] == [(0, "nvidia-smi")] and p.n_gpu_layers == GEMMA_FULL
    assert not p.warnings


# --- the CLI ---------------------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, env=env)


def test_ggstudio_plan_json(gemma_model, llama_server_bin):
    out = run_cli("plan", str(gemma_model), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["model"]["architecture"] == "gemma3" and info["model"]["native_context"] == 32768
    assert info["context"]["automatic"] is True and 4096 <= info["context"]["n_ctx"] <= 32768
    assert info["context"]["max_safe"] >= info["context"]["n_ctx"]
    assert info["speculative"]["requested"] == "auto" and info["speculative"]["argv"] == ["--spec-default"]
    cpu_bill = next(b for b in info["bill"] if b["device"] == "CPU")
    assert cpu_bill["weights_bytes"] > 200 * MIB and cpu_bill["kv_bytes"] > 0 and cpu_bill["fits"]
    assert any("budget: 90 %" in r for r in info["reasons"])
    argv = info["argv"]
    assert argv[argv.index("-m") + 1] == str(gemma_model) and "--api-key-file" in argv


def test_ggstudio_plan_options_and_text(gemma_model, llama_server_bin):
    out = run_cli("plan", str(gemma_model), "--ctx", "8192", "--parallel", "2", "--spec", "ngram-mod")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "context    8192 tokens (requested; native 32768" in text
    assert "spec       ngram -> ngram (--spec-type ngram-mod" in text
    assert "predicted memory" in text and "reasons" in text and "2 parallel slots share the context" in text


def test_ggstudio_plan_shows_why_the_gpus_are_unused(gemma_model, llama_server_bin, tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy2(FIXTURES / "gpu-tools" / "nvidia-smi", tools / "nvidia-smi")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "GGUF_STUDIO_LLAMA_CPP")}
    env.update(
        LLAMA_SERVER_PATH=str(llama_server_bin),
        FAKE_NVIDIA_SMI="one",
        PATH=f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
    )
    text = run_cli("plan", str(gemma_model), env=env).stdout
    assert "offload    CPU only (-ngl 0)" in text
    assert "\nwarnings\n  ! nvidia-smi sees 1 GPU, but this llama-server has no CUDA backend (a cpu build)" in text


def test_ggstudio_plan_takes_a_model_name_and_its_config_defaults(gemma_model, llama_server_bin, tmp_path):
    (tmp_path / "config.toml").write_text(
        f"model_dirs = [{str(gemma_model.parent)!r}]\n"
        f'[models."{gemma_model.stem}"]\nn_ctx = 8192\nn_parallel = 2\nspec = "ngram"\ncache_type_kv = "q8_0"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GGUF_STUDIO_LLAMA_CPP", "GGUF_STUDIO_CONFIG")}
    env.update(GGUF_STUDIO_HOME=str(tmp_path), LLAMA_SERVER_PATH=str(llama_server_bin))
    info = json.loads(run_cli("plan", gemma_model.stem, "--json", env=env).stdout)
    assert (info["context"]["n_ctx"], info["context"]["automatic"]) == (8192, False)
    assert info["speculative"]["requested"] == "ngram" and "2 parallel slots share the context" in str(info["reasons"])
    argv = info["argv"]
    assert argv[argv.index("--cache-type-k") + 1] == argv[argv.index("--cache-type-v") + 1] == "q8_0"
    # what the command line gives wins over the config
    info = json.loads(
        run_cli("plan", str(gemma_model), "--ctx", "4096", "--cache-type", "f16", "--json", env=env).stdout
    )
    argv = info["argv"]
    assert info["context"]["n_ctx"] == 4096 and argv[argv.index("--cache-type-k") + 1] == "f16"
    assert info["speculative"]["requested"] == "ngram"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--spec", "turbo"), "error: unknown speculative mode 'turbo'"),
    ],
)
def test_ggstudio_plan_errors_are_one_line(gemma_model, llama_server_bin, args, message):
    out = run_cli("plan", str(gemma_model), *args)
    assert out.returncode == 1 and out.stderr.startswith(message)
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1


def test_ggstudio_plan_refuses_a_context_out_of_the_load_options_bounds_as_a_usage_error(gemma_model):
    """The flag's bounds are the load option's (``studio.load_options``), checked before anything is planned."""
    out = run_cli("plan", str(gemma_model), "--ctx", "-5")
    assert out.returncode == 2 and "Invalid value for '--ctx': -5 is not in the range 256<=x<=16777216" in out.stderr
    assert "Traceback" not in out.stderr
