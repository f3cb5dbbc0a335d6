"""Nothing lost to a crash: a request that has received nothing yet survives its llama-server killed by a signal,
at each moment one can die under it, and the studio says why it died.

The kills are real ``kill -9`` of the real llama-server (what the kernel's out-of-memory killer does on a
desktop); SIGSTOP first where the moment must be held still (a request sent, its answer not begun). On b5a9904
each of these requests failed: 500 "llama-server exited with code -9 while loading: <its last log line>" for a
load, 502 "llama-server did not answer" for one sent.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import psutil
import pytest
from starlette.responses import Response

from launcher.devices import Inventory
from launcher.diagnosis import exit_by_signal
from launcher.errors import LoadError
from studio.errors import BusyError, RetriesSpentError, UpstreamDiedError, UpstreamError
from studio.http.clients.load_wait import RETRIES, Answer, acquire_surviving, answer_surviving
from studio.http.errors import describe
from studio.residency.lifecycle import ResidentState
from studio.residency.requests import LoadRequest
from studio.residency.resident import Lease, LoadedModel
from tests.fake_llama import FakeChildren, fake_children
from tests.helpers import wait_for
from tests.manager_harness import GIB, ZOO, cpu_machine, fake_manager
from tests.test_answer_limits import serving
from tests.test_cli import SMOL, cli, llama_servers, tagged_env

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]

QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}


def test_a_signal_is_named_with_its_likely_cause():
    assert "killed by SIGKILL" in exit_by_signal(-9, oom_killed=False, log_lines=[]).reason
    oom = exit_by_signal(-9, oom_killed=True, log_lines=[])
    assert oom.cause == "out_of_memory" and "out-of-memory killer" in oom.reason
    crash = exit_by_signal(-11, oom_killed=False, log_lines=["0.00.1.2 E ggml_abort: bad tensor"])
    assert crash.cause == "crashed" and "SIGSEGV" in crash.reason and "bad tensor" in crash.reason
    assert exit_by_signal(1, oom_killed=True, log_lines=[]) is None  # an exit code of its own says the rest


def test_a_model_killed_on_every_load_is_loaded_at_most_once_per_retry(tmp_path, real, zoo_dir):
    """One budget of retries per request: the load's own retries were nested inside the request's, so a model
    the out-of-memory killer took on every start was started nine times for one request."""
    model = ZOO[0]

    async def never(loaded, lease):  # a load never succeeds: no answer is asked for
        raise AssertionError("answered by a model that never loaded")

    async def run() -> dict[str, int]:
        with fake_children() as children:
            children.killed.add(f"{model}.gguf")
            manager = fake_manager(tmp_path, children, real, {model: zoo_dir / f"{model}.gguf"})
            try:
                # the error says it was tried again until the budget ran out, not only that it died
                with pytest.raises(RetriesSpentError, match=rf"SIGKILL.*died {RETRIES + 1} times under this") as spent:
                    await answer_surviving(manager, model, never)
                assert spent.value.tries == RETRIES + 1 and isinstance(spent.value.__cause__, LoadError)
            finally:
                await manager.aclose()
            return children.starts

    assert asyncio.run(run()) == {f"{model}.gguf": RETRIES + 1}


def _taken_after(plans: int) -> Callable[[], Inventory]:
    """The machine's memory as placement reads it: plenty for the first ``plans`` reads, then 1 MiB, as when
    another program took the room (what the out-of-memory killer then takes a llama-server for)."""
    reads = itertools.count()
    return lambda: cpu_machine(64 * GIB if next(reads) < plans else 1 << 20)


def _answer_once_killed(children: FakeChildren) -> Answer:
    """An answer whose llama-server is killed as the request reaches it, the first time; later ones answer."""
    attempts = []

    async def answer(loaded: LoadedModel, lease: Lease) -> Response:
        attempts.append(loaded)
        if len(attempts) == 1:
            assert children.supervisors[-1].crash()
            raise UpstreamDiedError(f"llama-server died before it answered: {await lease.died(within=10)}")
        await lease()
        return Response(b"answered")

    return answer


def test_retries_spent_are_told_by_the_errors_code_not_only_by_its_message(tmp_path, real, zoo_dir):
    """Regression: a request sent again until its retries ran out was told so only in its message (the soak
    matched "times under this request"): a ``RetriesSpentError`` now, ``retries_spent`` in the answer's code."""
    model = ZOO[0]

    async def killed(loaded: LoadedModel, lease: Lease) -> Response:  # every time the request reaches it
        assert children.supervisors[-1].crash()
        raise UpstreamDiedError(f"llama-server died before it answered: {await lease.died(within=10)}")

    async def run() -> RetriesSpentError:
        try:
            with pytest.raises(RetriesSpentError) as spent:
                await answer_surviving(manager, model, killed)
            return spent.value
        finally:
            await manager.aclose()

    with fake_children() as children:
        manager = fake_manager(tmp_path, children, real, {model: zoo_dir / f"{model}.gguf"})
        spent = asyncio.run(run())
    assert spent.tries == RETRIES + 1 and isinstance(spent.__cause__, UpstreamDiedError)
    answer = describe(spent)
    assert (answer.status, answer.type, answer.code) == (502, "upstream_error", "retries_spent"), answer
    # the message still says what happened, to a person
    assert "llama-server died before it answered" in answer.message, answer.message
    assert f"it died {RETRIES + 1} times under this request" in answer.message, answer.message


def test_a_restart_into_memory_another_program_took_answers_503_naming_it(tmp_path, real, zoo_dir):
    """The resident restarted a crashed model with its old plan, into memory another program had taken (a
    restart loop the out-of-memory killer ends each time): it is planned again first, and refused."""
    model = ZOO[0]

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(
                tmp_path, children, real, {model: zoo_dir / f"{model}.gguf"}, discover=_taken_after(1)
            )
            try:
                with pytest.raises(BusyError) as refused:
                    await answer_surviving(manager, model, _answer_once_killed(children))
                assert children.starts == {f"{model}.gguf": 1}  # never restarted into the same death
                assert describe(refused.value) is not None
                answer = describe(refused.value)
                assert answer.status == 503 and answer.headers and "Retry-After" in answer.headers, answer
                message = str(refused.value)
                assert f"not enough memory to restart {model} now: it needs" in message, message
                assert "other programs hold the rest of the memory" in message, message
                resident = manager.find(model)
                assert resident is not None and resident.state is ResidentState.FAILED
            finally:
                await manager.aclose()

    asyncio.run(run())


def test_a_load_killed_then_without_room_answers_503_not_400(tmp_path, real, zoo_dir):
    """A load the out-of-memory killer took is loaded again, planned against the memory free now; when the room
    is gone, the request hears it may retry later (503), not that the model can never fit (400)."""
    model = ZOO[0]

    async def run() -> None:
        with fake_children() as children:
            children.killed.add(f"{model}.gguf")
            manager = fake_manager(
                tmp_path, children, real, {model: zoo_dir / f"{model}.gguf"}, discover=_taken_after(1)
            )
            try:
                with pytest.raises(BusyError, match="the memory it held is taken now") as refused:
                    await acquire_surviving(manager, model)
                assert children.starts == {f"{model}.gguf": 1}
                answer = describe(refused.value)
                assert answer is not None and answer.status == 503 and answer.headers, answer
            finally:
                await manager.aclose()

    asyncio.run(run())


def test_a_request_waiting_for_a_restart_that_ran_out_answers_502_not_500(tmp_path, real, zoo_dir):
    """A request that came while the model's last allowed crash was being cleaned up waited for its restart, and got
    a bare StudioError when there was none: a 500 for a child's death."""
    model = ZOO[0]

    async def run() -> None:
        with fake_children() as children:
            manager = fake_manager(tmp_path, children, real, {model: zoo_dir / f"{model}.gguf"})
            try:
                await manager.load(LoadRequest(model=model))
                resident = manager.find(model)
                assert resident is not None
                resident.max_restarts = 0  # this crash is its last
                supervisor = children.supervisors[-1]
                stop = supervisor.stop
                supervisor.stop = lambda: (time.sleep(0.5), stop())[1]  # as long as a real stop's reaping may take
                assert supervisor.crash()
                await resident.wait_until({ResidentState.CRASHED}, timeout=10)
                with pytest.raises(UpstreamError) as gave_up:
                    await manager.acquire(model)
                assert not isinstance(gave_up.value, UpstreamDiedError)  # given up: no request loads it again for it
                answer = describe(gave_up.value)
                assert answer is not None and answer.status == 502 and answer.code == "llama_server_died", answer
                assert "crashed 1 times; not restarting it again" in answer.message, answer.message
                assert "injected crash" in answer.message, answer.message
            finally:
                await manager.aclose()

    asyncio.run(run())


@pytest.fixture(scope="module")
def listening(llama_server_bin, smollm_model, tmp_path_factory) -> Iterator[tuple[str, str, dict[str, str]]]:
    """The studio: its URL, its Ollama listener's, its environment."""
    env = tagged_env()
    with serving(tmp_path_factory.mktemp("crash"), "", "--model", SMOL, "--ctx", "2048", env=env) as (url, ollama):
        yield url, ollama, env


@pytest.fixture
def studio(listening) -> tuple[str, dict[str, str]]:
    return listening[0], listening[2]


def _server(env: dict[str, str]) -> psutil.Process:
    """The llama-server of a model: not one of the placement's short ``--list-devices`` runs, which come first."""

    def serving() -> psutil.Process | None:
        for server in llama_servers(env):
            try:
                if "-m" in server.cmdline():
                    return server
            except psutil.NoSuchProcess:
                continue
        return None

    return wait_for(serving, timeout=60, interval=0.01, what="a model's llama-server")


def _fresh(url: str, env: dict[str, str]) -> psutil.Process:
    """The model loaded anew (its restarts count from zero), and its llama-server."""
    assert httpx.post(f"{url}/api/unload", json={"model": SMOL}, timeout=60).status_code == 200
    assert httpx.post(f"{url}/api/load", json={"model": SMOL, "n_ctx": 2048}, timeout=120).status_code == 200
    return _server(env)


def _ready(url: str) -> dict:
    def ready() -> dict | None:
        status = httpx.get(f"{url}/api/status", timeout=30).json()
        return status if status["state"] == "ready" else None

    return wait_for(ready, timeout=120, interval=0.1, what="the model to be ready")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/chat (the page's)", "/api/chat (Ollama's)"])
def test_a_request_sent_but_unanswered_is_sent_again_when_its_llama_server_is_killed(listening, route):
    url, ollama, env = listening
    server = _fresh(url, env)
    server.suspend()  # the request reaches it and waits: sent, not answered
    asked = {
        "/v1/chat/completions": (f"{url}/v1/chat/completions", QUESTION),
        "/api/chat (the page's)": (f"{url}/api/chat", QUESTION),
        "/api/chat (Ollama's)": (f"{ollama}/api/chat", {"model": SMOL, **QUESTION, "stream": False}),
    }
    target, body = asked[route]
    answers: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answers.append(httpx.post(target, json=body, timeout=120)))
    asking.start()
    time.sleep(1.0)
    server.kill()
    asking.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    assert '"error"' not in answers[0].text and "Paris" in answers[0].text, answers[0].text
    status = _ready(url)
    assert status["restarts"] == 1
    assert "killed by SIGKILL" in status["last_exit"], status["last_exit"]


def test_a_stream_waiting_for_its_first_token_is_sent_again_when_its_llama_server_is_killed(studio):
    url, env = studio
    server = _fresh(url, env)
    server.suspend()
    chunks: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**QUESTION, "stream": True}, timeout=120) as r:
            chunks.extend(line for line in r.iter_lines() if line.startswith("data: "))

    asking = threading.Thread(target=stream)
    asking.start()
    time.sleep(1.5)  # past FIRST_BEAT: its 200 and a keep-alive went out, no answer byte did
    server.kill()
    asking.join(timeout=120)
    assert chunks and chunks[-1] == "data: [DONE]", chunks
    assert not any('"error"' in c for c in chunks), chunks
    text = "".join((json.loads(c[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or "" for c in chunks[:-1])
    assert text, chunks


def _last_request(url: str) -> dict:
    """The activity record of the last request the studio answered."""
    return wait_for(
        lambda: (
            (found := httpx.get(f"{url}/api/activity", params={"kind": "request"}, timeout=30).json()["records"])
            and found[0]
        ),
        timeout=60,
        what="the request's record",
    )


def _bytes_sent(port: int) -> dict[str, int]:
    """The bytes each established TCP connection of the listener on ``port`` has sent, by its peer (``ss``'s
    ``bytes_sent``, from the kernel's ``tcp_info``): what a server wrote on each, without a byte of it read here."""
    shown = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    sent = {}
    for head, info in zip(shown[::2], shown[1::2], strict=True):
        found = re.search(r"\bbytes_sent:(\d+)", info)
        sent[head.split()[-1]] = int(found.group(1)) if found else 0
    return sent


#: Bytes of b11434's head of a stream (~185) and less than its first chunk (~600 more).
HEAD_AT_MOST = 400


def _head_sent(server: psutil.Process, port: int, before: dict[str, int]) -> int:
    """Wait until ``server`` (listening on ``port``) has sent a stream's head on a connection since ``before``, then
    stop it there (SIGSTOP); return the bytes it sent on it.

    A connection it answered on that closes soon after (the slot cache's warm-up, before the stream is asked) is
    not the stream's: the server goes on until the one it sent on is still open while it is stopped.
    """

    def grown() -> list[int]:
        return [n - before.get(peer, 0) for peer, n in _bytes_sent(port).items() if n > before.get(peer, 0)]

    while True:
        wait_for(grown, timeout=60, interval=0.005, what="llama-server to send its head")
        server.suspend()
        time.sleep(0.3)  # the studio closes a connection it is done with meanwhile
        heads = [n for n in grown() if n <= HEAD_AT_MOST]
        if heads:
            return heads[0]
        server.resume()


def _long_question() -> list[dict[str, str]]:
    """A prompt of hundreds of tokens (seconds of reading it, between a stream's head and its first token), of
    words no saved slot begins with (a restored one would spare the reading)."""
    words = " ".join(f"{secrets.token_hex(3)}{i}" for i in range(200))
    return [{"role": "user", "content": f"Say the first of these words: {words}"}]


def _openai_stream(url: str) -> str:
    """The text of a chat stream asked with the official client; raises what it raises."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = client.chat.completions.create(model=SMOL, messages=_long_question(), max_tokens=8, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _page_stream(url: str) -> str:
    """The typed events of the page's own ``/api/chat`` (a stream), checked for an error event."""
    events = httpx.post(f"{url}/api/chat", json={"messages": _long_question(), "max_tokens": 8}, timeout=300)
    assert events.status_code == 200 and '"error"' not in events.text, events.text
    return events.text if re.search(r'"type": ?"content"', events.text) else ""


@pytest.mark.parametrize("ask", [_openai_stream, _page_stream], ids=["openai client", "the page's /api/chat"])
def test_a_stream_killed_before_its_first_token_is_sent_again(studio, ask):
    """b11434 sends a stream's head as it starts reading the prompt, its first bytes after it: the relay took the
    stream over at the head, so a llama-server killed while it read the prompt ended the stream with an error
    event (a 502 chunk), though not a byte of the answer had reached the client."""
    url, env = studio
    server = _fresh(url, env)
    port = int(server.cmdline()[server.cmdline().index("--port") + 1])
    assert httpx.delete(f"{url}/api/activity", timeout=30).status_code == 200
    before = _bytes_sent(port)
    answer: list[str] = []
    failed: list[BaseException] = []

    def stream() -> None:
        try:
            answer.append(ask(url))
        except BaseException as exc:  # the assertions below say what it was
            failed.append(exc)

    asking = threading.Thread(target=stream)
    asking.start()
    wrote = _head_sent(server, port, before)
    assert 0 < wrote <= HEAD_AT_MOST, wrote  # its head alone, read by the studio while the server was stopped
    server.kill()
    asking.join(timeout=300)
    assert not failed, failed
    assert answer and answer[0], answer
    status = _ready(url)
    assert status["restarts"] == 1 and "killed by SIGKILL" in status["last_exit"], status
    record = _last_request(url)
    # not an error; the client closes at "[DONE]", maybe before the body's end, which reads as it leaving
    assert record["retries"] == 1 and record["outcome"] != "error", record
    assert "killed by SIGKILL" in record["retried_after"][0], record["retried_after"]


def test_a_stream_killed_mid_answer_ends_with_the_dialects_error_naming_the_signal(studio):
    url, env = studio
    server = _fresh(url, env)
    body = {**QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            lines.append(line)
            if sum(x.startswith("data: {") for x in lines) == 2:
                os.kill(server.pid, signal.SIGKILL)
    errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {") and '"error"' in x]
    assert errors, lines[-3:]
    assert "killed by SIGKILL" in errors[-1]["error"]["message"], errors[-1]
    _ready(url)  # and it is restarted for the next one
    shown = cli("ps", "--url", url, env=env)
    assert f"{SMOL}: restarted 1x; last: llama-server exited unexpectedly with code -9: it was killed by SIGKILL" in (
        shown.stdout
    )


def test_a_request_waiting_for_a_load_that_is_killed_gets_its_answer_from_the_next(studio):
    url, env = studio
    _ready(url)
    assert httpx.post(f"{url}/api/unload", json={"model": SMOL}, timeout=60).status_code == 200
    wait_for(lambda: not llama_servers(env), timeout=30, what="the model to unload")
    answers: list[httpx.Response] = []
    asking = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{url}/v1/chat/completions", json={**QUESTION, "model": SMOL}, timeout=120)
        )
    )
    asking.start()
    _server(env).kill()  # at once: it has not loaded the weights yet
    asking.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    record = _last_request(url)  # the load killed under it is on its record, as a death once sent is
    assert record["retries"] == 1 and "SIGKILL" in record["retried_after"][0], record


def test_a_model_that_dies_on_every_start_gets_the_cause_not_a_wait_for_ever(studio):
    url, env = studio
    _ready(url)
    assert httpx.post(f"{url}/api/unload", json={"model": SMOL}, timeout=60).status_code == 200
    stop = threading.Event()
    started: dict[int, str] = {}

    def killer() -> None:  # every llama-server of this studio dies as it starts
        while not stop.is_set():
            for p in llama_servers(env):
                try:
                    started[p.pid] = " ".join(p.cmdline())
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.01)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        answer = httpx.post(f"{url}/v1/chat/completions", json={**QUESTION, "model": SMOL}, timeout=120)
    finally:
        stop.set()
        thread.join()
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert "killed by SIGKILL" in error["message"] and error["code"] == "retries_spent", error
    assert answer.headers["x-error-code"] == "retries_spent"  # as the Anthropic and Ollama shapes' answers say it
    assert "exited with code" not in error["message"]  # not whatever log line came last
    loads = [argv for argv in started.values() if " -m " in argv]  # not the placement's `--list-devices` runs
    assert 1 <= len(loads) <= RETRIES + 1, loads  # one budget of retries for the request, not one per load
    retried = httpx.post(f"{url}/v1/chat/completions", json={**QUESTION, "model": SMOL}, timeout=120)
    assert retried.status_code == 200  # nothing is left broken
