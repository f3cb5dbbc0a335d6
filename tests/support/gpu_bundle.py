"""What the GPU check carries to a machine that can fetch nothing, in one folder of at most 64 MiB.

The device tool sends the git working tree plus up to 8 ignored paths, 64 MiB in
all. ``scripts/gpu_check.py --bundle DIR`` fills one such folder with:

- ``llama.cpp-src.tar.gz``: the pinned llama.cpp tree without what a CUDA
  llama-server build never reads (docs, vocab GGUFs, media, examples, the other
  GPU backends...): about 8 MiB instead of the sdist's 37. It is cut from a tree
  the pin's sha256 vouches for, and ``source-manifest.txt`` lists every file's
  sha256; the manifest's own sha256 is recorded here (``TRIMMED_MANIFESTS``), so
  on the device the restored tree is checked against this repository, not only
  against itself.
- ``models.tar.gz`` + ``models.json``: each model's GGUF header (metadata and
  tensor list) and its size. Restored, the header is followed by a hole up to
  that size: the weights read as zeros, which llama-server maps and places
  exactly as the real ones (allocations depend on shapes and types only), so
  Gemma's 253 MB travel as its 3 MB of vocabulary.
- ``wheels/``: the run path's third-party packages (psutil, httpx and its
  dependencies, structlog) as wheels, unpacked there only for those the
  machine's Python lacks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from gguf.reader import read_header
from launcher.build import SOURCE_MARKER_NAME, Pin

MIB = 1024 * 1024
#: What the device tool carries: the working tree and the carried folders together.
CARRY_LIMIT = 64 * MIB
SOURCE_ARCHIVE = "llama.cpp-src.tar.gz"
SOURCE_MANIFEST = "source-manifest.txt"
MODELS_ARCHIVE = "models.tar.gz"
MODELS_INDEX = "models.json"
WHEELS = "wheels"

#: Folders of the llama.cpp tree a CUDA llama-server build never reads: documentation, vocab GGUFs and media
#: (tests only name them at run time), the Python converters, the examples (LLAMA_BUILD_EXAMPLES=OFF), and the
#: ggml backends the pin's cpu/cuda recipes leave off (each is added only when its GGML_<NAME> option is on).
TRIM = (
    "docs",
    "models",
    "media",
    "benches",
    "gguf-py",
    "conversion",
    "examples",
    "pocs",
    "skills",
    *(
        f"ggml/src/ggml-{b}"
        for b in (
            "vulkan",
            "sycl",
            "opencl",
            "metal",
            "hexagon",
            "et",
            "openvino",
            "webgpu",
            "cann",
            "virtgpu",
            "zdnn",
            "zendnn",
        )
    ),
)
#: sha256 of ``source-manifest.txt`` for each pin (keyed by the pin's sdist sha256). A new pin, or a new TRIM,
#: changes it: ``tests/test_gpu_check.py`` recomputes it from the studio's verified source tree.
TRIMMED_MANIFESTS = {
    "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45": "77c554527f573ab48875287c5574d81fe8447a28f723190fe3ee63db444901eb",
}

#: The run path's third-party modules (``launcher.devices``: psutil; ``launcher.process``: httpx; the supervisor
#: and the zoo helpers: structlog) and what they import in turn, by distribution name.
RUNTIME_DISTRIBUTIONS = (
    "psutil",
    "httpx",
    "httpcore",
    "h11",
    "anyio",
    "idna",
    "certifi",
    "sniffio",
    "typing_extensions",
    "structlog",
)
#: The device machine's Python (KINDS.md: Python 3.12 on x86-64 Linux); psutil's wheel is abi3, the rest pure.
WHEEL_PYTHON = "3.12"
WHEEL_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


class BundleError(RuntimeError):
    """The bundle is missing a part, or a part is not what was packed."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- the trimmed source -------------------------------------------------------------------------------------------
def trimmed_files(tree: Path) -> list[str]:
    """The files of ``tree`` the CUDA build needs, as sorted POSIX paths relative to it."""
    out = []
    for dirpath, dirnames, filenames in os.walk(tree):
        rel = Path(dirpath).relative_to(tree)
        dirnames[:] = sorted(d for d in dirnames if (rel / d).as_posix() not in TRIM)
        out += [(rel / f).as_posix() for f in filenames if not (rel == Path(".") and f == SOURCE_MARKER_NAME)]
    return sorted(out)


def manifest_text(tree: Path, files: Iterable[str]) -> str:
    """One ``<sha256>  <size>  <path>`` line per file (the order of ``files``)."""
    return "".join(f"{_file_sha256(tree / f)}  {(tree / f).stat().st_size}  {f}\n" for f in files)


def expected_manifest_digest(pin: Pin) -> str:
    try:
        return TRIMMED_MANIFESTS[pin.sha256]
    except KeyError:
        raise BundleError(
            f"no trimmed-source manifest is recorded for the pin {pin.tag} ({pin.sha256[:12]}...); "
            "add its digest to tests/support/gpu_bundle.py TRIMMED_MANIFESTS"
        ) from None


def pack_source(tree: Path, bundle: Path, pin: Pin) -> str:
    """Write the trimmed archive and its manifest of ``tree`` (a verified pinned tree) into ``bundle``.

    Returns the manifest's sha256; raises BundleError when it is not the recorded
    one (the tree was changed since extraction, or TRIM changed without its digest).
    """
    files = trimmed_files(tree)
    text = manifest_text(tree, files)
    digest = _sha256(text.encode())
    if digest != expected_manifest_digest(pin):
        raise BundleError(
            f"the trimmed tree of {tree} has manifest sha256 {digest}, not the recorded "
            f"{expected_manifest_digest(pin)}: the tree differs from the pinned sources (or TRIM "
            "changed: record the new digest)"
        )
    bundle.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle / SOURCE_ARCHIVE, "w:gz", compresslevel=6) as tar:
        for f in files:
            tar.add(tree / f, arcname=f"{pin.tree}/{f}", recursive=False)
    (bundle / SOURCE_MANIFEST).write_text(text)
    return digest


def restore_source(bundle: Path, dest: Path, pin: Pin) -> int:
    """Extract the trimmed tree to ``dest`` (replacing it), check every file against the manifest, mark it pinned.

    The marker is the one ``launcher.build`` writes after extracting a verified
    sdist (plus the manifest's digest), so ``ensure_built`` builds from this tree
    without downloading; a tree already restored from this manifest is left as it
    is, so a second run on the same machine resumes the build. Returns the number
    of files.
    """
    text = (bundle / SOURCE_MANIFEST).read_text()
    digest = _sha256(text.encode())
    if digest != expected_manifest_digest(pin):
        raise BundleError(f"{bundle / SOURCE_MANIFEST} has sha256 {digest}, not the one recorded for {pin.tag}")
    expected = {line.split("  ", 2)[2]: line.split("  ", 2)[0] for line in text.splitlines()}
    try:  # restored by an earlier run on this machine: new timestamps would make ninja rebuild everything
        if json.loads((dest / SOURCE_MARKER_NAME).read_text()).get("trimmed_manifest") == digest:
            return len(expected)
    except (OSError, ValueError, AttributeError):
        pass
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="src-", dir=dest.parent) as tmp:
        with tarfile.open(bundle / SOURCE_ARCHIVE) as tar:
            tar.extractall(tmp, filter="data")
        tree = Path(tmp) / pin.tree
        found = trimmed_files(tree)
        if sorted(expected) != found:
            missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
            raise BundleError(
                f"the source archive does not hold the manifest's files (missing {missing[:5]}, extra {extra[:5]})"
            )
        bad = [f for f in found if _file_sha256(tree / f) != expected[f]]
        if bad:
            raise BundleError(f"{len(bad)} source files differ from the manifest, e.g. {bad[:5]}")
        (tree / SOURCE_MARKER_NAME).write_text(
            json.dumps({"sha256": pin.sha256, "package": pin.requirement, "trimmed_manifest": digest}, indent=2) + "\n"
        )
        if dest.exists():
            shutil.rmtree(dest)
        tree.rename(dest)
    return len(found)


# -- the models ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CarriedModel:
    """One model in the bundle: its header bytes' digest and the whole file's size."""

    name: str
    size: int
    head_sha256: str


def pack_models(models: Sequence[tuple[str, Path]], bundle: Path) -> list[CarriedModel]:
    """Write each ``(name, path)``'s GGUF header into ``bundle``'s models archive, with the index."""
    bundle.mkdir(parents=True, exist_ok=True)
    carried = []
    with tarfile.open(bundle / MODELS_ARCHIVE, "w:gz", compresslevel=9) as tar:
        for name, path in models:
            head = _head_bytes(path)
            info = tarfile.TarInfo(f"{name}.gguf.head")
            info.size = len(head)
            tar.addfile(info, io.BytesIO(head))
            carried.append(CarriedModel(name, path.stat().st_size, _sha256(head)))
    (bundle / MODELS_INDEX).write_text(json.dumps([asdict(c) for c in carried], indent=2) + "\n")
    return carried


def _head_bytes(path: Path) -> bytes:
    header = read_header(path)
    if header.data_offset > header.file_size:
        raise BundleError(f"{path}: its header claims {header.data_offset} bytes, more than the file")
    with path.open("rb") as fh:
        return fh.read(header.data_offset)


def restore_models(bundle: Path, dest: Path) -> dict[str, Path]:
    """Write every carried model to ``dest`` as its header plus a hole; returns name -> path."""
    index = [CarriedModel(**m) for m in json.loads((bundle / MODELS_INDEX).read_text())]
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    with tarfile.open(bundle / MODELS_ARCHIVE) as tar:
        for m in index:
            member = tar.extractfile(f"{m.name}.gguf.head")
            head = member.read() if member is not None else b""
            if _sha256(head) != m.head_sha256:
                raise BundleError(f"the carried header of {m.name} does not match models.json")
            path = dest / f"{m.name}.gguf"
            with path.open("wb") as fh:
                fh.write(head)
                fh.truncate(m.size)
            out[m.name] = path
    return out


# -- the wheels ---------------------------------------------------------------------------------------------------
def pack_wheels(bundle: Path, distributions: Sequence[str] = RUNTIME_DISTRIBUTIONS) -> list[Path]:
    """Download the wheels of ``distributions``, at the versions installed here, for the device's Python."""
    from importlib.metadata import version

    dest = bundle / WHEELS
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--python-version",
        WHEEL_PYTHON,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(dest),
        *(f"{d}=={version(d)}" for d in distributions),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"pip could not download the runtime wheels: {(proc.stdout + proc.stderr)[-800:]}")
    return sorted(dest.glob("*.whl"))


def activate_wheels(bundle: Path, site: Path) -> list[str]:
    """Unpack into ``site`` the carried wheels whose modules this Python cannot import, and put ``site`` first.

    Wheels are zip files laid out as ``site-packages``; unpacking one is all an
    install does for modules that need no compiled entry points. Returns the
    distributions unpacked.
    """
    used = []
    for wheel in sorted((bundle / WHEELS).glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            tops = _top_level(z.namelist())
            if all(importlib.util.find_spec(t) is not None for t in tops):
                continue
            z.extractall(site)
            used.append(wheel.name.split("-", 1)[0])
    if used:
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
    return used


def _top_level(names: Iterable[str]) -> list[str]:
    """The importable top-level names a wheel's file list installs."""
    tops = set()
    for n in names:
        first = n.split("/", 1)[0]
        if first.endswith((".dist-info", ".data")):
            continue
        tops.add(first.removesuffix(".py") if "/" not in n else first)
    return sorted(t for t in tops if t.isidentifier())


# -- the size -----------------------------------------------------------------------------------------------------
def folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (what the device tool counts)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def working_tree_bytes(repo: Path) -> int:
    """Bytes of the git working tree that travels: tracked and untracked-not-ignored files."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    )
    paths = {p for p in proc.stdout.decode().split("\0") if p}
    return sum((repo / p).stat().st_size for p in paths if (repo / p).is_file())
