"""bench-spec: measured speculative decoding on the real llama-server, stored, and followed by ``auto``.

The measuring runs the real binary on the zoo's Qwen3.5 with an appended MTP
block (every mode, MTP included) and on Gemma (no MTP). Which mode wins on this
busy machine is whatever the measurement says; what is asserted is that ``auto``
follows the stored winner, that a stored result changes what ``auto`` resolves
to, and that another binary or device set finds nothing and leaves the policy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from launcher.devices import Device, Inventory, discover
from launcher.planner import ModelInfo, PlanRequest, load_model, plan, spec_devices
from launcher.spec_measurements import ModeResult, SpecKey, SpecMeasurement, lookup, save
from launcher.speculative import SpecModel
from launcher.speculative import plan as spec_plan
from studio.spec_bench import measure_and_store
from tests.support.studio import running_studio

GIB = 1 << 30
CPU = Inventory((Device("CPU", None, "Test CPU", 16 * GIB, 8 * GIB, "psutil"),), ())


def _auto(info: ModelInfo, caps, store: Path | None, inventory: Inventory = CPU):
    return plan(info, inventory, caps, PlanRequest(n_ctx=2048, spec="auto", spec_measurements=store)).spec


def _with_winner(measured: SpecMeasurement, mode: str) -> SpecMeasurement:
    """``measured`` with ``mode`` made the fastest, as if this machine had measured it so."""
    best = max(r.tokens_per_s for r in measured.results)
    results = tuple(dataclasses.replace(r, tokens_per_s=best * 1.5) if r.mode == mode else r for r in measured.results)
    return dataclasses.replace(measured, results=results)


@pytest.mark.slow
def test_bench_spec_on_the_mtp_zoo_model_measures_every_mode_and_auto_follows_the_stored_result(
    qwen35_mtp_model, llama_server_bin, real, tmp_path
):
    info = load_model(qwen35_mtp_model)
    store = tmp_path / "spec"
    policy = _auto(info, real, store)
    assert policy.measured is None and policy.resolved == "ngram"  # an MTP model under 3B: the policy's ngram-mod

    measured, stored = measure_and_store(
        info, CPU, real, llama_server_bin, store=store, work_dir=tmp_path / "work", tokens=8, rounds=1, n_ctx=2048
    )
    assert [r.mode for r in measured.results] == ["off", "ngram", "ngram-simple", "mtp", "mtp+ngram"]
    assert all(
        r.tokens_per_s > 0 and set(r.per_prompt) == {"prose", "code edit", "repetitive"} for r in measured.results
    )
    assert measured.result("mtp").draft_acceptance is not None  # the MTP head drafted
    assert stored.exists() and lookup(store, qwen35_mtp_model, spec_devices(CPU, real), real) == measured

    followed = _auto(info, real, store)
    assert followed.resolved == measured.winner.mode and followed.measured == measured
    assert followed.reasons[0].startswith(f"auto -> {measured.winner.label}, measured ")

    for mode in ("mtp", "off", "mtp+ngram"):  # whatever was measured, the stored winner is what auto takes
        save(store, _with_winner(measured, mode))
        assert _auto(info, real, store).resolved == mode
    assert _auto(info, real, store).argv[:2] == ("--spec-type", "draft-mtp,ngram-mod")


@pytest.mark.slow
def test_a_changed_binary_or_device_set_finds_no_measurement_and_the_policy_stands(
    qwen35_mtp_model, llama_server_bin, real, tmp_path
):
    info = load_model(qwen35_mtp_model)
    store = tmp_path / "spec"
    key = SpecKey.of(qwen35_mtp_model, spec_devices(CPU, real), real)
    save(store, SpecMeasurement(key, (ModeResult("off", 10.0), ModeResult("mtp", 20.0)), "2026-01-01T00:00:00"))
    assert _auto(info, real, store).resolved == "mtp"

    rebuilt = tmp_path / "bin" / "llama-server"
    rebuilt.parent.mkdir()
    shutil.copy2(llama_server_bin, rebuilt)
    os.utime(rebuilt, ns=(rebuilt.stat().st_atime_ns, rebuilt.stat().st_mtime_ns + 1_000_000_000))
    for caps in (dataclasses.replace(real, binary=str(rebuilt)), dataclasses.replace(real, version="b99999")):
        assert _auto(info, caps, store).measured is None and _auto(info, caps, store).resolved == "ngram"

    gpu = Device("CUDA", 0, "NVIDIA H200", 140 * GIB, 139 * GIB, "nvidia-smi")
    with_gpu = Inventory((gpu, *CPU.devices), ())
    other_cpu = Inventory((dataclasses.replace(CPU.cpu, name="Another CPU"),), ())
    for inventory in (with_gpu, other_cpu):
        spec = _auto(info, real, store, inventory)
        assert spec.measured is None and spec.resolved == "ngram"

    touched = tmp_path / "model.gguf"  # the model file rewritten in place: another mtime
    shutil.copy2(qwen35_mtp_model, touched)
    assert lookup(store, touched, spec_devices(CPU, real), real) is None


def test_auto_follows_a_measurement_and_explicit_modes_ignore_it(real):
    model = SpecModel("m.gguf", 1_000_000_000, nextn_layers=1)
    key = SpecKey("m|1|1", ("CPU=x",), "b|1|1|v")
    measured = SpecMeasurement(
        key, (ModeResult("off", 10.0), ModeResult("ngram", 13.1), ModeResult("mtp", 12.0)), "2026-05-04T10:00:00+00:00"
    )
    spec = spec_plan("auto", real, model, on_gpu=False, measured=measured)
    assert spec.resolved == "ngram" and spec.argv[:2] == ("--spec-type", "ngram-mod")
    assert spec.reasons == ("auto -> ngram-mod, measured 1.31x over off on this machine (2026-05-04)",)
    assert spec_plan("mtp", real, model, on_gpu=False, measured=measured).resolved == "mtp"
    assert spec_plan("mtp", real, model, on_gpu=False, measured=measured).measured is None
    off = dataclasses.replace(measured, results=(ModeResult("off", 10.0), ModeResult("ngram", 9.0)))
    spec = spec_plan("auto", real, model, on_gpu=False, measured=off)
    assert spec.resolved == "off" and spec.argv == () and spec.n_draft == 0  # not llama-server's --spec-default


def test_a_stored_measurement_that_is_not_ours_is_ignored(real, tmp_path, gemma_model):
    key = SpecKey.of(gemma_model, spec_devices(CPU, real), real)
    path = save(tmp_path, SpecMeasurement(key, (ModeResult("off", 1.0),), "2026-01-01T00:00:00"))
    for text in ("not json", json.dumps({"schema": 99}), json.dumps({**json.loads(path.read_text()), "results": []})):
        path.write_text(text)
        assert lookup(tmp_path, gemma_model, spec_devices(CPU, real), real) is None


@pytest.mark.slow
def test_bench_spec_cli_on_gemma_stores_the_winner_and_plan_says_so(gemma_model, llama_server_bin, tmp_path):
    env = {
        **os.environ,
        "GGUF_STUDIO_HOME": str(tmp_path / "home"),
        "LLAMA_SERVER_PATH": str(llama_server_bin),
        "NO_COLOR": "1",
    }
    cli = [str(Path(sys.executable).parent / "ggstudio")]
    done = subprocess.run(
        [*cli, "bench-spec", str(gemma_model), "--tokens", "8", "--rounds", "1", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [r["mode"] for r in out["results"]] == ["off", "ngram", "ngram-simple"]  # Gemma has no MTP layers
    winner = max(out["results"], key=lambda r: r["tokens_per_s"])["mode"]
    assert out["auto"]["resolved"] == winner and Path(out["stored"]).is_file()

    shown = subprocess.run(
        [*cli, "plan", str(gemma_model), "--ctx", "2048", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    spec = json.loads(shown.stdout)["speculative"]
    assert spec["resolved"] == winner and spec["measured"]["winner"] == out["winner"]
    assert spec["reasons"][0] == f"auto -> {out['summary']}"
    text = subprocess.run(
        [*cli, "plan", str(gemma_model), "--ctx", "2048"], env=env, capture_output=True, text=True, timeout=300
    ).stdout
    assert f"measured: {out['summary']}" in text


@pytest.mark.slow
def test_api_status_says_auto_follows_the_measurement(qwen35_mtp_model, llama_server_bin, real, tmp_path):
    store = tmp_path / "spec"
    inventory = discover(llama_server=llama_server_bin)
    key = SpecKey.of(qwen35_mtp_model, spec_devices(inventory, real), real)
    measured = SpecMeasurement(key, (ModeResult("off", 10.0), ModeResult("mtp", 14.2)), "2026-02-03T00:00:00+00:00")
    save(store, measured)
    with running_studio(tmp_path, llama_server_bin, {"mtp": qwen35_mtp_model}, spec_measurements=store) as studio:
        resp = httpx.post(f"{studio.url}/api/load", json={"model": "mtp", "n_ctx": 1024}, timeout=300)
        assert resp.status_code == 200, resp.text
        spec = httpx.get(f"{studio.url}/api/status", timeout=30).json()["speculative"]
    assert spec["resolved"] == "mtp" and spec["flags"][:2] == ["--spec-type", "draft-mtp"]
    assert spec["measured"]["summary"] == "mtp, measured 1.42x over off on this machine (2026-02-03)"
    assert spec["reasons"][0] == f"auto -> {spec['measured']['summary']}"
