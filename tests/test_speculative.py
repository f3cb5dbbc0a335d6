"""Speculative-decoding policy: every branch against the real and the legacy binary, then the real server."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import httpx
import pytest

import gguf
from launcher.capabilities import Capabilities
from launcher.devices import Device, Inventory
from launcher.planner import PlanRequest, load_model
from launcher.planner import plan as plan_launch
from launcher.process import LlamaServer
from launcher.speculative import (
    GPU_MTP_N_MAX,
    MODES,
    NGRAM_N_MAX,
    NGRAM_SIMPLE_N_MAX,
    SpecModel,
    SpeculativeConfigError,
    normalize_mode,
    plan,
)
from tests.helpers import free_port, server_argv
from tests.support.zoo import derive_mtp_model

FIXTURES = Path(__file__).parent / "fixtures"

BIG_MTP = SpecModel("Qwen3-Next-80B-A3B-Q4_K_M.gguf", 80_000_000_000, nextn_layers=1)
SMALL_MTP = SpecModel("tiny-1B.gguf", 1_000_000_000, nextn_layers=1)
PLAIN = SpecModel("gemma-3-270m-it-Q4_K_M.gguf", 270_000_000, nextn_layers=0)
NAMED_MTP = SpecModel("GLM-4.5-Air-MTP-Q4_K_M.gguf", 100_000_000_000)  # no facts: the name decides

NEW_NGRAM = ("--spec-ngram-mod-n-match", "24", "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64")


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("auto", "auto"),
        ("default", "auto"),
        ("DEFAULT", "auto"),
        ("mtp", "mtp"),
        ("draft-mtp", "mtp"),
        ("ngram", "ngram"),
        ("ngram-mod", "ngram"),
        ("mtp+ngram", "mtp+ngram"),
        ("draft-mtp,ngram-mod", "mtp+ngram"),
        ("ngram-mod,draft-mtp", "mtp+ngram"),
        ("mtp,ngram", "mtp+ngram"),
        ("off", "off"),
        ("none", "off"),
        ("ngram-simple", "ngram-simple"),
        (" mtp ", "mtp"),
    ],
)
def test_normalize_accepts_canonical_and_llama_cpp_spellings(text, mode):
    assert normalize_mode(text) == mode


@pytest.mark.parametrize("text", ["turbo", "", "draft-eagle3", "mtp,turbo", "ngram-simple,draft-mtp"])
def test_unknown_mode_lists_the_valid_ones(text):
    with pytest.raises(SpeculativeConfigError, match=r"auto, mtp, ngram, mtp\+ngram, off, ngram-simple"):
        normalize_mode(text)


# (requested, model, on_gpu, n_max, resolved, argv on the real b11434 build)
REAL_CASES = [
    ("auto", BIG_MTP, True, None, "mtp", ("--spec-type", "draft-mtp", "--spec-draft-n-max", "2")),
    (
        "auto",
        BIG_MTP,
        False,
        None,
        "mtp+ngram",
        ("--spec-type", "draft-mtp,ngram-mod", "--spec-draft-n-max", "3", *NEW_NGRAM),
    ),
    ("auto", NAMED_MTP, True, None, "mtp", ("--spec-type", "draft-mtp", "--spec-draft-n-max", "2")),
    ("auto", SMALL_MTP, True, None, "ngram", ("--spec-type", "ngram-mod", *NEW_NGRAM)),
    ("auto", SMALL_MTP, False, None, "ngram", ("--spec-type", "ngram-mod", *NEW_NGRAM)),
    ("auto", PLAIN, True, None, "ngram", ("--spec-default",)),
    ("auto", PLAIN, False, None, "ngram", ("--spec-default",)),
    ("auto", BIG_MTP, True, 5, "mtp", ("--spec-type", "draft-mtp", "--spec-draft-n-max", "5")),
    ("mtp", BIG_MTP, False, None, "mtp", ("--spec-type", "draft-mtp", "--spec-draft-n-max", "3")),
    ("mtp", SMALL_MTP, True, None, "mtp", ("--spec-type", "draft-mtp", "--spec-draft-n-max", "2")),
    ("mtp", PLAIN, False, None, "off", ()),
    ("mtp+ngram", PLAIN, False, None, "ngram", ("--spec-type", "ngram-mod", *NEW_NGRAM)),
    (
        "mtp+ngram",
        BIG_MTP,
        True,
        4,
        "mtp+ngram",
        ("--spec-type", "draft-mtp,ngram-mod", "--spec-draft-n-max", "4", *NEW_NGRAM),
    ),
    ("ngram", PLAIN, False, None, "ngram", ("--spec-type", "ngram-mod", *NEW_NGRAM)),
    (
        "ngram",
        PLAIN,
        False,
        16,
        "ngram",
        (
            "--spec-type",
            "ngram-mod",
            "--spec-ngram-mod-n-match",
            "24",
            "--spec-ngram-mod-n-min",
            "16",
            "--spec-ngram-mod-n-max",
            "16",
        ),
    ),
    ("ngram-simple", PLAIN, False, None, "ngram-simple", ("--spec-type", "ngram-simple")),
    ("off", BIG_MTP, True, None, "off", ()),
]


@pytest.mark.parametrize(("requested", "model", "on_gpu", "n_max", "resolved", "argv"), REAL_CASES)
def test_policy_on_the_real_build(real, requested, model, on_gpu, n_max, resolved, argv):
    result = plan(requested, real, model, on_gpu=on_gpu, n_max=n_max)
    assert (result.requested, result.resolved, result.argv) == (normalize_mode(requested), resolved, argv)
    if requested == "auto":
        assert any(r.startswith("auto:") for r in result.reasons)


def test_every_argv_for_the_real_build_parses(real, llama_server_bin):
    # llama-server parses flags in order and exits at --version, so a bad flag or value fails first.
    emitted = {plan(r, real, m, on_gpu=g, n_max=n).argv for r, m, g, n, *_ in REAL_CASES}
    for argv in emitted:
        done = subprocess.run([str(llama_server_bin), *argv, "--version"], capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, (argv, done.stderr)
    stub = subprocess.run(
        [str(llama_server_bin), "--draft-max", "3", "--version"], capture_output=True, text=True, timeout=10
    )
    assert stub.returncode != 0 and "has been removed" in stub.stderr


LEGACY_CASES = [
    ("auto", BIG_MTP, True, None, "mtp", ("--spec-type", "mtp", "--draft-max", "2")),
    (
        "auto",
        BIG_MTP,
        False,
        None,
        "mtp+ngram",
        ("--spec-type", "mtp,ngram-mod", "--draft-max", "3", "--spec-ngram-size-n", "24"),
    ),
    (
        "auto",
        SMALL_MTP,
        False,
        None,
        "ngram",
        ("--spec-type", "ngram-mod", "--spec-ngram-size-n", "24", "--draft-min", "48", "--draft-max", "64"),
    ),
    ("auto", PLAIN, True, None, "off", ()),  # no --spec-default in older builds
    ("mtp", BIG_MTP, True, 7, "mtp", ("--spec-type", "mtp", "--draft-max", "7")),
    (
        "ngram",
        PLAIN,
        False,
        8,
        "ngram",
        ("--spec-type", "ngram-mod", "--spec-ngram-size-n", "24", "--draft-min", "8", "--draft-max", "8"),
    ),
    ("ngram-simple", PLAIN, False, None, "ngram-simple", ("--spec-type", "ngram-simple")),
]


@pytest.mark.parametrize(("requested", "model", "on_gpu", "n_max", "resolved", "argv"), LEGACY_CASES)
def test_policy_on_the_legacy_build(legacy, requested, model, on_gpu, n_max, resolved, argv):
    result = plan(requested, legacy, model, on_gpu=on_gpu, n_max=n_max)
    assert (result.resolved, result.argv) == (resolved, argv)


def test_mtp_on_a_model_without_mtp_layers_is_dropped_with_a_reason(real):
    result = plan("draft-mtp", real, PLAIN, on_gpu=True)
    assert result.resolved == "off" and result.argv == ()
    assert any("no MTP layers" in r for r in result.reasons)


def test_the_name_fallback_is_not_used_when_facts_say_no_mtp(real):
    liar = SpecModel("Something-MTP.gguf", 80_000_000_000, nextn_layers=0)
    assert plan("mtp", real, liar, on_gpu=True).resolved == "off"


@pytest.mark.parametrize("extra", [["--spec-type", "ngram-simple"], ["--spec-type=ngram-cache"], ["--spec-default"]])
def test_a_spec_flag_in_the_extra_args_wins(real, extra):
    result = plan("auto", real, BIG_MTP, on_gpu=True, extra_args=["-t", "2", *extra])
    assert (result.resolved, result.argv) == ("user", ())
    assert "extra arguments" in result.reasons[0]


def _without(caps: Capabilities, *spec_types: str) -> Capabilities:
    return dataclasses.replace(caps, spec_types=tuple(t for t in caps.spec_types if t not in spec_types))


def test_modes_the_binary_cannot_do_are_dropped_with_a_reason(real):
    no_mtp = _without(real, "draft-mtp")
    result = plan("mtp+ngram", no_mtp, BIG_MTP, on_gpu=False)
    assert (result.resolved, result.argv) == ("ngram", ("--spec-type", "ngram-mod", *NEW_NGRAM))
    assert any("no MTP speculative type" in r for r in result.reasons)
    # auto on a GPU wants MTP alone; without it, the non-MTP default applies
    assert plan("auto", no_mtp, BIG_MTP, on_gpu=True).argv == ("--spec-default",)
    bare = _without(real, "ngram-mod", "ngram-simple")
    for mode in ("ngram", "ngram-simple"):
        result = plan(mode, bare, PLAIN, on_gpu=False)
        assert (result.resolved, result.argv) == ("off", ())
        assert any(f"no {mode if mode != 'ngram' else 'ngram-mod'} speculative type" in r for r in result.reasons)


def test_n_max_must_be_positive(real):
    with pytest.raises(SpeculativeConfigError, match="at least 1"):
        plan("mtp", real, BIG_MTP, on_gpu=True, n_max=0)


def test_spec_model_from_facts(gemma_model):
    facts = gguf.read(gemma_model).facts
    model = SpecModel.from_facts(facts, gemma_model)
    assert model.nextn_layers == 0 and not model.has_mtp and model.parameter_count < 1_000_000_000


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_starts_the_real_server_on_gemma(real, llama_server_bin, gemma_model, tmp_path, mode):
    facts = gguf.read(gemma_model).facts
    spec = plan(mode, real, SpecModel.from_facts(facts, gemma_model), on_gpu=False)
    port = free_port()
    argv = server_argv(llama_server_bin, gemma_model, host="127.0.0.1", port=port, n_ctx=2048, extra=spec.argv)
    server = LlamaServer(argv, host="127.0.0.1", port=port, log_path=tmp_path / "llama-server.log")
    server.start()
    try:
        server.wait_ready(timeout=120)
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("requested", "model", "on_gpu", "n_max", "n_draft"),
    [
        ("auto", PLAIN, False, None, NGRAM_N_MAX),  # --spec-default drafts up to 64
        ("ngram", PLAIN, False, 16, 16),
        ("mtp", BIG_MTP, True, None, GPU_MTP_N_MAX),
        ("auto", BIG_MTP, False, None, NGRAM_N_MAX),  # MTP (3) chained with ngram-mod (64)
        ("ngram-simple", PLAIN, False, None, NGRAM_SIMPLE_N_MAX),
        ("off", PLAIN, False, None, 0),
    ],
)
def test_the_plan_says_how_many_tokens_a_step_may_draft(real, requested, model, on_gpu, n_max, n_draft):
    """The memory estimate sizes the logits for n_parallel x (1 + n_draft) rows."""
    assert plan(requested, real, model, on_gpu=on_gpu, n_max=n_max).n_draft == n_draft


# --- MTP needs its NextN tensors ---------------------------------------------------------------------------------

CPU_ONLY = Inventory((Device("CPU", None, "Test CPU", 64 << 30, 60 << 30, "psutil"),), ())


@pytest.fixture(scope="module")
def trunk_only_model(zoo_dir, tmp_path_factory) -> Path:
    """The zoo's GLM-4 MoE as a trunk-only file: ``nextn_predict_layers`` = 1, the NextN block's tensors left out
    (llama.cpp's glm4-moe loader accepts such a file: ``trunk_only`` in models/glm4-moe.cpp)."""
    out = tmp_path_factory.mktemp("trunk") / "glm4moe-trunk-only.gguf"
    return derive_mtp_model(zoo_dir / "glm4moe-moe.gguf", out, trunk_only=True)


def test_the_nextn_tensors_presence_is_a_model_fact(trunk_only_model, qwen35_mtp_model, gemma_model):
    trunk = gguf.read(trunk_only_model).facts
    assert (trunk.nextn_predict_layers, trunk.mtp_tensors, trunk.trunk_only, trunk.has_mtp) == (1, False, True, False)
    heads = gguf.read(qwen35_mtp_model).facts
    assert (heads.mtp_tensors, heads.trunk_only, heads.has_mtp) == (True, False, True)
    plain = gguf.read(gemma_model).facts
    assert (plain.mtp_tensors, plain.trunk_only) == (False, False)


def test_auto_plans_no_mtp_on_a_trunk_only_file(real, trunk_only_model):
    """``auto`` trusted ``nextn_predict_layers`` alone, and would have passed draft-mtp, which llama-server
    refuses on such a file. The zoo file is tiny; made as big as the 80B MTP models auto gives MTP to."""
    facts = gguf.read(trunk_only_model).facts
    model = dataclasses.replace(SpecModel.from_facts(facts, trunk_only_model), parameter_count=80_000_000_000)
    for on_gpu in (True, False):
        result = plan("auto", real, model, on_gpu=on_gpu)
        assert "draft-mtp" not in " ".join(result.argv) and "mtp" not in result.resolved
        assert any("trunk-only" in r for r in result.reasons), result.reasons


@pytest.mark.parametrize("mode", ["mtp", "mtp+ngram", "draft-mtp"])
def test_forced_mtp_on_a_trunk_only_file_is_refused_before_launch(real, trunk_only_model, mode):
    with pytest.raises(SpeculativeConfigError, match="trunk-only file") as refused:
        plan_launch(load_model(trunk_only_model), CPU_ONLY, real, PlanRequest(n_ctx=2048, spec=mode))
    assert "Use the model's file that keeps the MTP heads, or spec = auto or ngram" in str(refused.value)


def test_llama_server_aborts_on_draft_mtp_without_the_nextn_tensors(llama_server_bin, trunk_only_model, tmp_path):
    """Why the refusal above: the pin loads the trunk-only file, then asserts in the MTP graph (glm4-moe.cpp)."""
    for extra, ready in (((), True), (("--spec-type", "draft-mtp"), False)):
        port = free_port()
        argv = server_argv(llama_server_bin, trunk_only_model, host="127.0.0.1", port=port, n_ctx=512, extra=extra)
        server = LlamaServer(argv, host="127.0.0.1", port=port, log_path=tmp_path / f"server-{port}.log")
        server.start()
        try:
            if ready:
                server.wait_ready(timeout=60)
            else:
                assert server.wait_exit(timeout=60) not in (None, 0)
                assert "missing nextn.eh_proj" in (tmp_path / f"server-{port}.log").read_text()
        finally:
            server.stop()


def test_mtp_forced_on_a_model_under_3b_warns(real, qwen35_mtp_model):
    assert any("under 3B" in w for w in plan("mtp", real, SMALL_MTP, on_gpu=True).warnings)
    assert plan("mtp", real, BIG_MTP, on_gpu=True).warnings == ()
    assert plan("auto", real, SMALL_MTP, on_gpu=True).warnings == ()  # auto leaves MTP out there itself
    launch = plan_launch(load_model(qwen35_mtp_model), CPU_ONLY, real, PlanRequest(n_ctx=2048, spec="mtp"))
    assert launch.spec.resolved == "mtp" and any("MTP asked for on a model under 3B" in w for w in launch.warnings)
