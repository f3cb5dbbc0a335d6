#!/usr/bin/env python3
"""Benchmark the OpenAI proxy against llama-server itself, in the same run.

Starts the studio service in-process on the default Gemma model (n_parallel 16),
then sends the same streaming prompts directly to llama-server and through the
proxy, interleaved round by round, with 1 and 16 concurrent streams. Prints the
median time to first token (TTFT) and streaming tokens/s per stream for each
path, and the ratios. Targets: proxy tokens/s >= 0.98x direct; added TTFT
median <= 2 ms.

    .venv/bin/python scripts/bench_proxy.py [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.build import ensure_built  # noqa: E402
from launcher.process import free_port  # noqa: E402
from launcher.capabilities import probe
from launcher.registry import ChildRegistry  # noqa: E402
from launcher.supervisor import Supervisor, owner_token  # noqa: E402
from studio.app import create_app  # noqa: E402
from studio.catalog import Catalog  # noqa: E402
from studio.default_model import ensure_default_model  # noqa: E402
from studio.manager import LoadRequest, ModelManager  # noqa: E402
from studio.settings import Settings  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


async def one_stream(client: httpx.AsyncClient, url: str, headers: dict, tokens: int) -> tuple[float, float]:
    """Return (TTFT seconds, tokens/s after the first token) of one streamed completion."""
    body = {"messages": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    n = 0
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                n += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None, "no token streamed"
    return first - t0, (n - 1) / (end - first) if n > 1 else 0.0


async def round_of(client, url, headers, tokens, concurrency) -> list[tuple[float, float]]:
    return await asyncio.gather(*(one_stream(client, url, headers, tokens) for _ in range(concurrency)))


async def bench(direct: str, direct_headers: dict, proxy: str, rounds: int, tokens: int) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await round_of(client, direct, direct_headers, 8, 2)  # warm up both paths
        await round_of(client, proxy, {}, 8, 2)
        print(f"{'streams':>7} {'path':>7} {'TTFT ms':>9} {'tok/s':>8}")
        for concurrency in (1, 16):
            results: dict[str, list[tuple[float, float]]] = {"direct": [], "proxy": []}
            for _ in range(rounds):  # interleaved so drift hits both paths alike
                results["direct"] += await round_of(client, direct, direct_headers, tokens, concurrency)
                results["proxy"] += await round_of(client, proxy, {}, tokens, concurrency)
            med = {k: (statistics.median(t for t, _ in v) * 1000, statistics.median(r for _, r in v))
                   for k, v in results.items()}
            for path in ("direct", "proxy"):
                print(f"{concurrency:>7} {path:>7} {med[path][0]:9.2f} {med[path][1]:8.2f}")
            print(f"{concurrency:>7} {'ratio':>7} {'+%.2f ms' % (med['proxy'][0] - med['direct'][0]):>9} "
                  f"{med['proxy'][1] / med['direct'][1]:7.3f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    settings = Settings.from_env()
    binary = ensure_built(settings.home).llama_server
    model = ensure_default_model(settings.models_dir)
    with tempfile.TemporaryDirectory() as tmp:
        supervisor = Supervisor(logs_dir=Path(tmp) / "logs", registry=ChildRegistry(Path(tmp) / "run", owner_token()))
        manager = ModelManager(catalog=Catalog([model.parent]), binary=binary, supervisor=supervisor,
                               caps=probe(binary), files_root=Path(tmp))
        port = free_port()
        app = create_app(manager, initial_load=LoadRequest(model=str(model), n_ctx=16 * 512, n_parallel=16, spec="off"))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while not server.started:
                if time.monotonic() > deadline:
                    raise SystemExit("the studio service did not start")
                time.sleep(0.05)
            while httpx.get(f"{base}/api/status").json()["state"] != "ready":
                if time.monotonic() > deadline:
                    raise SystemExit("the model did not load within 120 s")
                time.sleep(0.2)
            loaded = manager.loaded
            print(f"model {loaded.name}, n_parallel 16, {args.tokens} tokens per stream, {args.rounds} rounds")
            asyncio.run(bench(f"{loaded.url}/v1/chat/completions", loaded.auth_headers,
                              f"{base}/v1/chat/completions", args.rounds, args.tokens))
        finally:
            server.should_exit = True
            thread.join(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
