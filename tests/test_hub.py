"""Hugging Face resolution and downloads, through the real huggingface_hub against a local Hub stand-in."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gguf
from gguf.writer import TensorToWrite, write_gguf
from studio.error_table import outcome
from studio.errors import (
    BadRequestError,
    DiskSpaceError,
    DownloadCancelledError,
    HubAuthError,
    HubError,
    ModelNotFoundError,
)
from studio.library import hub
from tests.helpers import free_port
from tests.hub_server import HubServer

# ---------------------------------------------------------------- fixtures and GGUF builders


@pytest.fixture
def server():
    s = HubServer().start()
    yield s
    s.stop()


@pytest.fixture
def hf_env(server, tmp_path, monkeypatch) -> hub.HubConfig:
    """huggingface_hub's variables pointing at the stand-in and at a cache in tmp_path."""
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return hub.HubConfig.from_env()


def model_bytes(
    tmp_path: Path,
    *,
    arch: str = "llama",
    n_embd: int = 64,
    floats: int = 64,
    split: tuple[int, int] | None = None,
    name: str = "m",
) -> bytes:
    """A tiny GGUF (one F32 tensor of ``floats`` values) as bytes."""
    meta: dict = {
        "general.architecture": arch,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.block_count": 1,
        f"{arch}.context_length": 2048,
        f"{arch}.attention.head_count": 4,
    }
    if split:
        meta.update({"split.no": split[0], "split.count": split[1]})
    path = write_gguf(
        tmp_path / f"{name}-{os.urandom(4).hex()}.gguf",
        meta,
        [TensorToWrite(f"t{split[0] if split else 0}.weight", (floats,), "F32", os.urandom(4 * floats))],
    )
    return path.read_bytes()


def mmproj_bytes(tmp_path: Path, projection_dim: int = 64) -> bytes:
    path = write_gguf(
        tmp_path / f"mmproj-{os.urandom(4).hex()}.gguf",
        {
            "general.architecture": "clip",
            "clip.projector_type": "gemma3",
            "clip.has_vision_encoder": True,
            "clip.vision.projection_dim": projection_dim,
        },
    )
    return path.read_bytes()


def add_shards(repo, tmp_path: Path, stem: str, count: int, floats: int = 64, only: set[int] | None = None) -> None:
    for i in range(1, count + 1):
        if only is None or i in only:
            repo.add(f"{stem}-{i:05d}-of-{count:05d}.gguf", model_bytes(tmp_path, split=(i - 1, count), floats=floats))


def blobs(cfg: hub.HubConfig, repo: str) -> list[Path]:
    folder = hub.repo_folder(cfg.cache_dir, repo) / "blobs"
    return sorted(folder.iterdir()) if folder.is_dir() else []


# ---------------------------------------------------------------- names (pure)


@pytest.mark.parametrize(
    "variant, path, expected",
    [
        ("Q4_K_M", "model-Q4_K_M.gguf", True),
        ("q4_k_m", "model-Q4_K_M.gguf", True),
        ("Q4_K_M", "model-Q4_K_M_XL.gguf", False),
        ("Q4_K_M", "model-IQ4_K_M.gguf", False),
        ("Q4_K", "model-Q4_K_M.gguf", False),
        ("Q4_K_XL", "model-UD-Q4_K_XL.gguf", True),
        ("BF16", "BF16/model-00001-of-00002.gguf", True),
        ("Q8_0", "model.Q8_0.gguf", True),
    ],
)
def test_variant_is_matched_as_a_whole_token(variant, path, expected):
    assert hub.variant_matches(variant, path) is expected


def test_candidates_group_shards_and_leave_out_mmproj():
    files = [
        hub.HubFile(p, 10)
        for p in (
            "m-Q8_0-00001-of-00002.gguf",
            "m-Q8_0-00002-of-00002.gguf",
            "m-Q4_K_M.gguf",
            "mmproj-F16.gguf",
            "README.md",
        )
    ]
    cands = hub.candidates(files)
    assert [(c.label, len(c.files)) for c in cands] == [("Q4_K_M", 1), ("Q8_0", 2)]


def test_gemma_3_4b_mmproj_f16_is_no_candidate_on_the_hub_either():
    """The Hub listing and the library's folder scan use one rule (``studio.library.projectors``): ``mmproj``
    anywhere in the file name, so Unsloth's ``gemma-3-4b-mmproj-f16.gguf`` is never offered as a chat model."""
    files = [
        hub.HubFile(p, 10)
        for p in ("gemma-3-4b-it-Q4_K_M.gguf", "gemma-3-4b-mmproj-f16.gguf", "BF16/gemma-3-4b-mmproj-BF16.gguf")
    ]
    assert [c.key for c in hub.candidates(files)] == ["gemma-3-4b-it-Q4_K_M"]
    assert [f.path for f in files if hub.is_mmproj(f.path)] == [
        "gemma-3-4b-mmproj-f16.gguf",
        "BF16/gemma-3-4b-mmproj-BF16.gguf",
    ]


# ---------------------------------------------------------------- resolve + pull


def test_single_file_pull_defaults_to_q4_k_m_and_fills_the_cache(server, hf_env, tmp_path):
    repo = server.repo("acme/tiny-GGUF")
    repo.add("tiny-Q4_K_M.gguf", model_bytes(tmp_path))
    repo.add("tiny-Q2_K.gguf", model_bytes(tmp_path, floats=32))
    repo.add("README.md", b"# tiny\n")
    pulled = hub.pull("acme/tiny-GGUF")
    assert pulled.resolved.model.label == "Q4_K_M"
    assert "default" in pulled.resolved.reason
    assert pulled.path.read_bytes() == repo.files["tiny-Q4_K_M.gguf"]
    assert pulled.path.is_relative_to(hf_env.cache_dir / "models--acme--tiny-GGUF" / "snapshots" / repo.commit)
    assert pulled.downloaded == len(repo.files["tiny-Q4_K_M.gguf"])
    assert (hub.repo_folder(hf_env.cache_dir, "acme/tiny-GGUF") / "refs" / "main").read_text() == repo.commit
    assert server.downloads() == [f"/acme/tiny-GGUF/resolve/{repo.commit}/tiny-Q4_K_M.gguf"]


def test_without_q4_k_m_the_smallest_is_picked_and_said(server, hf_env, tmp_path):
    repo = server.repo("acme/two")
    repo.add("two-Q8_0.gguf", model_bytes(tmp_path, floats=256))
    repo.add("two-Q5_K_S.gguf", model_bytes(tmp_path, floats=64))
    resolved = hub.resolve("acme/two")
    assert resolved.model.label == "Q5_K_S" and "smallest" in resolved.reason


def test_sharded_variant_pulls_every_shard(server, hf_env, tmp_path):
    repo = server.repo("acme/big-GGUF")
    add_shards(repo, tmp_path, "big-Q8_0", 3)
    repo.add("big-Q4_K_M.gguf", model_bytes(tmp_path))
    pulled = hub.pull("acme/big-GGUF:q8_0")
    assert [p.name for p in pulled.paths] == [f"big-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert len(gguf.read(pulled.path).shards) == 3


def test_a_shard_missing_from_the_repo_is_named(server, hf_env, tmp_path):
    repo = server.repo("acme/holey")
    add_shards(repo, tmp_path, "holey-Q8_0", 3, only={1, 3})
    with pytest.raises(ModelNotFoundError, match="holey-Q8_0-00002-of-00003.gguf"):
        hub.resolve("acme/holey:Q8_0")


def test_subfolder_variant(server, hf_env, tmp_path):
    repo = server.repo("acme/folders")
    add_shards(repo, tmp_path, "BF16/folders", 2)  # the label is only in the folder name
    repo.add("Q4_K_M/folders-Q4_K_M.gguf", model_bytes(tmp_path))
    pulled = hub.pull("acme/folders:bf16")
    assert [p.relative_to(pulled.path.parents[1]).as_posix() for p in pulled.paths] == [
        "BF16/folders-00001-of-00002.gguf",
        "BF16/folders-00002-of-00002.gguf",
    ]
    assert hub.resolve("acme/folders").model.key == "Q4_K_M/folders-Q4_K_M"


def test_variant_boundary_q4_k_m_is_not_q4_k_m_xl(server, hf_env, tmp_path):
    repo = server.repo("acme/bound")
    repo.add("bound-Q4_K_M_XL.gguf", model_bytes(tmp_path, floats=32))
    repo.add("bound-Q4_K_M.gguf", model_bytes(tmp_path))
    assert hub.resolve("acme/bound:Q4_K_M").model.files[0].path == "bound-Q4_K_M.gguf"
    assert hub.resolve("acme/bound:Q4_K_M_XL").model.files[0].path == "bound-Q4_K_M_XL.gguf"


def test_ambiguous_variant_lists_the_candidates(server, hf_env, tmp_path):
    repo = server.repo("acme/twins")
    repo.add("a-Q4_0.gguf", model_bytes(tmp_path))
    repo.add("b-Q4_0.gguf", model_bytes(tmp_path))
    with pytest.raises(BadRequestError, match="a-Q4_0.gguf; b-Q4_0.gguf"):
        hub.resolve("acme/twins:Q4_0")
    assert hub.resolve("acme/twins:b-Q4_0.gguf").model.key == "b-Q4_0"


def test_unknown_repo_no_gguf_and_unknown_variant(server, hf_env, tmp_path):
    with pytest.raises(ModelNotFoundError, match="acme/nope not found"):
        hub.resolve("acme/nope")
    server.repo("acme/safetensors", files={"model.safetensors": b"x" * 10, "config.json": b"{}"})
    with pytest.raises(ModelNotFoundError, match="no GGUF model file.*config.json, model.safetensors"):
        hub.resolve("acme/safetensors")
    server.repo("acme/one").add("one-Q4_K_M.gguf", model_bytes(tmp_path))
    with pytest.raises(ModelNotFoundError, match="no 'Q6_K' variant; it has: Q4_K_M"):
        hub.resolve("acme/one:Q6_K")
    with pytest.raises(BadRequestError, match="owner/repo"):
        hub.resolve("just-a-name")


def test_mmproj_is_picked_separately_preferring_f16(server, hf_env, tmp_path):
    repo = server.repo("acme/vision")
    repo.add("vision-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=64))
    repo.add("mmproj-vision-F32.gguf", mmproj_bytes(tmp_path, 64))
    repo.add("mmproj-vision-F16.gguf", mmproj_bytes(tmp_path, 64))
    repo.add("mmproj-vision-BF16.gguf", mmproj_bytes(tmp_path, 64))
    resolved = hub.resolve("acme/vision")
    assert [c.label for c in resolved.candidates] == ["Q4_K_M"]
    assert resolved.mmproj.path == "mmproj-vision-F16.gguf"
    pulled = hub.pull("acme/vision")
    assert pulled.mmproj is not None and pulled.mmproj.name == "mmproj-vision-F16.gguf"
    assert pulled.notes == ()


def test_an_mmproj_of_another_family_is_not_used(server, hf_env, tmp_path):
    repo = server.repo("acme/mixed")
    repo.add("mixed-Q4_K_M.gguf", model_bytes(tmp_path, n_embd=64))
    repo.add("mmproj-F16.gguf", mmproj_bytes(tmp_path, 1152))
    pulled = hub.pull("acme/mixed")
    assert pulled.mmproj is None
    assert "projects to 1152" in pulled.notes[0] and "embedding length is 64" in pulled.notes[0]


def test_unknown_revision_and_foreign_errors_are_translated(server, hf_env, tmp_path):
    from huggingface_hub.errors import LocalEntryNotFoundError

    server.repo("acme/rev").add("rev-Q4_K_M.gguf", model_bytes(tmp_path))
    with pytest.raises(ModelNotFoundError, match="no such revision"):
        hub.resolve("acme/rev", revision="v9")
    with pytest.raises(DiskSpaceError, match="full while downloading x.gguf; the partial file was removed"):
        with hub._hub_errors("acme/rev", hf_env, "x.gguf"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(HubError, match="unreachable and the file is not in the cache"):
        with hub._hub_errors("acme/rev", hf_env, "x.gguf"):
            raise LocalEntryNotFoundError("offline")


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB file system (tmpfs) to fill up; skipped where this user may not mount one."""
    mount_point = tmp_path / "tiny-disk"
    mount_point.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.filterwarnings("ignore:Not enough free disk space")  # huggingface_hub's own check only warns
def test_a_disk_that_fills_up_mid_download_is_one_clear_error_and_leaves_no_partial_file(
    server, hf_env, tmp_path, tiny_disk, monkeypatch
):
    server.repo("acme/big").add("big-Q4_K_M.gguf", model_bytes(tmp_path, floats=600_000))  # ~2.3 MB > the disk
    monkeypatch.setenv("HF_HUB_CACHE", str(tiny_disk / "hub"))
    cfg = hub.HubConfig.from_env()
    # the preflight is told there is room, as when something else fills the disk during the download
    with pytest.raises(DiskSpaceError) as info:
        hub.pull("acme/big", disk_free=lambda _: 2**40)
    assert f"the disk holding {cfg.cache_dir} is full while downloading big-Q4_K_M.gguf" in str(info.value)
    assert "free some space and pull again" in str(info.value)
    left = [p for p in tiny_disk.rglob("*") if p.is_file()]
    assert not [p for p in left if p.stat().st_size > 64 * 1024], left  # no half-written model kept
    assert os.statvfs(tiny_disk).f_bfree * os.statvfs(tiny_disk).f_frsize > 900 * 1024  # the space is back


# ---------------------------------------------------------------- preflight


def test_preflight_offers_the_largest_variant_that_fits(server, hf_env, tmp_path):
    repo = server.repo("acme/sizes")
    repo.add("sizes-Q8_0.gguf", model_bytes(tmp_path, floats=60_000))  # ~240 kB
    repo.add("sizes-Q4_K_M.gguf", model_bytes(tmp_path, floats=35_000))  # ~140 kB
    repo.add("sizes-Q2_K.gguf", model_bytes(tmp_path, floats=10_000))  # ~40 kB
    free = 200_000
    with pytest.raises(DiskSpaceError) as info:
        hub.pull("acme/sizes:Q8_0", disk_free=lambda _: free)
    err = info.value
    assert err.fallback == "Q4_K_M" and err.free == free and err.needed == len(repo.files["sizes-Q8_0.gguf"])
    assert f"needs {err.needed:,} bytes more" in err.message and "only 200,000 bytes are free" in err.message
    assert "pull acme/sizes:Q4_K_M" in err.message
    with pytest.raises(DiskSpaceError, match="no variant of this repo fits"):
        hub.pull("acme/sizes:Q2_K", disk_free=lambda _: 10)
    assert server.downloads() == []

    pulled = hub.pull("acme/sizes:Q8_0", disk_free=lambda _: free, fallback=True)
    assert pulled.resolved.model.label == "Q4_K_M" and "largest variant that fits" in pulled.resolved.reason
    # complete blobs are subtracted: nothing left to fetch, so even a full disk passes
    again = hub.preflight(hub.resolve("acme/sizes:Q4_K_M"), disk_free=lambda _: 0)
    assert again.needed == 0 and again.fits and again.cached == len(repo.files["sizes-Q4_K_M.gguf"])
    with pytest.raises(DiskSpaceError, match="largest variant that fits is Q4_K_M"):  # it is cached already
        hub.pull("acme/sizes:Q8_0", disk_free=lambda _: 0)


# ---------------------------------------------------------------- offline


def test_offline_resolution_uses_the_cache_only(server, hf_env, tmp_path, monkeypatch):
    repo = server.repo("acme/away")
    repo.add("away-Q4_K_M.gguf", model_bytes(tmp_path))
    repo.add("away-Q8_0.gguf", model_bytes(tmp_path, floats=128))
    first = hub.pull("acme/away")
    server.clear()

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pulled = hub.pull("acme/away")
    assert pulled.path == first.path and pulled.downloaded == 0
    assert "offline mode" in pulled.resolved.offline_reason
    assert server.requests == []
    with pytest.raises(ModelNotFoundError, match="no 'Q8_0' variant.*local cache only: offline mode"):
        hub.pull("acme/away:Q8_0")
    with pytest.raises(ModelNotFoundError, match="acme/never is not in the local cache"):
        hub.resolve("acme/never")
    monkeypatch.delenv("HF_HUB_OFFLINE")

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    pulled = hub.pull("acme/away")
    assert pulled.path == first.path and "unreachable" in pulled.resolved.offline_reason


# ---------------------------------------------------------------- cancellation


def test_cancel_within_a_file_leaves_no_partial_blob(server, hf_env, tmp_path):
    repo = server.repo("acme/slow")
    big = model_bytes(tmp_path, floats=6 << 20)  # 24 MiB: more than one 10 MiB chunk of huggingface_hub
    repo.add("slow-Q4_K_M.gguf", big)
    cancel = threading.Event()
    seen = []

    def progress(p: hub.DownloadProgress) -> None:
        seen.append(p)
        if p.done > 0:
            cancel.set()

    with pytest.raises(DownloadCancelledError):
        hub.pull("acme/slow", progress=progress, cancel=cancel)
    assert 0 < seen[-1].done < len(big) and seen[-1].total == len(big) and seen[-1].rate > 0
    folder = hub.repo_folder(hf_env.cache_dir, "acme/slow")
    assert blobs(hf_env, "acme/slow") == []  # no .incomplete left, no blob
    assert not (folder / "snapshots" / repo.commit / "slow-Q4_K_M.gguf").exists()

    pulled = hub.pull("acme/slow")  # the cache is consistent: the next pull completes it
    assert pulled.path.read_bytes() == big


def test_cancel_between_files_keeps_the_complete_ones(server, hf_env, tmp_path):
    repo = server.repo("acme/parts")
    add_shards(repo, tmp_path, "parts-Q4_K_M", 2)
    first = repo.files["parts-Q4_K_M-00001-of-00002.gguf"]
    cancel = threading.Event()

    def progress(p: hub.DownloadProgress) -> None:
        if p.file_index == 1 and p.done == len(first):
            cancel.set()

    with pytest.raises(DownloadCancelledError):
        hub.pull("acme/parts", progress=progress, cancel=cancel)
    assert [b.name for b in blobs(hf_env, "acme/parts")] == [repo.etag("parts-Q4_K_M-00001-of-00002.gguf")]
    assert hub.preflight(hub.resolve("acme/parts")).needed == len(repo.files["parts-Q4_K_M-00002-of-00002.gguf"])


# ---------------------------------------------------------------- auth


def test_gated_repo_asks_for_hf_token_and_never_shows_it(server, hf_env, tmp_path, monkeypatch, capsys):
    repo = server.repo("acme/gated", gated=True, granted_token="hf_granted_secret")
    repo.add("gated-Q4_K_M.gguf", model_bytes(tmp_path))
    with pytest.raises(HubAuthError, match="set HF_TOKEN") as info:
        hub.pull("acme/gated")
    assert outcome(info.value).status == 401

    monkeypatch.setenv("HF_TOKEN", "hf_wrong_secret")
    with pytest.raises(HubAuthError, match="HF_TOKEN has no access") as info:
        hub.pull("acme/gated")
    assert "hf_wrong_secret" not in str(info.value) and "hf_wrong_secret" not in repr(hub.HubConfig.from_env())

    monkeypatch.setenv("HF_TOKEN", "hf_granted_secret")
    assert hub.pull("acme/gated").path.is_file()
    out = capsys.readouterr()
    assert "secret" not in out.out + out.err


# ---------------------------------------------------------------- CLI


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("ggstudio")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-c", "from studio.cli.app import main; main()"]
    return subprocess.run(argv + list(args), env=env, capture_output=True, text=True, timeout=120)


def test_cli_pull_is_idempotent_and_ls_lists_it(server, hf_env, tmp_path):
    repo = server.repo("acme/cli-GGUF")
    repo.add("cli-Q4_K_M.gguf", model_bytes(tmp_path))
    repo.add("cli-Q8_0.gguf", model_bytes(tmp_path, floats=128))
    repo.add("mmproj-cli-F16.gguf", mmproj_bytes(tmp_path, 64))
    env = {**os.environ, "GGUF_STUDIO_HOME": str(tmp_path / "studio")}

    first = _cli("pull", "acme/cli-GGUF:Q4_K_M", env=env)
    assert first.returncode == 0, first.stderr
    assert len(server.downloads()) == 2  # the model and its projector
    assert "cli-Q4_K_M.gguf" in first.stdout
    server.clear()
    second = _cli("pull", "acme/cli-GGUF:Q4_K_M", env=env)
    assert second.returncode == 0, second.stderr
    assert server.downloads() == [] and "already in the cache" in second.stderr

    listed = _cli("ls", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)
    [entry] = [e for e in entries if e["repo"] == "acme/cli-GGUF"]
    assert entry["variant"] == "Q4_K_M" and entry["mmproj"].endswith("mmproj-cli-F16.gguf")
    text = _cli("ls", env=env)
    assert text.returncode == 0 and "acme/cli-GGUF" in text.stdout

    missing = _cli("pull", "acme/absent", env=env)
    assert missing.returncode == 3 and "acme/absent not found" in missing.stderr
    assert "Traceback" not in missing.stderr
