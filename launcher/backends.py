"""Which llama.cpp backend this machine should build and run: CUDA, ROCm/HIP, Metal, Vulkan or CPU.

``detect_machine`` looks (cheaply: a tool that is not installed costs a PATH lookup, no process) for
the GPUs (``nvidia-smi``, ``rocm-smi`` or ``/dev/kfd``, ``vulkaninfo`` or a render node with a GPU
Vulkan driver, Apple silicon) and for the toolkits a faster backend is built with (``nvcc``,
``hipcc``/``hipconfig``, the Vulkan headers and ``glslc``). ``choose_backend`` is a pure function of
what was found: the backend to build, why, the one line naming what to install when a GPU's faster
backend lacks its toolkit, and the order in which already-built backends are run (the best one that
reaches the devices first). A machine with no GPU gets ``cpu`` and runs only the tools on its PATH.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.build import built_backend

if TYPE_CHECKING:
    from launcher.devices import Device
    from launcher.discovery import Discovered

TOOL_TIMEOUT_S = 5.0
#: A package-name family per distribution (``/etc/os-release``'s ID and ID_LIKE); the rest get Debian's names.
_FAMILIES = ("debian", "fedora", "arch")
#: What to install for each backend's toolkit, per family.
INSTALL: dict[str, dict[str, str]] = {
    "debian": {
        "cuda": "sudo apt-get install nvidia-cuda-toolkit",
        "rocm": "sudo apt-get install hipcc libhipblas-dev librocblas-dev",
        "vulkan": "sudo apt-get install libvulkan-dev glslc",
    },
    "fedora": {
        "cuda": "sudo dnf install cuda-toolkit (from NVIDIA's CUDA repository)",
        "rocm": "sudo dnf install rocm-hip-devel hipblas-devel rocblas-devel",
        "vulkan": "sudo dnf install vulkan-loader-devel glslc",
    },
    "arch": {
        "cuda": "sudo pacman -S cuda",
        "rocm": "sudo pacman -S rocm-hip-sdk",
        "vulkan": "sudo pacman -S vulkan-headers vulkan-icd-loader shaderc",
    },
}
_NAME = {"cuda": "CUDA", "rocm": "ROCm"}
_TOOLKIT = {"cuda": "the CUDA toolkit (nvcc)", "rocm": "ROCm/HIP (hipcc)", "vulkan": "the Vulkan headers and glslc"}
_VULKAN_DEVICE_TYPE = re.compile(r"deviceType\s*=\s*PHYSICAL_DEVICE_TYPE_(\w+)")
#: Vulkan drivers that run on the CPU (Mesa's lavapipe): a render node with only these is no GPU.
_SOFTWARE_ICDS = ("lvp_icd",)
_ICD_DIRS = ("usr/share/vulkan/icd.d", "etc/vulkan/icd.d", "usr/local/share/vulkan/icd.d")


@dataclass(frozen=True)
class Machine:
    """What ``detect_machine`` found: GPUs per kind, the toolkits, and the distribution's package family."""

    nvidia_gpus: int = 0
    amd_gpus: int = 0
    vulkan_gpus: int = 0  # GPUs a Vulkan driver reaches, any vendor's
    apple_silicon: bool = False
    nvcc: str | None = None
    hip_compiler: str | None = None  # the HIP clang (``hipconfig -l``), or hipcc when hipconfig is absent
    vulkan_headers: bool = False
    glslc: bool = False
    family: str = "debian"

    @property
    def vulkan_buildable(self) -> bool:
        return self.vulkan_headers and self.glslc


@dataclass(frozen=True)
class BackendChoice:
    """The backend to build here, why, and which built backends to run, best first."""

    backend: str  # the pin's backend name: cpu, cuda, rocm, vulkan, metal
    why: str
    run_order: tuple[str, ...]  # ends with cpu
    install: str | None = None  # one line: what to install for the GPU's faster backend; None when nothing is
    cmake_args: tuple[str, ...] = ()  # what the toolkit found here adds to the pin's recipe (the compiler's path)


#: What a caller that detects nothing gets (tests, scripts): the CPU build, as before this module.
CPU_ONLY = BackendChoice("cpu", "no GPU found", ("cpu",))


def choose_backend(m: Machine) -> BackendChoice:
    """The backend for ``m``: a GPU's own backend when its toolkit is there, else Vulkan when it can be built
    and reaches a GPU, else the CPU; a GPU left on a slower backend gets the line naming what to install."""
    if m.apple_silicon:
        return BackendChoice("metal", "macOS on Apple silicon", ("metal", "cpu"))
    if m.nvidia_gpus:
        gpus = _count(m.nvidia_gpus, "NVIDIA GPU")
        if m.nvcc:
            return BackendChoice(
                "cuda",
                f"nvidia-smi lists {gpus} and nvcc is at {m.nvcc}",
                ("cuda", "vulkan", "cpu"),
                cmake_args=(f"-DCMAKE_CUDA_COMPILER={m.nvcc}",),
            )
        return _without_toolkit(m, "cuda", f"nvidia-smi lists {gpus}")
    if m.amd_gpus:
        gpus = _count(m.amd_gpus, "AMD GPU")
        if m.hip_compiler:
            return BackendChoice(
                "rocm",
                f"{gpus} and ROCm/HIP ({m.hip_compiler})",
                ("rocm", "vulkan", "cpu"),
                cmake_args=(f"-DCMAKE_HIP_COMPILER={m.hip_compiler}",) if m.hip_compiler.endswith("clang") else (),
            )
        return _without_toolkit(m, "rocm", gpus)
    if m.vulkan_gpus:
        gpus = _count(m.vulkan_gpus, "GPU")
        if m.vulkan_buildable:
            return BackendChoice("vulkan", f"a Vulkan driver reaches {gpus}", ("vulkan", "cpu"))
        return BackendChoice(
            "cpu",
            f"a Vulkan driver reaches {gpus}, but the Vulkan headers or glslc are missing",
            ("vulkan", "cpu"),
            install=f"{gpus} could run the Vulkan build: {_install(m, 'vulkan')}, then `ggstudio build-llama`; "
            "the CPU build runs meanwhile",
        )
    return CPU_ONLY


def _without_toolkit(m: Machine, fast: str, gpus: str) -> BackendChoice:
    """A GPU whose own backend cannot be built here: Vulkan if it can be, else the CPU, and what to install."""
    order = (fast, "vulkan", "cpu")
    if m.vulkan_gpus and m.vulkan_buildable:
        why = f"{gpus}, but {_TOOLKIT[fast]} is missing: the Vulkan build reaches them meanwhile"
        install = f"{gpus}: {_install(m, fast)} for the faster {_NAME[fast]} build, then `ggstudio build-llama`"
        return BackendChoice("vulkan", why, order, install=install)
    why = f"{gpus}, but {_TOOLKIT[fast]} is missing"
    install = f"{gpus}: {_install(m, fast)} for the {_NAME[fast]} build"
    if m.vulkan_gpus:
        install += f" (or {_install(m, 'vulkan')} for the Vulkan build)"
    install += ", then `ggstudio build-llama`; the CPU build runs meanwhile"
    return BackendChoice("cpu", why, order, install=install)


def _install(m: Machine, backend: str) -> str:
    return f"`{INSTALL.get(m.family, INSTALL['debian'])[backend]}`"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n > 1 else ''}"


def detect_machine(
    env: Mapping[str, str] | None = None,
    *,
    root: Path = Path("/"),
    system: str | None = None,
    arch: str | None = None,
    timeout: float = TOOL_TIMEOUT_S,
) -> Machine:
    """Look for GPUs and toolkits under ``env`` (default: this process's) and the filesystem at ``root``.

    ``root``, ``system`` and ``arch`` stand in for ``/``, ``platform.system()`` and ``platform.machine()``
    (tests build fake machines with them).
    """
    env = dict(os.environ if env is None else env)
    path = env.get("PATH", os.defpath)
    system = system or platform.system()
    arch = arch or platform.machine()
    if system == "Darwin" and arch == "arm64":
        return Machine(apple_silicon=True)
    gpus: tuple[Device, ...] = ()
    if any(shutil.which(tool, path=path) for tool in ("nvidia-smi", "rocm-smi")):
        from launcher.devices import discover  # psutil and the tools' parsers: not on a machine without them

        # the vendor tools' own numbering and visibility masks (CUDA_VISIBLE_DEVICES...), as the planner sees them
        gpus = discover(env=env, timeout=timeout).gpus
    nvidia = sum(1 for d in gpus if d.source == "nvidia-smi")
    amd = sum(1 for d in gpus if d.source == "rocm-smi") or int((root / "dev" / "kfd").exists())
    return Machine(
        nvidia_gpus=nvidia,
        amd_gpus=amd,
        vulkan_gpus=_vulkan_gpus(env, path, root, timeout),
        nvcc=_nvcc(env, path, root) if nvidia else None,
        hip_compiler=_hip_compiler(env, path, root, timeout) if amd else None,
        vulkan_headers=any(
            (d / "vulkan" / "vulkan.h").is_file()
            for d in [root / "usr" / "include", root / "usr" / "local" / "include"]
            + ([Path(env["VULKAN_SDK"]) / "include"] if env.get("VULKAN_SDK") else [])
        ),
        glslc=shutil.which("glslc", path=path) is not None,
        family=_family(root),
    )


def _nvcc(env: Mapping[str, str], path: str, root: Path) -> str | None:
    """nvcc on PATH, else in $CUDA_HOME, $CUDA_PATH or /usr/local/cuda (where NVIDIA's installers put it)."""
    homes = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), str(root / "usr" / "local" / "cuda")]
    return shutil.which("nvcc", path=path) or next(
        (str(Path(h) / "bin" / "nvcc") for h in homes if h and os.access(Path(h) / "bin" / "nvcc", os.X_OK)), None
    )


def _hip_compiler(env: Mapping[str, str], path: str, root: Path, timeout: float) -> str | None:
    """The clang ROCm builds HIP with (``hipconfig -l`` names its folder); hipcc when only that is there."""
    rocm_bin = str(root / "opt" / "rocm" / "bin")
    search = os.pathsep.join([path, rocm_bin])
    hipconfig = shutil.which("hipconfig", path=search)
    if hipconfig:
        try:
            out = subprocess.run([hipconfig, "-l"], capture_output=True, text=True, timeout=timeout, env=dict(env))
            folder = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
        except (OSError, subprocess.TimeoutExpired):
            folder = ""
        if folder and os.access(Path(folder) / "clang", os.X_OK):
            return str(Path(folder) / "clang")
    return shutil.which("hipcc", path=search)


def _vulkan_gpus(env: Mapping[str, str], path: str, root: Path, timeout: float) -> int:
    """GPUs a Vulkan driver lists (``vulkaninfo --summary``, CPU devices left out); without vulkaninfo, the
    render nodes when a GPU's Vulkan driver (an ICD other than lavapipe) is installed."""
    vulkaninfo = shutil.which("vulkaninfo", path=path)
    if vulkaninfo:
        try:
            out = subprocess.run(
                [vulkaninfo, "--summary"], capture_output=True, text=True, timeout=timeout, env=dict(env)
            )
            if out.returncode == 0:
                return sum(1 for t in _VULKAN_DEVICE_TYPE.findall(out.stdout) if t != "CPU")
        except (OSError, subprocess.TimeoutExpired):
            pass
    dri = root / "dev" / "dri"
    nodes = sorted(dri.glob("renderD*")) if dri.is_dir() else []
    if not nodes:
        return 0
    icds = [f for d in _ICD_DIRS for f in (root / d).glob("*.json")] if nodes else []
    return len(nodes) if any(not f.name.startswith(_SOFTWARE_ICDS) for f in icds) else 0


def _family(root: Path) -> str:
    """Which distribution's package names to give: ``/etc/os-release``'s ID, then ID_LIKE."""
    try:
        text = (root / "etc" / "os-release").read_text()
    except OSError:
        return "debian"
    fields = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.M))
    for word in [fields.get("ID", ""), *fields.get("ID_LIKE", "").split()]:
        for family in _FAMILIES:
            if word == family or (family == "debian" and word == "ubuntu") or (family == "fedora" and word == "rhel"):
                return family
    return "debian"


def running_build(found: Discovered, choice: BackendChoice) -> dict[str, Any]:
    """Which llama-server runs and why, for ``ggstudio doctor`` and ``/api/status``: ``{"backend", "path",
    "source", "why", "install"}`` (``backend`` None for a binary the studio did not build)."""
    backend = found.backend or built_backend(found.path)
    if found.source != "pinned build":
        named = {
            "LLAMA_SERVER_PATH": "LLAMA_SERVER_PATH names it",
            "GGUF_STUDIO_LLAMA_CPP": "GGUF_STUDIO_LLAMA_CPP names its folder",
        }.get(found.source, f"no pinned build is there; found through {found.source}")
        why = named + (f" (this machine's choice: {choice.backend}, {choice.why})" if backend != choice.backend else "")
    elif backend == choice.backend:
        why = choice.why
    elif found.backend in choice.run_order[: choice.run_order.index(choice.backend)]:
        why = f"the {backend} build made earlier reaches the GPUs (a build now would be {choice.backend}: {choice.why})"
    else:
        why = f"{choice.why}; the {choice.backend} build is not there yet (`ggstudio build-llama` makes it)"
    return {"backend": backend, "path": str(found.path), "source": found.source, "why": why, "install": choice.install}
