"""Find the llama-server binary to run, and say where it came from.

Order: an explicit file (``LLAMA_SERVER_PATH``), a llama.cpp directory
(``GGUF_STUDIO_LLAMA_CPP``: its root or ``build/bin/``), the pinned build in the
studio home, an in-tree build under ``vendor/llama.cpp/``, then ``PATH``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from launcher.build import load_pin, layout_for
from launcher.errors import BinaryNotFoundError

Source = Literal["LLAMA_SERVER_PATH", "GGUF_STUDIO_LLAMA_CPP", "pinned build", "vendor tree", "PATH"]

BINARY_NAME = "llama-server"
_VENDOR_DIR = Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp"


@dataclass(frozen=True)
class Discovered:
    """A llama-server binary and the place it was found through."""

    path: Path
    source: Source


def find_llama_server(
    *,
    home: Path,
    explicit: Path | None = None,
    llama_cpp_dir: Path | None = None,
    backend: str = "cpu",
) -> Discovered:
    """Return the llama-server to use.

    Raises:
        BinaryNotFoundError: nothing found; the message lists every place searched.
    """
    searched: list[str] = []
    if explicit is not None:
        if _is_executable(explicit):
            return Discovered(explicit, "LLAMA_SERVER_PATH")
        # An explicit choice that is wrong must not silently fall through to another binary.
        raise BinaryNotFoundError([f"LLAMA_SERVER_PATH={explicit} (not an executable file)"])
    candidates: list[tuple[Path, Source]] = []
    if llama_cpp_dir is not None:
        candidates += [(llama_cpp_dir / BINARY_NAME, "GGUF_STUDIO_LLAMA_CPP"),
                       (llama_cpp_dir / "build" / "bin" / BINARY_NAME, "GGUF_STUDIO_LLAMA_CPP")]
    candidates.append((layout_for(home, load_pin(), backend).binary(BINARY_NAME), "pinned build"))
    candidates.append((_VENDOR_DIR / "build" / "bin" / BINARY_NAME, "vendor tree"))
    for path, source in candidates:
        if _is_executable(path):
            return Discovered(path, source)
        searched.append(f"{path} ({source})")
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        return Discovered(Path(on_path), "PATH")
    searched.append(f"{BINARY_NAME} on PATH")
    raise BinaryNotFoundError(searched)


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
