"""The capability probe against the real pinned build, a saved older help text and broken fakes."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from launcher import capabilities
from launcher.capabilities import Capabilities, ProbeError, capabilities_from_text, parse_help, probe

FIXTURES = Path(__file__).parent / "fixtures"
FAKE = FIXTURES / "bin" / "llama-server"


@pytest.fixture(autouse=True)
def fresh_memory_cache():
    capabilities.clear_memory_cache()
    yield
    capabilities.clear_memory_cache()


def legacy_capabilities() -> Capabilities:
    """The saved help of an older build (before the --spec-draft-* renames)."""
    return capabilities_from_text(
        "old/llama-server", (FIXTURES / "legacy-version.txt").read_text(), (FIXTURES / "legacy-help.txt").read_text()
    )


@pytest.fixture
def fake_binary(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A copy of the fake llama-server and the file it logs each invocation to."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    shutil.copy2(FAKE, binary)
    calls = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_LLAMA_FIXTURES", str(FIXTURES))
    monkeypatch.setenv("FAKE_LLAMA_CALLS", str(calls))
    return binary, calls


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


# --- the real pinned build -------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(llama_server_bin, tmp_path_factory) -> Capabilities:
    capabilities.clear_memory_cache()
    return probe(llama_server_bin, cache_dir=tmp_path_factory.mktemp("cache"))


def test_real_build_version_and_speculative_facts(real):
    assert real.build == 11434
    assert real.version
    assert "draft-mtp" in real.spec_types and "mtp" not in real.spec_types
    assert real.mtp_type == "draft-mtp"
    assert {"none", "ngram-mod", "ngram-simple"} <= set(real.spec_types)
    assert real.ngram_style == "new"
    assert real.draft_n_max_flag == "--spec-draft-n-max"


def test_real_build_removed_stubs_are_not_flags(real):
    for stub in ("--draft-max", "--draft", "--draft-min", "--spec-ngram-size-n"):
        assert stub in real.removed_flags
        assert not real.supports(stub)


@pytest.mark.parametrize(
    "flag",
    [
        "--fit",
        "-fit",
        "--fit-target",
        "--fit-ctx",
        "--list-devices",
        "--no-context-shift",
        "--context-shift",
        "--chat-template-kwargs",
        "--jinja",
        "--mmproj",
        "--api-key",
        "--spec-default",
        "-lv",
        "--verbosity",
        "--metrics",
        "--slots",
        "--kv-unified",
        "--swa-full",
        "--spec-type",
        "--spec-draft-n-max",
        "--spec-ngram-mod-n-match",
        "--spec-ngram-mod-n-min",
        "--spec-ngram-mod-n-max",
    ],
)
def test_real_build_supports(real, flag):
    assert real.supports(flag)


def test_real_build_round_trips_through_json(real):
    assert Capabilities.from_json(json.loads(json.dumps(real.to_json()))) == real


# --- help parsing and the legacy format -------------------------------------------------------


def test_parse_help_splits_declaration_hint_and_description():
    text = (
        "----- common params -----\n\n"
        "-fit,  --fit [on|off]                   whether to adjust unset arguments to fit in device memory\n"
        "                                        (env: LLAMA_ARG_FIT)\n"
        "--spec-type none,draft-mtp,ngram-mod\n"
        "                                        comma-separated list of types\n"
        "--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max\n"
    )
    fit, spec, draft = parse_help(text)
    assert fit.flags == ("-fit", "--fit") and fit.value_hint == "[on|off]" and not fit.removed
    assert fit.description.endswith("(env: LLAMA_ARG_FIT)")
    assert spec.flags == ("--spec-type",) and spec.value_hint == "none,draft-mtp,ngram-mod"
    assert draft.flags == ("--draft", "--draft-n", "--draft-max") and draft.removed


def test_legacy_help_is_classified_legacy():
    old = legacy_capabilities()
    assert (old.version, old.build) == ("6990", 6990)
    assert old.spec_types == ("none", "mtp", "ngram-cache", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
    assert old.mtp_type == "mtp"
    assert old.ngram_style == "legacy"
    assert old.draft_n_max_flag == "--draft-max"
    assert old.supports("--draft-max") and old.supports("--draft-min") and old.supports("--spec-ngram-size-n")
    assert not old.supports("--fit") and not old.supports("--spec-default") and not old.supports("--fit-target")
    assert old.supports("--no-context-shift") and old.supports("-lv") and old.supports("--mmproj")
    assert not old.removed_flags


def test_ngram_style_none_without_any_knobs():
    help_text = "-h,    --help                           print usage and exit\n--spec-type [none|ngram-mod]\n"
    caps = capabilities_from_text("x", "", help_text)
    assert caps.ngram_style == "none" and caps.draft_n_max_flag is None and caps.build is None


# --- probing fakes: cache and failures --------------------------------------------------------


def test_probe_runs_the_binary_once_then_uses_memory_and_disk_caches(fake_binary, tmp_path):
    binary, calls = fake_binary
    cache = tmp_path / "cache"
    first = probe(binary, cache_dir=cache)
    assert first.ngram_style == "legacy"
    assert _calls(calls) == ["--version", "--help"]

    assert probe(binary, cache_dir=cache) == first  # memory
    capabilities.clear_memory_cache()
    assert probe(binary, cache_dir=cache) == first  # disk, as a new process would see it
    assert len(_calls(calls)) == 2
    assert len(list(cache.glob("capabilities-*.json"))) == 1


def test_a_changed_binary_is_probed_again(fake_binary, tmp_path):
    binary, calls = fake_binary
    probe(binary, cache_dir=tmp_path / "cache")
    stat = binary.stat()
    os.utime(binary, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # "rebuilt"
    probe(binary, cache_dir=tmp_path / "cache")
    assert len(_calls(calls)) == 4


def test_a_corrupted_cache_file_is_ignored_and_rewritten(fake_binary, tmp_path):
    binary, calls = fake_binary
    cache = tmp_path / "cache"
    probe(binary, cache_dir=cache)
    (cache_file,) = cache.glob("capabilities-*.json")
    cache_file.write_text('{"schema": 1, "path": ')
    capabilities.clear_memory_cache()
    caps = probe(binary, cache_dir=cache)
    assert len(_calls(calls)) == 4
    assert Capabilities.from_json(json.loads(cache_file.read_text())["capabilities"]) == caps


def test_a_binary_that_hangs_is_killed_and_reported(fake_binary, monkeypatch):
    binary, _ = fake_binary
    monkeypatch.setenv("FAKE_LLAMA_MODE", "hang")
    started = time.monotonic()
    with pytest.raises(ProbeError, match=r"did not finish within 0.5 s") as err:
        probe(binary, timeout=0.5)
    assert time.monotonic() - started < 5
    assert str(binary.resolve()) in str(err.value)


def test_a_binary_that_crashes_is_reported_with_its_exit_code_and_output(fake_binary, monkeypatch):
    binary, _ = fake_binary
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    with pytest.raises(ProbeError, match=r"exited with code 134") as err:
        probe(binary)
    assert "GGML_ASSERT" in err.value.output_tail
    assert err.value.binary == str(binary.resolve())


def test_a_binary_that_prints_garbage_is_not_llama_server(fake_binary, monkeypatch):
    binary, _ = fake_binary
    monkeypatch.setenv("FAKE_LLAMA_MODE", "garbage")
    with pytest.raises(ProbeError, match=r"no llama.cpp option list"):
        probe(binary)


def test_a_missing_binary_is_a_probe_error(tmp_path):
    with pytest.raises(ProbeError, match="cannot probe"):
        probe(tmp_path / "nope")
