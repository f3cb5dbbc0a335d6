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
from launcher.backends import CPU_ONLY, Machine, choose_backend, running_build
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
    assert find_llama_server(home=home, backends=("cuda",)).path == cuda
    with pytest.raises(BinaryNotFoundError):
        find_llama_server(home=home, backends=("cpu",))


NVIDIA = choose_backend(Machine(nvidia_gpus=1, nvcc="/usr/local/cuda/bin/nvcc"))


def test_the_build_that_reaches_the_gpus_runs_without_llama_server_path(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "_VENDOR_DIR", tmp_path / "vendor")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    home, pin = tmp_path / "home", load_pin()
    cpu = executable(layout_for(home, pin, "cpu").binary("llama-server"))
    # the CUDA build is not made yet: the CPU one runs, and the why says what to run
    found = find_llama_server(home=home, backends=NVIDIA.run_order)
    assert (found.path, found.backend) == (cpu, "cpu")
    assert running_build(found, NVIDIA)["why"] == (
        "nvidia-smi lists 1 NVIDIA GPU and nvcc is at /usr/local/cuda/bin/nvcc; the cuda build is not there yet "
        "(`ggstudio build-llama` makes it)"
    )
    vulkan = executable(layout_for(home, pin, "vulkan").binary("llama-server"))
    assert find_llama_server(home=home, backends=NVIDIA.run_order).path == vulkan
    cuda = executable(layout_for(home, pin, "cuda").binary("llama-server"))
    found = find_llama_server(home=home, backends=NVIDIA.run_order)
    assert (found.path, found.source, found.backend) == (cuda, "pinned build", "cuda")
    assert running_build(found, NVIDIA) == {
        "backend": "cuda",
        "path": str(cuda),
        "source": "pinned build",
        "why": "nvidia-smi lists 1 NVIDIA GPU and nvcc is at /usr/local/cuda/bin/nvcc",
        "install": None,
    }
    # a machine without a GPU keeps running its CPU build, whatever else was built
    assert find_llama_server(home=home, backends=CPU_ONLY.run_order).path == cpu
    # an explicit LLAMA_SERVER_PATH still wins, and the why says so
    explicit = executable(tmp_path / "mine" / "llama-server")
    found = find_llama_server(home=home, explicit=explicit, backends=NVIDIA.run_order)
    assert found.path == explicit
    assert running_build(found, NVIDIA)["why"] == (
        "LLAMA_SERVER_PATH names it (this machine's choice: cuda, nvidia-smi lists 1 NVIDIA GPU and nvcc is at "
        "/usr/local/cuda/bin/nvcc)"
    )


def test_a_gpu_left_on_vulkan_runs_an_older_cuda_build(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "_VENDOR_DIR", tmp_path / "vendor")
    no_nvcc = choose_backend(Machine(nvidia_gpus=1, vulkan_gpus=1, vulkan_headers=True, glslc=True))
    home = tmp_path / "home"
    cuda = executable(layout_for(home, load_pin(), "cuda").binary("llama-server"))
    found = find_llama_server(home=home, backends=no_nvcc.run_order)
    assert found.path == cuda
    assert running_build(found, no_nvcc)["why"] == (
        "the cuda build made earlier reaches the GPUs (a build now would be vulkan: nvidia-smi lists 1 NVIDIA GPU, "
        "but the CUDA toolkit (nvcc) is missing: the Vulkan build reaches them meanwhile)"
    )


# --- ggstudio doctor -------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LLAMA_SERVER_PATH", "GGUF_STUDIO_LLAMA_CPP", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH")
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
    # this machine has no GPU (and a CUDA toolkit): its CPU build runs, and doctor says why
    assert info["backend"] == {
        "backend": "cpu",
        "path": str(llama_server_bin),
        "source": "pinned build",
        "why": "no GPU found",
        "install": None,
    }
    check = next(c for c in info["checks"] if c["check"] == "backend")
    assert check == {"check": "backend", "ok": True, "detail": "cpu: no GPU found", "fix": None}


def test_doctor_runs_the_cuda_build_on_an_nvidia_machine(tmp_path):
    """Fake nvidia-smi and nvcc on PATH, a (fake) CUDA build beside the CPU one: doctor picks CUDA, says why."""
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy2(FIXTURES / "gpu-tools" / "nvidia-smi", tools / "nvidia-smi")
    executable(tools / "nvcc")
    home = tmp_path / "home"
    for backend in ("cpu", "cuda"):
        binary = layout_for(home, load_pin(), backend).binary("llama-server")
        binary.parent.mkdir(parents=True)
        shutil.copy2(FIXTURES / "bin" / "llama-server", binary)
        (binary.parent.parent / "build-complete.json").write_text(json.dumps({"backend": backend}))
    cuda = layout_for(home, load_pin(), "cuda").binary("llama-server")
    env = clean_env(
        GGUF_STUDIO_HOME=str(home),
        FAKE_LLAMA_FIXTURES=str(FIXTURES),
        FAKE_LLAMA_DEVICES="cuda",
        FAKE_NVIDIA_SMI="two",
        PATH=f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
    )
    out = doctor("--json", env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["binary"] == {"path": str(cuda), "source": "pinned build"}
    why = f"nvidia-smi lists 2 NVIDIA GPUs and nvcc is at {tools / 'nvcc'}"
    expected = {"backend": "cuda", "path": str(cuda), "source": "pinned build", "why": why, "install": None}
    assert info["backend"] == expected
    assert [(d["backend"], d["index"]) for d in info["devices"]] == [("CUDA", 0), ("CUDA", 1), ("CPU", None)]
    assert f"backend    cuda: {why}" in doctor(env=env).stdout


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


def test_status_says_which_build_runs_and_why(settings, llama_server_bin, real, tmp_path):
    """``GET /api/status``'s ``build``: the studio's own lookup (``find_build``) on this GPU-less machine."""
    from launcher.registry import ChildRegistry
    from launcher.supervisor import owner_token
    from studio.cli.common import find_build
    from studio.library.catalog import Catalog
    from studio.residency.manager import ModelManager, supervisor_factory
    from studio.views.residency import status_json

    assert settings.llama_server_path is None and settings.llama_cpp_dir is None
    found, build = find_build(settings)
    manager = ModelManager(
        catalog=Catalog([tmp_path]),
        binary=found.path,
        build=build,
        caps=real,
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
    )
    assert status_json(manager)["build"] == {
        "backend": "cpu",
        "path": str(llama_server_bin),
        "source": "pinned build",
        "why": "no GPU found",
        "install": None,
    }
