#!/usr/bin/env python3
"""The prompt cache on the bill, conversations that survive a swap, and requests grouped by model (#30).

Runs ``ggstudio serve`` (this checkout's code) as its own process over real llama-servers and real
models: SmolLM2-135M-Instruct under two names (``smol-a``, ``smol-b``: two residents of one file) and
Gemma 3 270M. Prints three tables:

1. Memory against the bills: ``--prompts`` distinct prompts of about ``--tokens`` tokens to one
   resident, then as many spread over three residents under a budget that fits the three; every
   100 ms the RSS of the studio's process tree (the studio and every llama-server) is set against
   the sum of the residents' bills and the studio's reserve. Largest ratio (target <= 1.0).
2. Swap back: a conversation of ``--conversation`` tokens on A; B's load evicts A under a budget
   that fits one model; A is loaded again and the next turn sent. Prompt tokens processed on that
   turn (``timings.prompt_n``) and its time to first token (the load excluded), against the same
   turn on an A never evicted. Targets: <= 5 % processed again, TTFT <= 1.5x.
3. Grouping: two clients, one sending ``--requests`` chats to A one after another, the other as many
   to B, under a budget that fits one model: swaps (evictions) and the longest wait for a first
   token, with ``group_size`` 4 (the default) against 0 (each waiting load takes the memory at once).
   Target <= 4 swaps where one per request is 2 x ``--requests``.

    .venv/bin/python scripts/bench_cache.py [--prompts 50] [--tokens 2000] [--conversation 3000] [--repeat 3]
        [--requests 8] [--only memory|swap|grouping]

A few minutes on two cores at the defaults; ``--prompts 10 --tokens 500`` shrinks table 1 to seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.process import free_port  # noqa: E402
from studio.library.default_model import ensure_default_model, ensure_gemma  # noqa: E402
from studio.settings import Settings  # noqa: E402

#: What the scratch studio home borrows from the real one (as the test suite's ``run_home``): the pinned
#: build, the models, the zoo and the probe cache. Not its discovery file, lock, logs, history or slots: a
#: benchmark run in the real home once left them to the test suite, which then talked to its studio.
BORROWED = ("llama.cpp", "models", "zoo", "cache")

MIB = 2**20
A, B, GEMMA = "smol-a", "smol-b", "gemma"
#: MiB of prompt cache for A and B in tables 2 and 3: fixed, so the bill a budget fitting one is made from is
#: the bill they get (the planner's default grows with the room the budget leaves).
PAIR_CACHE = 128
#: Words the prompts are drawn from: distinct prompts of a known length without a data set.
WORDS = (
    "river stone lantern orchard violet copper meadow harbor winter maple silver canyon ember "
    "willow thunder pepper marble falcon cedar velvet glacier saffron quartz ribbon tundra mango "
    "beacon cobalt prairie walnut cinder lagoon juniper nectar basalt oyster mosaic pebble rustle"
).split()


#: Makes this run's texts its own: a slot the studio saved in an earlier run (they outlive it, in the studio
#: home) would otherwise be restored for the "never evicted" turn too.
RUN = random.randrange(1 << 30)


def text_of(tokens: int, seed: int) -> str:
    """About ``tokens`` SmolLM2 tokens of distinct text (its tokenizer gives about 1.13 a word here)."""
    rng = random.Random(RUN * 10_000 + seed)
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens / 1.13)))


def scratch_home(real: Path) -> Path:
    """A studio home of the run's own (kept, with the studios' logs), ``BORROWED`` linked in from ``real``."""
    home = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    for name in BORROWED:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    return home


@contextmanager
def studio(
    scratch: Path,
    models: dict[str, Path],
    *,
    budget: int,
    n_ctx: int,
    group_size: int = 4,
    cache_ram: int | None = None,
) -> Iterator[tuple[str, int]]:
    """``ggstudio serve`` over ``models`` (the first preloaded) under ``budget`` bytes; yields its URL and pid.

    ``cache_ram`` (MiB) fixes the prompt cache; without it the planner sizes it by the room the budget leaves.
    """
    folder = scratch / "models"
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in models.items():
        link = folder / f"{name}.gguf"
        if not link.exists():
            link.symlink_to(path)
    cache = f"cache_ram = {cache_ram}\n" if cache_ram is not None else ""
    tables = "".join(f'[models."{m}"]\nn_ctx = {n_ctx}\nspec = "off"\n{cache}' for m in models)
    config = scratch / f"config-{budget}-{group_size}.toml"
    first = next(iter(models))  # preloaded, else ``serve`` would preload the default model beside them
    config.write_text(
        f'model_dirs = ["{folder}"]\npreload = ["{first}"]\nmemory_budget = {budget}\n'
        f"group_size = {group_size}\nbusy_wait = 300\n{tables}"
    )
    port = free_port()
    env = {
        **os.environ,
        "GGUF_STUDIO_CONFIG": str(config),
        "GGUF_STUDIO_PORT": str(port),
        "PYTHONPATH": str(ROOT),  # this checkout's code, whatever the venv's editable install points at
    }
    url = f"http://127.0.0.1:{port}"
    log = (scratch / f"studio-{port}.log").open("w")
    with subprocess.Popen(
        [sys.executable, "-c", "from studio.cli.app import main; main()", "serve"], env=env, stdout=log, stderr=log
    ) as serve:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    ready = httpx.get(f"{url}/api/status", timeout=2).json()["models"]
                    if any(m["model"] == first and m["state"] == "ready" for m in ready):
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.2)
            else:
                raise SystemExit(f"the studio did not start; see {log.name}")
            yield url, serve.pid
        finally:
            serve.terminate()
            serve.wait(60)
            log.close()


def load(url: str, model: str) -> None:
    httpx.post(f"{url}/api/load", json={"model": model}, timeout=300).raise_for_status()


def bills(url: str) -> tuple[int, int]:
    """The sum of the resident models' predicted bills, and the studio's own reserve, in bytes."""
    status = httpx.get(f"{url}/api/status", timeout=10).json()
    billed = sum(m["memory"]["predicted"]["total"] for m in status["models"] if m["state"] == "ready")
    return billed, (status["memory_budget"] or {}).get("reserve", 0)


def tree_rss(pid: int) -> tuple[int, int]:
    """RSS of the studio itself, and of every process under it (its llama-servers)."""
    try:
        root = psutil.Process(pid)
        return root.memory_info().rss, sum(p.memory_info().rss for p in root.children(recursive=True))
    except psutil.Error:
        return 0, 0


class Sampler:
    """Every 100 ms: the process tree's RSS against the bills' sum (and the studio's reserve); keeps the
    largest ratios."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.worst = (0.0, 0, 0, 0, 0)  # (studio + servers) / (bills + reserve), studio, servers, bills, reserve
        self.worst_servers = 0.0  # servers / bills: what the bills promise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        billed, reserve, checked = 0, 0, 0.0
        while not self._stop.wait(0.1):
            if time.monotonic() - checked > 1.0:  # the bills change only when a model comes or goes
                (billed, reserve), checked = bills(self.url), time.monotonic()
            own, servers = tree_rss(self.pid)
            if not billed:
                continue
            self.worst_servers = max(self.worst_servers, servers / billed)
            if (own + servers) / (billed + reserve) > self.worst[0]:
                self.worst = ((own + servers) / (billed + reserve), own, servers, billed, reserve)


def complete(url: str, model: str, prompt: str) -> dict[str, Any]:
    """A one-token completion: the whole prompt is processed, and lands in the prompt cache."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int = 16) -> tuple[str, float, int, float]:
    """A streamed chat: (text, seconds to the first token, prompt tokens processed, seconds in all)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began, first, text, prompt_n = time.perf_counter(), None, [], -1
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:  # after the headers (a load that failed while the stream waited): not a turn
                raise RuntimeError(f"{model} answered with an error: {data['error']}")
            for choice in data.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            if "timings" in data:
                prompt_n = int(data["timings"].get("prompt_n", -1))
    end = time.perf_counter()
    if prompt_n < 0:  # a stream cut short counted as a turn made a table of nonsense (a "-1-token conversation")
        raise RuntimeError(f"{model}'s stream ended without its timings: {''.join(text)[:200]!r}")
    return "".join(text), (first or end) - began, prompt_n, end - began


def evictions(url: str) -> int:
    total = 0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("ggstudio_model_evictions_total{") and 'reason="evicted"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def memory_table(args: argparse.Namespace, scratch: Path, models: dict[str, Path], one: int, reserve: int) -> None:
    """Prints each phase's row as soon as it is measured: at 50 x 2,000 tokens the run takes many minutes."""
    budget = int(3.3 * one) + reserve  # three residents fit beside the studio, with room for their caches' growth
    print(f"\n1. Memory: {args.prompts} prompts of ~{args.tokens} tokens; budget {budget / MIB:.0f} MiB")
    print(
        f"{'':17}{'servers/bills':>14}{'(servers+studio)/(bills+reserve)':>34}{'studio':>8}{'servers':>9}"
        f"{'bills':>7}{'reserve':>9}  (MiB)",
        flush=True,
    )
    rows: list[Sampler] = []
    with studio(scratch / "memory", models, budget=budget, n_ctx=args.tokens + 1024) as (url, pid):
        load(url, A)
        with Sampler(url, pid) as one_resident:
            prompts(url, args, (A,), seed=0)
        rows.append(memory_row("one resident", one_resident))
        for m in (B, GEMMA):
            load(url, m)
        with Sampler(url, pid) as three:
            prompts(url, args, (A, B, GEMMA), seed=1000)
        rows.append(memory_row("three residents", three))
    print(
        f"largest ratio: {max(r.worst_servers for r in rows):.2f} for the llama-servers,"
        f" {max(r.worst[0] for r in rows):.2f} with the studio's own RSS against its reserve (target <= 1.0)"
    )


def prompts(url: str, args: argparse.Namespace, to: tuple[str, ...], seed: int) -> None:
    """``--prompts`` distinct prompts spread over ``to``, with a progress line on stderr every ten."""
    began = time.monotonic()
    for i in range(args.prompts):
        complete(url, to[i % len(to)], text_of(args.tokens, seed + i))
        if (i + 1) % 10 == 0:
            print(f"  {i + 1}/{args.prompts} prompts, {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)


def memory_row(name: str, sampled: Sampler) -> Sampler:
    ratio, own, servers, billed, reserve = sampled.worst
    print(
        f"{name:17}{sampled.worst_servers:>14.2f}{ratio:>34.2f}{own / MIB:>8.0f}{servers / MIB:>9.0f}"
        f"{billed / MIB:>7.0f}{reserve / MIB:>9.0f}",
        flush=True,
    )
    return sampled


def swap_table(url: str, args: argparse.Namespace) -> None:
    """Medians of ``--repeat`` conversations each way: (conversation tokens, prompt_n of the next turn, its TTFT)."""
    rows = []
    for name, evicted in (("never evicted", False), ("evicted, restored", True)):
        runs = []
        for i in range(args.repeat):
            question = text_of(args.conversation, 100 * i + evicted) + "\nSum this up."
            messages = [{"role": "user", "content": question}]
            load(url, A)
            reply, _, first_n, _ = chat(url, A, messages)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And in one word?"}]
            if evicted:
                chat(url, B, [{"role": "user", "content": "Hi."}], max_tokens=2)  # B's load evicts A, saving its slot
                load(url, A)  # the load is not part of the next turn's time
            _, ttft, prompt_n, _ = chat(url, A, messages)
            runs.append((first_n, prompt_n, ttft))
        rows.append((name, *(statistics.median(r[k] for r in runs) for k in range(3))))
    print(f"\n2. Swap back: a ~{rows[0][1]:.0f}-token conversation on A, then its next turn (medians of {args.repeat})")
    print(f"{'':20}{'prompt_n':>10}{'of the conversation':>21}{'TTFT (s)':>10}")
    for name, first_n, prompt_n, ttft in rows:
        print(f"{name:20}{prompt_n:>10.0f}{prompt_n / max(first_n, 1):>21.1%}{ttft:>10.3f}")
    print(
        f"processed again: {rows[1][2] / max(rows[1][1], 1):.1%} (target <= 5 %);"
        f" TTFT {rows[1][3] / rows[0][3]:.2f}x the resident one (target <= 1.5x)"
    )


def grouping_run(url: str, requests: int) -> tuple[int, float, float]:
    """Two clients, A x ``requests`` and B x ``requests``: (swaps, longest time to first token, wall time)."""
    before = evictions(url)
    waits: list[float] = []
    began = time.perf_counter()

    def client(model: str) -> None:
        for i in range(requests):
            _, ttft, _, _ = chat(url, model, [{"role": "user", "content": f"Count to {i + 2}."}], max_tokens=8)
            waits.append(ttft)

    threads = [threading.Thread(target=client, args=(m,)) for m in (A, B)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return evictions(url) - before, max(waits), time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=50, help="prompts per phase of table 1")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of each prompt in table 1")
    parser.add_argument("--conversation", type=int, default=3000, help="tokens of table 2's conversation")
    parser.add_argument("--repeat", type=int, default=3, help="conversations each way in table 2")
    parser.add_argument("--requests", type=int, default=8, help="requests of each client in table 3")
    parser.add_argument("--only", choices=("memory", "swap", "grouping"), help="one table only")
    args = parser.parse_args()
    scratch = scratch_home(Settings.from_env().home)
    os.environ["GGUF_STUDIO_HOME"] = str(scratch)  # every studio below runs there, one after another
    settings = Settings.from_env()
    smol, gemma = ensure_default_model(settings.models_dir), ensure_gemma(settings.models_dir)
    models = {A: smol, B: smol, GEMMA: gemma}
    # one model's bill at the largest context used: from a studio that plans it without a budget
    n_ctx = max(args.tokens, args.conversation) + 1024
    with studio(scratch / "probe", {A: smol, GEMMA: gemma}, budget=64 << 30, n_ctx=n_ctx) as (url, _):
        plans = [httpx.post(f"{url}/api/plan", json={"model": m}, timeout=120).json() for m in (A, GEMMA)]
        fixed = httpx.post(f"{url}/api/plan", json={"model": A, "cache_ram": PAIR_CACHE}, timeout=120).json()
        reserve = httpx.get(f"{url}/api/status", timeout=10).json()["memory_budget"]["reserve"]  # the studio's own
    bill = {m: sum(d["total_bytes"] for d in p["bill"]) for m, p in zip((A, GEMMA), plans, strict=True)}
    if args.only in (None, "memory"):
        memory_table(args, scratch, models, max(bill.values()), reserve)
    if args.only in (None, "swap", "grouping"):
        pair = {A: smol, B: smol}
        one_fits = int(1.5 * sum(d["total_bytes"] for d in fixed["bill"])) + reserve  # A or B, never both
        swaps: dict[int, tuple[int, float, float]] = {}
        for group_size in (4, 0):
            with studio(
                scratch / f"one-{group_size}",
                pair,
                budget=one_fits,
                n_ctx=n_ctx,
                group_size=group_size,
                cache_ram=PAIR_CACHE,
            ) as (url, _):
                if group_size == 4 and args.only in (None, "swap"):
                    swap_table(url, args)
                if args.only in (None, "grouping"):
                    load(url, A)
                    swaps[group_size] = grouping_run(url, args.requests)
        if swaps:
            print(f"\n3. Grouping: two clients, {args.requests} chats each to A and to B, one model fits")
            print(f"{'':22}{'swaps':>7}{'longest TTFT (s)':>18}{'wall (s)':>10}")
            for group_size, (n, longest, wall) in swaps.items():
                print(f"{'group_size ' + str(group_size):22}{n:>7}{longest:>18.2f}{wall:>10.1f}")
            print(f"target: <= 4 swaps with grouping, against {2 * args.requests} one per request")


if __name__ == "__main__":
    main()
