"""The command builder: argv and env from a plan, extra-argument checks, secrets; then the real server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from launcher.allocations import parse_allocations
from launcher.capabilities import capabilities_from_text, run_tool
from launcher.command import REDACTED, LaunchCommand, Secret, build_command, chat_template_kwargs, child_env
from launcher.devices import Device, Inventory
from launcher.extra_args import MANAGED_FLAGS, ExtraArgsError, validate_extra_args
from launcher.planner import LaunchPlan, PlanRequest, load_model, plan
from launcher.process import LlamaServer
from launcher.registry import ChildRegistry
from launcher.speculative import MODES
from launcher.supervisor import State, Supervisor, owner_token
from launcher.units import MIB
from tests.helpers import free_port

FIXTURES = Path(__file__).parent / "fixtures"
GIB = 1024 * MIB
BIN = Path("/opt/llama/bin/llama-server")
THINK_OFF = "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}{{ messages[0].content }}"
THINK_ON = "{% set t = enable_thinking | default(true) %}{% if t %}<think>{% endif %}{{ messages }}"


def cpu_only() -> Inventory:
    return Inventory((Device("CPU", None, "Test CPU", 64 * GIB, 60 * GIB, "psutil"),), ())


def gpus(*free: int, backend: str = "CUDA", uuids: bool = True) -> Inventory:
    devices = tuple(
        Device(backend, i, f"GPU {i}", 80 * GIB, f, "nvidia-smi", f"GPU-{i:04d}" if uuids else None)
        for i, f in enumerate(free)
    )
    return Inventory((*devices, Device("CPU", None, "Test CPU", 64 * GIB, 60 * GIB, "psutil")), ())


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture
def build(tmp_path):
    """build_command with private files under tmp_path, cleaned up after the test."""
    made: list[LaunchCommand] = []

    def make(p, caps, **kwargs) -> LaunchCommand:
        kwargs.setdefault("binary", BIN)
        command = build_command(p, caps, files_root=tmp_path / "run", **kwargs)
        made.append(command)
        return command

    yield make
    for command in made:
        command.cleanup()


# --- argv ---------------------------------------------------------------------------------------


def test_default_cpu_argv_on_the_real_build(gemma, real, build):
    p = plan(gemma, cpu_only(), real, PlanRequest(extra_args=("--temp", "0.5", "--seed", "-1")))
    argv = build(p, real, threads=3).argv(8123)
    assert argv[:6] == [str(BIN), "-m", str(gemma.path), "--host", "127.0.0.1", "--port"]
    assert value(argv, "--port") == "8123" and value(argv, "--ctx-size") == "32768"
    assert value(argv, "--parallel") == "4" and "--kv-unified" in argv and value(argv, "--n-gpu-layers") == "0"
    assert value(argv, "--fit") == "off" and value(argv, "--threads") == "3"
    assert value(argv, "--cache-type-k") == "f16" and value(argv, "--cache-type-v") == "f16"
    assert value(argv, "-lv") == "4" and value(argv, "--alias") == "gemma-3-270m-Q4_K_M"
    assert {"--no-context-shift", "--jinja", "--metrics"} <= set(argv)
    assert "--flash-attn" not in argv and "--api-key" not in argv and "--chat-template-kwargs" not in argv
    assert argv[-5:] == ["--spec-default", "--temp", "0.5", "--seed", "-1"]  # spec flags, then the user's last


def test_gpu_argv_fit_and_split(gemma, real, build):
    full = plan(gemma, gpus(80 * GIB), real)
    argv = build(full, real).argv(1)
    assert value(argv, "--n-gpu-layers") == "19" and value(argv, "--fit") == "off" and "--tensor-split" not in argv
    tiny = plan(gemma, gpus(60 * MIB, 40 * MIB), real, PlanRequest(n_ctx=8192))
    assert tiny.offload == "fit"
    argv = build(tiny, real).argv(1)
    assert value(argv, "--fit") == "on" and "--n-gpu-layers" not in argv
    assert value(argv, "--fit-target") == ",".join(str(m) for m in tiny.fit_target_mib)
    assert "--tensor-split" not in argv and tiny.tensor_split == ()  # --fit gives up when a split is passed
    # without speculation: --spec-default's 65 rows of logits would need ~70 MiB more on the output GPU, which also
    # holds its own copy of the 170 MiB tied embeddings
    split = plan(gemma, gpus(200 * MIB, 400 * MIB), real, PlanRequest(n_ctx=32768, spec="off"))
    assert split.offload == "ngl" and len(split.gpus) == 2, split.reasons
    assert value(build(split, real).argv(1), "--tensor-split") == "200,400"


def test_a_gpu_plan_runs_four_slots_on_a_unified_cache(gemma, real, build):
    """The slots share the cache, so each slot's answer may run to the whole context, not to a quarter of it."""
    on_gpu = build(plan(gemma, gpus(80 * GIB), real, PlanRequest(n_ctx=8192)), real).argv(1)
    assert value(on_gpu, "--parallel") == "4" and "--kv-unified" in on_gpu
    assert value(on_gpu, "--n-predict") == "4096"  # the default answer limit, within the 8192 a slot may hold
    split = build(plan(gemma, cpu_only(), real, PlanRequest(n_ctx=8192, n_parallel=4)), real).argv(1)
    assert value(split, "--parallel") == "4" and "--kv-unified" not in split
    assert value(split, "--n-predict") == "2048"  # each slot's share of the context


def test_quantized_cache_argv(gemma, real, build):
    p = plan(gemma, cpu_only(), real, PlanRequest(n_ctx=4096, cache_type_k="q8_0", cache_type_v="q4_0"))
    argv = build(p, real).argv(1)
    assert value(argv, "--flash-attn") == "on"
    assert (value(argv, "--cache-type-k"), value(argv, "--cache-type-v")) == ("q8_0", "q4_0")


def test_legacy_help_yields_legacy_flags(mtp_model, legacy, build):
    p = plan(mtp_model, cpu_only(), legacy, PlanRequest(n_ctx=4096, spec="mtp+ngram", spec_n_max=3))
    command = build(p, legacy, threads=2)
    argv = command.argv(9000)
    i = argv.index("--spec-type")
    assert argv[i:] == ["--spec-type", "mtp,ngram-mod", "--draft-max", "3", "--spec-ngram-size-n", "24"]
    assert value(argv, "--ctx-size") == "4096" and value(argv, "--n-gpu-layers") == "0"
    assert value(argv, "--threads") == "2"
    # Flags the old build lacks are left out, and said so.
    for missing in ("--fit", "--parallel", "-np", "--flash-attn", "--alias", "--api-key-file", "--cache-type-k"):
        assert missing not in argv
    assert any(n.startswith("--parallel left out") for n in command.notes)
    assert any(n.startswith("--alias left out") for n in command.notes)
    # Without --api-key-file the key is in the argv, and only there.
    assert value(argv, "--api-key") == command.api_key
    assert value(command.redacted_argv(9000), "--api-key") == REDACTED


def test_legacy_gpu_plan_uses_the_largest_ngl(gemma, legacy, build):
    p = plan(gemma, gpus(260 * MIB), legacy, PlanRequest(n_ctx=8192))  # the output layer's 170 MiB and a few blocks
    assert p.offload == "ngl" and 0 < p.n_gpu_layers < 19
    argv = build(p, legacy).argv(1)
    assert value(argv, "--n-gpu-layers") == str(p.n_gpu_layers) and "--fit" not in argv


def test_mmproj_and_alias(gemma, real, build, tmp_path):
    projector = tmp_path / "mmproj.gguf"
    model = dataclasses.replace(gemma, mmproj=projector, mmproj_bytes=100 * MIB)
    p = plan(model, cpu_only(), real, PlanRequest(alias="my-model"))
    argv = build(p, real).argv(1)
    assert value(argv, "--mmproj") == str(projector) and value(argv, "--alias") == "my-model"
    assert "--no-mmproj-offload" not in argv  # no GPU: nothing to keep it off
    assert p.bill.device("CPU").projector == 100 * MIB
    assert p.bill.device("CPU").weights == plan(gemma, cpu_only(), real).bill.device("CPU").weights


# --- chat templates -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "kwargs"),
    [
        (None, None),
        ("", None),
        ("{{ messages }}", None),
        (THINK_OFF, {"enable_thinking": False}),
        (THINK_ON, {"enable_thinking": True}),
    ],
)
def test_chat_template_kwargs_keep_the_templates_reasoning_default(template, kwargs):
    assert chat_template_kwargs(template) == kwargs


def test_a_template_override_goes_in_a_private_file(gemma, real, build):
    p = plan(gemma, cpu_only(), real, PlanRequest(chat_template=THINK_OFF))
    command = build(p, real)
    argv = command.argv(1)
    path = Path(value(argv, "--chat-template-file"))
    assert path.read_text() == THINK_OFF and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(value(argv, "--chat-template-kwargs")) == {"enable_thinking": False}
    command.cleanup()
    assert not path.parent.exists()
    command.cleanup()  # idempotent


def test_the_models_own_template_sets_the_kwargs(gemma, real, build):
    model = dataclasses.replace(gemma, facts=dataclasses.replace(gemma.facts, chat_template=THINK_ON))
    argv = build(plan(model, cpu_only(), real), real).argv(1)
    assert json.loads(value(argv, "--chat-template-kwargs")) == {"enable_thinking": True}
    assert "--chat-template-file" not in argv


# --- the thinking a model starts with ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_qwen35(zoo_dir):
    """The zoo's Qwen3.5 (a few million parameters) with a template that thinks unless told not to."""
    model = load_model(zoo_dir / "qwen35-dense.gguf")
    return dataclasses.replace(model, facts=dataclasses.replace(model.facts, chat_template=THINK_ON))


def test_a_small_qwen35_starts_with_thinking_off(small_qwen35, real, build):
    """The reference backend starts Qwen3.5/3.6 under 9B without thinking; the studio kept the template's own
    default (thinking), decided by the GGUF's parameter count and architecture, not its name."""
    p = plan(small_qwen35, cpu_only(), real, PlanRequest(n_ctx=2048))
    assert json.loads(value(build(p, real).argv(1), "--chat-template-kwargs")) == {"enable_thinking": False}
    assert any(r.startswith("thinking off at load: a qwen35 model of 0.0B parameters") for r in p.reasons)
    big = dataclasses.replace(small_qwen35, facts=dataclasses.replace(small_qwen35.facts, parameter_count=9 * 10**9))
    p = plan(big, cpu_only(), real, PlanRequest(n_ctx=2048))
    assert json.loads(value(build(p, real).argv(1), "--chat-template-kwargs")) == {"enable_thinking": True}
    assert not any(r.startswith("thinking") for r in p.reasons)


def test_the_small_model_rule_is_qwen35s_alone(gemma, real, build):
    model = dataclasses.replace(gemma, facts=dataclasses.replace(gemma.facts, chat_template=THINK_ON))
    assert model.facts.parameter_count < 10**9  # small, but of an architecture without the rule
    argv = build(plan(model, cpu_only(), real), real).argv(1)
    assert json.loads(value(argv, "--chat-template-kwargs")) == {"enable_thinking": True}


@pytest.mark.parametrize("on", [True, False])
def test_the_models_config_sets_the_thinking_at_load(small_qwen35, gemma, real, build, on):
    for model in (small_qwen35, dataclasses.replace(gemma, facts=small_qwen35.facts)):
        p = plan(model, cpu_only(), real, PlanRequest(n_ctx=2048, thinking=on))
        assert json.loads(value(build(p, real).argv(1), "--chat-template-kwargs")) == {"enable_thinking": on}
        assert f"thinking {'on' if on else 'off'} at load, as the model's config says" in " ".join(p.reasons)
    no_switch = dataclasses.replace(gemma, facts=dataclasses.replace(gemma.facts, chat_template="{{ messages }}"))
    p = plan(no_switch, cpu_only(), real, PlanRequest(thinking=on))
    assert "--chat-template-kwargs" not in build(p, real).argv(1)
    assert any("ignored: the chat template has no switch" in r for r in p.reasons)


@pytest.mark.slow
def test_a_request_still_turns_thinking_on_for_a_small_qwen35(small_qwen35, llama_server_bin, real, tmp_path):
    """The load's default is only a default: llama-server lays a request's kwargs over it (the studio's proxy
    spells a request's enable_thinking there)."""
    p = plan(small_qwen35, cpu_only(), real, PlanRequest(n_ctx=2048, chat_template=THINK_ON))  # the file has none
    assert p.thinking is False
    with _serving(p, real, llama_server_bin, tmp_path) as (server, command):

        def prompt(**body: object) -> str:
            messages = [{"role": "user", "content": "hi"}]
            resp = httpx.post(
                f"{server.url}/apply-template", json={"messages": messages, **body}, headers=command.auth_headers
            )
            return resp.raise_for_status().json()["prompt"]

        assert "<think>" not in prompt()
        assert "<think>" in prompt(chat_template_kwargs={"enable_thinking": True})


# --- the API key --------------------------------------------------------------------------------------


def test_the_api_key_is_random_private_and_redacted(gemma, real, build):
    p = plan(gemma, cpu_only(), real)
    one, two = build(p, real), build(p, real)
    assert one.api_key != two.api_key and len(one.api_key) >= 32
    key = str(one.api_key)
    argv = one.argv(5555)
    assert key not in " ".join(argv)  # never on the command line (ps shows it to every user)
    key_file = Path(value(argv, "--api-key-file"))
    assert key_file.read_text().strip() == key and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    spec = one.launch_spec()
    for shown in (repr(one), str(one), repr(spec), str(spec), repr(one.api_key), f"{spec!r}", repr(one.env)):
        assert key not in shown
    assert one.api_key not in repr(spec) and "--port <port>" in repr(one)
    assert f"Bearer {spec.api_key}" == f"Bearer {key}"  # the value is still usable
    assert spec.make_argv(5555) == argv and spec.model_bytes == gemma.file_bytes and spec.host == "127.0.0.1"


def test_secret_behaves_as_its_value():
    s = Secret("abc")
    assert s == "abc" and str(s) == "abc" and f"{s}" == "abc" and repr(s) == repr(REDACTED)


# --- environment ----------------------------------------------------------------------------------------


def test_cuda_gpus_are_pinned_by_uuid(gemma, real):
    p = plan(gemma, gpus(10 * GIB, 70 * GIB), real)
    env = child_env(
        p,
        BIN,
        {
            "PATH": "/bin",
            "LD_LIBRARY_PATH": "/usr/lib/x",
            "CUDA_VISIBLE_DEVICES": "0",
            "LLAMA_ARG_N_GPU_LAYERS": "99",
            "LLAMA_API_KEY": "leak",
        },
        site_dirs=(),
        cuda_roots=(),
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0001" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["LD_LIBRARY_PATH"] == f"{BIN.parent}:/usr/lib/x" and env["PATH"] == "/bin"
    assert "LLAMA_ARG_N_GPU_LAYERS" not in env and "LLAMA_API_KEY" not in env


def test_a_prebuilt_llama_server_finds_pip_and_toolkit_cuda_libraries(gemma, real, tmp_path):
    """A release llama-server linked against libcudart/libcublas finds them in pip's NVIDIA wheels or the
    CUDA toolkit, which the dynamic loader does not search; the child got only the binary's folder."""
    site = tmp_path / "site-packages"
    for wheel in ("cublas", "cuda_runtime"):
        (site / "nvidia" / wheel / "lib").mkdir(parents=True)
    (site / "nvidia" / "no_libs").mkdir()  # a wheel without a lib folder adds nothing
    toolkit = tmp_path / "cuda"
    (toolkit / "lib64").mkdir(parents=True)
    p = plan(gemma, gpus(70 * GIB), real)
    env = child_env(p, BIN, {"CUDA_HOME": str(toolkit), "LD_LIBRARY_PATH": "/mine"}, site_dirs=[str(site)])
    parts = env["LD_LIBRARY_PATH"].split(":")
    assert parts[:3] == [str(BIN.parent), "/mine", str(toolkit / "lib64")]  # the user's own path before guesses
    assert parts[-2:] == [str(site / "nvidia" / "cublas" / "lib"), str(site / "nvidia" / "cuda_runtime" / "lib")]
    assert all(p.startswith("/usr/local/cuda/") for p in parts[3:-2])  # this machine's toolkit, where it has one
    bare = child_env(p, BIN, {}, site_dirs=[str(tmp_path / "empty")], cuda_roots=[str(tmp_path / "none")])
    assert bare["LD_LIBRARY_PATH"] == str(BIN.parent)


def test_gpus_without_uuids_are_pinned_by_index(gemma, real):
    free = 60 * MIB
    p = plan(gemma, gpus(free, free, free, uuids=False), real, PlanRequest(n_ctx=8192))
    assert len(p.gpus) == 3
    assert child_env(p, BIN, {})["CUDA_VISIBLE_DEVICES"] == "0,1,2"


def test_amd_gpus_are_pinned_through_rocr_and_hip(gemma, real):
    p = plan(gemma, gpus(80 * GIB, backend="ROCm"), real)
    env = child_env(p, BIN, {"CUDA_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "2"})
    assert (env["ROCR_VISIBLE_DEVICES"], env["HIP_VISIBLE_DEVICES"]) == ("GPU-0000", "0")
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_an_amd_apu_gets_unified_memory(gemma, real):
    """An APU's VRAM is a small carve-out of system memory: llama-server allocates managed memory there, as the
    reference backend has it do; a discrete AMD card keeps plain device allocations."""
    apu = Device("ROCm", 0, "Radeon 8060S", 64 * GIB, 60 * GIB, "rocm-smi", integrated=True)
    cpu = Device("CPU", None, "c", 64 * GIB, 60 * GIB, "psutil")
    env = child_env(plan(gemma, Inventory((apu, cpu), ()), real), BIN, {})
    assert env["GGML_CUDA_ENABLE_UNIFIED_MEMORY"] == "1"
    mine = child_env(plan(gemma, Inventory((apu, cpu), ()), real), BIN, {"GGML_CUDA_ENABLE_UNIFIED_MEMORY": "0"})
    assert mine["GGML_CUDA_ENABLE_UNIFIED_MEMORY"] == "0"  # the user's own setting wins
    assert "GGML_CUDA_ENABLE_UNIFIED_MEMORY" not in child_env(
        plan(gemma, gpus(80 * GIB, backend="ROCm"), real), BIN, {}
    )


def test_a_cpu_plan_hides_every_gpu(gemma, real):
    env = child_env(plan(gemma, cpu_only(), real), BIN, {"CUDA_VISIBLE_DEVICES": "0"})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["HIP_VISIBLE_DEVICES"] == ""


def test_other_backends_are_pinned_with_device(gemma, real, build):
    vk = Device("Vulkan", 1, "Radeon", 24 * GIB, 20 * GIB, "llama-server")
    p = plan(gemma, Inventory((vk, Device("CPU", None, "c", 64 * GIB, 60 * GIB, "psutil")), ()), real)
    argv = build(p, real).argv(1)
    assert value(argv, "--device") == "Vulkan1"


# --- extra arguments ---------------------------------------------------------------------------------------


def test_every_managed_flag_is_refused(real):
    for flags in MANAGED_FLAGS:
        for flag in flags:
            with pytest.raises(ExtraArgsError) as err:
                validate_extra_args([flag, "1"], real)
            assert err.value.flags == (flag,) and f"{flag} is managed by the studio" in str(err.value)


def test_a_managed_flags_alias_this_list_lacks_is_refused_through_the_probed_help(llama_server_bin):
    help_text = run_tool([str(llama_server_bin), "--help"], timeout=30).stdout
    # a build that spells the context flag a third way, and the threads flag a new way
    help_text = help_text.replace("-c,    --ctx-size N", "-c, --ctx-size, --context-length N", 1)
    help_text = help_text.replace("-t,    --threads N", "-t, --threads, --n-threads N", 1)
    assert "--context-length" in help_text and "--n-threads" in help_text
    caps = capabilities_from_text(str(llama_server_bin), "version: 9999 (x)", help_text)
    with pytest.raises(ExtraArgsError) as err:
        validate_extra_args(["--context-length", "4096", "--n-threads", "2", "--temp", "0.7"], caps)
    assert err.value.flags == ("--context-length", "--n-threads")
    assert (
        "--context-length is managed by the studio (the planner chooses the context; use the load option n_ctx)"
        in str(err.value)
    )
    threads = "(the planner divides the cores among the resident models; use the load option threads)"
    assert f"--n-threads is managed by the studio {threads}" in str(err.value)


def test_each_offending_flag_is_named(real):
    args = [
        "--temp",
        "0.7",
        "--port",
        "1",
        "--api_key",
        "k",
        "-a",
        "x",
        "--frobnicate",
        "--draft-max",
        "3",
        "--top-k",
        "5",
    ]
    with pytest.raises(ExtraArgsError) as err:
        validate_extra_args(args, real)
    assert err.value.flags == ("--port", "--api_key", "-a", "--frobnicate", "--draft-max")
    message = str(err.value)
    assert "--port is managed by the studio" in message and "--api_key is managed" in message
    assert "--frobnicate is not a flag of this llama-server" in message
    assert "--draft-max was removed from this llama-server" in message
    assert "--temp" not in message and "--top-k" not in message


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--temp", "0.7"),
        ("--seed", "-1"),
        ("--top-p", "-0.5"),
        ("--spec-type", "ngram-simple"),
        ("-s", "42", "--repeat-penalty", "1.1"),
        ("--lora-scaled", "x.gguf", "0.5"),
    ],
)
def test_allowed_extra_args_pass(real, args):
    assert validate_extra_args(args, real) == args


def test_flags_the_legacy_build_lacks_are_unknown_there(legacy, real):
    assert validate_extra_args(["--top-k", "5"], real)
    with pytest.raises(ExtraArgsError, match="--top-k is not a flag of this llama-server"):
        validate_extra_args(["--top-k", "5"], legacy)


# --- the real server --------------------------------------------------------------------------------------


def _assert_serves(url: str, key: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert models.status_code == 200


@pytest.mark.slow
def test_default_plan_serves_gemma_under_the_supervisor(gemma_model, llama_server_bin, real, tmp_path):
    from launcher.devices import discover

    p = plan(load_model(gemma_model), discover(llama_server=llama_server_bin), real)
    command = build_command(p, real, binary=llama_server_bin, files_root=tmp_path / "run")
    supervisor = Supervisor(logs_dir=tmp_path / "logs", registry=ChildRegistry(tmp_path / "reg", owner_token()))
    try:
        status = supervisor.start(command.launch_spec(start_timeout=120))
        assert status.state == State.READY and status.url
        _assert_serves(status.url, str(command.api_key))
        model = httpx.get(f"{status.url}/v1/models", headers={"Authorization": f"Bearer {command.api_key}"}).json()
        assert model["data"][0]["id"] == "gemma-3-270m-Q4_K_M"
        assert model["data"][0]["meta"]["n_ctx"] == p.n_ctx
        log = status.log_path.read_text()
        assert "CPU KV buffer size" in log  # -lv 4: the allocations are there to compare
        assert str(command.api_key) not in log
    finally:
        supervisor.close()
        command.cleanup()
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@contextlib.contextmanager
def _serving(p: LaunchPlan, caps, binary: Path, tmp_path: Path) -> Iterator[tuple[LlamaServer, LaunchCommand]]:
    """llama-server started from ``p``'s argv (2 threads, log in tmp_path), ready and answering, stopped after."""
    port = free_port()
    with build_command(p, caps, binary=binary, files_root=tmp_path / "run", threads=2) as command:
        server = LlamaServer(
            command.argv(port),
            host="127.0.0.1",
            port=port,
            env=command.env,
            api_key=command.api_key,
            log_path=tmp_path / "llama-server.log",
        )
        server.start()
        try:
            server.wait_ready(timeout=120)
            _assert_serves(server.url, str(command.api_key))
            yield server, command
        finally:
            server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_speculative_mode_plans_builds_and_serves(gemma, llama_server_bin, real, tmp_path, mode):
    p = plan(gemma, cpu_only(), real, PlanRequest(n_ctx=2048, spec=mode))
    with _serving(p, real, llama_server_bin, tmp_path) as (server, command):
        argv, spec = list(command.argv(server.port)), list(p.spec.argv)
        if spec:  # the planned speculative flags reach llama-server, together and in order
            assert any(argv[i : i + len(spec)] == spec for i in range(len(argv))), (spec, argv)
        else:  # nothing planned: no speculative flag slips in
            assert not any(a.startswith("--spec") for a in argv), argv


@pytest.mark.slow
def test_the_planner_engages_mtp_on_a_model_with_a_nextn_block(qwen35_mtp_model, llama_server_bin, real, tmp_path):
    """Policy, bill and argv for ``--spec mtp`` on a real MTP model; the server drafts with it and the bill holds."""
    p = plan(load_model(qwen35_mtp_model), cpu_only(), real, PlanRequest(n_ctx=2048, spec="mtp"))
    assert p.mtp_engaged and p.spec.argv[:2] == ("--spec-type", "draft-mtp")
    assert any(c.label == "MTP draft main" for c in p.bill.caches)
    with _serving(p, real, llama_server_bin, tmp_path) as (server, command):
        done = httpx.post(
            f"{server.url}/completion",
            json={"prompt": "hello world", "n_predict": 8},
            headers={"Authorization": f"Bearer {command.api_key}"},
            timeout=60,
        ).json()
        assert done["tokens_predicted"] == 8 and done["timings"]["draft_n"] > 0
    actual = parse_allocations((tmp_path / "llama-server.log").read_text())
    assert [(c.label, c.cells, c.k_bytes) for c in actual.caches] == [
        (c.label, c.cells, c.k_bytes) for c in p.bill.caches
    ]
