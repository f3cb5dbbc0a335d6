"""Finding llama-server: each source in order, the not-found message, and `ggstudio doctor`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import discovery
from launcher.build import layout_for, load_pin
from launcher.discovery import find_llama_server
from launcher.errors import BinaryNotFoundError

FIXTURES = Path(__file__).parent / "fixtures"
CLI = str(Path(sys.executable).parent / "ggstudio")
SCRIPT = "#!/bin/sh\nexit 0\n"


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SCRIPT)
    path.chmod(0o755)
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """Every place discovery looks, under tmp_path, each with a llama-server in it."""
    home = tmp_path / "home"
    vendor = tmp_path / "vendor" / "llama.cpp"
    monkeypatch.setattr(discovery, "_VENDOR_DIR", vendor)
    path_dir = tmp_path / "on-path"
    monkeypatch.setenv("PATH", str(path_dir))
    found = {
        "LLAMA_SERVER_PATH": executable(tmp_path / "explicit" / "my-llama-server"),
        "GGUF_STUDIO_LLAMA_CPP root": executable(tmp_path / "checkout" / "llama-server"),
        "GGUF_STUDIO_LLAMA_CPP build/bin": executable(tmp_path / "checkout" / "build" / "bin" / "llama-server"),
        "pinned build": executable(layout_for(home, load_pin(), "cpu").binary("llama-server")),
        "vendor tree": executable(vendor / "build" / "bin" / "llama-server"),
        "PATH": executable(path_dir / "llama-server"),
    }
    return home, tmp_path / "checkout", found


def test_each_source_in_order(places):
    home, checkout, found = places
    order = list(found)
    for i, name in enumerate(order):
        explicit = found["LLAMA_SERVER_PATH"] if name == "LLAMA_SERVER_PATH" else None
        result = find_llama_server(home=home, explicit=explicit, llama_cpp_dir=checkout)
        assert result.path == found[name], name
        assert result.source == name.removesuffix(" root").removesuffix(" build/bin"), name
        if i:  # take this one away: the next source answers next time
            found[name].unlink()


def test_the_checkout_root_wins_over_its_build_dir(places):
    home, checkout, found = places
    assert find_llama_server(home=home, llama_cpp_dir=checkout).path == checkout / "llama-server"
    (checkout / "llama-server").unlink()
    assert find_llama_server(home=home, llama_cpp_dir=checkout).path == checkout / "build" / "bin" / "llama-server"


def test_a_non_executable_file_is_skipped(places):
    home, checkout, found = places
    found["GGUF_STUDIO_LLAMA_CPP root"].chmod(0o644)
    assert find_llama_server(home=home, llama_cpp_dir=checkout).source == "GGUF_STUDIO_LLAMA_CPP"
    assert find_llama_server(home=home, llama_cpp_dir=checkout).path.parent.name == "bin"


def test_a_wrong_explicit_path_does_not_fall_through(places, tmp_path):
    home, checkout, _ = places
    with pytest.raises(BinaryNotFoundError) as err:
        find_llama_server(home=home, explicit=tmp_path / "nope", llama_cpp_dir=checkout)
    assert err.value.searched == [f"LLAMA_SERVER_PATH={tmp_path / 'nope'} (not an executable file)"]
    assert isinstance(err.value, FileNotFoundError)


def test_not_found_lists_every_place_searched_and_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "_VENDOR_DIR", tmp_path / "vendor")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    home, checkout = tmp_path / "home", tmp_path / "checkout"
    with pytest.raises(BinaryNotFoundError) as err:
        find_llama_server(home=home, llama_cpp_dir=checkout)
    pinned = layout_for(home, load_pin(), "cpu").binary("llama-server")
    assert err.value.searched == [
        f"{checkout / 'llama-server'} (GGUF_STUDIO_LLAMA_CPP)",
        f"{checkout / 'build' / 'bin' / 'llama-server'} (GGUF_STUDIO_LLAMA_CPP)",
        f"{pinned} (pinned build)",
        f"{tmp_path / 'vendor' / 'build' / 'bin' / 'llama-server'} (vendor tree)",
        "llama-server on PATH",
    ]
    message = str(err.value)
    assert all(place in message for place in err.value.searched)
    assert "ggstudio build-llama" in message and "LLAMA_SERVER_PATH" in message


def test_other_backends_have_their_own_pinned_build(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "_VENDOR_DIR", tmp_path / "vendor")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    home = tmp_path / "home"
    cuda = executable(layout_for(home, load_pin(), "cuda").binary("llama-server"))
    assert find_llama_server(home=home, backend="cuda").path == cuda
    with pytest.raises(BinaryNotFoundError):
        find_llama_server(home=home, backend="cpu")


# --- ggstudio doctor -------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LLAMA_SERVER_PATH", "GGUF_STUDIO_LLAMA_CPP", "CUDA_VISIBLE_DEVICES")
    }
    return {**env, **extra}


def doctor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "doctor", *args], capture_output=True, text=True, timeout=120, env=env)


def test_doctor_json_on_the_pinned_build(llama_server_bin, settings):
    out = doctor("--json", env=clean_env(GGUF_STUDIO_HOME=str(settings.home)))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["binary"] == {"path": str(llama_server_bin), "source": "pinned build"}
    assert info["build"] == 11434 and info["version"]
    caps = info["capabilities"]
    assert caps["flags"]["--fit"] and caps["flags"]["--api-key-file"] and caps["flags"]["-lv"]
    assert caps["mtp_type"] == "draft-mtp" and caps["ngram_style"] == "new" and "ngram-mod" in caps["spec_types"]
    assert info["devices"][-1]["backend"] == "CPU" and info["devices"][-1]["free_bytes"] > 0


def test_doctor_reports_an_explicit_legacy_binary_and_fake_gpus(tmp_path, settings):
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy2(FIXTURES / "gpu-tools" / "nvidia-smi", tools / "nvidia-smi")
    binary = tmp_path / "old" / "llama-server"
    binary.parent.mkdir()
    shutil.copy2(FIXTURES / "bin" / "llama-server", binary)
    env = clean_env(
        LLAMA_SERVER_PATH=str(binary),
        GGUF_STUDIO_HOME=str(tmp_path / "home"),
        FAKE_LLAMA_FIXTURES=str(FIXTURES),
        FAKE_NVIDIA_SMI="two",
        PATH=f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
    )
    out = doctor("--json", env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["binary"] == {"path": str(binary), "source": "LLAMA_SERVER_PATH"}
    assert info["build"] == 6990
    caps = info["capabilities"]
    assert caps["mtp_type"] == "mtp" and caps["ngram_style"] == "legacy" and caps["draft_n_max_flag"] == "--draft-max"
    assert caps["flags"]["--fit"] is False and caps["flags"]["--api-key"] is True
    names = [(d["backend"], d["index"]) for d in info["devices"]]
    # nvidia-smi's two H100s, the Vulkan GPU only the binary lists (its CUDA0 is nvidia-smi's), the CPU.
    assert names == [("CUDA", 0), ("CUDA", 1), ("Vulkan", 0), ("CPU", None)]
    text = doctor(env=env).stdout
    assert "found via  LLAMA_SERVER_PATH" in text and "build 6990" in text and "lacks" in text
    assert "CUDA1  NVIDIA H100 80GB HBM3  40.0 GiB free of 79.6 GiB  (nvidia-smi)" in text


def test_doctor_says_why_a_cpu_build_leaves_the_gpus_unused(tmp_path, llama_server_bin):
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy2(FIXTURES / "gpu-tools" / "nvidia-smi", tools / "nvidia-smi")
    env = clean_env(
        LLAMA_SERVER_PATH=str(llama_server_bin),
        GGUF_STUDIO_HOME=str(tmp_path / "home"),
        FAKE_NVIDIA_SMI="two",
        PATH=f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
    )
    out = doctor("--json", env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert [d["backend"] for d in info["devices"]] == ["CPU"]
    (warning,) = info["warnings"]
    assert warning.startswith("nvidia-smi sees 2 GPUs, but this llama-server has no CUDA backend (a cpu build)")
    devices = next(c for c in info["checks"] if c["check"] == "devices")
    assert devices["ok"] is False and warning in devices["detail"]
    text = doctor(env=env).stdout
    assert f"  ! {warning}" in text and "PROBLEM  devices: CPU only; nvidia-smi sees 2 GPUs" in text


def test_doctor_without_a_binary_is_a_clean_error(tmp_path):
    env = clean_env(GGUF_STUDIO_HOME=str(tmp_path / "home"), PATH=str(tmp_path / "empty"))
    out = doctor(env=env)
    assert out.returncode == 3 and out.stderr.startswith("error: llama-server was not found. Searched:")
    assert "(pinned build)" in out.stderr and "ggstudio build-llama" in out.stderr
    assert "Traceback" not in out.stderr
