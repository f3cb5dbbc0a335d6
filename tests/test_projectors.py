"""Projectors: their facts from their own metadata, one rule for what is one, pairing with a model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import gguf
from gguf.projector import projector_facts, width_mismatch
from launcher.allocations import parse_allocations
from launcher.capabilities import probe
from launcher.command import build_command
from launcher.devices import Device, Inventory
from launcher.memory import ProjectorBill
from launcher.planner import PlanRequest, ProjectorError, load_model, plan
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from launcher.units import MIB
from studio.errors import BadRequestError
from studio.http.app import create_app
from studio.library.catalog import Catalog
from studio.library.projectors import is_projector_file, named_like_projector, projector_problem
from studio.library.scan import scan
from studio.residency.manager import ModelManager, supervisor_factory
from tests.support.projectors import SMOLLM2_WIDTH, write_audio_projector, write_vision_projector
from tests.test_hub import model_bytes


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def tiny_projectors(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("projectors")
    return write_vision_projector(root / "eye.gguf"), write_audio_projector(root / "ear.gguf")


def test_projector_facts_come_from_its_own_metadata(tiny_projectors):
    vision, audio = (projector_facts(gguf.read(p)) for p in tiny_projectors)
    assert vision.vision and not vision.audio and vision.types == ("mlp",)
    assert audio.audio and not audio.vision and audio.types == ("voxtral",)
    assert vision.projection_dims == audio.projection_dims == (SMOLLM2_WIDTH,)
    assert vision.weight_bytes == gguf.read(tiny_projectors[0]).tensor_bytes > 100_000
    assert vision.encoders[0].warmup_positions == 16 and audio.encoders[0].warmup_positions == 1500
    assert (
        projector_facts(
            gguf.read(put(Path(tiny_projectors[0]).parent / "m.gguf", model_bytes(tiny_projectors[0].parent)))
        )
        is None
    )


def test_the_width_check_names_both_widths(tiny_projectors, tmp_path):
    facts = projector_facts(gguf.read(tiny_projectors[0]))
    narrow = put(tmp_path / "narrow.gguf", model_bytes(tmp_path, n_embd=64))
    wide = put(tmp_path / "wide.gguf", model_bytes(tmp_path, n_embd=SMOLLM2_WIDTH))
    assert width_mismatch(facts, gguf.read(wide)) is None
    assert width_mismatch(facts, gguf.read(narrow)) == "it projects to 576 but the llama model's embedding length is 64"
    assert "not a clip projector" in projector_problem(wide, narrow)


def test_gemma_3_4b_mmproj_f16_is_not_offered_as_a_chat_model(tmp_path):
    """The catalog's old rule was ``startswith("mmproj")``: Unsloth's ``gemma-3-4b-mmproj-f16.gguf`` was a model."""
    models = tmp_path / "models"
    put(models / "gemma-3-4b-it-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=SMOLLM2_WIDTH))
    write_vision_projector(models / "gemma-3-4b-mmproj-f16.gguf")
    entries = Catalog([models]).entries()
    assert [e.name for e in entries] == ["gemma-3-4b-it-Q4_K_M"]
    assert entries[0].mmproj == models / "gemma-3-4b-mmproj-f16.gguf"


def test_the_header_decides_over_the_name(tmp_path):
    models = tmp_path / "models"
    model = put(models / "mmproj-lookalike-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=SMOLLM2_WIDTH))
    adapter = write_vision_projector(models / "vision-adapter.gguf")
    garbage = put(models / "mmproj-broken.gguf", b"not a gguf")
    assert not is_projector_file(model) and is_projector_file(adapter) and is_projector_file(garbage)
    assert named_like_projector("unsloth/x/BF16/gemma-3-4b-mmproj-BF16.gguf") and not named_like_projector("x.gguf")
    entries = {e.name: e for e in scan([models])}
    assert sorted(entries) == ["mmproj-lookalike-Q4_K_M"]
    assert entries["mmproj-lookalike-Q4_K_M"].mmproj == adapter


def test_a_projector_of_another_width_is_not_paired(tmp_path):
    models = tmp_path / "models"
    put(models / "tiny-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=64))
    write_vision_projector(models / "mmproj-F16.gguf")  # projects to 576
    assert [e.mmproj for e in Catalog([models]).entries()] == [None]


def test_a_model_named_by_path_gets_the_projector_beside_it_and_a_projector_is_no_model(tmp_path):
    model = put(tmp_path / "eye-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=SMOLLM2_WIDTH))
    projector = write_vision_projector(tmp_path / "mmproj-eye-F16.gguf")
    catalog = Catalog([tmp_path / "none"])
    assert catalog.resolve(str(model)).mmproj == projector
    with pytest.raises(BadRequestError, match="is a multimodal projector, not a model") as info:
        catalog.resolve(str(projector))
    assert info.value.code == "projector_not_model"


# ---------------------------------------------------------------- planning: the bill and the placement

GIB = 1024 * MIB


def _gpu(free: int) -> Inventory:
    return Inventory(
        (
            Device("CUDA", 0, "GPU 0", 80 * GIB, free, "nvidia-smi", "GPU-0000"),
            Device("CPU", None, "Test CPU", 64 * GIB, 60 * GIB, "psutil"),
        ),
        (),
    )


@pytest.fixture
def gemma_with_projector(gemma, tmp_path):
    """Gemma's plan inputs with a 300 MiB projector beside it (200 MiB of weights, 100 MiB of compute)."""
    return dataclasses.replace(
        gemma, mmproj=tmp_path / "mmproj-F16.gguf", mmproj_bytes=200 * MIB, mmproj_compute_bytes=100 * MIB
    )


def test_the_projector_counts_on_the_first_gpu_when_it_fits_there(gemma_with_projector, real, tmp_path):
    p = plan(gemma_with_projector, _gpu(8 * GIB), real, PlanRequest(n_ctx=4096))
    assert p.mmproj_offload and p.bill.projector.device == "GPU0"
    assert p.bill.device("GPU0").projector == 300 * MIB and p.bill.device("CPU").projector == 0
    assert any("projector mmproj-F16.gguf on GPU0 (CUDA0)" in r for r in p.reasons)
    argv = build_command(p, real, binary=Path("/x/llama-server"), files_root=tmp_path).argv(1)
    assert argv[argv.index("--mmproj") + 1].endswith("mmproj-F16.gguf") and "--no-mmproj-offload" not in argv


def test_a_projector_that_would_push_layers_off_the_gpu_stays_on_the_cpu(gemma, gemma_with_projector, real, tmp_path):
    alone = plan(gemma, _gpu(8 * GIB), real, PlanRequest(n_ctx=4096))
    # room for the model fully offloaded, not for the model and the projector
    free = int((alone.bill.device("GPU0").total + 150 * MIB) / 0.9)
    p = plan(gemma_with_projector, _gpu(free), real, PlanRequest(n_ctx=4096))
    assert not p.mmproj_offload and p.n_gpu_layers == gemma.facts.block_count + 1 and p.fits
    assert p.bill.projector.device == "CPU" and p.bill.device("CPU").projector == 300 * MIB
    assert any(r.startswith("projector on the CPU (--no-mmproj-offload)") for r in p.reasons)
    argv = build_command(p, real, binary=Path("/x/llama-server"), files_root=tmp_path).argv(1)
    assert "--no-mmproj-offload" in argv


def test_a_projector_of_another_width_is_refused_before_planning(gemma_model, tmp_path):
    projector = write_vision_projector(tmp_path / "mmproj.gguf")  # 576 wide; Gemma 270M is 640
    with pytest.raises(ProjectorError, match="projects to 576 but the gemma3 model's embedding length is 640"):
        load_model(gemma_model, mmproj=projector)


# ---------------------------------------------------------------- what inspect, ls and /api/models say

CLI = str(Path(sys.executable).parent / "ggstudio")


def ggstudio(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


@pytest.fixture
def media_library(tmp_path, zoo_dir) -> Path:
    """A folder: a model with a vision projector, one with an audio projector, and a TTS model."""
    root = tmp_path / "lib"
    for name in ("eye", "ear"):
        put(root / name / f"{name}-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=SMOLLM2_WIDTH))
    write_vision_projector(root / "eye" / "mmproj-eye-F16.gguf")
    write_audio_projector(root / "ear" / "mmproj-ear-F16.gguf")
    (root / "tts").mkdir()
    (root / "tts" / "qwen3tts-dense.gguf").symlink_to(zoo_dir / "qwen3tts-dense.gguf")
    return root


def test_inspect_says_what_a_projector_takes(tiny_projectors):
    out = ggstudio("inspect", str(tiny_projectors[1]))
    assert out.returncode == 0, out.stderr
    assert "multimodal projector (mmproj)" in out.stdout and "audio (speech in)" in out.stdout
    assert "voxtral: 1 layers of 64, 128 mel bins, into width 576" in out.stdout
    info = json.loads(ggstudio("inspect", "--json", str(tiny_projectors[0])).stdout)
    assert info["kind"] == "projector" and info["vision"] and not info["audio"]
    assert info["encoders"][0]["projector_type"] == "mlp" and info["projection_dims"] == [576]


def test_ls_and_api_models_show_vision_audio_and_tts(media_library, tmp_path, llama_server_bin):
    env = {
        "GGUF_STUDIO_HOME": str(tmp_path / "home"),
        "GGUF_STUDIO_MODEL_DIRS": str(media_library),
        "HF_HUB_CACHE": str(tmp_path / "hf"),
    }
    listed = {e["name"]: e for e in json.loads(ggstudio("ls", "--json", env=env).stdout)}
    assert sorted(listed) == ["ear-Q4_K_M", "eye-Q4_K_M", "qwen3tts-dense"]
    assert listed["eye-Q4_K_M"]["vision"] and not listed["eye-Q4_K_M"]["audio"]
    assert listed["ear-Q4_K_M"]["audio"] and "text-to-speech" in listed["qwen3tts-dense"]["tts"]
    text = ggstudio("ls", env=env).stdout
    assert "MEDIA" in text and " vision " in text and " audio " in text and " TTS " in text

    manager = ModelManager(
        catalog=Catalog([media_library]),
        binary=llama_server_bin,
        caps=probe(llama_server_bin),
        make_supervisor=supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token())),
    )
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as client:
        models = {m["name"]: m for m in client.get("/api/models").json()}
        one = client.get("/api/models/ear-Q4_K_M").json()
    assert models["eye-Q4_K_M"]["vision"] and models["eye-Q4_K_M"]["mmproj"].endswith("mmproj-eye-F16.gguf")
    assert one["audio"] and not one["vision"] and one["tts"] is None
    assert models["qwen3tts-dense"]["tts"]["family"] == "Qwen3-TTS" and models["qwen3tts-dense"]["speech"]


def test_clip_lines_make_the_projector_part_of_the_actual_bill():
    """Two encoders of one file print the file's size twice: it is loaded once between them."""
    log = "\n".join(
        [
            "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB",
            "sched_reserve:        CPU compute buffer size =    16.64 MiB",
            "clip_model_loader: model name:   omni",
            "clip_ctx: CLIP using CUDA0 backend",
            "load_hparams: model size:         10.00 MiB",
            "reserve_compute_meta:      CUDA0 compute buffer size =     4.00 MiB",
            "reserve_compute_meta:      CUDA0 compute buffer size =     5.00 MiB",  # again, flash attention off
            "reserve_compute_meta:        CPU compute buffer size =     1.00 MiB",
            "clip_ctx: CLIP using CUDA0 backend",
            "load_hparams: model size:         10.00 MiB",
            "reserve_compute_meta:      CUDA0 compute buffer size =     2.00 MiB",
        ]
    )
    bill = parse_allocations(log)
    assert bill.projector == ProjectorBill("GPU0", 10 * MIB, 8 * MIB)
    assert bill.device("GPU0").projector == 17 * MIB and bill.device("CPU").projector == 1 * MIB
    assert bill.device("CPU").weights == round(92.10 * MIB)
    assert bill.total == round(92.10 * MIB) + round(16.64 * MIB) + 18 * MIB
