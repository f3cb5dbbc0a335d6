#!/usr/bin/env python3
"""How fast the CLI starts: median wall and CPU time of commands that do no work, and (``--first-token``) how
soon a model's first answer comes.

Targets (issue 33): ``--help`` <= 120 ms, ``serve --help`` and ``plan --help`` <= 250 ms.

Measured next to a bare ``python -c pass`` in the same run, the floor any CLI
written in Python pays (the studio's editable install adds its import hook to
every interpreter of the venv, that floor included). On a loaded machine the
wall time swings with the load; the CPU time (user + sys of the child) is
steadier, its least over the runs (the run the load disturbed least) steadier
still, and its ratio to the floor's says what the CLI itself costs.

    .venv/bin/python scripts/bench_cli.py [--runs 21]

With ``--first-token`` (issue 55's target: ``serve --model M`` and ``run M --once`` within 1.2x of llama-server
started by hand on the same model), the wall time from launch to the first streamed token of one fixed chat
request, median of ``--runs`` (default 5), for: the pinned llama-server started by hand with the argv the studio
gives it (polling its ``/health``, then asking); ``ggstudio serve --model M`` (asking as soon as its port
answers: the request waits for the load); and ``ggstudio run M --once`` (its first byte on stdout). Each launch
gets a fresh studio home that borrows the real home's llama.cpp build and models. ``--base PATH`` also times the
studio from another checkout (``git worktree add``), in the same run: on a shared machine compare only figures
of one run, beside the load average it prints.

    .venv/bin/python scripts/bench_cli.py --first-token [--runs 5] [--model M] [--base /tmp/base-checkout]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

COMMANDS = (["--help"], ["--version"], ["serve", "--help"], ["plan", "--help"])


CLI = str(Path(sys.executable).parent / "ggstudio")

#: As an installed CLI runs: with its bytecode cached (with PYTHONDONTWRITEBYTECODE a checkout compiles every start).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def measure(argv: list[str], runs: int) -> tuple[float, float, float]:
    """Median wall, median CPU and least CPU seconds of ``runs`` runs of ``argv``, after one that warms the caches.

    The caches: the OS's file cache, and the studio's ``--help`` text, as a second ``ggstudio --help`` finds it.
    """
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=ENV)
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=ENV)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus), min(cpus)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="runs per command (default 21; 5 with --first-token)")
    parser.add_argument("--first-token", action="store_true", help="time a model's first answer instead")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct.Q4_1", help="with --first-token: the model")
    parser.add_argument("--base", type=Path, help="with --first-token: also time the studio of this checkout")
    args = parser.parse_args()
    if args.first_token:
        return first_token(args.model, args.runs or 5, args.base)
    args.runs = args.runs or 21
    cli = CLI
    floor_wall, floor_cpu, floor_least = measure([sys.executable, "-c", "pass"], args.runs)
    print(f"medians of {args.runs} runs (CPU least: the best run), load {os.getloadavg()[0]:.1f}")
    print(f"{'command':24} {'wall ms':>8} {'CPU ms':>8} {'CPU least':>10} {'x floor':>8}")
    print(
        f"{'python -c pass':24} {floor_wall * 1000:8.1f} {floor_cpu * 1000:8.1f} {floor_least * 1000:10.1f} {1:7.2f}x"
    )
    for argv in COMMANDS:
        wall, cpu, least = measure([cli, *argv], args.runs)
        print(
            f"{' '.join(['ggstudio', *argv]):24} {wall * 1000:8.1f} {cpu * 1000:8.1f} {least * 1000:10.1f} "
            f"{least / floor_least:7.2f}x"
        )
    return 0


# -- first token ---------------------------------------------------------------------------------------------

#: The real home's folders a bench home links to: the pinned build, the models, and the capability cache.
BORROWED = ("llama.cpp", "models", "zoo", "cache")
PROMPT = "What is the capital of France?"
#: Seconds one launch may take to its first token before the bench gives up on it.
LIMIT = 120.0


def real_home() -> Path:
    return Path(os.environ.get("GGUF_STUDIO_HOME") or Path.home() / ".gguf-studio")


@contextmanager
def bench_home() -> Iterator[Path]:
    """A fresh studio home with the real one's build and models linked in, removed after."""
    home = Path(tempfile.mkdtemp(prefix="ggstudio-bench-home-"))
    try:
        for name in BORROWED:
            (home / name).symlink_to(real_home() / name, target_is_directory=True)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)  # unlinks the links; never follows them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_body(model: str) -> bytes:
    """The fixed request: streamed, greedy, a few tokens."""
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": 8, "temperature": 0}
    return json.dumps(body).encode()


def first_token_after(port: int, body: bytes, headers: dict[str, str]) -> bool:
    """Send the chat request and read until its first chunk with text; False when the server is not ready (503)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=LIMIT)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        if response.status == 503:
            return False
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        while line := response.readline():
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    return True
        raise RuntimeError("the stream ended with no text")
    finally:
        conn.close()


def answers(port: int, path: str = "/health") -> bool:
    """Whether ``port`` answers ``path`` with a 200 (False while it does not listen, or loads)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=LIMIT)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def poll(until: Callable[[], bool], proc: subprocess.Popen[bytes], t0: float, interval: float = 0.005) -> None:
    while not until():
        if proc.poll() is not None:
            said = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before its first token: {said}")
        if time.perf_counter() - t0 > LIMIT:
            raise RuntimeError(f"{proc.args!r}: no first token after {LIMIT:.0f} s")
        time.sleep(interval)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) so far of process ``pid`` itself, and of its llama-server children."""
    import psutil

    me = psutil.Process(pid)
    own = sum(me.cpu_times()[:2])
    children = sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True) if c.name() == "llama-server")
    return own, children


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a launch as Ctrl-C would, and wait for it (its llama-server with it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def env_for(home: Path, checkout: Path | None) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if not k.startswith("GGUF_STUDIO_")}
    env.update(GGUF_STUDIO_HOME=str(home), NO_COLOR="1")
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    return env


def studio_argv(model: str, keep: Path) -> list[str]:
    """The argv the studio gives llama-server for ``model``, from a real load (a warm-up ``serve``), with its
    launch files (template, key) copied to ``keep``, where they outlive it; ``{port}`` marks the port."""
    import psutil

    with bench_home() as home:
        port = free_port()
        proc = subprocess.Popen(
            [CLI, "serve", "--model", model, "--port", str(port)],
            env=env_for(home, Path(__file__).resolve().parent.parent),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            t0 = time.perf_counter()
            poll(lambda: first_token_after(port, chat_body(model), {}) if listens(port) else False, proc, t0, 0.05)
            child = next(c for c in psutil.Process(proc.pid).children() if c.name() == "llama-server")
            argv = child.cmdline()
            for i, arg in enumerate(argv):  # the template: removed with the launch's folder when the studio stops
                if i and argv[i - 1] == "--chat-template-file":
                    shutil.copy(arg, keep / Path(arg).name)
        finally:
            stop(proc)
    out = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--port":
            arg = "{port}"
        elif i and argv[i - 1] in ("--chat-template-file", "--api-key-file"):
            arg = str(keep / Path(arg).name)
        elif i and argv[i - 1] == "--slot-save-path":
            arg = str(keep / "slots")
        arg = arg.replace(str(home), str(real_home()))  # the borrowed build and models, by their real paths
        out.append(arg)
    (keep / "slots").mkdir()
    (keep / "api-key").write_text("bench-key")
    return out


def by_hand(argv: list[str], model: str) -> tuple[float, float]:
    """Seconds from starting llama-server to its first streamed token (polling ``/health`` every 5 ms first), and
    the CPU seconds it used."""
    port = free_port()
    key = {"Authorization": "Bearer bench-key"} if "--api-key-file" in argv else {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [a.replace("{port}", str(port)) for a in argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        poll(lambda: answers(port), proc, t0)
        poll(lambda: first_token_after(port, chat_body(model), key), proc, t0)
        return time.perf_counter() - t0, cpu_seconds(proc.pid)[0]
    finally:
        proc.terminate()
        proc.wait()


def studio_serve(model: str, checkout: Path | None) -> tuple[float, float, tuple[float, float]]:
    """Seconds from launching ``ggstudio serve --model`` to its port answering, and to its first streamed token
    (the request is sent as soon as the port answers, and waits for the load); the CPU seconds of the studio and
    of its llama-server by then."""
    with bench_home() as home:
        port = free_port()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [CLI, "serve", "--model", model, "--port", str(port)],
            env=env_for(home, checkout),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            poll(lambda: listens(port), proc, t0)
            listening = time.perf_counter() - t0
            poll(lambda: first_token_after(port, chat_body(model), {}), proc, t0)
            return listening, time.perf_counter() - t0, cpu_seconds(proc.pid)
        finally:
            stop(proc)


def studio_run(model: str, checkout: Path | None) -> float:
    """Seconds from launching ``ggstudio run --once`` (no studio running) to the first byte of its answer."""
    with bench_home() as home:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [CLI, "run", model, "--once", PROMPT, "--max-tokens", "8"],
            env=env_for(home, checkout),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert proc.stdout is not None
            if not proc.stdout.read(1):
                raise RuntimeError(f"run --once printed nothing (exit {proc.wait()})")
            return time.perf_counter() - t0
        finally:
            stop(proc)


def first_token(model: str, runs: int, base: Path | None) -> int:
    """Print the medians of each way to a first token, interleaved run by run so the load falls on each alike.

    Beside the wall times, the CPU seconds spent by the first token: on a machine with few cores the studio's
    own start-up (the interpreter, its imports) and llama-server's load share them, and their sum over the
    cores is a floor under the wall time that no overlap removes.
    """
    with tempfile.TemporaryDirectory(prefix="ggstudio-bench-argv-") as keep:
        argv = studio_argv(model, Path(keep))
        print("by hand:", " ".join(argv).replace(str(real_home()), "~home"))
        rows, cpus, loads = first_tokens(model, argv, runs, base)
    hand = statistics.median(rows["llama-server by hand"])
    print(f"{model}, medians of {runs} runs, load average {min(loads):.1f}..{max(loads):.1f} ({os.cpu_count()} cores)")
    print(f"{'launch ->':34} {'median s':>9} {'min s':>7} {'x by hand':>10} {'CPU studio':>11} {'CPU llama':>10}")
    for label, times in rows.items():
        median = statistics.median(times)
        used = cpus.get(label)
        cpu = (
            f" {statistics.median(u[0] for u in used):10.3f}s {statistics.median(u[1] for u in used):9.3f}s"
            if used
            else ""
        )
        print(f"{label:34} {median:9.3f} {min(times):7.3f} {median / hand:9.2f}x{cpu}")
    target = statistics.median(rows["studio: serve first token"]) / hand
    busy = max(loads) >= (os.cpu_count() or 1)  # others' work then slows llama-server by hand too, and the ratio lies
    verdict = "not judged: the machine was busy, rerun it when the load average is under the cores" if busy else None
    verdict = verdict or ("met" if target <= 1.2 else "MISSED")
    print(f"target serve first token <= 1.2x by hand: {target:.2f}x, {verdict}")
    return 0


def first_tokens(
    model: str, argv: list[str], runs: int, base: Path | None
) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, float]]], list[float]]:
    """Each way's wall times, CPU seconds (studio, llama-server) where measured, and the load average per run."""
    rows: dict[str, list[float]] = {}
    cpus: dict[str, list[tuple[float, float]]] = {}
    loads = []
    mine = Path(__file__).resolve().parent.parent
    checkouts = [("studio", mine)] + ([("base", base.resolve())] if base is not None else [])
    for _ in range(runs):
        loads.append(os.getloadavg()[0])
        wall, cpu = by_hand(argv, model)
        rows.setdefault("llama-server by hand", []).append(wall)
        cpus.setdefault("llama-server by hand", []).append((0.0, cpu))
        for label, checkout in checkouts:
            listening, token, used = studio_serve(model, checkout)
            rows.setdefault(f"{label}: serve listens", []).append(listening)
            rows.setdefault(f"{label}: serve first token", []).append(token)
            cpus.setdefault(f"{label}: serve first token", []).append(used)
            rows.setdefault(f"{label}: run --once first byte", []).append(studio_run(model, checkout))
    return rows, cpus, loads


if __name__ == "__main__":
    raise SystemExit(main())
