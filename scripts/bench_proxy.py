#!/usr/bin/env python3
"""Benchmark what the studio adds to a stream: CPU per relayed chunk, time to first token, tokens/s.

Starts the studio service on Gemma 3 270M (32 slots, speculative decoding off)
in its own process, the way ``ggstudio serve`` runs it, so the CPU time that
process spends is the studio's alone. Then streams the same chat completions
directly to llama-server (with its key) and through the studio, interleaved so
that drift and the other load on the machine hit both paths alike:

- ``/v1`` through the OpenAI proxy against the same request sent directly;
- ``/api/chat`` (the GUI's typed events) against the direct request with
  ``stream_options.include_usage``, as the GUI route sends it.

At 1, 8 and 32 concurrent streams it prints, per path, the median time to first
token (TTFT) and tokens/s per stream, and for the studio's paths the added TTFT
(p50 and p90 of the studio's TTFTs less the direct ones), the tokens/s ratio and
the studio process's CPU time (user + sys) per relayed chunk over its rounds;
``net`` is that less what the studio process spends anyway while llama-server
streams (its CPU rate over the direct rounds: uvicorn's ticks, the supervisor's
threads), which dominates when a loaded machine leaves llama-server few tokens/s.

CPU per chunk is the steady number on a loaded machine; the ratios need
several runs (``--runs`` repeats the whole set and prints the medians).
Targets (issue 19): CPU per chunk <= 40 us at 8 streams, tokens/s >= 0.99x at
1, 8 and 32 streams, added TTFT p50 <= 1 ms.

The client is a bare asyncio socket per stream (``Connection: close``, bytes
counted, nothing parsed), cheap enough not to crowd the two paths it measures.

    .venv/bin/python scripts/bench_proxy.py [--runs 3] [--tokens 64] [--streams 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.process import free_port  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]
N_PARALLEL = 32
#: Rounds per concurrency in one run: enough single streams for a TTFT percentile, fewer of the long rounds.
ROUNDS = {1: 10, 8: 4, 32: 2}
#: A streamed token: OpenAI's delta with string content (the first chunk's ``"content":null`` is no token).
V1_TOKEN = re.compile(rb'"content":"')
#: A token in ``/api/chat``'s typed events.
GUI_TOKEN = re.compile(rb'"type": ?"content"')
EVENT = b"data: "
#: The end of a chunked body (neither llama-server nor uvicorn sends trailers).
LAST_CHUNK = b"\r\n0\r\n\r\n"


def serve(port: int, conn: Connection) -> None:
    """Run the studio service on ``port`` as ``ggstudio serve`` does; send (model, URL, auth headers) when ready."""
    from launcher.capabilities import probe
    from launcher.discovery import find_llama_server
    from launcher.registry import ChildRegistry
    from launcher.supervisor import owner_token
    from studio.http.app import create_app
    from studio.http.server import run_service
    from studio.library.catalog import Catalog
    from studio.library.default_model import ensure_gemma
    from studio.residency.manager import ModelManager, supervisor_factory
    from studio.residency.requests import LoadRequest
    from studio.settings import Settings

    settings = Settings.from_env()
    binary = find_llama_server(home=settings.home).path
    model = ensure_gemma(settings.models_dir)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        manager = ModelManager(catalog=Catalog([model.parent]), binary=binary,
                               make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run",
                                                                                               owner_token())),
                               caps=probe(binary, cache_dir=root / "cache"), files_root=root)
        load = LoadRequest(model=str(model), n_ctx=N_PARALLEL * 512, n_parallel=N_PARALLEL, spec="off")

        def announce() -> None:
            def wait() -> None:
                while manager.loaded is None:
                    default = manager.default
                    if default is not None and default.state.value == "failed":
                        conn.send(None)
                        return
                    time.sleep(0.1)
                loaded = manager.loaded
                conn.send((loaded.name, loaded.url, loaded.auth_headers))

            threading.Thread(target=wait, daemon=True).start()

        run_service(create_app(manager, preload=[load]), host="127.0.0.1", port=port, announce=announce)


@dataclass
class Route:
    """One way to the model: where to send, what to send, and how a token looks in what comes back."""

    name: str
    port: int
    target: str
    headers: dict[str, str]
    extra: dict[str, object]
    token: re.Pattern[bytes]
    studio: bool


@dataclass
class Stream:
    ttft: float
    tokens_per_s: float
    events: int


@dataclass
class Samples:
    streams: list[Stream] = field(default_factory=list)
    cpu_s: float = 0.0  # the studio process's CPU time over this path's rounds
    wall_s: float = 0.0
    events: int = 0


async def one_stream(path: Route, tokens: int) -> Stream:
    """Stream one completion on a fresh connection; TTFT and tokens/s as the client sees them."""
    body = json.dumps({"model": "gemma-3-270m-Q4_K_M", "messages": PROMPT, "max_tokens": tokens, "stream": True,
                       "temperature": 0, "ignore_eos": True, **path.extra}).encode()
    head = [f"POST {path.target} HTTP/1.1", f"Host: 127.0.0.1:{path.port}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in path.headers.items())]
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", path.port)
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    data = bytearray()
    first = last = None
    try:
        while chunk := await reader.read(65536):
            last = time.perf_counter()
            start = max(0, len(data) - 32)
            data += chunk
            if first is None and path.token.search(data, start):
                first = last
            if data.endswith(LAST_CHUNK):  # llama-server may keep the connection open after a stream
                break
    finally:
        writer.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"{path.name}: {bytes(data[:300])!r}")
    n = len(path.token.findall(data))
    if first is None or n < 2:
        raise SystemExit(f"{path.name}: fewer than 2 tokens streamed: {bytes(data[-300:])!r}")
    return Stream(first - t0, (n - 1) / (last - first), data.count(EVENT))


async def warm_up(paths: list[Route]) -> None:
    for p in paths:
        await one_stream(p, 8)


def studio_cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def round_of(path: Route, samples: Samples, concurrency: int, tokens: int, pid: int) -> None:
    before, t0 = studio_cpu(pid), time.perf_counter()
    streams = await asyncio.gather(*(one_stream(path, tokens) for _ in range(concurrency)))
    samples.cpu_s += studio_cpu(pid) - before
    samples.wall_s += time.perf_counter() - t0
    samples.streams += streams
    samples.events += sum(s.events for s in streams)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Row:
    """One run's figures for one path at one concurrency."""

    ttft_p50: float
    ttft_p90: float
    tps: float
    cpu_us_per_chunk: float | None
    #: Less what the studio spends anyway while llama-server streams (its rate over the direct rounds).
    net_us_per_chunk: float | None = None


async def run_once(paths: list[Route], baseline_of: dict[str, str], streams: Sequence[int], tokens: int,
                   pid: int, rounds: dict[int, int]) -> dict[tuple[int, str], Row]:
    rows: dict[tuple[int, str], Row] = {}
    for concurrency in streams:
        samples = {p.name: Samples() for p in paths}
        for i in range(rounds.get(concurrency, 2)):
            order = paths if i % 2 == 0 else paths[::-1]  # interleaved both ways so drift hits every path alike
            for p in order:
                await round_of(p, samples[p.name], concurrency, tokens, pid)
        print(f"  {concurrency} streams done, load {psutil.getloadavg()[0]:.1f}", file=sys.stderr)
        for p in paths:
            s = samples[p.name]
            row = Row(pct([x.ttft for x in s.streams], 0.5) * 1000, pct([x.ttft for x in s.streams], 0.9) * 1000,
                      statistics.median(x.tokens_per_s for x in s.streams), None)
            if p.studio:
                base = samples[baseline_of[p.name]]
                row.cpu_us_per_chunk = s.cpu_s / s.events * 1e6
                row.net_us_per_chunk = (s.cpu_s - base.cpu_s / base.wall_s * s.wall_s) / s.events * 1e6
            rows[concurrency, p.name] = row
    return rows


def report(runs: list[dict[tuple[int, str], Row]], paths: list[Route], baseline_of: dict[str, str],
           streams: Sequence[int]) -> None:
    def med(c: int, name: str, attr: str) -> float:
        return statistics.median(getattr(r[c, name], attr) for r in runs)

    print(f"medians of {len(runs)} run(s)")
    print(f"{'streams':>7} {'path':>14} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>7} | {'+TTFT p50':>9} "
          f"{'+TTFT p90':>9} {'tok/s x':>8} {'CPU us/chunk':>12} {'net':>6}")
    for c in streams:
        for p in paths:
            line = (f"{c:>7} {p.name:>14} {med(c, p.name, 'ttft_p50'):9.2f} {med(c, p.name, 'ttft_p90'):9.2f} "
                    f"{med(c, p.name, 'tps'):7.2f} |")
            if p.studio:
                base = baseline_of[p.name]
                added50 = statistics.median(r[c, p.name].ttft_p50 - r[c, base].ttft_p50 for r in runs)
                added90 = statistics.median(r[c, p.name].ttft_p90 - r[c, base].ttft_p90 for r in runs)
                ratio = statistics.median(r[c, p.name].tps / r[c, base].tps for r in runs)
                cpu = statistics.median(r[c, p.name].cpu_us_per_chunk for r in runs)
                net = statistics.median(r[c, p.name].net_us_per_chunk for r in runs)
                line += f" {added50:+9.2f} {added90:+9.2f} {ratio:7.3f}x {cpu:12.1f} {net:6.1f}"
            print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole set; medians are printed")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--streams", default="1,8,32", help="concurrencies, comma-separated")
    parser.add_argument("--rounds", default=None,
                        help="rounds per concurrency, comma-separated like --streams (default 10,4,2 for 1,8,32)")
    parser.add_argument("--no-gui", action="store_true", help="leave out /api/chat")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if max(streams) > N_PARALLEL:
        raise SystemExit(f"at most {N_PARALLEL} streams: llama-server runs {N_PARALLEL} slots")
    rounds = dict(zip(streams, (int(r) for r in args.rounds.split(",")))) if args.rounds else ROUNDS
    port = free_port()
    ours, theirs = multiprocessing.Pipe()
    service = multiprocessing.get_context("spawn").Process(target=serve, args=(port, theirs), daemon=True)
    service.start()
    try:
        if not ours.poll(300):
            raise SystemExit("the studio service did not start or the model did not load within 300 s")
        ready = ours.recv()
        if ready is None:
            raise SystemExit("the model failed to load")
        name, upstream, auth = ready
        up_port = int(upstream.rsplit(":", 1)[1])
        usage = {"stream_options": {"include_usage": True}}
        paths = [
            Route("direct", up_port, "/v1/chat/completions", auth, {}, V1_TOKEN, False),
            Route("studio /v1", port, "/v1/chat/completions", {}, {}, V1_TOKEN, True),
        ]
        baseline_of = {"studio /v1": "direct"}
        if not args.no_gui:
            paths += [Route("direct+usage", up_port, "/v1/chat/completions", auth, usage, V1_TOKEN, False),
                      Route("studio /api", port, "/api/chat", {}, {}, GUI_TOKEN, True)]
            baseline_of["studio /api"] = "direct+usage"
        print(f"model {name}, {N_PARALLEL} slots, {args.tokens} tokens per stream, streams {args.streams}, "
              f"rounds {[rounds.get(c, 2) for c in streams]}, machine load {psutil.getloadavg()[0]:.1f} "
              f"on {psutil.cpu_count()} CPUs")
        asyncio.run(warm_up(paths))
        before, t0 = studio_cpu(service.pid), time.perf_counter()
        time.sleep(5)
        idle = (studio_cpu(service.pid) - before) / (time.perf_counter() - t0)
        print(f"studio process idle, model loaded: {idle * 1000:.1f} ms CPU per second")
        runs = []
        for i in range(args.runs):
            runs.append(asyncio.run(run_once(paths, baseline_of, streams, args.tokens, service.pid, rounds)))
            if args.runs > 1:
                print(f"run {i + 1}/{args.runs} done, load {psutil.getloadavg()[0]:.1f}", file=sys.stderr)
        report(runs, paths, baseline_of, streams)
    finally:
        service.terminate()  # SIGTERM: uvicorn shuts down and the app stops llama-server
        service.join(30)
        if service.is_alive():
            service.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
