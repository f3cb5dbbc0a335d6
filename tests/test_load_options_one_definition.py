"""A load option is defined once, in ``studio.load_options``: a made-up one, added as one row there, is taken
by the config file, the load API (``/api/load``, ``/api/plan``, ``/api/load-options``) and ``ggstudio plan`` /
``load``, and reaches the settings the model is loaded with. Before, an option was written about ten times
(commit 21a9261 touched 13 source files to add four)."""

from __future__ import annotations

import json

import httpx
import pytest
import typer
from typer.testing import CliRunner

from studio.cli import models
from studio.cli.common import with_load_options
from studio.load_options import OPTIONS, Option
from studio.settings import ModelDefaults, Settings
from tests.manager_harness import ZOO
from tests.support.studio import running_studio

#: The one place the made-up option is written.
MADE_UP = Option("made_up", "int", "A made-up option no planner rule reads", "none", least=1, most=9)
TABLE = (*OPTIONS, MADE_UP)


def read(tmp_path, text: str, options=TABLE) -> Settings:
    (tmp_path / "config.toml").write_text(text)
    return Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}, options=options)


def test_the_config_file_takes_a_made_up_option_with_its_bounds(tmp_path):
    assert read(tmp_path, "[models.m]\nmade_up = 5\nn_ctx = 512\n").model_defaults["m"].made_up == 5
    with pytest.raises(ValueError) as info:
        read(tmp_path, "[models.m]\nmade_up = 10\n")
    assert "config.toml: [models.'m']: made_up must be an integer from 1 to 9" in str(info.value)
    with pytest.raises(ValueError, match="unknown key 'made_up'"):  # without its row, no such key
        read(tmp_path, "[models.m]\nmade_up = 5\n", options=OPTIONS)


def cli_app() -> typer.Typer:
    """``ggstudio plan`` and ``load`` as they are, their options derived from the table with the made-up row."""
    app = typer.Typer()
    app.command("plan")(with_load_options(TABLE)(models.plan_command.__wrapped__))  # type: ignore[attr-defined]
    app.command("load")(with_load_options(TABLE)(models.load.__wrapped__))  # type: ignore[attr-defined]
    return app


def test_the_command_line_takes_a_made_up_option_with_its_bounds_and_help():
    runner = CliRunner()
    shown = runner.invoke(cli_app(), ["plan", "--help"], env={"COLUMNS": "200"})
    assert "--made-up" in shown.output and "A made-up option no planner rule reads (default: none)." in shown.output
    refused = runner.invoke(cli_app(), ["load", "m", "--made-up", "10"])
    assert refused.exit_code == 2 and "--made-up" in refused.output


def test_the_load_api_and_the_command_line_take_a_made_up_option_to_the_load(tmp_path, llama_server_bin, zoo_dir):
    model = ZOO[0]
    defaults = {model: ModelDefaults.of({"n_ctx": 256, "spec": "off", "made_up": 5})}
    models_ = {model: zoo_dir / f"{model}.gguf"}
    with running_studio(tmp_path, llama_server_bin, models_, defaults=defaults, load_options=TABLE) as studio:
        listed = httpx.get(f"{studio.url}/api/load-options", timeout=30).json()
        row = next(o for o in listed["options"] if o["name"] == "made_up")
        assert (row["least"], row["most"], row["flag"]) == (1, 9, "--made-up")
        assert listed["limits"]["made_up"] == [1, 9]

        planned = httpx.post(f"{studio.url}/api/plan", json={"model": model, "made_up": 3}, timeout=60)
        assert planned.status_code == 200, planned.text
        refused = httpx.post(f"{studio.url}/api/plan", json={"model": model, "made_up": 0}, timeout=60)
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "made_up"

        loaded = httpx.post(f"{studio.url}/api/load", json={"model": model, "made_up": 3}, timeout=120)
        assert loaded.status_code == 200, loaded.text
        assert studio.manager.find(model).settings.made_up == 3  # the request's own value
        unload = httpx.post(f"{studio.url}/api/unload", json={"model": model}, timeout=60)
        assert unload.status_code == 200, unload.text

        httpx.post(f"{studio.url}/api/load", json={"model": model}, timeout=120).raise_for_status()
        assert studio.manager.find(model).settings.made_up == 5  # the config's, left out of the request

        runner = CliRunner()
        out = runner.invoke(cli_app(), ["plan", model, "--made-up", "7", "--url", studio.url, "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["context"]["n_ctx"] == 256  # planned with the config table
        out = runner.invoke(cli_app(), ["load", model, "--made-up", "7", "--url", studio.url])
        assert out.exit_code == 0, out.output
        assert studio.manager.find(model).settings.made_up == 7  # a changed option restarts it with the new value


def test_the_studio_without_the_row_refuses_the_made_up_option(tmp_path, llama_server_bin, zoo_dir):
    model = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, {model: zoo_dir / f"{model}.gguf"}) as studio:
        refused = httpx.post(f"{studio.url}/api/plan", json={"model": model, "made_up": 3}, timeout=60)
        assert refused.status_code == 422 and refused.json()["error"]["message"].startswith("made_up: unknown field")
        listed = httpx.get(f"{studio.url}/api/load-options", timeout=30).json()
        assert "made_up" not in {o["name"] for o in listed["options"]}
