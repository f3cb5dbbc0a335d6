#!/usr/bin/env python3
"""Benchmark the OpenAI proxy against llama-server itself, in the same run.

Starts the studio service on the default Gemma model (n_parallel 16) in its
own process, as ``ggstudio serve`` runs it (in a thread of this script it would
share the GIL with the client and measure contention a deployment does not
have). Then sends the same requests directly to llama-server and through the
proxy, interleaved so drift hits both paths alike.

By default: streaming prompts with 1 and 16 concurrent streams; prints the
median time to first token (TTFT) and streaming tokens/s per stream for each
path, and the ratios. Targets: proxy tokens/s >= 0.98x direct; added TTFT
median <= 2 ms.

With ``--overhead``: the proxy's own cost, without generation noise. The
smallest requests (``max_tokens`` 1), one at a time, many times: the whole
non-streamed answer, and a stream's first event. Prints the median of each
path, their difference, and the median of the paired differences.

    .venv/bin/python scripts/bench_proxy.py [--rounds 5] [--tokens 64]
    .venv/bin/python scripts/bench_proxy.py --overhead [--rounds 100]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.process import free_port  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]
TINY_PROMPT = [{"role": "user", "content": "Hi"}]
#: llama-server closes the connection after every stream (studio/upstream.py): a direct client must not reuse it.
STREAM_HEADERS = {"Connection": "close"}


def serve(port: int, conn: Connection) -> None:
    """Run the studio service on ``port``; send (model, llama-server URL, its auth headers) once it is ready."""
    import uvicorn

    from launcher.build import ensure_built
    from launcher.capabilities import probe
    from launcher.registry import ChildRegistry
    from launcher.supervisor import Supervisor, owner_token
    from studio.http.app import create_app
    from studio.library.catalog import Catalog
    from studio.library.default_model import ensure_gemma
    from studio.residency.manager import LoadRequest, ModelManager
    from studio.settings import Settings

    settings = Settings.from_env()
    binary = ensure_built(settings.home).llama_server
    model = ensure_gemma(settings.models_dir)
    with tempfile.TemporaryDirectory() as tmp:
        supervisor = Supervisor(logs_dir=Path(tmp) / "logs", registry=ChildRegistry(Path(tmp) / "run", owner_token()))
        manager = ModelManager(catalog=Catalog([model.parent]), binary=binary, supervisor=supervisor,
                               caps=probe(binary), files_root=Path(tmp))
        app = create_app(manager, initial_load=LoadRequest(model=str(model), n_ctx=16 * 512, n_parallel=16, spec="off"))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

        def announce() -> None:
            while not (server.started and manager.loaded):
                if manager.status()["state"] == "failed":
                    conn.send(None)
                    return
                time.sleep(0.1)
            loaded = manager.loaded
            conn.send((loaded.name, loaded.url, loaded.auth_headers))

        threading.Thread(target=announce, daemon=True).start()
        server.run()  # until SIGTERM; the app's shutdown stops llama-server


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
    direct_headers = {**direct_headers, **STREAM_HEADERS}
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
            print(f"{concurrency:>7} {'ratio':>7} {'%+.2f ms' % (med['proxy'][0] - med['direct'][0]):>9} "
                  f"{med['proxy'][1] / med['direct'][1]:7.3f}x")


async def tiny(client: httpx.AsyncClient, url: str, headers: dict, stream_headers: dict, stream: bool) -> float:
    """Seconds to the whole answer of a one-token request, or to a stream's first event."""
    body = {"messages": TINY_PROMPT, "max_tokens": 1, "temperature": 0, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        resp = await client.post(url, json=body, headers=headers)
        resp.raise_for_status()
        return time.perf_counter() - t0
    first = None
    async with client.stream("POST", url, json=body, headers=stream_headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - t0
    assert first is not None, "the stream sent no event"
    return first


async def overhead(direct: str, direct_headers: dict, proxy: str, rounds: int) -> None:
    paths = {"direct": (direct, direct_headers, {**direct_headers, **STREAM_HEADERS}), "proxy": (proxy, {}, {})}
    async with httpx.AsyncClient(timeout=60) as client:
        for path in paths.values():  # warm up both paths
            for stream in (False, True, False, True):
                await tiny(client, *path, stream)
        times: dict[tuple[str, bool], list[float]] = {(p, s): [] for p in paths for s in (False, True)}
        for i in range(rounds):
            for stream in (False, True):
                order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
                for path in order:
                    times[path, stream].append(await tiny(client, *paths[path], stream))
    print(f"{'request':>20} {'direct ms':>10} {'proxy ms':>10} {'added ms':>9} {'paired ms':>10}")
    for stream, label in ((False, "whole answer"), (True, "stream first event")):
        d, p = times["direct", stream], times["proxy", stream]
        md, mp = statistics.median(d) * 1000, statistics.median(p) * 1000
        paired = statistics.median(b - a for a, b in zip(d, p)) * 1000
        print(f"{label:>20} {md:10.2f} {mp:10.2f} {mp - md:+9.2f} {paired:+10.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead", action="store_true", help="measure the proxy's own cost on one-token requests")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; 100 with --overhead)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    rounds = args.rounds or (100 if args.overhead else 5)
    port = free_port()
    ours, theirs = multiprocessing.Pipe()
    service = multiprocessing.get_context("spawn").Process(target=serve, args=(port, theirs), daemon=True)
    service.start()
    try:
        if not ours.poll(180):
            raise SystemExit("the studio service did not start or the model did not load within 180 s")
        ready = ours.recv()
        if ready is None:
            raise SystemExit("the model failed to load")
        name, upstream, headers = ready
        direct, proxy = f"{upstream}/v1/chat/completions", f"http://127.0.0.1:{port}/v1/chat/completions"
        if args.overhead:
            print(f"model {name}, n_parallel 16, one-token requests, {rounds} interleaved rounds")
            asyncio.run(overhead(direct, headers, proxy, rounds))
        else:
            print(f"model {name}, n_parallel 16, {args.tokens} tokens per stream, {rounds} rounds")
            asyncio.run(bench(direct, headers, proxy, rounds, args.tokens))
    finally:
        service.terminate()  # SIGTERM: uvicorn shuts down and the app stops llama-server
        service.join(30)
        if service.is_alive():
            service.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
