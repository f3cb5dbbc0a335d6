#!/usr/bin/env python3
"""A soak of a real ``ggstudio serve``: mixed traffic in every dialect while its llama-servers are killed.

Two models, ``max_resident = 1`` (every switch is an eviction), clients asking OpenAI chats and streams,
Anthropic messages, llama-server's native ``/completion``, Ollama chats (on the Ollama port), streams the
client drops after two chunks, and status polls; every ``--fault-every`` seconds a fault: ``kill -9`` of a
running llama-server (what the kernel's out-of-memory killer does on a desktop) at whatever moment it is in
(loading, a request queued or sent, mid-stream), or an unload. Loopback only, bounded in time and count.

It prints what the clients got: answered, cut mid-answer (a stream that had bytes, ended with its dialect's
error event: allowed), refused as busy (an eviction waited out ``busy_wait``: not a crash's doing), cut by an
unload, given up after repeated deaths (sent again after each until its retries ran out: the issue's exception
for a model that keeps dying), and **lost**: any other error for a request that had received nothing, by kind;
then how many requests the
studio sent again (its log), its RSS, descriptors and threads after the warm-up and at the end, and the
llama-servers left after SIGTERM.

    .venv/bin/python scripts/soak.py [--minutes 4] [--fault-every 20] [--clients 6]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's tests/, as bench_proxy uses them
from tests.helpers import stop_studio  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "ggstudio")
MODELS = ("SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-Q4_K_M")
HI = [{"role": "user", "content": "Say hello in one short sentence."}]


def studio_home(real: Path) -> Path:
    """A home of its own borrowing the real one's build and models (nothing of the real studio's state)."""
    home = Path(tempfile.mkdtemp(prefix="ggstudio-soak-"))
    for name in ("llama.cpp", "models", "cache"):
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    (home / "config.toml").write_text(
        "max_resident = 1\nbusy_wait = 30\n" + "".join(f'[models."{m}"]\nn_ctx = 2048\n' for m in MODELS)
    )
    return home


class Tally:
    """Outcomes by kind, counted from several client threads."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.lock = threading.Lock()

    def add(self, outcome: str, example: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if example and outcome not in self.examples:
                self.examples[outcome] = example[:300]


#: The error code of a request sent again after each death until its retries ran out (``RetriesSpentError``).
RETRIES_SPENT = "retries_spent"


def error_code(text: str, headers: httpx.Headers | None = None) -> str | None:
    """The studio's code of an error answer: its ``X-Error-Code`` header (every dialect's answer has it; the
    Anthropic and Ollama shapes have no field for it), else the OpenAI shape's ``code`` (a stream's error event)."""
    if headers is not None and (code := headers.get("x-error-code")):
        return code
    try:
        error = json.loads(text.removeprefix("data: ")).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def classify_error(status: int | None, text: str, route: str, headers: httpx.Headers | None = None) -> str:
    """What an error answer to a request that had received nothing means (``status`` None: a stream's error event,
    told by its type)."""
    if "unloaded" in text:
        return "cut by an unload"
    if error_code(text, headers) == RETRIES_SPENT:  # sent again after each death until its retries ran out
        return "given up after repeated deaths"
    if status == 503 or "server_busy" in text:
        return "refused as busy"
    return f"lost ({route}, {status or 'error event'})"


def ask(client: httpx.Client, url: str, ollama: str, tally: Tally, rng: random.Random) -> None:
    """One request of a random kind to a random model."""
    model = rng.choice(MODELS)
    kind = rng.choice(("chat", "stream", "messages", "native", "ollama", "dropped", "status"))
    if kind == "status":
        tally.add("answered" if client.get(f"{url}/api/status").status_code == 200 else "lost (status)")
        return
    routes = {
        "chat": (f"{url}/v1/chat/completions", {"model": model, "messages": HI, "max_tokens": 24}),
        "stream": (f"{url}/v1/chat/completions", {"model": model, "messages": HI, "max_tokens": 48, "stream": True}),
        "dropped": (f"{url}/v1/chat/completions", {"model": model, "messages": HI, "max_tokens": 64, "stream": True}),
        "messages": (f"{url}/v1/messages", {"model": model, "messages": HI, "max_tokens": 24}),
        "native": (f"{url}/completion", {"model": model, "prompt": "The sky is", "n_predict": 16}),
        "ollama": (
            f"{ollama}/api/chat",
            {"model": model, "messages": HI, "stream": False, "options": {"num_predict": 16}},
        ),
    }
    target, body = routes[kind]
    if not body.get("stream"):
        resp = client.post(target, json=body)
        if resp.status_code == 200:
            tally.add("answered")
        else:
            tally.add(classify_error(resp.status_code, resp.text, kind, resp.headers), resp.text)
        return
    got_answer = False
    with client.stream("POST", target, json=body) as resp:
        if resp.status_code != 200:
            tally.add(classify_error(resp.status_code, resp.read().decode(errors="replace"), kind, resp.headers))
            return
        chunks = 0
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            if '"error"' in line:
                outcome = (
                    "cut mid-answer"
                    if got_answer
                    else classify_error(int(json.loads(line[6:]).get("status", 502) or 502), line, kind)
                )
                tally.add(outcome, line)
                return
            got_answer = got_answer or '"content":"' in line.replace(" ", "")
            chunks += 1
            if kind == "dropped" and chunks == 2:
                tally.add("dropped by its client")
                return
    tally.add("answered")


def client_loop(url: str, ollama: str, deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=httpx.Timeout(180, connect=10)) as client:
        while time.monotonic() < deadline:
            try:
                ask(client, url, ollama, tally, rng)
            except httpx.HTTPError as exc:
                tally.add(f"lost (no answer: {type(exc).__name__})", str(exc))


def faults(serve: psutil.Process, url: str, deadline: float, every: float, log: list[str], rng: random.Random) -> None:
    while (left := deadline - time.monotonic()) > every / 2:
        time.sleep(min(left, every * rng.uniform(0.7, 1.3)))
        children = [p for p in serve.children(recursive=True) if p.name() == "llama-server"]
        if children and rng.random() < 0.7:
            victim = rng.choice(children)
            try:
                victim.kill()
                log.append(f"{time.strftime('%H:%M:%S')} kill -9 {victim.pid}")
            except psutil.NoSuchProcess:
                pass
        else:
            httpx.post(f"{url}/api/unload", json={}, timeout=120)
            log.append(f"{time.strftime('%H:%M:%S')} unload all")


def footprint(proc: psutil.Process) -> tuple[float, int, int]:
    return proc.memory_info().rss / 2**20, proc.num_fds(), proc.num_threads()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults, about")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--warm-up", type=float, default=30.0, help="seconds before the first footprint")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from studio.settings import Settings

    home = studio_home(Settings.from_env().home)
    port, ollama_port = _free_port(), _free_port()
    url, ollama = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ollama_port}"
    env = {**os.environ, "GGUF_STUDIO_HOME": str(home), "GGUF_STUDIO_OLLAMA_PORT": str(ollama_port)}
    err = (home / "serve.err").open("w")
    serve = subprocess.Popen(
        [CLI, "serve", "--port", str(port)], stdout=subprocess.PIPE, stderr=err, text=True, env=env
    )
    proc = psutil.Process(serve.pid)
    try:
        assert serve.stdout is not None and url in serve.stdout.readline(), (home / "serve.err").read_text()
        began = time.monotonic()
        deadline = began + args.minutes * 60
        tally, fault_log = Tally(), []
        threads = [
            threading.Thread(target=client_loop, args=(url, ollama, deadline, tally, args.seed + i), daemon=True)
            for i in range(args.clients)
        ]
        threads.append(
            threading.Thread(
                target=faults,
                args=(proc, url, deadline, args.fault_every, fault_log, random.Random(args.seed)),
                daemon=True,
            )
        )
        for t in threads:
            t.start()
        time.sleep(min(args.warm_up, args.minutes * 30))
        warm = footprint(proc)
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + 240)
        end = footprint(proc)
    finally:
        stop_studio(serve, signal.SIGTERM)
        err.close()
    left = [
        p
        for p in psutil.process_iter(["name", "environ"])
        if p.info["name"] == "llama-server" and (p.info["environ"] or {}).get("GGUF_STUDIO_HOME") == str(home)
    ]
    log_text = (home / "serve.err").read_text()
    retried = log_text.count("sending a request again") + log_text.count("loading again")
    lost = {k: v for k, v in tally.counts.items() if k.startswith("lost")}
    kills, unloads = sum("kill" in f for f in fault_log), sum("unload" in f for f in fault_log)
    print(
        f"soak: {args.minutes:g} min, {args.clients} clients, a fault every ~{args.fault_every:g} s, "
        f"models {', '.join(MODELS)}, max_resident 1"
    )
    print(f"faults: {len(fault_log)} ({kills} kill -9, {unloads} unloads)")
    for outcome, count in sorted(tally.counts.items(), key=lambda kv: -kv[1]):
        print(f"  {outcome:<40} {count}")
    print(f"lost: {sum(lost.values())}; sent again by the studio: {retried}")
    for outcome, example in tally.examples.items():
        if outcome.startswith("lost"):
            print(f"  e.g. {outcome}: {example}")
    print(
        f"studio after the warm-up: RSS {warm[0]:.1f} MiB, {warm[1]} descriptors, {warm[2]} threads; at the end: "
        f"RSS {end[0]:.1f} MiB ({end[0] - warm[0]:+.1f}), {end[1]} descriptors ({end[1] - warm[1]:+d}), "
        f"{end[2]} threads ({end[2] - warm[2]:+d})"
    )
    print(f"llama-servers left after SIGTERM: {len(left)}; exit status {serve.returncode}")
    if lost or left:  # the studio's own account of what went wrong outlives its home
        kept = Path(tempfile.gettempdir()) / f"ggstudio-soak-{serve.pid}.err"
        shutil.copy(home / "serve.err", kept)
        print(f"the studio's log: {kept}")
    shutil.rmtree(home, ignore_errors=True)
    return 0 if not lost and not left else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
