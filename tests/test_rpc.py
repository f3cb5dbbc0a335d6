"""llama.cpp RPC workers: real ggml-rpc-server processes on loopback ports, the real llama-server over them.

Workers are CPU devices here (the pinned build is CPU-only), each reporting the
machine's whole RAM as free, as ggml's CPU device does.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import uvicorn

from launcher.allocations import parse_allocations
from launcher.capabilities import probe
from launcher.devices import discover
from launcher.discovery import find_rpc_server
from launcher.errors import PortInUseError
from launcher.planner import PlanRequest, load_model, plan
from launcher.registry import ChildRegistry
from launcher.rpc import (
    LINK_WARNING,
    RpcWorkerError,
    RpcWorkers,
    explain_failure,
    normalize_endpoint,
    parse_endpoints,
    query_worker,
)
from launcher.rpc_worker import RemoteBindError, RpcWorker, check_bind
from launcher.supervisor import Supervisor, owner_token
from studio.http.app import create_app
from studio.library.catalog import Catalog
from studio.residency.manager import ModelManager, supervisor_factory
from studio.settings import Settings
from tests.helpers import free_port, wait_for
from tests.test_cli import CLI, cli, tagged_env

MIB = 2**20
GEMMA = "gemma-3-270m-Q4_K_M"


@pytest.fixture(scope="session")
def rpc_server_bin(pinned_build, settings) -> Path:
    return find_rpc_server(home=settings.home).path


@contextmanager
def running_workers(binary: Path, logs: Path, n: int) -> Iterator[list[RpcWorker]]:
    """``n`` ggml-rpc-server children on free loopback ports, one thread each; all stopped after."""
    started: list[RpcWorker] = []
    try:
        for i in range(n):
            worker = RpcWorker(binary, host="127.0.0.1", port=free_port(), threads=1, log_path=logs / f"worker{i}.log")
            worker.start()
            started.append(worker)
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            worker.stop()


def endpoints(workers: list[RpcWorker]) -> tuple[str, ...]:
    return tuple(w.endpoint for w in workers)


def dead_endpoint() -> str:
    return f"127.0.0.1:{free_port()}"


# --- endpoints, binding, the worker process ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, why",
    [
        ("10.0.0.2", "must be host:port"),
        (":50052", "must be host:port"),
        ("[::1]:50052", "IPv4 only"),
        ("10.0.0.2:0", "from 1 to 65535"),
        ("10.0.0.2:http", "from 1 to 65535"),
    ],
)
def test_a_bad_worker_endpoint_says_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=why.replace("[", r"\[")):
        normalize_endpoint(text)


def test_endpoints_are_normalized_and_deduplicated():
    assert parse_endpoints(" 10.0.0.2:050052, box:7,10.0.0.2:50052") == ("10.0.0.2:50052", "box:7")


def test_rpc_workers_in_the_config_file_are_checked(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('rpc_workers = ["10.0.0.2:50052", "10.0.0.3"]\n')
    with pytest.raises(ValueError, match=r"config.toml: rpc_workers: RPC worker '10.0.0.3' must be host:port"):
        Settings.from_env({"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_CONFIG": str(config)})
    config.write_text('rpc_workers = ["10.0.0.2:50052", "10.0.0.3:50052"]\n')
    env = {"GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_CONFIG": str(config)}
    assert Settings.from_env(env).rpc_workers == ("10.0.0.2:50052", "10.0.0.3:50052")
    assert Settings.from_env({**env, "GGUF_STUDIO_RPC_WORKERS": "box:1"}).rpc_workers == ("box:1",)


def test_binding_beyond_loopback_needs_the_explicit_flag():
    check_bind("127.0.0.1", allow_remote=False)
    check_bind("127.0.0.2", allow_remote=False)
    with pytest.raises(RemoteBindError, match="no authentication and no encryption.*--allow-remote"):
        check_bind("0.0.0.0", allow_remote=False)
    with pytest.raises(RemoteBindError):
        check_bind("192.168.1.20", allow_remote=False)
    check_bind("0.0.0.0", allow_remote=True)
    with pytest.raises(ValueError, match="IPv4 address only"):
        check_bind("localhost", allow_remote=False)


def test_rpc_worker_command_refuses_a_non_loopback_address_with_the_reason(rpc_server_bin):
    env = tagged_env()
    result = cli("rpc-worker", "--host", "0.0.0.0", env=env)
    assert result.returncode == 2
    assert (
        "refusing to bind the RPC worker to 0.0.0.0: the RPC protocol has no authentication and no encryption"
        in result.stderr
        and "--allow-remote" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_a_taken_port_is_a_clear_error(rpc_server_bin, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = RpcWorker(rpc_server_bin, host="127.0.0.1", port=port, log_path=tmp_path / "w.log")
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            worker.start()
        result = cli("rpc-worker", "--port", str(port))
    assert result.returncode == 1 and f"error: port {port} on 127.0.0.1 is already in use" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_rpc_worker_command_stops_its_worker_on_a_signal(rpc_server_bin, sig):
    port = free_port()
    proc = subprocess.Popen(
        [CLI, "rpc-worker", "--port", str(port), "--threads", "1"], env=tagged_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        wait_for(
            lambda: any(f"RPC worker at 127.0.0.1:{port}" in line for line in lines),
            timeout=30,
            what="the worker to listen",
        )
        assert any(LINK_WARNING in line for line in lines)
        (worker,) = psutil.Process(proc.pid).children()
        assert query_worker(f"127.0.0.1:{port}")  # it serves
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        reader.join(5)
        assert lines[-1].strip() == "stopped"
        wait_for(
            lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE,
            timeout=10,
            what="the worker to exit",
        )
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


# --- querying workers ---------------------------------------------------------------------------------------


def test_a_worker_reports_its_devices_over_the_protocol(rpc_server_bin, tmp_path):
    with running_workers(rpc_server_bin, tmp_path, 1) as (worker,):
        (device,) = query_worker(worker.endpoint)
    assert device.index == 0 and device.buffer_name == f"RPC0[{worker.endpoint}]"
    ram = psutil.virtual_memory().total
    assert device.total_bytes == ram and device.reports_total_as_free  # a CPU worker: ggml says all RAM is free


def hello(sock: socket.socket) -> None:
    """The client side of the protocol's handshake (HELLO, 24 bytes of zero caps): a session starts."""
    sock.sendall(struct.pack("<BQ", 14, 24) + bytes(24))
    assert len(sock.recv(8 + 28, socket.MSG_WAITALL)) == 36


def test_a_busy_worker_is_told_from_a_dead_one_and_keeps_its_last_answer(rpc_server_bin, tmp_path):
    with running_workers(rpc_server_bin, tmp_path, 1) as (worker,):
        dead = dead_endpoint()
        workers = RpcWorkers((worker.endpoint, dead), timeout=1.0)
        live, gone = workers.query()
        assert live.usable and live.problem is None
        assert gone.endpoint == dead and not gone.usable and not gone.busy
        assert gone.problem.startswith("connection refused")
        with socket.create_connection(("127.0.0.1", worker.port)) as session:
            hello(session)  # the worker now serves this client alone, as it would a llama-server
            with pytest.raises(RpcWorkerError, match="accepted the connection but did not answer") as busy:
                query_worker(worker.endpoint, timeout=0.5)
            assert busy.value.busy
            for _ in range(2):  # the first waiting client fills its one-place backlog: the next ones time out
                stale, _ = workers.query()
                assert stale.usable and stale.busy and stale.stale_since is not None
                assert stale.devices == live.devices
            fresh = RpcWorkers((worker.endpoint,), timeout=0.5).query()[0]
            assert not fresh.usable and fresh.problem.startswith("no connection within 0.5 s")


def test_the_inventory_lists_answering_workers_and_leaves_a_dead_one_out(rpc_server_bin, llama_server_bin, tmp_path):
    with running_workers(rpc_server_bin, tmp_path, 2) as pair:
        dead = dead_endpoint()
        inventory = discover(
            llama_server=llama_server_bin, workers=RpcWorkers((pair[0].endpoint, dead, pair[1].endpoint))
        )
    assert [(d.backend, d.index, d.rpc_buffer_name) for d in inventory.rpc] == [
        ("RPC", 0, f"RPC0[{pair[0].endpoint}]"),
        ("RPC", 1, f"RPC0[{pair[1].endpoint}]"),
    ]
    assert inventory.cpu.backend == "CPU" and inventory.gpus == ()
    assert [r.endpoint for r in inventory.workers] == [pair[0].endpoint, dead, pair[1].endpoint]
    assert any(w.startswith(f"RPC worker {dead} left out: connection refused") for w in inventory.warnings)
    assert any("share its memory" in w for w in inventory.warnings)


def test_a_failed_worker_is_named_from_llama_servers_log_and_a_probe(rpc_server_bin, tmp_path):
    with running_workers(rpc_server_bin, tmp_path, 1) as (alive,):
        dead = dead_endpoint()
        crashed = ["... ggml-rpc.cpp:569: Remote RPC server crashed or returned malformed response"]
        failure = explain_failure(crashed, [alive.endpoint, dead])
        assert failure.workers == (dead,) and "connection refused" in failure.reasons[0]
        assert f"RPC worker {dead} failed (connection refused" in failure.message
        at_start = [f"... ggml-rpc.cpp:547: Failed to connect to {dead}"]
        assert explain_failure(at_start, [alive.endpoint, dead]).workers == (dead,)
        assert explain_failure(["llama_server: model loaded"], [alive.endpoint, dead]) is None


def test_rpc_buffer_lines_keep_their_device_names():
    log = "\n".join(
        [
            "load_tensors:   CPU_Mapped model buffer size =   170.00 MiB",
            "load_tensors: RPC0[127.0.0.1:50911] model buffer size =    35.82 MiB",
            "load_tensors: RPC0[127.0.0.1:50912] model buffer size =   199.34 MiB",
            "llama_kv_cache: RPC0[127.0.0.1:50911] KV buffer size =     1.00 MiB",
            "sched_reserve: RPC0[127.0.0.1:50912] compute buffer size =    29.57 MiB",
        ]
    )
    bill = parse_allocations(log)
    assert [d.device for d in bill.devices] == ["CPU", "RPC0[127.0.0.1:50911]", "RPC0[127.0.0.1:50912]"]
    assert bill.device("RPC0[127.0.0.1:50912]").weights == round(199.34 * MIB)
    assert bill.device("RPC0[127.0.0.1:50911]").kv == MIB


# --- planning -----------------------------------------------------------------------------------------------


def test_the_plan_spreads_layers_over_the_workers_and_the_cpu(rpc_server_bin, llama_server_bin, gemma, real, tmp_path):
    with running_workers(rpc_server_bin, tmp_path, 3) as three:
        inventory = discover(llama_server=llama_server_bin, workers=RpcWorkers(endpoints(three)))
    p = plan(gemma, inventory, real, PlanRequest(n_ctx=4096))
    names = [f"RPC0[{e}]" for e in endpoints(three)]
    assert [d.name for d in p.devices] == [*names, "CPU"] and p.rpc_workers == endpoints(three)
    assert p.offload == "ngl" and 0 < p.n_gpu_layers < 19 and len(p.tensor_split) == 3
    assert all(p.bill.device(n).weights > 0 and p.bill.device(n).kv > 0 for n in names)
    assert p.bill.device("CPU").kv > 0  # the CPU keeps the first blocks, in proportion to its free RAM
    assert LINK_WARNING in p.warnings and any("--fit is unreliable over RPC" in r for r in p.reasons)


def test_doctor_and_plan_show_the_workers(rpc_server_bin, gemma_model, tmp_path):
    with running_workers(rpc_server_bin, tmp_path, 2) as pair:
        rpc = ",".join([*endpoints(pair), dead := dead_endpoint()])
        doctor = cli("doctor", "--json", "--rpc", rpc)
        planned = cli("plan", str(gemma_model), "--ctx", "4096", "--json", "--rpc", rpc)
    assert doctor.returncode == 0, doctor.stderr
    info = json.loads(doctor.stdout)
    rpc_devices = [d for d in info["devices"] if d["backend"] == "RPC"]
    assert [d["buffer_name"] for d in rpc_devices] == [f"RPC0[{e}]" for e in endpoints(pair)]
    assert all(d["free_bytes"] > 0 for d in rpc_devices)
    assert [(w["endpoint"], w["answered"]) for w in info["rpc_workers"]] == [
        (pair[0].endpoint, True),
        (pair[1].endpoint, True),
        (dead, False),
    ]
    check = next(c for c in info["checks"] if c["check"] == "rpc workers")
    assert not check["ok"] and f"not answering: {dead}" in check["detail"]
    assert LINK_WARNING in doctor.stderr
    assert planned.returncode == 0, planned.stderr
    shown = json.loads(planned.stdout)
    assert [b["device"] for b in shown["bill"]] == [*(f"RPC0[{e}]" for e in endpoints(pair)), "CPU"]
    assert shown["rpc_workers"] == list(endpoints(pair))
    argv = shown["argv"]
    assert argv[argv.index("--rpc") + 1] == ",".join(endpoints(pair)) and "--tensor-split" in argv


# --- running: a chat over the workers, predicted vs actual, a worker killed mid-generation -----------------


@pytest.fixture
def studio_over_workers(rpc_server_bin, llama_server_bin, gemma_model, tmp_path):
    """A studio service whose plans use three live workers (and one dead endpoint)."""
    models = tmp_path / "models"
    models.mkdir()
    (models / gemma_model.name).symlink_to(gemma_model)
    with running_workers(rpc_server_bin, tmp_path, 3) as three:
        workers = RpcWorkers((*endpoints(three), dead_endpoint()))
        supervisors = supervisor_factory(tmp_path / "logs", ChildRegistry(tmp_path / "run", owner_token()))
        manager = ModelManager(
            catalog=Catalog([models]),
            binary=llama_server_bin,
            make_supervisor=supervisors,
            caps=probe(llama_server_bin, cache_dir=tmp_path / "cache"),
            discover_devices=lambda: discover(llama_server=llama_server_bin, workers=workers),
        )
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(manager), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: server.started, timeout=30, what="uvicorn to start")
            yield f"http://127.0.0.1:{port}", manager, three
        finally:
            server.should_exit = True
            thread.join(30)


@pytest.mark.slow
def test_a_chat_over_three_workers_and_a_worker_killed_mid_generation(studio_over_workers):
    base, manager, three = studio_over_workers
    with httpx.Client(base_url=base, timeout=300) as http:
        loaded = http.post("/api/load", json={"model": GEMMA, "n_ctx": 4096, "spec": "off"})
        assert loaded.status_code == 200, loaded.text
        status = http.get("/api/status").json()
        assert status["state"] == "ready"
        names = [f"RPC0[{e}]" for e in endpoints(three)]
        assert sorted(status["offload"]["active_on"]) == sorted(["CPU", *names])

        # predicted vs actual on every RPC device: the weights within 2 % (or 1 MiB), the KV cache exact
        predicted, actual = status["memory"]["predicted"]["devices"], status["memory"]["actual"]["devices"]
        for name in names:
            p, a = predicted[name], actual[name]
            assert abs(p["weights"] - a["weights"]) <= max(0.02 * a["weights"], MIB), (name, p, a)
            assert abs(p["kv"] - a["kv"]) <= 0.01 * MIB and a["kv"] > 0, (name, p, a)

        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            answer = client.completions.create(model=GEMMA, prompt="The capital of France is", max_tokens=8)
        assert answer.choices[0].text.strip()

        # a worker dies while tokens stream: the client's stream ends with an error naming it, within seconds
        victim = three[1]
        body = {"model": GEMMA, "prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        events: list[dict] = []
        killed_at = 0.0
        with http.stream("POST", "/v1/completions", json=body) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    killed_at = time.monotonic()
                    psutil.Process(victim.pid).kill()
        took = time.monotonic() - killed_at
        assert killed_at and "error" in events[-1], events[-3:]
        error = events[-1]["error"]
        assert f"RPC worker {victim.endpoint} failed" in error["message"] and error["code"] == "rpc_worker_failed"
        assert took < 15, took

        # the status names the worker (crashed; then failed, once a restart finds the worker still gone), and
        # the model's supervisor lists it
        (resident,) = manager.residents
        wait_for(lambda: http.get("/api/status").json()["state"] in ("crashed", "failed"), timeout=15, what="the crash")
        down = http.get("/api/status").json()
        assert f"RPC worker {victim.endpoint}" in down["error"], down["error"]
        assert resident.supervisor.status().failed_workers == (victim.endpoint,)
        wait_for(lambda: http.get("/api/status").json()["state"] == "failed", timeout=30, what="the restart to fail")
        assert (
            f"RPC worker {victim.endpoint} is not ready (connection refused" in http.get("/api/status").json()["error"]
        )

        assert http.post("/api/unload", json={"model": GEMMA}).status_code == 200
    wait_for(
        lambda: not [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-server"],
        timeout=15,
        what="llama-server to exit",
    )


@pytest.mark.slow
def test_predicted_matches_llama_servers_allocations_on_each_worker(rpc_server_bin, llama_server_bin, tmp_path, real):
    """Gemma (SWA, tied embeddings) and a zoo model, over two workers and the CPU."""
    from launcher.command import build_command

    models = [
        load_model(Path(p))
        for p in (
            Settings.from_env().models_dir / f"{GEMMA}.gguf",
            Settings.from_env().home / "zoo" / "b11434" / "llama-dense.gguf",
        )
    ]
    with running_workers(rpc_server_bin, tmp_path, 2) as pair:
        for model in models:
            inventory = discover(llama_server=llama_server_bin, workers=RpcWorkers(endpoints(pair)))
            p = plan(model, inventory, real, PlanRequest(n_ctx=2048, spec="off", threads=1))
            supervisor = Supervisor(logs_dir=tmp_path / "logs", registry=ChildRegistry(tmp_path / "run", owner_token()))
            with build_command(p, real, binary=llama_server_bin) as command, supervisor:
                actual = supervisor.start(command.launch_spec(start_timeout=300)).allocations
            for d in p.devices:
                got = actual.device(d.name)
                assert abs(d.bill.weights - got.weights) <= max(0.02 * got.weights, MIB), (model.path, d.name)
                assert abs(d.bill.kv - got.kv) <= 0.01 * MIB, (model.path, d.name)


def test_a_worker_that_is_gone_at_load_time_is_left_out_not_fatal(
    rpc_server_bin, llama_server_bin, gemma, real, tmp_path
):
    dead = dead_endpoint()
    inventory = discover(llama_server=llama_server_bin, workers=RpcWorkers((dead,)))
    p = plan(gemma, inventory, real, PlanRequest(n_ctx=2048))
    assert p.rpc_workers == () and [d.name for d in p.devices] == ["CPU"]
    assert any(w.startswith(f"RPC worker {dead} left out") for w in p.warnings)


@pytest.mark.slow
def test_a_worker_gone_between_plan_and_start_fails_the_load_naming_it(
    rpc_server_bin, llama_server_bin, gemma, real, tmp_path
):
    from launcher.command import build_command
    from launcher.errors import LoadError

    with running_workers(rpc_server_bin, tmp_path, 2) as pair:
        inventory = discover(llama_server=llama_server_bin, workers=RpcWorkers(endpoints(pair)))
        p = plan(gemma, inventory, real, PlanRequest(n_ctx=2048, spec="off", threads=1))
        pair[1].stop()
        supervisor = Supervisor(logs_dir=tmp_path / "logs", registry=ChildRegistry(tmp_path / "run", owner_token()))
        with build_command(p, real, binary=llama_server_bin) as command, supervisor:
            with pytest.raises(LoadError) as failed:
                supervisor.start(command.launch_spec(start_timeout=120))
            assert failed.value.cause == "rpc_worker_failed"
            assert f"RPC worker {pair[1].endpoint} is not ready (connection refused" in str(failed.value)
            assert supervisor.status().failed_workers == (pair[1].endpoint,)
            assert supervisor.status().pid is None  # refused before llama-server was spawned


def test_a_busy_worker_fails_the_start_at_once_instead_of_hanging_it(
    rpc_server_bin, llama_server_bin, gemma, real, tmp_path
):
    from launcher.command import build_command
    from launcher.errors import LoadError

    with running_workers(rpc_server_bin, tmp_path, 1) as (worker,):
        inventory = discover(llama_server=llama_server_bin, workers=RpcWorkers(endpoints([worker])))
        p = plan(gemma, inventory, real, PlanRequest(n_ctx=2048, spec="off"))
        supervisor = Supervisor(logs_dir=tmp_path / "logs", registry=ChildRegistry(tmp_path / "run", owner_token()))
        with (
            socket.create_connection(("127.0.0.1", worker.port)) as other_client,
            supervisor,
            build_command(p, real, binary=llama_server_bin) as command,
        ):
            hello(other_client)  # another llama-server holds the worker
            started = time.monotonic()
            with pytest.raises(LoadError, match=f"RPC worker {worker.endpoint} is not ready .*another llama-server"):
                supervisor.start(command.launch_spec(start_timeout=120))
            assert time.monotonic() - started < 30
            assert supervisor.status().failed_workers == (worker.endpoint,)
