"""Find the llama-server binary to run (and ggml-rpc-server, for RPC workers), and say where it came from.

Order: an explicit file (``LLAMA_SERVER_PATH``), a llama.cpp directory
(``GGUF_STUDIO_LLAMA_CPP``: its root or ``build/bin/``), the pinned builds in the
studio home (one folder per backend, in the order ``launcher.backends`` prefers for
this machine's devices: on an NVIDIA machine the CUDA build, then Vulkan, then CPU),
an in-tree build under ``vendor/llama.cpp/``, then ``PATH``.
``ggml-rpc-server`` is looked for the same way, with ``GGML_RPC_SERVER_PATH`` first
and then beside an explicit ``LLAMA_SERVER_PATH`` (a build makes both).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from launcher.build import layout_for, load_pin
from launcher.errors import BinaryNotFoundError

Source = Literal[
    "LLAMA_SERVER_PATH",
    "GGUF_STUDIO_LLAMA_CPP",
    "pinned build",
    "vendor tree",
    "PATH",
    "GGML_RPC_SERVER_PATH",
    "beside LLAMA_SERVER_PATH",
]

BINARY_NAME = "llama-server"
RPC_SERVER_NAME = "ggml-rpc-server"
_VENDOR_DIR = Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp"


@dataclass(frozen=True)
class Discovered:
    """A llama-server binary and the place it was found through."""

    path: Path
    source: Source
    backend: str | None = None  # the pinned build's backend (cpu, cuda...); None when found elsewhere


def find_llama_server(
    *,
    home: Path,
    explicit: Path | None = None,
    llama_cpp_dir: Path | None = None,
    backends: Sequence[str] = ("cpu",),
) -> Discovered:
    """Return the llama-server to use; ``backends`` are the pinned builds to look for, best first.

    Raises:
        BinaryNotFoundError: nothing found; the message lists every place searched.
    """
    if explicit is not None:
        if _is_executable(explicit):
            return Discovered(explicit, "LLAMA_SERVER_PATH")
        # An explicit choice that is wrong must not silently fall through to another binary.
        raise BinaryNotFoundError([f"LLAMA_SERVER_PATH={explicit} (not an executable file)"])
    return _search(BINARY_NAME, [], home=home, llama_cpp_dir=llama_cpp_dir, backends=backends)


def find_rpc_server(
    *,
    home: Path,
    explicit: Path | None = None,
    llama_server: Path | None = None,
    llama_cpp_dir: Path | None = None,
    backends: Sequence[str] = ("cpu",),
) -> Discovered:
    """Return the ggml-rpc-server to run a worker with.

    ``explicit`` is ``GGML_RPC_SERVER_PATH``; ``llama_server`` an explicit
    ``LLAMA_SERVER_PATH``, whose folder is searched next.

    Raises:
        BinaryNotFoundError: nothing found; the message lists every place searched.
    """
    if explicit is not None:
        if _is_executable(explicit):
            return Discovered(explicit, "GGML_RPC_SERVER_PATH")
        raise BinaryNotFoundError([f"GGML_RPC_SERVER_PATH={explicit} (not an executable file)"], binary=RPC_SERVER_NAME)
    first: list[tuple[Path, Source]] = (
        [(llama_server.parent / RPC_SERVER_NAME, "beside LLAMA_SERVER_PATH")] if llama_server is not None else []
    )
    return _search(RPC_SERVER_NAME, first, home=home, llama_cpp_dir=llama_cpp_dir, backends=backends)


def _search(
    name: str,
    first: list[tuple[Path, Source]],
    *,
    home: Path,
    llama_cpp_dir: Path | None,
    backends: Sequence[str],
) -> Discovered:
    searched: list[str] = []
    candidates: list[tuple[Path, Source, str | None]] = [(p, s, None) for p, s in first]
    if llama_cpp_dir is not None:
        candidates += [
            (llama_cpp_dir / name, "GGUF_STUDIO_LLAMA_CPP", None),
            (llama_cpp_dir / "build" / "bin" / name, "GGUF_STUDIO_LLAMA_CPP", None),
        ]
    pin = load_pin()
    candidates += [(layout_for(home, pin, b).binary(name), "pinned build", b) for b in backends]
    candidates.append((_VENDOR_DIR / "build" / "bin" / name, "vendor tree", None))
    for path, source, backend in candidates:
        if _is_executable(path):
            return Discovered(path, source, backend)
        searched.append(f"{path} ({source})")
    on_path = shutil.which(name)
    if on_path:
        return Discovered(Path(on_path), "PATH")
    searched.append(f"{name} on PATH")
    raise BinaryNotFoundError(searched, binary=name)


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
