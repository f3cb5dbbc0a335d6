"""The config file is read through one definition per key (``studio.settings.CONFIG_KEYS``): a made-up key added
as one row is taken from the file and its variable, every file the studio took before is still taken, and the
module docstring's example is a file the studio takes, naming every key."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from textwrap import dedent
from typing import Any

import pytest

import studio.settings
from studio.load_options import Option
from studio.settings import (
    CONFIG_KEYS,
    MCP_KEYS,
    PYTHON_KEYS,
    MemoryBudget,
    PythonToolConfig,
    Settings,
    config_key,
    config_values,
)

#: A made-up top-level key with bounds, a check and a variable: the one place it is written.
MADE_UP = config_key(
    "made_up", "int", "A made-up key no part of the studio reads", 3, least=1, most=9, env="GGUF_STUDIO_MADE_UP"
)
KEYS = (*CONFIG_KEYS, MADE_UP)


def read(tmp_path: Path, text: str, keys=KEYS, **env: str) -> dict[str, Any]:
    (tmp_path / "config.toml").write_text(text)
    return config_values({"GGUF_STUDIO_HOME": str(tmp_path), **env}, keys)


def test_a_made_up_top_level_key_is_taken_from_the_file_and_its_variable(tmp_path):
    assert read(tmp_path, "")["made_up"] == 3  # its row's value
    assert read(tmp_path, "made_up = 5\nport = 9000\n")["made_up"] == 5
    assert read(tmp_path, "made_up = 5\n", GGUF_STUDIO_MADE_UP="7")["made_up"] == 7  # the variable wins
    with pytest.raises(ValueError) as info:
        read(tmp_path, "made_up = 10\n")
    assert "config.toml: made_up must be an integer from 1 to 9" in str(info.value)
    with pytest.raises(ValueError, match="GGUF_STUDIO_MADE_UP must be an integer from 1 to 9"):
        read(tmp_path, "", GGUF_STUDIO_MADE_UP="0")
    with pytest.raises(ValueError, match="unknown key 'made_up'"):  # without its row, no such key
        read(tmp_path, "made_up = 5\n", keys=CONFIG_KEYS)


#: Files the studio took on b5a9904, each with what it must still read from it.
ACCEPTED: dict[str, tuple[str, dict[str, Any]]] = {
    "ports as strings": ('port = "9000"\nollama_port = "11500"\n', {"port": 9000, "ollama_port": 11500}),
    "the Ollama listener off by 0": ("ollama_port = 0\n", {"ollama_port": None}),
    'the Ollama listener off by ""': ('ollama_port = ""\n', {"ollama_port": None}),
    "the Ollama listener off by false": ("ollama_port = false\n", {"ollama_port": None}),
    "an empty token": ('api_token = ""\n', {"api_token": None}),
    "a budget per device": (
        'memory_budget = {CPU = "6GiB", CUDA0 = "20 GiB"}\n',
        {"residency.memory_budget": MemoryBudget(per_device={"CPU": 6 * 2**30, "CUDA0": 20 * 2**30})},
    ),
    "a budget in bytes": ("memory_budget = 2147483648\n", {"residency.memory_budget": MemoryBudget(total=2**31)}),
    "a budget as pairs": (
        'memory_budget = "CPU=2GiB,CUDA0=1.5GB"\n',
        {"residency.memory_budget": MemoryBudget(per_device={"CPU": 2**31, "CUDA0": 1_500_000_000})},
    ),
    "fractional residency numbers": (
        "ttl = 0.5\nmax_resident = 2.5\nunload_grace = 0.25\nbusy_wait = 1.5\ngroup_size = 2.7\n",
        # b5a9904 kept 2.5 models, which the placement cannot count with: whole models, as group_size was
        {"residency.ttl": 0.5, "residency.max_resident": 2, "residency.busy_wait": 1.5, "residency.group_size": 2},
    ),
    "whole residency numbers": (
        "max_resident = 2\ngroup_size = 3\n",
        {"residency.max_resident": 2, "residency.group_size": 3},
    ),
    "no slot cache": ("slot_cache_disk = 0\n", {"residency.slot_cache_disk": 0}),
    'no slot cache, as "0"': ('slot_cache_disk = "0"\n', {"residency.slot_cache_disk": 0}),
    "a slot cache in bytes": ("slot_cache_disk = 1073741824\n", {"residency.slot_cache_disk": 2**30}),
    "a slot cache as a float": ("slot_cache_disk = 1e9\n", {"residency.slot_cache_disk": 10**9}),
    "workers twice": ('rpc_workers = ["a:1", "a:1", "b:2"]\n', {"rpc_workers": ("a:1", "b:2")}),
    "any origin and host": ('allowed_origins = ["*"]\nallowed_hosts = ["*"]\n', {"allowed_origins": ("*",)}),
    "empty tables": ("[aliases]\n[models]\n[mcp_servers]\n[tools]\n[tools.python]\n", {"aliases": {}}),
    "an empty model table": ("[models.m]\n", {"model_defaults.m.n_ctx": None}),
    "a fractional python timeout": ("[tools.python]\ntimeout = 0.5\n", {"tools.python.timeout": 0.5}),
    "an integer python timeout": ("[tools.python]\ntimeout = 5\n", {"tools.python.timeout": 5.0}),  # seconds
    "llama.cpp's spelling of a mode": (
        '[models.m]\nspec = "draft-mtp,ngram-mod"\n',
        {"model_defaults.m.spec": "mtp+ngram"},
    ),
    "a projector in the home": (
        '[models.m]\nmmproj = "~/p.gguf"\n',
        {"model_defaults.m.mmproj": str(Path("~/p.gguf").expanduser())},
    ),
    "the smallest body": ("max_body_bytes = 1024\n", {"max_body_bytes": 1024}),
    "dotted keys": (
        'tools.python.enabled = true\naliases.chat = "m"\nmodels.m.n_ctx = 512\n',
        {"tools.python.enabled": True, "aliases": {"chat": "m"}, "model_defaults.m.n_ctx": 512},
    ),
    "a stdio server with a folder": (
        '[mcp_servers.files]\ncommand = "npx"\ncwd = "~/notes"\nenv = { A = "1" }\n',
        {"tools.mcp_servers.files.cwd": Path("~/notes").expanduser(), "tools.mcp_servers.files.args": ()},
    ),
}


def found(settings: Settings, path: str) -> Any:
    value: Any = settings
    for step in path.split("."):
        value = value[step] if hasattr(value, "keys") and not isinstance(value, Settings) else getattr(value, step)
    return value


def typed(value: Any) -> Any:
    """``value`` with the type of each part beside it, through dataclasses, mappings (any kind alike: a read-only
    view is the dict it shows) and sequences: ``==`` on two of these tells ``1`` from ``1.0`` and ``True``, which
    plain ``==`` takes as equal."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value), tuple((f.name, typed(getattr(value, f.name))) for f in dataclasses.fields(value))
    if isinstance(value, Mapping):
        return Mapping, {k: typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value), tuple(typed(v) for v in value)
    return type(value), value


def test_typed_tells_a_whole_float_from_an_integer_at_any_depth():
    assert typed(1) != typed(1.0) and typed(1) != typed(True)
    assert typed(MemoryBudget(total=2**31)) != typed(MemoryBudget(total=float(2**31)))
    assert typed({"a": (1, "x")}) == typed({"a": (1, "x")}) and typed({"a": (1,)}) != typed({"a": (1.0,)})


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_file_taken_before_is_still_taken_with_the_type_it_is_used_as(tmp_path, name):
    """Regression for the reshaping onto pydantic: b5a9904's hand-written reader took each of these files. The
    values are compared with their types: with ``==`` alone, ``1 == 1.0`` let ``max_resident = 1`` through as a
    float, which the placement could not count with (a 500 on every eviction)."""
    text, expected = ACCEPTED[name]
    (tmp_path / "config.toml").write_text(text)
    settings = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert typed({path: found(settings, path) for path in expected}) == typed(expected)


def example() -> str:
    """The config file in ``studio.settings``' docstring."""
    doc = studio.settings.__doc__ or ""
    return dedent(doc[doc.index("::\n") + 3 : doc.index("\n| variable")])


def test_the_docstrings_example_is_a_file_the_studio_takes_and_names_every_key(tmp_path):
    (tmp_path / "config.toml").write_text(example())
    settings = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert settings.tools.python.enabled and settings.model_defaults["gemma-3-270m-Q4_K_M"].n_ctx == 8192
    parsed = tomllib.loads(example())
    assert set(parsed) == {o.name for o in CONFIG_KEYS}
    assert set(parsed["tools"]["python"]) == {o.name for o in PYTHON_KEYS}
    assert set(parsed["mcp_servers"]["files"]) | set(parsed["mcp_servers"]["search"]) == {o.name for o in MCP_KEYS}
    variables = {o.env for o in CONFIG_KEYS if o.env}
    assert {v for v in variables if f"``{v}``" not in (studio.settings.__doc__ or "")} == set()


def test_the_rows_values_are_the_settings_defaults(tmp_path):
    """Settings made in code (``Settings(home=...)``) and settings read from nothing agree."""
    assert Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}) == Settings(home=tmp_path)
    assert PythonToolConfig(**{o.name: o.value for o in PYTHON_KEYS}) == PythonToolConfig()


@pytest.mark.parametrize(
    "text, words",
    [
        ("prot = 8080", "unknown key 'prot' (did you mean 'port'?)"),
        ("[models.m]\nspce = 'ngram'", "[models.'m']: unknown key 'spce' (did you mean 'spec'?)"),
        ("port = 'eighty'", "port must be a port number (1-65535), not 'eighty'"),
        ("max_body_bytes = 10", "max_body_bytes must be a number of bytes of at least 1024, not 10"),
        ("host = 3", "host must be a string"),
        ("models = 3", "[models] must hold one table per model: [models.NAME]"),
        ("[tools]\npython = 3", "[tools.python] must be a table"),
        ("[mcp_servers.a]\ncommand = ''", "[mcp_servers.'a']: command must be a program name or path"),
        ("allowed_origins = ['a', 'b']", "allowed_origins: 'a' is not an origin"),
    ],
)
def test_a_wrong_key_names_its_file_table_and_key_and_what_to_write(tmp_path, text, words):
    (tmp_path / "config.toml").write_text(text + "\n")
    with pytest.raises(ValueError) as info:
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert str(info.value).startswith(f"{tmp_path / 'config.toml'}: ") and words in str(info.value)


def test_every_problem_in_a_file_is_told_at_once(tmp_path):
    (tmp_path / "config.toml").write_text("port = 0\nttl = -1\n[models.m]\nn_ctx = 1\n[tools.python]\ntimeout = 0\n")
    with pytest.raises(ValueError) as info:
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert [p.split(" must ")[0] for p in str(info.value).split(": ", 1)[1].split("; ")] == [
        "ttl",
        "[models.'m']: n_ctx",
        "port",
        "[tools.python]: timeout",
    ]


@pytest.mark.parametrize(
    "variable, text, attribute, value",
    [
        ("GGUF_STUDIO_HOST", "0.0.0.0", "host", "0.0.0.0"),
        ("GGUF_STUDIO_PORT", "9100", "port", 9100),
        ("GGUF_STUDIO_API_TOKEN", "t", "api_token", "t"),
        ("GGUF_STUDIO_MODEL_DIRS", f"/a{os.pathsep}/b", "model_dirs", (Path("/a"), Path("/b"))),
        ("GGUF_STUDIO_RPC_WORKERS", "h:1,h:2", "rpc_workers", ("h:1", "h:2")),
        ("GGUF_STUDIO_ORIGINS", "", "allowed_origins", ()),  # set to nothing: none, over the file's
        ("GGUF_STUDIO_MAX_BODY_BYTES", "2048", "max_body_bytes", 2048),
        ("GGUF_STUDIO_AUTO_DOWNLOAD", "off", "auto_download", False),
        ("GGUF_STUDIO_MEMORY_BUDGET", "1GiB", "residency.memory_budget", MemoryBudget(total=2**30)),
    ],
)
def test_a_variable_wins_over_the_file(tmp_path, variable, text, attribute, value):
    (tmp_path / "config.toml").write_text(
        'host = "::1"\nport = 9000\napi_token = "f"\nmodel_dirs = ["/f"]\nrpc_workers = ["f:1"]\n'
        'allowed_origins = ["http://f.example"]\nmax_body_bytes = 4096\nauto_download = true\nmemory_budget = "2GiB"\n'
    )
    settings = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), variable: text})
    assert found(settings, attribute) == value


def test_the_configuration_pages_example_is_a_file_the_studio_takes(tmp_path):
    """docs/configuration.md shows a config file and the variables: each is checked against the rows."""
    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    text = page.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "config.toml").write_text(text)
    assert Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).model_defaults["gemma-3-270m-Q4_K_M"].n_ctx == 8192
    assert {o.env for o in CONFIG_KEYS if o.env and f"`{o.env}`" not in page} == set()


def test_max_resident_from_the_file_is_a_whole_number_the_placement_can_count_with(tmp_path):
    """Regression: read through the number row, ``max_resident = 1`` became 1.0, and every load that had to
    evict failed with a 500 (``range()`` of a float in the placement's eviction search)."""
    (tmp_path / "config.toml").write_text("max_resident = 1\ngroup_size = 2\n")
    residency = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).residency
    assert type(residency.max_resident) is int and residency.max_resident == 1
    assert type(residency.group_size) is int and residency.group_size == 2


def _whole_number_keys(rows: tuple[Option, ...] = CONFIG_KEYS, table: str = "") -> list[tuple[str, Option]]:
    """Each ``int`` row of the file, by the table it is written in ("" at the top; a model's for ``[models.m]``)."""
    found = []
    for row in rows:
        if row.kind == "int":
            found.append((table, row))
        elif row.kind in ("table", "tables"):
            inner = f"{table}.{row.name}" if table else row.name
            found += _whole_number_keys(row.table, f"{inner}.m" if row.kind == "tables" else inner)
    return found


def _written(table: str, key: str, value: Any) -> str:
    return (f"[{table}]\n" if table else "") + f"{key} = {value!r}\n"


def test_max_resident_and_group_size_are_ints_as_the_file_is_read_not_when_settings_are_built(tmp_path):
    """Regression: both were number rows, read as floats, and made ints by an ``int()`` where ``Settings`` was
    built; every other reader of the file's values got ``2.0``."""
    values = read(tmp_path, "max_resident = 2\ngroup_size = 3\n", keys=CONFIG_KEYS)
    assert typed((values["max_resident"], values["group_size"])) == typed((2, 3))


@pytest.mark.parametrize(
    "table, row", [pytest.param(t, r, id=f"{t or 'top'}.{r.name}") for t, r in _whole_number_keys()]
)
def test_every_whole_number_key_is_an_int_as_the_file_is_read(tmp_path, table, row):
    """An ``int`` row is an ``int`` as the file is read; a fraction, or a whole float (TOML's ``2.0``), is refused,
    naming the file, table and key and what to write, except where b5a9904 took a fraction (``floors``): read as
    the number below it, so that each file it read is still read."""
    least = int(row.least or 0)
    path = [*table.split("."), row.name] if table else [row.name]
    for written in (least, least + 0.5, float(least)):
        text = _written(table, row.name, written)
        if isinstance(written, int) or row.floors:
            value: Any = read(tmp_path, text, keys=CONFIG_KEYS)
            for step in path:
                value = value[step]
            assert typed(value) == typed(least)
            continue
        with pytest.raises(ValueError) as info:
            read(tmp_path, text, keys=CONFIG_KEYS)
        where = "[" + table.replace(".m", ".'m'") + "]: " if table else ""
        said = str(info.value)
        assert said.startswith(f"{tmp_path / 'config.toml'}: {where}{row.name} must be"), said
        assert said.endswith(f", not {written!r}" + (f": write {least}" if written == least else "")), said


def test_a_made_up_whole_number_row_that_floors_reads_a_fraction_as_an_int(tmp_path):
    """A row is all it takes: the kind and ``floors`` say how the file's value is read, nowhere else."""
    floors = config_key("made_up", "int", "A made-up count", 3, least=1, most=9, floors=True)
    assert typed(read(tmp_path, "made_up = 2.5\n", keys=(*CONFIG_KEYS, floors))["made_up"]) == typed(2)
    with pytest.raises(ValueError, match=r"made_up must be an integer from 1 to 9, not 2\.5$"):
        read(tmp_path, "made_up = 2.5\n")  # MADE_UP: an int row that does not floor
