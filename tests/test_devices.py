"""Device discovery through fake nvidia-smi / rocm-smi on PATH, the real llama-server, and psutil."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import psutil
import pytest

from launcher.devices import Device, discover, free_memory_of, parse_list_devices, visible, wait_for_memory_release
from launcher.units import MIB

FIXTURES = Path(__file__).parent / "fixtures"
H100_0 = "GPU-2f6b8c1e-7a53-4b9e-9d2c-1f0e3a4b5c6d"
H100_2 = "GPU-9a0c7d55-1e2f-4a3b-8c4d-5e6f7a8b9c0d"
MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """Put only the named fake tools on PATH (nothing else: a real nvidia-smi must not leak in)."""
    bin_dir = tmp_path / "tools"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    for name in MASKS:
        monkeypatch.delenv(name, raising=False)

    def install(**modes: str) -> None:
        for tool, mode in modes.items():
            name = tool.replace("_", "-")
            shutil.copy2(FIXTURES / "gpu-tools" / name, bin_dir / name)
            monkeypatch.setenv(f"FAKE_{tool.upper()}", mode)

    return install


def _summary(inventory) -> list[tuple[str, int | None, str]]:
    return [(d.backend, d.index, d.name) for d in inventory.gpus]


def test_no_tools_means_just_the_cpu(tools):
    inventory = discover()
    assert inventory.gpus == () and inventory.warnings == ()
    cpu = inventory.cpu
    assert (cpu.backend, cpu.source, cpu.index) == ("CPU", "psutil", None)
    assert cpu.total_bytes == psutil.virtual_memory().total
    assert 0 < cpu.free_bytes <= cpu.total_bytes


@pytest.mark.parametrize(
    ("mode", "names"),
    [
        ("none", []),
        ("one", ["NVIDIA H100 80GB HBM3"]),
        ("two", ["NVIDIA H100 80GB HBM3"] * 2),
        ("four", ["NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"] * 2),
    ],
)
def test_nvidia_smi_machines(tools, mode, names):
    tools(nvidia_smi=mode)
    inventory = discover()
    assert [d.name for d in inventory.gpus] == names
    assert [d.index for d in inventory.gpus] == list(range(len(names)))
    assert inventory.warnings == ()
    assert inventory.devices[-1].backend == "CPU"


def test_nvidia_memory_is_in_bytes_with_uuids(tools):
    tools(nvidia_smi="four")
    rtx = discover().gpus[3]
    assert rtx == Device(
        "CUDA",
        3,
        "NVIDIA GeForce RTX 4090",
        24564 * MIB,
        1024 * MIB,
        "nvidia-smi",
        "GPU-5d8f21c9-aa10-4e2b-b7c3-0d9e8f7a6b5c",
    )


@pytest.mark.parametrize(
    ("mask", "indices"),
    [
        ("2,0", [2, 0]),
        ("1,", [1]),  # trailing comma
        ("", []),  # empty: no GPU
        ("  ", []),
        ("-1", []),
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("1,1,2", [1]),  # a repeated device is not usable twice
        (f"{H100_2},{H100_0}", [2, 0]),
        ("GPU-9a0c7d55", [2]),  # unique UUID prefix
        ("9a0c7d55-1e2f-4a3b-8c4d-5e6f7a8b9c0d", [2]),  # without the GPU- prefix
        ("GPU-5d,0", []),  # ambiguous prefix (two RTX 4090s start with 5d)
        ("GPU-ffffffff,0", []),
        ("3,GPU-2f6b", [3, 0]),
    ],
)
def test_cuda_visible_devices(tools, monkeypatch, mask, indices):
    tools(nvidia_smi="four")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    inventory = discover()
    assert [d.index for d in inventory.gpus] == indices
    assert inventory.warnings == ()


def test_index_masks_on_mixed_gpus_warn_without_pci_bus_order(tools, monkeypatch):
    tools(nvidia_smi="four")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    inventory = discover()
    assert [d.index for d in inventory.gpus] == [1]
    assert "CUDA_DEVICE_ORDER" in inventory.warnings[0]


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("fail", "exited with code 9: NVIDIA-SMI has failed"),
        ("garbage", "unexpected line"),
        ("hang", "did not finish within 0.5 s"),
    ],
)
def test_a_broken_nvidia_smi_is_skipped_with_a_warning(tools, mode, why):
    tools(nvidia_smi=mode)
    started = time.monotonic()
    inventory = discover(timeout=0.5)
    assert time.monotonic() - started < 5
    assert inventory.gpus == ()
    assert len(inventory.warnings) == 1 and inventory.warnings[0].startswith("nvidia-smi skipped: ")
    assert why in inventory.warnings[0]
    assert inventory.cpu.backend == "CPU"


def test_rocm_smi_machines(tools):
    tools(rocm_smi="one")
    (mi300,) = discover().gpus
    assert mi300 == Device(
        "ROCm", 0, "AMD Instinct MI300X OAM", 206141652992, 206141652992 - 293863424, "rocm-smi", "GPU-18f68e602b8a790f"
    )
    tools(rocm_smi="two")  # ROCm 5 spelling, a warning line before the JSON, a "system" entry
    inventory = discover()
    assert _summary(inventory) == [("ROCm", 0, "AMD Instinct MI210"), ("ROCm", 1, "AMD Instinct MI210")]
    assert inventory.gpus[1].free_bytes == 68702699520 - 34351349760
    assert inventory.warnings == ()


@pytest.mark.parametrize(
    ("env", "indices"),
    [
        ({"HIP_VISIBLE_DEVICES": "1"}, [1]),
        ({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"}, [1]),  # HIP indexes what ROCR left
        ({"ROCR_VISIBLE_DEVICES": "GPU-7e8f90123a4b5c6d,0"}, [1, 0]),
        ({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"}, []),
        ({"CUDA_VISIBLE_DEVICES": "1"}, [1]),  # HIP honours CUDA_VISIBLE_DEVICES when HIP_VISIBLE_DEVICES is unset
        ({"HIP_VISIBLE_DEVICES": ""}, []),
    ],
)
def test_rocm_visibility_masks(tools, monkeypatch, env, indices):
    tools(rocm_smi="two")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert [d.index for d in discover().gpus] == indices


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("fail", "exited with code 2: ERROR:root:Driver not initialized"),
        ("garbage", "not JSON"),
        ("hang", "did not finish"),
    ],
)
def test_a_broken_rocm_smi_is_skipped_with_a_warning(tools, mode, why):
    tools(rocm_smi=mode, nvidia_smi="one")
    inventory = discover(timeout=0.5)
    assert _summary(inventory) == [("CUDA", 0, "NVIDIA H100 80GB HBM3")]
    assert len(inventory.warnings) == 1 and inventory.warnings[0].startswith("rocm-smi skipped: ")
    assert why in inventory.warnings[0]


def test_both_vendors_at_once(tools):
    tools(nvidia_smi="two", rocm_smi="one")
    assert [d.backend for d in discover().devices] == ["CUDA", "CUDA", "ROCm", "CPU"]


def test_the_real_cpu_build_lists_no_devices(tools, llama_server_bin):
    # --list-devices leaves CPU devices out: a CPU-only build prints "Available devices:" and "  (none)".
    inventory = discover(llama_server=llama_server_bin)
    assert inventory.gpus == () and inventory.warnings == ()
    assert [d.backend for d in inventory.devices] == ["CPU"]


def test_list_devices_adds_backends_no_vendor_tool_covers(tools, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FIXTURES", str(FIXTURES))
    fake = FIXTURES / "bin" / "llama-server"
    alone = discover(llama_server=fake)
    assert _summary(alone) == [
        ("Vulkan", 0, "AMD Radeon RX 7900 XTX (RADV NAVI31)"),
        ("CUDA", 0, "NVIDIA H100 80GB HBM3"),
    ]
    assert alone.gpus[0].total_bytes == 24560 * MIB and alone.gpus[0].source == "llama-server"
    tools(nvidia_smi="one")  # nvidia-smi reports CUDA itself, with physical indices and UUIDs
    both = discover(llama_server=fake)
    assert [(d.backend, d.source) for d in both.gpus] == [("CUDA", "nvidia-smi"), ("Vulkan", "llama-server")]


def test_a_cpu_build_leaves_the_nvidia_gpus_out(tools, llama_server_bin):
    # Regression: a CPU build on a GPU machine was planned as if it could offload to nvidia-smi's GPUs.
    tools(nvidia_smi="two")
    inventory = discover(llama_server=llama_server_bin)
    assert inventory.gpus == ()
    (warning,) = inventory.warnings
    assert warning.startswith("nvidia-smi sees 2 GPUs, but this llama-server has no CUDA backend (a cpu build)")
    assert "`ggstudio build-llama --backend cuda`" in warning and "LLAMA_SERVER_PATH" in warning


def test_one_warning_per_missing_backend(tools, llama_server_bin):
    tools(nvidia_smi="four", rocm_smi="one")
    warnings = discover(llama_server=llama_server_bin).warnings
    assert [w.split(",")[0] for w in warnings] == ["nvidia-smi sees 4 GPUs", "rocm-smi sees 1 GPU"]
    assert "no ROCm backend" in warnings[1] and "--backend rocm" in warnings[1]


def test_a_cuda_build_keeps_nvidia_smis_gpus(tools, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_DEVICES", "cuda")
    tools(nvidia_smi="two")
    inventory = discover(llama_server=FIXTURES / "bin" / "llama-server")
    assert [(d.index, d.source, d.uuid) for d in inventory.gpus] == [
        (0, "nvidia-smi", H100_0),
        (1, "nvidia-smi", H100_2),
    ]
    assert inventory.warnings == ()


def test_a_cuda_build_keeps_the_physical_indices_under_a_mask(tools, monkeypatch):
    # The child lists its masked GPUs as CUDA0, CUDA1...; nvidia-smi's numbering is what gets pinned.
    monkeypatch.setenv("FAKE_LLAMA_DEVICES", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    tools(nvidia_smi="four")
    assert [d.index for d in discover(llama_server=FIXTURES / "bin" / "llama-server").gpus] == [2, 0]


def test_a_cuda_build_that_sees_no_gpu_says_to_check_the_driver(tools, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_LLAMA_DEVICES", "cuda-no-gpu")
    tools(nvidia_smi="one")
    build = tmp_path / "b11434-cuda"
    (build / "bin").mkdir(parents=True)
    shutil.copy2(FIXTURES / "bin" / "llama-server", build / "bin" / "llama-server")
    (build / "build-complete.json").write_text(json.dumps({"backend": "cuda"}))
    (warning,) = discover(llama_server=build / "bin" / "llama-server").warnings
    assert "(a cuda build) lists no CUDA device (its CUDA runtime cannot reach the GPUs)" in warning
    assert "check the driver" in warning and "build-llama" not in warning


def test_a_binary_the_studio_did_not_build_is_judged_by_its_listing(tools, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FIXTURES", str(FIXTURES))
    tools(rocm_smi="one")  # the fake lists Vulkan and CUDA devices, no ROCm
    inventory = discover(llama_server=FIXTURES / "bin" / "llama-server")
    assert [d.backend for d in inventory.gpus] == ["Vulkan", "CUDA"]
    (warning,) = inventory.warnings
    assert "lists no ROCm device (built without ROCm, or its runtime cannot reach the GPUs)" in warning


def test_an_unreadable_listing_filters_nothing(tools, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FIXTURES", str(FIXTURES))
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    tools(nvidia_smi="one")
    inventory = discover(llama_server=FIXTURES / "bin" / "llama-server")
    assert [d.source for d in inventory.gpus] == ["nvidia-smi"]
    assert inventory.warnings[0].startswith("llama-server skipped: exited with code 134")


def test_a_broken_llama_server_listing_is_a_warning(tools, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FIXTURES", str(FIXTURES))
    monkeypatch.setenv("FAKE_LLAMA_MODE", "garbage")
    inventory = discover(llama_server=FIXTURES / "bin" / "llama-server")
    assert inventory.gpus == ()
    assert inventory.warnings[0].startswith("llama-server skipped: no device list")


def test_parse_list_devices_none():
    assert parse_list_devices("Available devices:\n  (none)\n") == []


def test_visible_without_mask_keeps_everything():
    gpus = [Device("CUDA", i, "g", 1, 1, "nvidia-smi", f"GPU-{i}") for i in range(2)]
    assert visible(gpus, None) == gpus


def test_memory_release_wait_returns_once_free_memory_stops_rising():
    gib = 1 << 30
    reads = iter([{"GPU-a": 10 * gib}, {"GPU-a": 50 * gib}, {"GPU-a": 80 * gib}, {"GPU-a": 80 * gib + (3 << 20)}])
    clock = iter(range(100))
    slept = []
    assert (
        wait_for_memory_release(lambda: next(reads), timeout=10, clock=lambda: next(clock), sleep=slept.append) is True
    )
    assert len(slept) == 3


def test_memory_release_wait_gives_up_at_the_deadline():
    rising = iter(range(0, 1 << 50, 1 << 30))  # a GiB more at every read: still being released
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    assert (
        wait_for_memory_release(
            lambda: {"GPU-a": next(rising)}, timeout=1.0, interval=0.25, clock=lambda: now[0], sleep=sleep
        )
        is False
    )
    assert now[0] == 1.0


def test_memory_release_wait_ends_quickly_when_free_memory_only_jitters(tools, tmp_path, monkeypatch):
    """A desktop GPU's free memory moves by a few MiB between reads (a compositor, a browser); the wait took
    its whole bound when it asked for two exactly equal reads."""
    tools(nvidia_smi="jitter")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_READS", str(tmp_path / "reads"))
    gpu = "GPU-2f6b8c1e-7a53-4b9e-9d2c-1f0e3a4b5c6d"
    read = free_memory_of([gpu])
    assert read()[gpu] - read()[gpu] == 3 * MIB  # no two successive reads are equal
    started = time.monotonic()
    assert wait_for_memory_release(read, timeout=10.0) is True
    assert time.monotonic() - started < 2.0


def test_an_amd_apu_is_known_as_integrated(tools):
    tools(rocm_smi="apu")
    (apu,) = discover().gpus
    assert (apu.backend, apu.free_bytes, apu.integrated) == ("ROCm", 536870912 - 160432128, True)
    tools(rocm_smi="one")
    assert [d.integrated for d in discover().gpus] == [False]  # an MI300X (gfx942) is a card of its own
