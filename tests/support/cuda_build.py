"""Build the pinned llama-server for CUDA, quickly, on a machine that has a GPU but no network.

``launcher.build.ensure_built`` does the build; this module only finds what CMake
needs there and narrows the recipe to what the GPU check runs:

- only the device's architecture (``nvidia-smi --query-gpu=compute_cap``: an H200
  says ``9.0``, built as ``90-real``) instead of llama.cpp's default list of six;
- only the ``llama-server`` target, on every core, with ninja;
- the runtime, cuBLAS and the driver library where a pip-installed CUDA puts
  them. An image whose toolkit came from NVIDIA's wheels (this workplace's: its
  ``/usr/local/cuda-13.0`` has a ``dist-info`` folder) has ``nvcc`` and the
  runtime under ``/usr/local/cuda`` but cuBLAS only in the Python packages
  (``site-packages/nvidia/cu13/lib/libcublas.so.13``, no unversioned link), and
  ``libcuda.so.1`` in the driver's own folder: FindCUDAToolkit finds neither, so
  each library's path is passed as its cache variable (as llama.cpp's own
  ``cmake/arm64-windows-msvc-cuda.cmake`` does for the driver library);
- no NCCL: one GPU needs no collective communication, and a half-found NCCL is
  one more way for a configure to fail there;
- ``-O1`` for host code, NVVM and ptxas (``QUICK_BUILD_ARGS``): what llama-server
  allocates comes from its graphs and ggml's allocator, not from how well its
  kernels are optimised, and the default ``-O3`` costs the build most of its time
  (measured here on sm_90: mmq-instance-q4_k.cu 66 s of CPU at -O3, 41 s at -O1;
  fattn-vec-instance-f16-f16.cu 22 s and 13 s). Timings taken with this binary say
  nothing about the studio's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from launcher.build import BuildResult, ProgressFn, ensure_built, load_pin

#: Where CUDA toolkits and NVIDIA's drivers usually live, after the environment's own hints.
TOOLKIT_ROOTS = ("/usr/local/cuda",)
DRIVER_DIRS = (
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib/wsl/lib",
)
#: The build type stays Release (NDEBUG: no asserts the shipped binary lacks); only the optimisation drops.
QUICK_BUILD_ARGS = (
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CUDA_FLAGS_RELEASE=-O1 -DNDEBUG -Xcicc -O1 -Xptxas -O1",
)
_LDCONFIG_LINE = re.compile(r"^\s*(\S+) \(([^)]*)\) => (\S+)$")


class CudaSetupError(RuntimeError):
    """A piece the CUDA build needs is missing; the message names it and where it was looked for."""


@dataclass(frozen=True)
class CudaToolchain:
    """The compiler and libraries a CUDA build of ggml links, as found on this machine."""

    nvcc: Path
    root: Path  # the toolkit: bin/nvcc, include/cuda_runtime.h
    cudart: Path
    cublas: Path
    cublas_lt: Path
    cublas_include: Path  # the folder with cublas_v2.h
    driver: Path  # libcuda.so(.1): the real driver, or the toolkit's link stub

    def cmake_args(self, architectures: str) -> tuple[str, ...]:
        """CMake arguments for this toolchain and ``architectures`` (e.g. ``90-real``)."""
        args = [
            f"-DCMAKE_CUDA_COMPILER={self.nvcc}",
            f"-DCUDAToolkit_ROOT={self.root}",
            f"-DCMAKE_CUDA_ARCHITECTURES={architectures}",
            "-DGGML_CUDA_NCCL=OFF",
            f"-DCUDA_cudart_LIBRARY={self.cudart}",
            f"-DCUDA_cublas_LIBRARY={self.cublas}",
            f"-DCUDA_cublasLt_LIBRARY={self.cublas_lt}",
            f"-DCUDA_cuda_driver_LIBRARY={self.driver}",
        ]
        if self.cublas_include != self.root / "include":
            args.append(f"-DCMAKE_CUDA_FLAGS=-isystem {self.cublas_include}")
        return tuple(args)

    @property
    def library_dirs(self) -> tuple[Path, ...]:
        """Folders the built binary loads its CUDA libraries from (for LD_LIBRARY_PATH)."""
        return tuple(dict.fromkeys(p.parent for p in (self.cudart, self.cublas, self.cublas_lt)))


def compute_capabilities(nvidia_smi: str = "nvidia-smi") -> str:
    """The CMake architecture list for the visible GPUs, e.g. ``90-real`` for an H200 (``9.0``)."""
    try:
        out = subprocess.run(
            [nvidia_smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CudaSetupError(f"cannot run {nvidia_smi}: {exc}") from exc
    caps = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not caps or not all(re.fullmatch(r"\d+\.\d+", c) for c in caps):
        raise CudaSetupError(
            f"{nvidia_smi} gave no compute capability (exit {out.returncode}): "
            f"{(out.stdout + out.stderr).strip()[:300]!r}"
        )
    return ";".join(f"{c.replace('.', '')}-real" for c in dict.fromkeys(caps))


def find_toolchain(env: Mapping[str, str] | None = None, python_paths: Sequence[str] | None = None) -> CudaToolchain:
    """Find nvcc, its toolkit, cuBLAS (toolkit or pip wheels) and the driver library.

    ``python_paths`` (default ``sys.path``) is searched for NVIDIA's wheels
    (``nvidia/<any>/lib``, e.g. ``nvidia/cu13`` or CUDA 12's ``nvidia/cublas``).
    """
    env = dict(os.environ if env is None else env)
    wheel_dirs = [
        d
        for p in (sys.path if python_paths is None else python_paths)
        if p
        for d in sorted(Path(p).glob("nvidia/*"))
        if d.is_dir()
    ]
    root = _toolkit_root(env, wheel_dirs)
    nvcc = root / "bin" / "nvcc"
    lib_dirs = [
        root / "lib64",
        root / "lib",
        root / "targets" / "x86_64-linux" / "lib",
        *(d / "lib" for d in wheel_dirs),
    ]
    cudart = _first_library("cudart", lib_dirs)
    cublas = _first_library("cublas", lib_dirs)
    cublas_lt = _first_library("cublasLt", [cublas.parent, *lib_dirs])
    include = next(
        (
            d
            for d in [root / "include", cublas.parent.parent / "include", *(w / "include" for w in wheel_dirs)]
            if (d / "cublas_v2.h").is_file()
        ),
        None,
    )
    if include is None:
        raise CudaSetupError(f"cublas_v2.h is not beside {cublas} nor in {root / 'include'}")
    driver = _driver_library(root)
    return CudaToolchain(
        nvcc=nvcc, root=root, cudart=cudart, cublas=cublas, cublas_lt=cublas_lt, cublas_include=include, driver=driver
    )


def _toolkit_root(env: dict[str, str], wheel_dirs: Sequence[Path]) -> Path:
    """The first toolkit with nvcc and the runtime headers: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc on PATH,
    then NVIDIA's wheels (``nvidia/cu13`` holds bin/nvcc once nvidia-cuda-nvcc is installed).

    A wrapper script named nvcc (``exec /usr/local/cuda-13.0/bin/nvcc``) is not a toolkit root: the headers decide.
    """
    candidates = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), *TOOLKIT_ROOTS]
    on_path = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent.parent))
    candidates += [str(d) for d in wheel_dirs]
    for c in filter(None, candidates):
        root = Path(c)
        if (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime.h").is_file():
            return root.resolve()
    raise CudaSetupError(
        f"no CUDA toolkit (bin/nvcc with include/cuda_runtime.h) in any of: {', '.join(filter(None, candidates))}"
    )


def _first_library(name: str, dirs: Iterable[Path]) -> Path:
    """``lib<name>.so`` or its highest versioned file in the first folder that has one."""
    searched = []
    for d in dirs:
        searched.append(str(d))
        found = sorted(d.glob(f"lib{name}.so*"), key=lambda p: (len(p.name), p.name))
        if found:
            return found[0]
    raise CudaSetupError(f"lib{name}.so not found in: {', '.join(dict.fromkeys(searched))}")


def _driver_library(root: Path) -> Path:
    """The driver's libcuda: what ldconfig knows, the usual driver folders, then the toolkit's link stub."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    for line in listing.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m and m.group(1) in ("libcuda.so.1", "libcuda.so") and "x86-64" in m.group(2):
            return Path(m.group(3))
    dirs = [Path(d) for d in DRIVER_DIRS] + [
        root / "lib64" / "stubs",
        root / "targets" / "x86_64-linux" / "lib" / "stubs",
    ]
    return _first_library("cuda", [d for d in dirs if d.is_dir()] or dirs)


def build_args(toolchain: CudaToolchain, architectures: str) -> tuple[str, ...]:
    """The CMake arguments the check adds to the pin's cuda recipe."""
    return (*toolchain.cmake_args(architectures), *QUICK_BUILD_ARGS)


def build_cuda_server(
    home: Path,
    toolchain: CudaToolchain,
    architectures: str,
    *,
    jobs: int | None = None,
    progress: ProgressFn | None = None,
) -> BuildResult:
    """``ensure_built`` for the ``cuda`` backend, ``llama-server`` only, for ``architectures``, at ``-O1``."""
    pin = load_pin()
    return ensure_built(
        home,
        backend="cuda",
        extra_cmake_args=build_args(toolchain, architectures),
        jobs=jobs or os.cpu_count(),
        pin=replace(pin, targets=("llama-server",)),
        progress=progress,
    )
