#!/usr/bin/env python3
"""Several clients at once: aggregate tokens/s and time to first token through the studio, against llama-server's
own defaults.

Starts ``ggstudio serve`` on SmolLM2-135M (a studio home of its own, the pinned llama-server) with the studio's
default slots (the planner's: 1 on the CPU, 4 on a unified KV cache on GPUs), and beside it llama-server started by
hand with the same model and context and its own defaults (``-np -1``: 4 slots on a unified cache). At 1, 4 and 8
clients, each client streams ``--tokens`` tokens a request (end of sequence ignored) from ``/v1/chat/completions``,
one request per round; the two servers take turns round by round (the first round of each count is a warm-up, not
counted), so other load on the machine hits both alike. Per count it prints the aggregate tokens/s (every token
over the rounds' wall time), the p50 and p90 time to first token, and the studio's tokens/s over llama-server's.

Target (issue 59) on a CPU machine: the studio's default >= 0.95x llama-server's own at 8 clients.

    .venv/bin/python scripts/bench_concurrency.py [--rounds 3] [--tokens 32] [--ctx 8192] [--clients 1,4,8]

``measure`` (one count of clients against one server) is what ``scripts/gpu_check.py`` runs on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The issue's target: the studio's default against llama-server's own at the largest count of clients.
TARGET = 0.95
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle. Once upon a time,"
START_TIMEOUT_S = 180
#: Time for one request: a loaded 2-core machine may take several seconds for the prompt of 8 clients at once.
REQUEST_TIMEOUT_S = 300


@dataclass(frozen=True)
class Target:
    """A server to stream from: its OpenAI base URL, auth headers, and the model name it answers to."""

    name: str
    url: str
    headers: dict[str, str]
    model: str


@dataclass
class Tally:
    """What the counted rounds of one count of clients gave one server."""

    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        """The ``q`` quantile of the times to first token (nearest rank), in seconds."""
        values = sorted(self.ttft)
        return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))] if values else float("nan")


def stream_once(client: httpx.Client, target: Target, n: int, tokens: int) -> tuple[float, int]:
    """One streamed chat completion of ``tokens`` tokens: (seconds to the first content, tokens generated)."""
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": f"Story {n}. {PROMPT}"}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first: float | None = None
    usage = deltas = 0
    with client.stream("POST", f"{target.url}/v1/chat/completions", json=body, headers=target.headers) as response:
        if response.status_code != 200:
            raise SystemExit(f"{target.name}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens", 0)
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    deltas += 1
                    if first is None:
                        first = time.perf_counter() - t0
    if first is None:
        raise SystemExit(f"{target.name}: a stream without content")
    return first, usage or deltas


def measure(target: Target, clients: int, rounds: int, tokens: int, tally: Tally | None = None) -> Tally:
    """``rounds`` rounds of ``clients`` concurrent streams against ``target``, added to ``tally``."""
    tally = tally or Tally()
    for _ in range(rounds):
        results: list[tuple[float, int] | BaseException] = []

        def one(n: int) -> None:
            try:
                with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
                    results.append(stream_once(client, target, n, tokens))
            except BaseException as exc:  # noqa: BLE001 -- re-raised below, in the caller's thread
                results.append(exc)

        threads = [threading.Thread(target=one, args=(n,)) for n in range(clients)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tally.seconds += time.perf_counter() - started
        for r in results:
            if isinstance(r, BaseException):
                raise r
            tally.ttft.append(r[0])
            tally.tokens += r[1]
    return tally


def compare(
    targets: Sequence[Target], counts: Sequence[int], rounds: int, tokens: int, say: Callable[[str], None] = print
) -> dict[int, dict[str, Tally]]:
    """Every count of clients against every target, the targets taking turns round by round after a warm-up."""
    out: dict[int, dict[str, Tally]] = {}
    for clients in counts:
        tallies = {t.name: Tally() for t in targets}
        for t in targets:
            measure(t, clients, 1, tokens)  # warm-up: connections, the first prompt, a model still loading
        for r in range(rounds):
            for t in targets if r % 2 == 0 else reversed(targets):
                measure(t, clients, 1, tokens, tallies[t.name])
        out[clients] = tallies
        say(f"{clients} client(s): " + ", ".join(f"{n} {t.tokens_per_s:.1f} tok/s" for n, t in tallies.items()))
    return out


def table(results: dict[int, dict[str, Tally]], baseline: str) -> str:
    """The Markdown table: per count and server, aggregate tokens/s, TTFT p50/p90, and tokens/s over ``baseline``'s."""
    lines = [
        "| clients | server | aggregate tok/s | TTFT p50 (ms) | TTFT p90 (ms) | x llama-server's own |",
        "|---|---|---|---|---|---|",
    ]
    for clients, tallies in results.items():
        base = tallies[baseline].tokens_per_s or float("nan")
        for name, t in tallies.items():
            lines.append(
                f"| {clients} | {name} | {t.tokens_per_s:.1f} | {t.percentile(0.5) * 1000:.0f} | "
                f"{t.percentile(0.9) * 1000:.0f} | {'' if name == baseline else f'{t.tokens_per_s / base:.2f}x'} |"
            )
    return "\n".join(lines)


# -- the servers --------------------------------------------------------------------------------------------------
def wait_ready(url: str, headers: dict[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become ready in {timeout:.0f} s")


@contextmanager
def llama_server_defaults(binary: Path, model: Path, ctx: int, logs: Path) -> Iterator[Target]:
    """llama-server as a person starts it: the model, the context, its own defaults (``-np -1``)."""
    from launcher.process import free_port

    port = free_port()
    argv = [str(binary), "-m", str(model), "-c", str(ctx), "-np", "-1", "--host", "127.0.0.1", "--port", str(port)]
    with (logs / "llama-server.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, {}, START_TIMEOUT_S)
        yield Target("llama-server -np -1", url, {}, model.stem)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@contextmanager
def studio(binary: Path, model: Path, ctx: int, home: Path, slots: int | None = None) -> Iterator[Target]:
    """``ggstudio serve`` on ``model`` in its own home, with its default slots or ``slots`` (the model's
    ``n_parallel`` in the home's config); stopped with Ctrl-C after."""
    if slots is not None:
        (home / "config.toml").write_text(f'[models."{model.stem}"]\nn_parallel = {slots}\n')
    env = {
        **os.environ,
        "GGUF_STUDIO_HOME": str(home),
        "LLAMA_SERVER_PATH": str(binary),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    cli = Path(sys.executable).parent / "ggstudio"
    argv = [str(cli), "serve", "--port", "0", "--ready-json", "--model", str(model), "--ctx", str(ctx)]
    with (home / "studio.err").open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"ggstudio serve exited without a ready line; see {home / 'studio.err'}")
        ready = json.loads(line)
        headers = {"Authorization": f"Bearer {ready['token']}"} if ready.get("token") else {}
        # a model given by path is served under its file name; the warm-up round waits out its start-up load
        name = "studio (default slots)" if slots is None else f"studio (n_parallel {slots})"
        yield Target(name, ready["url"], headers, model.stem)
    finally:
        proc.send_signal(2)  # SIGINT: the studio stops its llama-servers
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def studio_slots(home: Path) -> str:
    """The slots the studio's llama-server started with, as its log says them."""
    for log in sorted((home / "logs").rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "n_slots =" in line and "kv_unified" in line:
                return line.split("initializing, ", 1)[-1].strip()
    return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    from launcher.build import ensure_built
    from studio.library.default_model import ensure_default_model
    from studio.settings import Settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds per count of clients (%(default)s)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer (%(default)s)")
    parser.add_argument("--ctx", type=int, default=8192, help="the context of both servers (%(default)s)")
    parser.add_argument("--clients", default="1,4,8", help="counts of concurrent clients (%(default)s)")
    parser.add_argument(
        "--also", type=int, metavar="N", help="a second studio beside, with n_parallel N for the model (e.g. 4)"
    )
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    settings = Settings.from_env()
    binary = ensure_built(settings.home).llama_server
    model = ensure_default_model(settings.models_dir)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-concurrency-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        home = work / "home"
        home.mkdir()
        ours = stack.enter_context(studio(binary, model, args.ctx, home))
        targets = [ours]
        if args.also is not None:
            (work / "also").mkdir()
            targets.append(stack.enter_context(studio(binary, model, args.ctx, work / "also", args.also)))
        theirs = stack.enter_context(llama_server_defaults(binary, model, args.ctx, work))
        print(f"{model.name}, -c {args.ctx}, {args.tokens} tokens an answer, {args.rounds} rounds", flush=True)
        results = compare([*targets, theirs], counts, args.rounds, args.tokens)
        slots = studio_slots(home)
    print(f"\nthe studio's llama-server: {slots}; llama-server by hand: -np -1 (4 slots, unified KV cache)\n")
    print(table(results, theirs.name))
    top = max(counts)
    ratio = results[top][ours.name].tokens_per_s / (results[top][theirs.name].tokens_per_s or float("nan"))
    print(
        f"\ntarget: studio >= {TARGET}x llama-server's own at {top} clients: {ratio:.2f}x "
        f"({'met' if ratio >= TARGET else 'missed'}); {time.monotonic() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
