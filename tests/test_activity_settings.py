"""How long the activity records are kept, and turning them off: the config's ``activity_days`` and
``activity_records``, read by a real ``ggstudio serve`` in front of the real llama-server and SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.library.default_model import ensure_default_model
from studio.settings import Settings
from tests.support.home_studio import home_env, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(settings) -> Path:
    return ensure_default_model(settings.models_dir)


def _chat(url: str, n: int) -> None:
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 2, "temperature": 0}
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text


def _records(url: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{url}/api/activity", params={"kind": "request"}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["records"]


def test_activity_days_zero_makes_no_record_and_no_phase_metric(tmp_path, llama_server_bin, smollm2):
    """Recording off: requests are answered as ever, and nothing of them is kept or counted by phase."""
    env = home_env(tmp_path / "home", llama_server_bin, GGUF_STUDIO_ACTIVITY_DAYS="0")
    with serving(env, smollm2) as (_, ready):
        url = ready["url"]
        _chat(url, 2)
        assert _records(url) == []
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "ggstudio_request_phase_seconds_count{" not in metrics


def test_activity_records_from_the_config_file_bound_what_is_kept(tmp_path, llama_server_bin, smollm2):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("activity_days = 2\nactivity_records = 3\n")
    env = home_env(home, llama_server_bin)
    with serving(env, smollm2) as (_, ready):
        url = ready["url"]
        _chat(url, 5)
        kept = _records(url)
        assert len(kept) == 3, kept
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "ggstudio_request_phase_seconds_count{" in metrics


def test_activity_keys_are_read_and_held_to_their_bounds(tmp_path):
    config = tmp_path / "config.toml"
    env = {"GGUF_STUDIO_CONFIG": str(config), "GGUF_STUDIO_HOME": str(tmp_path)}
    config.write_text("activity_days = 0.5\nactivity_records = 10\n")
    settings = Settings.from_env(env)
    assert (settings.activity_days, settings.activity_records) == (0.5, 10)
    assert (Settings.from_env({**env, "GGUF_STUDIO_ACTIVITY_DAYS": "0"})).activity_days == 0
    config.write_text("activity_days = -1\n")
    with pytest.raises(ValueError, match="activity_days"):
        Settings.from_env(env)
    config.write_text("activity_records = 0\n")
    with pytest.raises(ValueError, match="activity_records must be a positive integer"):
        Settings.from_env(env)
