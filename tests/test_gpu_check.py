"""The GPU check (``scripts/gpu_check.py``) as far as a machine without a GPU can run it.

What needs a CUDA device (the build, the measured allocations) waits for the GPU
machine; everything around it runs here: CUDA allocation lines parsed per device,
the device's architecture read from ``nvidia-smi``, the CUDA toolchain found in
NVIDIA's wheel layout, the carried bundle (trimmed sources checked against the
recorded manifest, model headers restored as holes, wheels unpacked only where
missing), and the whole dry run in a bare Python with nothing installed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

import gguf
from launcher.allocations import parse_allocations
from launcher.build import SOURCE_MARKER_NAME, load_pin
from launcher.memory import MemoryOptions, estimate, for_file
from launcher.units import MIB
from scripts.memory_accuracy import CONFIGS, Config, Outcome
from tests.support import gpu_bundle
from tests.support.cuda_build import CudaSetupError, compute_capabilities, find_toolchain

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
GPU_TOOLS = REPO / "tests" / "fixtures" / "gpu-tools"

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check

# A partial offload of Gemma 3 270M on a CUDA build, line by line in the pinned sources' formats:
# llama-model.cpp "%s: %12s model buffer size = %8.2f MiB", llama-context.cpp "%s: %10s  output buffer size",
# llama-kv-cache.cpp "%s: %10s KV buffer size", llama-context.cpp "%s: %10s compute buffer size = %8.2f MiB"
# (and its DEBUG "... compute buffer size is ..."), with ggml-cuda.cu's buffer names: "CUDA0" for the device,
# "CUDA_Host" for pinned host memory (the CPU backend's compute buffer and the outputs when a GPU is in use).
CUDA_PARTIAL_LOG = """\
0.00.101.110 I ggml_cuda_init: found 1 CUDA devices (Total VRAM: 143771 MiB):
0.00.101.120 I   Device 0: NVIDIA H200, compute capability 9.0, VMM: yes, VRAM: 143771 MiB
0.00.402.001 I load_tensors: offloading output layer to GPU
0.00.402.002 I load_tensors: offloading 8 repeating layers to GPU
0.00.402.003 I load_tensors: offloaded 9/19 layers to GPU
0.00.402.010 I load_tensors:   CPU_Mapped model buffer size =   170.41 MiB
0.00.402.011 I load_tensors:        CUDA0 model buffer size =    77.41 MiB
0.00.430.000 I llama_context:  CUDA_Host  output buffer size =     4.00 MiB
0.00.430.100 I llama_kv_cache_iswa: creating non-SWA KV cache, size = 1024 cells
0.00.430.200 I llama_kv_cache:        CPU KV buffer size =     1.00 MiB
0.00.430.201 I llama_kv_cache:      CUDA0 KV buffer size =     2.00 MiB
0.00.430.300 I llama_kv_cache: size =    3.00 MiB (  1024 cells,   3 layers,  4/1 seqs), K (f16):    1.50 MiB, V (f16):    1.50 MiB
0.00.430.400 I llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
0.00.430.500 I llama_kv_cache:        CPU KV buffer size =     6.00 MiB
0.00.430.501 I llama_kv_cache:      CUDA0 KV buffer size =     9.00 MiB
0.00.430.600 I llama_kv_cache: size =   15.00 MiB (  1024 cells,  15 layers,  4/1 seqs), K (f16):    7.50 MiB, V (f16):    7.50 MiB
0.00.480.000 D sched_reserve:      CUDA0 compute buffer size is 266.5000 MiB, matches expectation of 266.5000 MiB
0.00.480.001 I sched_reserve:      CUDA0 compute buffer size =   266.50 MiB
0.00.480.002 I sched_reserve:  CUDA_Host compute buffer size =     9.01 MiB
0.00.480.100 I llama_memory_recurrent:      CUDA0 RS buffer size =     0.50 MiB
"""


def test_cuda_buffer_names_are_parsed_per_device():
    bill = parse_allocations(CUDA_PARTIAL_LOG)
    cpu, gpu = bill.device("CPU"), bill.device("GPU0")
    assert [d.device for d in bill.devices] == ["CPU", "GPU0"]
    assert (cpu.weights, cpu.kv, cpu.compute, cpu.output) == (round(170.41 * MIB), 7 * MIB, round(9.01 * MIB), 4 * MIB)
    assert (gpu.weights, gpu.kv, gpu.compute, gpu.output, gpu.recurrent) == (
        round(77.41 * MIB),
        11 * MIB,
        round(266.5 * MIB),
        0,
        MIB // 2,
    )
    assert [(c.label, c.cells, c.layers, c.k_bytes) for c in bill.caches] == [
        ("non-SWA", 1024, 3, round(1.5 * MIB)),
        ("SWA", 1024, 15, round(7.5 * MIB)),
    ]


def test_config_argv_asks_for_the_estimators_layers():
    base = CONFIGS[0]
    argv = lambda ngl: Config(base.name, replace(base.options, n_gpu_layers=ngl)).argv()  # noqa: E731
    assert argv(-1)[-2:] == ["-ngl", "all"]  # llama-server's own -1 is "auto", not every layer
    assert argv(9)[-2:] == ["-ngl", "9"]
    assert "-ngl" not in argv(0)


def test_a_moe_model_also_runs_with_its_experts_on_the_cpu(zoo_dir):
    """On the GPU, every MoE case with all layers offloaded runs again with one block's experts on the CPU and with
    every block's, asking llama-server for --n-cpu-moe."""
    grid = gpu_check.cases({"qwen3moe-moe": zoo_dir / "qwen3moe-moe.gguf"}, ("all", "partial"))
    split = [(c.offload, c.n_gpu_layers, c.n_cpu_moe) for c in grid if c.config == "c1000-auto"]
    assert split == [("all", -1, 0), ("partial", 1, 0), ("experts-1", -1, 1), ("experts-2", -1, 2)]
    assert all(c.n_cpu_moe == 0 for c in gpu_check.cases({"llama-dense": zoo_dir / "llama-dense.gguf"}, ("all",)))
    base = CONFIGS[0]
    argv = Config(base.name, replace(base.options, n_gpu_layers=-1, n_cpu_moe=2)).argv()
    assert argv[-4:] == ["-ngl", "all", "--n-cpu-moe", "2"]


def test_the_planned_moe_split_is_reported_per_device():
    bill = {"weights": 170.53, "kv": 16.0, "compute": 40.0, "output": 0.0, "total": 226.53}
    moe = {
        "model": "qwen3moe-moe-128x8",
        "free_mib_given": 400,
        "n_cpu_moe": 1,
        "n_gpu_layers": 3,
        "reasons": ["--n-cpu-moe 1: the routed experts of 1 of 2 MoE layers"],
        "error": "",
        "devices": {
            "GPU0": {"predicted": bill, "actual": bill, "weights": True, "kv": True, "compute": True, "total": False}
        },
    }
    text = gpu_check.markdown({"mode": "cuda", "pin": "b11434", "timings_s": {}, "moe_plan": moe})
    assert "qwen3moe-moe-128x8 on 400 MiB free: --n-cpu-moe 1, -ngl 3" in text
    assert "- GPU0, MiB predicted/allocated: weights 170.53/170.53, kv 16.00/16.00" in text and "WKC-" in text


def test_the_script_parses_its_arguments():
    shown = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "--bundle-dir" in shown.stdout and "--dry-run" in shown.stdout


def test_gpu_rows_of_the_report_hold_each_device(gemma_model):
    """A report row and its table lines from a CUDA log, as the GPU machine will make them."""
    model = gguf.read(gemma_model)
    options = MemoryOptions(n_ctx=1000, n_gpu_layers=9)
    outcome = Outcome(
        gpu_check.GEMMA,
        "c1000-auto",
        estimate(model.facts, for_file(model, options)),
        parse_allocations(CUDA_PARTIAL_LOG),
    )
    row = gpu_check.case_row(gpu_check.Case(gpu_check.GEMMA, "c1000-auto", "partial", 9), ["-ngl", "9"], 1.0, outcome)
    assert set(row["devices"]) == {"CPU", "GPU0"}
    assert row["devices"]["GPU0"]["actual"] == {
        "weights": 77.41,
        "kv": 11.5,
        "compute": 266.5,
        "output": 0.0,
        "total": 355.41,
    }
    assert row["devices"]["GPU0"]["compute_ok"] is False  # the CPU formula's few MiB against CUDA's 266.5
    report = {"mode": "cuda", "pin": "b11434", "timings_s": {}, "cases": [row], "summary": gpu_check.summarize([row])}
    table = gpu_check.markdown(report)
    assert "| gemma-3-270m | c1000-auto | partial (9) | GPU0 | " in table
    assert "| gemma-3-270m | c1000-auto | partial (9) | CPU | " in table
    assert report["summary"]["GPU_compute_ok"] == "0/1"


# -- the device and its toolchain ---------------------------------------------------------------------------------
def _with_fake_smi(monkeypatch, machine: str) -> None:
    monkeypatch.setenv("PATH", f"{GPU_TOOLS}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI", machine)


def test_architectures_come_from_the_devices_compute_capability(monkeypatch):
    _with_fake_smi(monkeypatch, "one")
    assert compute_capabilities() == "90-real"  # an H100 / H200
    _with_fake_smi(monkeypatch, "four")
    assert compute_capabilities() == "90-real;89-real"  # each architecture once
    _with_fake_smi(monkeypatch, "fail")
    with pytest.raises(CudaSetupError, match="no compute capability"):
        compute_capabilities()


def _toolkit(root: Path) -> Path:
    """A CUDA toolkit's layout as NVIDIA's wheels install it under /usr/local/cuda: nvcc and the runtime, no cuBLAS."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (root / "bin" / "nvcc").chmod(0o755)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    (root / "lib64" / "stubs").mkdir(parents=True)
    (root / "lib64" / "libcudart.so.13").write_text("")
    (root / "lib64" / "stubs" / "libcuda.so").write_text("")
    return root


def test_cublas_is_found_in_nvidias_wheel_layout(tmp_path):
    """PyTorch's site-packages hold cuBLAS as ``nvidia/cu13/{lib,include}``, with only versioned libraries."""
    root = _toolkit(tmp_path / "cuda-13.0")
    site = tmp_path / "site-packages"
    (site / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "include").mkdir()
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (site / "nvidia" / "cu13" / "lib" / lib).write_text("")
    (site / "nvidia" / "cu13" / "include" / "cublas_v2.h").write_text("")
    tc = find_toolchain({"CUDA_HOME": str(root), "PATH": ""}, python_paths=[str(site)])
    args = tc.cmake_args("90-real")
    lib = site / "nvidia" / "cu13" / "lib"
    assert f"-DCUDA_cudart_LIBRARY={root.resolve() / 'lib64' / 'libcudart.so.13'}" in args
    assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so.13'}" in args
    assert f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so.13'}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-isystem {site / 'nvidia' / 'cu13' / 'include'}" in args
    assert f"-DCMAKE_CUDA_COMPILER={root.resolve() / 'bin' / 'nvcc'}" in args
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in args and "-DGGML_CUDA_NCCL=OFF" in args
    assert any(a.startswith("-DCUDA_cuda_driver_LIBRARY=") and "libcuda.so" in a for a in args)
    assert tc.library_dirs == (root.resolve() / "lib64", lib)


def test_a_missing_cublas_names_where_it_was_looked_for(tmp_path):
    root = _toolkit(tmp_path / "cuda")
    with pytest.raises(CudaSetupError, match=r"libcublas\.so not found in: .*cuda/lib64"):
        find_toolchain({"CUDA_HOME": str(root), "PATH": ""}, python_paths=[])


# -- the bundle ---------------------------------------------------------------------------------------------------
@pytest.fixture
def small_pin(tmp_path, monkeypatch):
    """A pin for a three-file tree, its trimmed manifest recorded as the real pin's is."""
    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    (tree / "docs").mkdir()
    (tree / "CMakeLists.txt").write_text("project(x)\n")
    (tree / "src" / "a.c").write_text("int a;\n")
    (tree / "docs" / "big.md").write_text("not needed\n")
    (tree / SOURCE_MARKER_NAME).write_text("{}")
    pin = replace(load_pin(), sha256="ab" * 32)
    manifest = gpu_bundle.manifest_text(tree, gpu_bundle.trimmed_files(tree))
    monkeypatch.setitem(gpu_bundle.TRIMMED_MANIFESTS, pin.sha256, hashlib.sha256(manifest.encode()).hexdigest())
    return tree, pin


def test_trimmed_source_round_trips_and_is_marked_pinned(small_pin, tmp_path):
    tree, pin = small_pin
    gpu_bundle.pack_source(tree, tmp_path / "bundle", pin)
    dest = tmp_path / "home" / "llama.cpp" / "b1-src"
    assert gpu_bundle.restore_source(tmp_path / "bundle", dest, pin) == 2
    assert (dest / "src" / "a.c").read_text() == "int a;\n" and not (dest / "docs").exists()
    marker = json.loads((dest / SOURCE_MARKER_NAME).read_text())
    assert marker["sha256"] == pin.sha256  # launcher.build then builds from it without a download
    before = (dest / "src" / "a.c").stat().st_mtime_ns
    os.utime(dest / "src" / "a.c", ns=(before - 10**9, before - 10**9))
    assert gpu_bundle.restore_source(tmp_path / "bundle", dest, pin) == 2
    assert (dest / "src" / "a.c").stat().st_mtime_ns == before - 10**9  # left alone: ninja resumes, not redoes


def test_a_changed_source_file_is_refused(small_pin, tmp_path):
    tree, pin = small_pin
    bundle = tmp_path / "bundle"
    gpu_bundle.pack_source(tree, bundle, pin)
    with tarfile.open(bundle / gpu_bundle.SOURCE_ARCHIVE, "w:gz") as tar:  # same names, one file changed
        for rel, text in (("CMakeLists.txt", b"project(x)\n"), ("src/a.c", b"int b;\n")):
            info = tarfile.TarInfo(f"{pin.tree}/{rel}")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    with pytest.raises(gpu_bundle.BundleError, match="1 source files differ from the manifest"):
        gpu_bundle.restore_source(bundle, tmp_path / "dest", pin)


def test_a_tree_unlike_the_recorded_one_is_not_packed(small_pin, tmp_path):
    tree, pin = small_pin
    (tree / "src" / "a.c").write_text("int a; /* edited */\n")
    with pytest.raises(gpu_bundle.BundleError, match="differs from the pinned sources"):
        gpu_bundle.pack_source(tree, tmp_path / "bundle", pin)


def test_recorded_manifest_is_the_pinned_trees(llama_src):
    """TRIM and TRIMMED_MANIFESTS agree with the pinned tree (a new pin or a new TRIM must record its digest)."""
    manifest = gpu_bundle.manifest_text(llama_src, gpu_bundle.trimmed_files(llama_src))
    assert hashlib.sha256(manifest.encode()).hexdigest() == gpu_bundle.expected_manifest_digest(load_pin())
    kept = {line.split("  ", 2)[2] for line in manifest.splitlines()}
    assert {"CMakeLists.txt", "ggml/src/ggml-cuda/CMakeLists.txt", "tools/server/server.cpp"} <= kept
    assert not any(p.startswith(("models/", "docs/", "ggml/src/ggml-vulkan/")) for p in kept)


def test_models_travel_as_headers_and_come_back_as_holes(zoo_dir, tmp_path):
    src = zoo_dir / "llama-dense.gguf"
    gpu_bundle.pack_models([("llama-dense", src)], tmp_path / "bundle")
    assert (tmp_path / "bundle" / gpu_bundle.MODELS_ARCHIVE).stat().st_size < src.stat().st_size // 20
    restored = gpu_bundle.restore_models(tmp_path / "bundle", tmp_path / "models")["llama-dense"]
    assert restored.stat().st_size == src.stat().st_size
    a, b = gguf.read(src), gguf.read(restored)
    assert a.facts == b.facts and [t.name for t in a.shards[0].tensors] == [t.name for t in b.shards[0].tensors]
    with restored.open("rb") as fh:
        fh.seek(gguf.read_header(restored).data_offset)
        assert not fh.read(1 << 16).strip(b"\0")  # the weights are zeros


def test_bundle_carries_gemma_not_the_chat_default(tmp_path, gemma_model):
    """Regression: the studio's default model became SmolLM2; the subset's Gemma must stay Gemma 3 270M."""
    ((name, path),) = gpu_check.gather_models([gpu_check.GEMMA], tmp_path)
    assert gguf.read(path).facts.architecture == "gemma3" and path.stat().st_size == gemma_model.stat().st_size


def _wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_only_wheels_this_python_lacks_are_unpacked(tmp_path, monkeypatch):
    wheels = tmp_path / "bundle" / gpu_bundle.WHEELS
    wheels.mkdir(parents=True)
    _wheel(
        wheels / "gpucheck_probe-1.0-py3-none-any.whl",
        {"gpucheck_probe/__init__.py": "VALUE = 7\n", "gpucheck_probe-1.0.dist-info/RECORD": ""},
    )
    _wheel(wheels / "json-9.9-py3-none-any.whl", {"json/__init__.py": "raise ImportError('shadowed')\n"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu_bundle.activate_wheels(tmp_path / "bundle", tmp_path / "site") == ["gpucheck_probe"]
    assert (tmp_path / "site" / "gpucheck_probe" / "__init__.py").is_file()
    assert not (tmp_path / "site" / "json").exists()  # the standard library's json stays


def test_the_slot_default_is_set_against_one_slot_and_llama_servers_own():
    """The GPU machine's table: each server's aggregate tokens/s over one slot's and over llama-server's own."""
    row = lambda server, tps: {  # noqa: E731
        "clients": 8,
        "server": server,
        "tokens_per_s": tps,
        "ttft_p50_ms": 40,
        "ttft_p90_ms": 60,
    }
    slots = {
        "default": {"n_parallel": 4, "kv_unified": True, "n_ctx": 32768},
        "reason": "slots: 4 on a unified KV cache: the model runs on GPUs",
        "clients": [8],
        "rounds": 2,
        "tokens": 32,
        "rows": [
            row("studio default (4 slots, unified)", 900.0),
            row("one slot", 300.0),
            row("llama-server -np -1", 1000.0),
        ],
    }
    report = {"mode": "cuda", "pin": "b11434", "timings_s": {}, "slots": slots}
    text = gpu_check.markdown(report)
    assert "planned: 4 slot(s) on a unified KV cache, n_ctx 32768" in text
    assert "| 8 | studio default (4 slots, unified) | 900.0 | 40 | 60 | 3.00 | 0.90 |" in text
    assert "| 8 | one slot | 300.0 | 40 | 60 | 1.00 | 0.30 |" in text
    assert "error: RuntimeError: no GPU" in gpu_check.markdown({**report, "slots": {"error": "RuntimeError: no GPU"}})


# -- the whole dry run --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dry_run_in_a_bare_python_writes_the_report(tmp_path, pinned_build, zoo_dir):
    """Bundle two zoo models, then run the check from a venv with no packages, as on the GPU machine."""
    env = {**os.environ, "PATH": f"{GPU_TOOLS}{os.pathsep}{os.environ['PATH']}", "FAKE_NVIDIA_SMI": "one"}
    bundle = tmp_path / "bundle"
    made = subprocess.run(
        [sys.executable, str(SCRIPT), "--bundle", str(bundle), "--models", "llama-dense,gemma3-dense"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    assert "MiB of 64 MiB" in made.stdout
    assert gpu_bundle.folder_bytes(bundle) < 16 * MIB

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    bare = tmp_path / "bare" / "bin" / "python"
    assert subprocess.run([bare, "-c", "import psutil"], capture_output=True).returncode != 0
    out = tmp_path / "out"
    run = subprocess.run(
        [
            bare,
            str(SCRIPT),
            "--bundle-dir",
            str(bundle),
            "--out",
            str(out),
            "--dry-run",
            "--work",
            str(tmp_path / "work"),
            "--jobs",
            "1",
            "--llama-server",
            str(pinned_build.llama_server),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert {"psutil", "httpx", "structlog"} <= set(report["wheels_unpacked"])
    assert report["mode"] == "dry-run" and report["build"]["architectures"] == "90-real"
    assert [(r["model"], r["config"], r["offload"]) for r in report["cases"]] == [
        (m, c, "none") for m in ("llama-dense", "gemma3-dense") for c in ("c1000-auto", "c2048-q8-fa")
    ]
    assert report["summary"]["kv_exact"] == 4 and report["summary"]["compared"] == 4
    planner = report["planner"]
    assert planner["inventory_vendor_tools"][0]["name"] == "NVIDIA H100 80GB HBM3"  # nvidia-smi sees it...
    assert planner["plan"]["gpus"] == [] and any("no CUDA backend" in w for w in planner["plan"]["warnings"])
    assert planner["run"]["completion_status"] == 200 and "CPU" in planner["run"]["allocations"]
    assert (planner["plan"]["n_parallel"], planner["plan"]["kv_unified"]) == (4, True)  # llama-server's own default
    slots = report["slots"]
    assert slots["default"]["n_parallel"] == 4 and slots["reason"].startswith("slots: 4 on a unified KV cache")
    servers = ("studio default (4 slots, unified)", "one slot", "llama-server -np -1")
    assert [(r["clients"], r["server"]) for r in slots["rows"]] == [(c, s) for c in (1, 4) for s in servers]
    assert all(r["tokens_per_s"] > 0 and r["ttft_p90_ms"] >= r["ttft_p50_ms"] > 0 for r in slots["rows"]), slots
    table = (out / "gpu_check.md").read_text()
    assert "| llama-dense | c1000-auto | none (0) | CPU |" in table and "## planner" in table
    assert "## slot default" in table and "| 4 | llama-server -np -1 |" in table
