"""Load options for what llama-server flags the studio manages: threads, flash attention, context shift, a
chat template by name; and every managed flag's refusal names an option that exists.

The planner's decisions are checked on Gemma's real facts over hand-made inventories; the argv through the
command builder; the manager's count of models sharing the CPU over fake llama-servers; a built-in template
by name on the real llama-server.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gguf.templates import template_capabilities
from launcher.capabilities import run_tool
from launcher.chat_templates import BUILTIN_CHAT_TEMPLATES
from launcher.command import LaunchCommand, build_command
from launcher.devices import Device, Inventory, usable_cores
from launcher.extra_args import MANAGED_FLAGS, ExtraArgsError, validate_extra_args
from launcher.planner import LaunchPlan, PlanError, PlanRequest, load_model, plan
from launcher.process import LlamaServer
from launcher.units import MIB
from studio.http.gui.gui_api import LoadBody
from studio.library.catalog import CatalogEntry
from studio.library.default_model import ensure_default_model
from studio.residency.requests import LoadRequest, load_settings
from studio.settings import _MODEL_KEYS, _TOP_KEYS, ModelDefaults, Settings
from tests.fake_llama import fake_children
from tests.helpers import free_port
from tests.manager_harness import ZOO, fake_manager, zoo_bill
from tests.support.studio import running_studio

GIB = 1024 * MIB
#: ``ggstudio`` from this checkout (the installed script imports whichever checkout it was installed from).
CLI = [sys.executable, "-c", "import sys; from studio.cli.app import main; sys.exit(main())"]
ROOT = Path(__file__).resolve().parent.parent
BIN = Path("/opt/llama/bin/llama-server")
JINJA = "{% for m in messages %}{{ m.content }}{% endfor %}"


def cpu(cores: int | None) -> Device:
    return Device("CPU", None, "Test CPU", 64 * GIB, 60 * GIB, "psutil", cores=cores)


def on_cpu(cores: int | None = 2) -> Inventory:
    return Inventory((cpu(cores),), ())


def with_gpu(free: int, cores: int = 8) -> Inventory:
    return Inventory((Device("CUDA", 0, "GPU 0", 80 * GIB, free, "nvidia-smi", "GPU-0"), cpu(cores)), ())


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture
def argv_of(tmp_path):
    """The argv ``build_command`` makes for a plan (its private files cleaned up after the test)."""
    made: list[LaunchCommand] = []

    def argv(p: LaunchPlan, caps) -> list[str]:
        command = build_command(p, caps, binary=BIN, files_root=tmp_path / "run")
        made.append(command)
        return command.argv(1)

    yield argv
    for command in made:
        command.cleanup()


# --- threads ---------------------------------------------------------------------------------------------


def test_one_resident_on_the_cpu_gets_every_usable_core(gemma, real, argv_of):
    p = plan(gemma, on_cpu(2), real, PlanRequest(n_ctx=4096))
    assert p.threads == 2 and p.layers_on_cpu
    assert "threads: 2, the usable physical cores" in p.reasons
    argv = argv_of(p, real)
    assert value(argv, "--threads") == "2" and "--threads-batch" not in argv


@pytest.mark.parametrize(
    "sharers, cores, each, reason",
    [
        (1, 2, 2, "threads: 2, the usable physical cores"),
        (2, 2, 1, "threads: 2 residents on 2 physical cores: 1 thread each"),
        (
            3,
            2,
            1,
            "threads: 3 residents on 2 physical cores: 1 thread each (more residents than cores: they share them)",
        ),
        (2, 8, 4, "threads: 2 residents on 8 physical cores: 4 threads each"),
        (3, 8, 2, "threads: 3 residents on 8 physical cores: 2 threads each"),
    ],
)
def test_models_sharing_the_cpu_divide_its_cores(gemma, real, argv_of, sharers, cores, each, reason):
    """Each llama-server took every core, so two busy models on one CPU thrashed each other."""
    p = plan(gemma, on_cpu(cores), real, PlanRequest(n_ctx=4096, cpu_sharers=sharers))
    assert p.threads == each and reason in p.reasons
    assert value(argv_of(p, real), "--threads") == str(each)


def test_a_fully_offloaded_model_keeps_every_core_and_is_no_cpu_sharer(gemma, real):
    p = plan(gemma, with_gpu(80 * GIB), real, PlanRequest(n_ctx=4096, cpu_sharers=3))
    assert p.n_gpu_layers == gemma.facts.block_count + 1 and not p.layers_on_cpu
    assert p.threads == 8
    assert "threads: 8, the usable physical cores (every layer is offloaded; the CPU only feeds the GPUs)" in p.reasons


def test_a_model_split_with_the_cpu_shares_the_cores(gemma, real):
    p = plan(gemma, with_gpu(60 * MIB), real, PlanRequest(n_ctx=8192, cpu_sharers=2))
    assert p.layers_on_cpu and p.n_gpu_layers < gemma.facts.block_count + 1
    assert p.threads == 4


def test_requested_threads_are_honoured_and_too_many_are_warned_about(gemma, real, argv_of):
    p = plan(gemma, on_cpu(2), real, PlanRequest(n_ctx=4096, threads=3, threads_batch=2, cpu_sharers=2))
    assert (p.threads, p.threads_batch) == (3, 2)
    assert "threads: 3, as requested" in p.reasons and "batch threads: 2, as requested" in p.reasons
    assert "3 threads on 2 usable physical cores: they will compete for them" in p.warnings
    argv = argv_of(p, real)
    assert (value(argv, "--threads"), value(argv, "--threads-batch")) == ("3", "2")


def test_an_inventory_that_does_not_count_cores_leaves_the_threads_to_the_command(gemma, real, argv_of):
    p = plan(gemma, on_cpu(None), real, PlanRequest(n_ctx=4096, cpu_sharers=2))
    assert p.threads is None
    assert value(argv_of(p, real), "--threads") == str(usable_cores())


@pytest.mark.parametrize("field", ["threads", "threads_batch"])
def test_zero_threads_are_refused(gemma, real, field):
    with pytest.raises(PlanError, match=f"{field} must be at least 1, not 0"):
        plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, **{field: 0}))


def test_the_cpu_device_counts_the_usable_cores():
    from launcher.devices import discover

    assert discover().cpu.cores == usable_cores() >= 1


def test_a_second_cpu_resident_gets_its_share_of_the_cores_not_all_of_them(tmp_path, real, zoo_dir):
    """The manager tells the planner how many resident models run layers on the CPU; the first, loaded alone with
    every core, restarts with its share."""
    a, b = ZOO[:2]
    models = {name: zoo_dir / f"{name}.gguf" for name in (a, b)}

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, models, discover=lambda: on_cpu(4))
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            threads = {r.name: r.plan.threads for r in manager.residents}
            assert threads == {a: 2, b: 2} and manager.find(b).plan.request.cpu_sharers == 2
            await manager.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("cores, cap, each", [(2, 2, 1), (4, 2, 2), (8, 3, 2)])
def test_two_residents_busy_at_once_run_no_more_threads_than_cores_under_max_resident(
    tmp_path, real, zoo_dir, cores, cap, each
):
    """Regression: two residents on 2 cores got --threads 2 and 1, three threads on two cores while both answered:
    the first, planned alone, kept every core. With max_resident the division is planned before the first load."""
    a, b = ZOO[:2]
    models = {name: zoo_dir / f"{name}.gguf" for name in (a, b)}

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, models, max_resident=cap, discover=lambda: on_cpu(cores))
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            threads = {r.name: r.plan.threads for r in manager.residents}
            assert threads == {a: each, b: each} and sum(t or 0 for t in threads.values()) <= cores
            await manager.aclose()

    asyncio.run(run())


def test_a_cpu_model_with_no_core_left_evicts_an_idle_one_under_max_resident(tmp_path, real, zoo_dir):
    """Cores are room: with three residents allowed on two cores, the third on the CPU evicts the least recently
    used idle one rather than run a third thread."""
    a, b, c = ZOO[:3]
    models = {name: zoo_dir / f"{name}.gguf" for name in (a, b, c)}

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, models, max_resident=3, discover=lambda: on_cpu(2))
            for name in (a, b):
                await manager.load(LoadRequest(model=name))
            placed = await manager.preview(LoadRequest(model=c))
            assert placed.evict == (a,) and placed.fits
            await manager.load(LoadRequest(model=c))
            assert {r.name: r.plan.threads for r in manager.residents} == {b: 1, c: 1}
            await manager.aclose()

    asyncio.run(run())


def test_a_model_swapped_in_gets_the_cores_of_the_model_it_evicts(tmp_path, real, zoo_dir):
    """Regression: B's plan counted A, which its load evicts, as a resident sharing the cores: B ran alone on two
    cores with one thread, at half speed (a swapped-back conversation took 1.9x its time to first token)."""
    a, b = ZOO[:2]
    models = {name: zoo_dir / f"{name}.gguf" for name in (a, b)}
    one_fits = int(max(zoo_bill(real, p) for p in models.values()) * 1.5)

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, models, budget=one_fits, discover=lambda: on_cpu(2))
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            assert {r.name: (r.plan.request.cpu_sharers, r.plan.threads) for r in manager.residents} == {b: (1, 2)}
            await manager.aclose()

    asyncio.run(run())


def test_residents_offloaded_to_a_gpu_do_not_count_as_cpu_sharers(tmp_path, real, zoo_dir):
    a, b = ZOO[:2]
    models = {name: zoo_dir / f"{name}.gguf" for name in (a, b)}

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, models, discover=lambda: with_gpu(80 * GIB, cores=4))
            await manager.load(LoadRequest(model=a))
            await manager.load(LoadRequest(model=b))
            assert {r.name: r.plan.request.cpu_sharers for r in manager.residents} == {a: 1, b: 1}
            await manager.aclose()

    asyncio.run(run())


# --- flash attention and context shift -------------------------------------------------------------------


@pytest.mark.parametrize(
    "asked, cache, planned, flag",
    [
        (None, "f16", "auto", None),  # the planner's default, unchanged
        (None, "q8_0", "on", "on"),
        ("off", "f16", "off", "off"),
        ("on", "f16", "on", "on"),
        ("auto", "q8_0", "auto", None),
    ],
)
def test_flash_attention_as_asked_and_the_planners_default_when_not(gemma, real, argv_of, asked, cache, planned, flag):
    p = plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, cache_type_k=cache, cache_type_v=cache, flash_attn=asked))
    assert p.flash_attn == planned
    argv = argv_of(p, real)
    assert (value(argv, "--flash-attn") if "--flash-attn" in argv else None) == flag
    if asked is not None:
        assert f"flash attention {asked}, as requested" in p.reasons


def test_a_quantized_cache_with_flash_attention_off_is_refused_before_planning(gemma, real):
    with pytest.raises(PlanError) as info:
        plan(gemma, on_cpu(), real, PlanRequest(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="off"))
    assert str(info.value) == (
        "a q8_0 KV cache needs flash attention, and flash_attn is off: set flash_attn to on or auto, "
        "or use the f16 cache type"
    )


def test_context_shift_is_off_unless_asked_for(gemma, real, argv_of):
    off = argv_of(plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096)), real)
    assert "--no-context-shift" in off and "--context-shift" not in off
    p = plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, context_shift=True))
    on = argv_of(p, real)
    assert "--context-shift" in on and "--no-context-shift" not in on
    assert any(r.startswith("context shift on, as requested") for r in p.reasons)


# --- a chat template by name -----------------------------------------------------------------------------


def test_a_built_in_template_name_is_passed_as_a_name_without_jinja(gemma, real, argv_of):
    argv = argv_of(plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, chat_template="llama3")), real)
    assert value(argv, "--chat-template") == "llama3" and "--no-jinja" in argv
    assert "--jinja" not in argv and "--chat-template-file" not in argv and "--chat-template-kwargs" not in argv


def test_chatml_by_name_keeps_jinja(gemma, real, argv_of):
    """llama.cpp swaps its own ChatML source in for the name, so tools still render."""
    argv = argv_of(plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, chat_template="chatml")), real)
    assert value(argv, "--chat-template") == "chatml" and "--jinja" in argv and "--no-jinja" not in argv


def test_jinja_text_still_goes_in_a_private_file(gemma, real, argv_of):
    argv = argv_of(plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, chat_template=JINJA)), real)
    assert Path(value(argv, "--chat-template-file")).read_text() == JINJA and "--jinja" in argv


def test_jinja_false_runs_llama_servers_built_in_renderer_and_true_or_unset_jinja(gemma, real, argv_of):
    off = argv_of(plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, jinja=False)), real)
    assert "--no-jinja" in off and "--jinja" not in off and "--chat-template-kwargs" not in off
    for jinja in (None, True):
        on = argv_of(plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, jinja=jinja)), real)
        assert "--jinja" in on and "--no-jinja" not in on
    named = argv_of(plan(gemma, on_cpu(), real, PlanRequest(n_ctx=4096, jinja=False, chat_template="llama3")), real)
    assert value(named, "--chat-template") == "llama3" and "--no-jinja" in named


def test_a_built_in_template_name_with_jinja_true_is_refused(gemma, real):
    """The name would be read as a Jinja template whose whole text is the name."""
    with pytest.raises(PlanError, match=r"the built-in chat template 'llama3' is rendered only without Jinja"):
        plan(gemma, on_cpu(), real, PlanRequest(chat_template="llama3", jinja=True))
    plan(gemma, on_cpu(), real, PlanRequest(chat_template="chatml", jinja=True))  # llama.cpp's Jinja ChatML


def test_a_word_that_is_no_built_in_template_is_refused(gemma, real):
    with pytest.raises(PlanError, match=r"the chat template 'llama-3' is neither Jinja text nor one of llama.cpp"):
        plan(gemma, on_cpu(), real, PlanRequest(chat_template="llama-3"))


def test_the_built_in_names_are_the_pinned_llama_servers(llama_server_bin):
    help_text = run_tool([str(llama_server_bin), "--help"], timeout=30).stdout
    block = help_text[help_text.index("--chat-template JINJA_TEMPLATE") :]
    listed = block[block.index("list of built-in templates:") + len("list of built-in templates:") :]
    names = re.split(r"[\s,]+", listed[: listed.index("(env:")].strip())
    assert set(names) == BUILTIN_CHAT_TEMPLATES


@pytest.mark.parametrize("name", sorted(BUILTIN_CHAT_TEMPLATES))
def test_template_capabilities_take_a_built_in_name(name):
    found = template_capabilities(name)
    assert not found.supports_tools and found.reasoning_style == "none"


@pytest.mark.slow
def test_a_built_in_template_name_renders_that_template_not_the_name_as_jinja_text(
    zoo_dir, llama_server_bin, real, tmp_path
):
    """The name went into the template file and llama-server read it as Jinja: every prompt became 'llama3'."""
    model = load_model(zoo_dir / "llama-dense.gguf")
    p = plan(model, on_cpu(), real, PlanRequest(n_ctx=256, spec="off", chat_template="llama3"))
    port = free_port()
    with build_command(p, real, binary=llama_server_bin, files_root=tmp_path / "run", threads=1) as command:
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
            answer = httpx.post(
                f"{server.url}/apply-template",
                json={"messages": [{"role": "user", "content": "hello"}]},
                headers=command.auth_headers,
                timeout=30,
            )
        finally:
            server.stop()
    assert answer.status_code == 200, answer.text
    prompt = answer.json()["prompt"]
    assert "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>" in prompt, prompt


# --- the load options through the API, the config file and the load settings -----------------------------


def test_load_options_reach_the_plan_request_from_the_api_and_the_config(tmp_path):
    entry = CatalogEntry(name="m", path=tmp_path / "m.gguf")
    body = LoadBody(model="m", threads=2, threads_batch=4, flash_attn="off", context_shift=True, chat_template="llama3")
    asked = load_settings(body.request(), entry, {}).plan_request("m")
    assert (asked.threads, asked.threads_batch, asked.flash_attn, asked.context_shift, asked.chat_template) == (
        2,
        4,
        "off",
        True,
        "llama3",
    )
    (tmp_path / "config.toml").write_text(
        '[models.m]\nthreads = 1\nthreads_batch = 2\nflash_attn = "on"\ncontext_shift = true\n'
        'chat_template = "chatml"\n'
    )
    defaults = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).model_defaults
    assert defaults["m"] == ModelDefaults(
        threads=1, threads_batch=2, flash_attn="on", context_shift=True, chat_template="chatml"
    )
    configured = load_settings(LoadRequest(model="m"), entry, defaults).plan_request("m")
    assert (configured.threads, configured.flash_attn, configured.context_shift) == (1, "on", True)
    unset = load_settings(LoadRequest(model="m"), entry, {}).plan_request("m")
    assert (unset.threads, unset.threads_batch, unset.flash_attn, unset.context_shift) == (None, None, None, False)
    assert unset.jinja is None


def test_the_jinja_option_reaches_the_plan_request_from_the_api_and_the_config(tmp_path):
    entry = CatalogEntry(name="m", path=tmp_path / "m.gguf")
    assert load_settings(LoadBody(model="m", jinja=False).request(), entry, {}).plan_request("m").jinja is False
    (tmp_path / "config.toml").write_text("[models.m]\njinja = false\n")
    defaults = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).model_defaults
    assert defaults["m"] == ModelDefaults(jinja=False)
    assert load_settings(LoadRequest(model="m"), entry, defaults).plan_request("m").jinja is False
    asked = load_settings(LoadRequest(model="m", jinja=True), entry, defaults).plan_request("m")
    assert asked.jinja is True  # the request's own value wins


def test_the_thinking_option_reaches_the_plan_request_from_the_config(tmp_path):
    entry = CatalogEntry(name="m", path=tmp_path / "m.gguf")
    (tmp_path / "config.toml").write_text("[models.m]\nthinking = true\n")
    defaults = Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)}).model_defaults
    assert defaults["m"] == ModelDefaults(thinking=True)
    assert load_settings(LoadRequest(model="m"), entry, defaults).plan_request("m").thinking is True
    assert load_settings(LoadRequest(model="m"), entry, {}).plan_request("m").thinking is None


def test_the_load_api_takes_the_options_and_refuses_flash_attention_off_with_a_quantized_cache(
    tmp_path, llama_server_bin, zoo_dir
):
    """What a GUI or a router client sees through /api/plan: the options in the plan, a refusal in words."""
    model = ZOO[0]
    with running_studio(tmp_path, llama_server_bin, {model: zoo_dir / f"{model}.gguf"}) as studio:
        body = {"model": model, "n_ctx": 256, "spec": "off", "threads": 1, "context_shift": True}
        planned = httpx.post(f"{studio.url}/api/plan", json={**body, "chat_template": "llama3"}, timeout=60)
        assert planned.status_code == 200, planned.text
        info = planned.json()
        assert (info["threads"], info["context_shift"]) == (1, True) and "threads: 1, as requested" in info["reasons"]
        refused = httpx.post(
            f"{studio.url}/api/load", json={**body, "cache_type_kv": "q8_0", "flash_attn": "off"}, timeout=60
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_plan" and error["message"].startswith(
            "a q8_0 KV cache needs flash attention, and flash_attn is off"
        )
        assert studio.manager.residents == []  # nothing was started
        bad = httpx.post(f"{studio.url}/api/plan", json={**body, "flash_attn": "maybe"}, timeout=60)
        assert bad.status_code in (400, 422) and "flash_attn" in bad.text


@pytest.mark.slow
def test_tools_to_a_model_loaded_with_jinja_false_are_refused_in_words(tmp_path, llama_server_bin, settings):
    """llama-server refuses them with "tools param requires --jinja flag", a flag the studio's users cannot pass."""
    smol = ensure_default_model(settings.models_dir)
    defaults = {"smol": ModelDefaults(n_ctx=512, spec="off", jinja=False)}
    with running_studio(tmp_path, llama_server_bin, {"smol": smol}, defaults=defaults) as studio:
        chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        plain = httpx.post(f"{studio.url}/v1/chat/completions", json=chat, timeout=300)
        assert plain.status_code == 200, plain.text  # llama-server's built-in renderer
        assert "--no-jinja" in studio.manager.find("smol").command.argv(1)
        tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
        refused = httpx.post(f"{studio.url}/v1/chat/completions", json={**chat, "tools": [tool]}, timeout=300)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("tools_need_jinja", "tools")
        assert error["message"].startswith("smol renders its chat template without Jinja (jinja = false)")
        assert "load option jinja true" in error["message"]


@pytest.mark.parametrize(
    "line, words",
    [
        ("threads = 0", "threads must be an integer from 1 to 1024"),
        ("threads_batch = 'many'", "threads_batch must be an integer from 1 to 1024"),
        ("flash_attn = 'maybe'", "flash_attn must be one of on, off, auto"),
        ("context_shift = 'yes'", "context_shift must be true or false"),
        ("jinja = 'no'", "jinja must be true or false"),
        ("thinking = 'off'", "thinking must be true or false"),
        ("chat_template = 'llama-3'", "chat_template: the chat template 'llama-3' is neither Jinja text"),
    ],
)
def test_a_bad_load_option_in_the_config_names_its_key(tmp_path, line, words):
    (tmp_path / "config.toml").write_text(f"[models.m]\n{line}\n")
    with pytest.raises(ValueError) as info:
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path)})
    assert f"[models.'m']: {words}" in str(info.value)


# --- the managed flags -----------------------------------------------------------------------------------


def test_every_managed_flags_refusal_names_an_option_that_exists():
    """``-t`` was refused with "use the threads option", and no load option, config key or CLI flag set threads."""
    load_options = set(LoadBody.model_fields)
    for flags, managed in MANAGED_FLAGS.items():
        if managed.option is None:
            assert "use the" not in managed.advice and "option" not in managed.advice, flags
            continue
        if managed.kind == "load":
            assert managed.option in load_options and managed.option in _MODEL_KEYS, (flags, managed.option)
            assert managed.advice.endswith(f"use the load option {managed.option}"), flags
        else:
            assert managed.option in _TOP_KEYS, (flags, managed.option)
            assert managed.advice.endswith(f"set {managed.option} in the config file"), flags


def test_the_threads_refusal_names_the_threads_load_option(real):
    with pytest.raises(ExtraArgsError) as info:
        validate_extra_args(["-t", "4", "--threads-batch", "4"], real)
    assert "-t is managed by the studio (the planner divides the cores among the resident models; use the load " in (
        str(info.value)
    )
    assert "--threads-batch is managed by the studio" in str(info.value) and "load option threads_batch" in str(
        info.value
    )


def test_ggstudio_plan_takes_the_load_options(gemma_model, llama_server_bin):
    args = ["--ctx", "4096", "--threads", "1", "--threads-batch", "2", "--flash-attn", "off", "--context-shift"]
    out = subprocess.run(
        [*CLI, "plan", str(gemma_model), *args, "--chat-template", "llama3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    argv = info["argv"]
    assert (value(argv, "--threads"), value(argv, "--threads-batch"), value(argv, "--flash-attn")) == ("1", "2", "off")
    assert "--context-shift" in argv and value(argv, "--chat-template") == "llama3" and "--no-jinja" in argv
    assert (info["threads"], info["threads_batch"], info["context_shift"]) == (1, 2, True)
    bad = subprocess.run(
        [*CLI, "plan", str(gemma_model), "--flash-attn", "maybe"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert bad.returncode != 0 and "flash_attn must be one of on, off, auto" in bad.stderr


def test_slots_left_unset_are_the_planners_by_device(tmp_path, gemma_model, real):
    """On main an unset n_parallel became 1 before the planner saw it, so a GPU plan could not choose 4."""
    entry = CatalogEntry(name="m", path=tmp_path / "m.gguf")
    unset = load_settings(LoadRequest(model="m"), entry, {}).plan_request("m")
    assert unset.n_parallel is None
    configured = {"m": ModelDefaults(n_parallel=2)}
    assert load_settings(LoadRequest(model="m"), entry, configured).plan_request("m").n_parallel == 2
    assert load_settings(LoadRequest(model="m", n_parallel=3), entry, configured).plan_request("m").n_parallel == 3
    gpu = Device("CUDA", 0, "GPU 0", 80 * 1024 * MIB, 80 * 1024 * MIB, "nvidia-smi", "GPU-0000")
    model = load_model(gemma_model)
    assert plan(model, Inventory((gpu, *on_cpu().devices), ()), real, unset).n_parallel == 4
    assert plan(model, on_cpu(), real, unset).n_parallel == 4
