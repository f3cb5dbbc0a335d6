"""Settings: environment variables over the TOML config file over the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from studio.settings import ModelDefaults, Settings

CONFIG = """
host = "0.0.0.0"
port = 9000
api_token = "from-file"
model_dirs = ["~/more-models"]

[aliases]
chat = "gemma-3-270m-Q4_K_M"

[models."gemma-3-270m-Q4_K_M"]
n_ctx = 8192
extra_args = ["--temp", "0.7"]
spec_n_max = 4
cache_type_kv = "q8_0"

[models.mtp-model]
spec = "draft-mtp,ngram-mod"
"""


def test_defaults_without_a_config_file(tmp_path):
    s = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert (s.host, s.port, s.api_token, s.model_dirs, dict(s.aliases)) == ("127.0.0.1", 8080, None, (), {})


def test_config_file_values_and_env_overrides(tmp_path):
    (tmp_path / "config.toml").write_text(CONFIG)
    s = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert (s.host, s.port, s.api_token) == ("0.0.0.0", 9000, "from-file")
    assert s.model_dirs == (Path("~/more-models").expanduser(),)
    assert s.aliases == {"chat": "gemma-3-270m-Q4_K_M"}
    assert s.model_defaults["gemma-3-270m-Q4_K_M"] == ModelDefaults(
        n_ctx=8192, extra_args=("--temp", "0.7"), spec_n_max=4, cache_type_kv="q8_0"
    )
    assert s.model_defaults["mtp-model"] == ModelDefaults(
        spec="mtp+ngram"
    )  # llama.cpp's spelling, read as the API does
    env = {
        "GGUF_STUDIO_HOME": str(tmp_path),
        "GGUF_STUDIO_PORT": "9100",
        "GGUF_STUDIO_HOST": "127.0.0.1",
        "GGUF_STUDIO_API_TOKEN": "from-env",
    }
    s = Settings.from_env(env)
    assert (s.host, s.port, s.api_token) == ("127.0.0.1", 9100, "from-env")


def test_the_ollama_listener_is_off_unless_a_port_is_given(tmp_path):
    assert Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).ollama_port is None
    (tmp_path / "config.toml").write_text("ollama_port = 11434\n")
    assert Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).ollama_port == 11434
    env = {"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_OLLAMA_PORT": "11500"}
    assert Settings.from_env(env).ollama_port == 11500
    with pytest.raises(ValueError, match="GGUF_STUDIO_OLLAMA_PORT must be a port number"):
        Settings.from_env({**env, "GGUF_STUDIO_OLLAMA_PORT": "70000"})


@pytest.mark.parametrize(
    "text, words",
    [
        ("port = ", "not valid TOML"),
        ("colour = 'blue'", "unknown key 'colour'"),
        ("[aliases]\nchat = 3", "[aliases] must map"),
        ("[models.m]\nn_ctx = -1", "n_ctx must be an integer from 256 to 16777216"),
        ("[models.m]\nn_ctx = 100", "n_ctx must be an integer from 256 to 16777216"),
        ("[models.m]\nn_ctx = 1000000000000", "n_ctx must be an integer from 256 to 16777216"),
        ("memory_budget = 'lots'", "memory_budget: 'lots' is not a size"),
        ("memory_budget = {CPU = '-1GiB'}", "is not a size"),
        ("ttl = -5", "ttl must be a number from 0"),
        ("max_resident = 0", "max_resident must be an integer from 1 to 64"),
        ("preload = 'gemma'", "preload must be a list of model names"),
        ("[models.m]\nttl = -1", "[models.'m']: ttl must be a number from 0"),
        ("[models.m]\npinned = 'yes'", "pinned must be true or false"),
        ("[models.m]\nctx = 1", "unknown key 'ctx'"),
        ("[models.m]\nextra_args = '--temp 0.7'", "extra_args must be a list of strings"),
        ("[models.m]\ntags = 'chat,small'", "[models.'m']: tags must be a list of strings"),
        ("[models.m]\ntags = ['chat', 3]", "[models.'m']: tags must be a list of strings"),
        ("slot_cache_disk = 'lots'", "slot_cache_disk: 'lots' is not a size"),
    ],
)
def test_a_bad_config_file_is_one_clear_error(tmp_path, text, words):
    """Each refused value names its key (and the model's table), nothing is half-applied."""
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ValueError) as info:
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert words in str(info.value) and "config.toml" in str(info.value)


@pytest.mark.parametrize(
    "line, words",
    [
        ("spec = 'warp-drive'", "spec: unknown speculative mode 'warp-drive'; valid modes: auto, mtp"),
        ("spec = 3", "spec must be a string, one of: auto, mtp"),
        ("spec_n_max = 0", "spec_n_max must be an integer from 1 to 64"),
        ("spec_n_max = 65", "spec_n_max must be an integer from 1 to 64"),  # the load API's own cap
        ("spec_n_max = true", "spec_n_max must be an integer from 1 to 64"),
        ("n_parallel = 100", "n_parallel must be an integer from 1 to 64"),
        ("cache_type_kv = 'q3_z'", "cache_type_kv: unknown cache type 'q3_z'; valid: f32, f16, bf16, q8_0"),
        ("cache_type_kv = 8", "cache_type_kv: unknown cache type 8"),
    ],
)
def test_a_bad_model_default_names_its_section_and_key(tmp_path, line, words):
    (tmp_path / "config.toml").write_text(f'[models."gemma-3-270m-Q4_K_M"]\n{line}\n')
    with pytest.raises(ValueError) as info:
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert f"config.toml: [models.'gemma-3-270m-Q4_K_M']: {words}" in str(info.value)


def test_a_named_config_file_must_exist(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_CONFIG": str(tmp_path / "nope.toml")})


def test_residency_settings_from_the_config_and_the_environment(tmp_path):
    (tmp_path / "config.toml").write_text(
        'memory_budget = "2GiB"\nttl = 300\nmax_resident = 3\npreload = ["a", "b"]\nunload_grace = 2\n'
        "[models.a]\nttl = 0\npinned = true\n"
    )
    s = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    r = s.residency
    assert (r.memory_budget.total, r.ttl, r.max_resident, r.preload, r.unload_grace) == (
        2 * 2**30,
        300,
        3,
        ("a", "b"),
        2,
    )
    assert s.model_defaults["a"].ttl == 0 and s.model_defaults["a"].pinned is True
    s = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_MEMORY_BUDGET": "CPU=512MiB,CUDA0=1.5GB"})
    assert s.residency.memory_budget.total is None
    assert dict(s.residency.memory_budget.per_device) == {"CPU": 512 * 2**20, "CUDA0": 1_500_000_000}
    with pytest.raises(ValueError, match="GGUF_STUDIO_MEMORY_BUDGET: 'x' is not a size"):
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_MEMORY_BUDGET": "x"})


TOOLS_CONFIG = """
[mcp_servers.files]
command = "npx"
args = ["-y", "server-filesystem", "/srv"]
env = { LOG_LEVEL = "warn" }

[mcp_servers.search]
url = "http://127.0.0.1:9000/mcp"

[tools.python]
enabled = true
timeout = 5.5
memory_mb = 256
max_processes = 8
"""


def test_mcp_servers_and_the_python_tool_from_the_config(tmp_path):
    (tmp_path / "config.toml").write_text(TOOLS_CONFIG)
    tools = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).tools
    files, search = tools.mcp_servers["files"], tools.mcp_servers["search"]
    assert (files.command, files.args, dict(files.env), files.url) == (
        "npx",
        ("-y", "server-filesystem", "/srv"),
        {"LOG_LEVEL": "warn"},
        None,
    )
    assert (search.command, search.url) == (None, "http://127.0.0.1:9000/mcp")
    python = tools.python
    assert (python.enabled, python.timeout, python.memory_mb, python.cpu_seconds, python.max_processes) == (
        True,
        5.5,
        256,
        10,
        8,
    )


def test_tools_are_off_without_a_config(tmp_path):
    tools = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).tools
    assert not tools.python.enabled and not tools.mcp_servers


@pytest.mark.parametrize(
    "text, words",
    [
        ("[mcp_servers.a]\nargs = []", "give either command"),
        ("[mcp_servers.a]\ncommand = 'x'\nurl = 'http://h/mcp'", "give either command"),
        ("[mcp_servers.a]\nurl = 'ftp://h'", "url must be an http"),
        ("[mcp_servers.a]\ncommand = 'x'\nargs = '-v'", "args must be a list of strings"),
        ("[mcp_servers.a]\ncommand = 'x'\nenv = { A = 1 }", "env must map names to strings"),
        ("[mcp_servers.a]\ncommand = 'x'\nport = 1", "unknown key 'port'"),
        ("[mcp_servers.\"a b\"]\ncommand = 'x'", "a server name is"),
        ("[mcp_servers.a]\nurl = 'http://h/mcp'\nargs = []", "args, env and cwd are for a command"),
        ("[tools.python]\nenabled = 'yes'", "enabled must be true or false"),
        ("[tools.python]\nmemory_mb = 0", "memory_mb must be a positive integer"),
        ("[tools.python]\nmax_processes = 2.5", "max_processes must be a positive integer"),
        ("[tools.python]\ntimeout = -1", "timeout must be a positive number"),
        ("[tools.python]\nnetwork = true", "unknown key 'network'"),
        ("[tools.shell]\nenabled = true", "[tools] holds only [tools.python]"),
    ],
)
def test_a_bad_tools_config_is_one_clear_error(tmp_path, text, words):
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ValueError) as info:
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert words in str(info.value)


def test_security_keys_from_the_config_file_and_the_environment(tmp_path):
    (tmp_path / "config.toml").write_text(
        'allowed_origins = ["HTTP://LocalHost:3000/"]\nallowed_hosts = ["Studio.LAN"]\nallow_any_path = true\n'
    )
    s = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert (s.allowed_origins, s.allowed_hosts, s.allow_any_path) == (("http://localhost:3000",), ("studio.lan",), True)
    s = Settings.from_env(
        {
            "GGUF_STUDIO_HOME": str(tmp_path),
            "GGUF_STUDIO_ORIGINS": "https://a.example, *",
            "GGUF_STUDIO_HOSTS": "box,box.lan",
        }
    )
    assert (s.allowed_origins, s.allowed_hosts) == (("https://a.example", "*"), ("box", "box.lan"))
    assert Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path / "none")}).allow_any_path is False


@pytest.mark.parametrize(
    "text, words",
    [
        ("allowed_origins = 'http://localhost:3000'", "allowed_origins must be a list of strings"),
        ("allowed_origins = ['localhost:3000']", "allowed_origins: 'localhost:3000' is not an origin"),
        ("allowed_origins = ['http://localhost:3000/app']", "is not an origin"),
        ("allowed_hosts = ['studio.lan:8080']", "allowed_hosts: 'studio.lan:8080': a host is named without a port"),
        ("allowed_hosts = [3]", "allowed_hosts must be a list of strings"),
        ("allow_any_path = 'yes'", "allow_any_path must be true or false"),
    ],
)
def test_a_bad_security_key_is_one_clear_error(tmp_path, text, words):
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ValueError) as info:
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert words in str(info.value) and "config.toml" in str(info.value)


def test_a_bad_origin_in_the_environment_names_the_variable(tmp_path):
    with pytest.raises(ValueError, match="GGUF_STUDIO_ORIGINS: 'evil' is not an origin"):
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_ORIGINS": "http://ok.example,evil"})


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "on", "On", " yes "])
def test_every_yes_no_variable_reads_yes_the_same_way(tmp_path, text):
    """Regression: GGUF_STUDIO_LOG_JSON took only 1/true/yes in lower case while GGUF_STUDIO_AUTO_DOWNLOAD and
    HF_HUB_OFFLINE also took "on" in any case; one rule (``studio.env``) now reads them all."""
    from studio.library.hub import HubConfig

    env = {
        "GGUF_STUDIO_HOME": str(tmp_path),
        "GGUF_STUDIO_LOG_JSON": text,
        "GGUF_STUDIO_AUTO_DOWNLOAD": text,
        "HF_HUB_OFFLINE": text,
    }
    s = Settings.from_env(env)
    assert (s.log_json, s.auto_download, HubConfig.from_env(env).offline) == (True, True, True)


@pytest.mark.parametrize("text", ["0", "false", "no", "off", "maybe"])
def test_every_yes_no_variable_reads_no_the_same_way(tmp_path, text):
    from studio.library.hub import HubConfig

    (tmp_path / "config.toml").write_text("auto_download = true\n")
    env = {
        "GGUF_STUDIO_HOME": str(tmp_path),
        "GGUF_STUDIO_LOG_JSON": text,
        "GGUF_STUDIO_AUTO_DOWNLOAD": text,
        "HF_HUB_OFFLINE": text,
        "TRANSFORMERS_OFFLINE": "1",
    }
    s = Settings.from_env(env)
    assert (s.log_json, s.auto_download, HubConfig.from_env(env).offline) == (False, False, False)
    unset = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_AUTO_DOWNLOAD": ""})
    assert unset.auto_download is True  # empty is unset: the config file's value holds


@pytest.mark.parametrize(
    "line, disk", [("", 4 * 2**30), ("slot_cache_disk = 0", 0), ('slot_cache_disk = "1GiB"', 2**30)]
)
def test_slot_cache_disk_is_a_size_and_zero_saves_nothing(tmp_path, line, disk):
    (tmp_path / "config.toml").write_text(f"{line}\n")
    assert Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).residency.slot_cache_disk == disk
