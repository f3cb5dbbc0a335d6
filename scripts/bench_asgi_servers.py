#!/usr/bin/env python3
"""Would another ASGI server relay a stream more cheaply than uvicorn? The same bare relay under each.

Issue 33 asked whether a Rust-based server (granian) gets closer to the Python floor than
uvicorn. This runs one minimal ASGI app (parse llama-server's answer with httptools, send each
arrival through the server's ``send``, nothing else) under uvicorn (uvloop, httptools) and under
granian (one worker, uvloop, one runtime thread) in front of ``bench_proxy``'s stand-in, beside
``bench_proxy``'s Python floor, interleaved, and prints the server process's CPU per relayed chunk
at 8 and 32 streams and per one-token request. The studio itself runs under uvicorn and writes
chunks past ``send`` (``studio.http.client_wire``), which no other server's objects allow.

granian is no dependency of the studio; install it into the environment first:

    .venv/bin/pip install granian
    .venv/bin/python scripts/bench_asgi_servers.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httptools

from studio.http.relay import send_now  # the studio's own: run ``send`` up to its first wait

HERE = Path(__file__).resolve().parent


class Back(asyncio.Protocol):
    """The upstream connection: each arrival's payload sent on from the parser, the end handed to ``done``."""

    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[None]], done: asyncio.Future[bytes]) -> None:
        self.send, self.done = send, done
        self.held: list[bytes] = []
        self.pending: list[asyncio.Future[None]] = []
        self.complete = False
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self.held.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        held = self.held
        if self.complete:
            if not self.done.done():
                self.done.set_result(b"".join(held))
            return
        if held:
            out = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            left = send_now(self.send, {"type": "http.response.body", "body": out, "more_body": True})
            if left is not None:  # a slow client: the rest of the send goes on meanwhile
                self.pending.append(asyncio.ensure_future(left))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(b"".join(self.held))


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The bare relay: the request's body to the stand-in on a new connection, its answer's payload back."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes] = loop.create_future()
    back = Back(send, done)
    transport, _ = await loop.create_connection(lambda: back, "127.0.0.1", int(os.environ["BENCH_UPSTREAM"]))
    transport.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: stand-in\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    last = await done
    for left in back.pending:
        await left
    transport.close()
    await send({"type": "http.response.body", "body": last, "more_body": False})


def serve(server: str, port: int) -> None:
    """Serve ``app`` under ``server`` on ``port``; print ``ready`` once it accepts connections."""
    sys.path.insert(0, str(HERE))  # granian imports the app by name
    if server == "uvicorn":
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        uvicorn_server = uvicorn.Server(config)
        threading.Thread(target=announce, args=(port,), daemon=True).start()
        uvicorn_server.run()
        return
    from granian.constants import Interfaces, Loops
    from granian.server import Server

    threading.Thread(target=announce, args=(port,), daemon=True).start()
    Server(
        "bench_asgi_servers:app",
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        loop=Loops.uvloop,
        log_enabled=False,
        runtime_threads=1,
    ).serve()


def announce(port: int) -> None:
    """Print ``ready`` once ``port`` accepts a connection."""
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    time.sleep(0.5)  # granian's worker starts after its listener
    print("ready", flush=True)


def serving_pid(server: str, process: subprocess.Popen[str]) -> int:
    """The process that runs the app: granian's worker is a child of the process started."""
    if server == "uvicorn":
        return process.pid
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    return int(children[0])


def measure(rounds: int) -> None:
    """Print CPU per chunk at 8 and 32 streams and per request: the floor, uvicorn and granian, interleaved."""
    sys.path.insert(0, str(HERE))
    import bench_proxy as bench

    from launcher.process import free_port

    spawn = multiprocessing.get_context("spawn")
    stand_in, floor = free_port(), free_port()
    helpers = [
        spawn.Process(target=bench.stand_in_llama_server, args=(stand_in, 50.0), daemon=True),
        spawn.Process(target=bench.floor_relay, args=(floor, stand_in), daemon=True),
    ]
    for helper in helpers:
        helper.start()
    servers: list[subprocess.Popen[str]] = []
    auth = {"Authorization": "Bearer stand-in"}
    routes = [bench.Route("floor py", floor, "/v1/chat/completions", auth, {}, bench.V1_TOKEN, True, helpers[1].pid)]
    try:
        for name in ("uvicorn", "granian"):
            port = free_port()
            process = subprocess.Popen(
                [sys.executable, __file__, "--serve", name, str(port)],
                stdout=subprocess.PIPE,
                text=True,
                cwd=HERE,
                env={**os.environ, "BENCH_UPSTREAM": str(stand_in)},
            )
            servers.append(process)
            assert process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                raise SystemExit(f"{name} did not start")
            pid = serving_pid(name, process)
            routes.append(bench.Route(name, port, "/v1/chat/completions", {}, {}, bench.V1_TOKEN, True, pid))
        asyncio.run(bench.warm_up(routes))
        for streams in (8, 32):
            samples = {route.name: bench.Samples() for route in routes}

            async def rounds_of(streams: int = streams, samples: dict[str, Any] = samples) -> None:
                for i in range(rounds if streams == 8 else max(2, rounds // 2)):
                    for route in routes if i % 2 == 0 else routes[::-1]:
                        await bench.round_of(route, samples[route.name], streams, 64)

            asyncio.run(rounds_of())
            floor_cpu = samples["floor py"].cpu_s / samples["floor py"].events
            for route in routes:
                cpu = samples[route.name].cpu_s / samples[route.name].events
                ratio = cpu / floor_cpu
                print(f"{streams:>3} streams {route.name:>9}: {cpu * 1e6:6.1f} us per chunk ({ratio:.2f}x floor py)")
        per: dict[str, list[float]] = {route.name: [] for route in routes}
        for block in range(4):
            for route in routes if block % 2 == 0 else routes[::-1]:
                per[route.name].append(asyncio.run(bench.cpu_per_request(route, 128, 8)))
        for name, values in per.items():
            blocks = " ".join(f"{v:.3f}" for v in values)
            print(f"CPU per request {name:>9}: {statistics.median(values):.3f} ms (blocks: {blocks})")
    finally:
        for process in servers:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
        for helper in helpers:
            helper.terminate()
            helper.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8, help="rounds at 8 streams (half as many at 32)")
    parser.add_argument("--serve", nargs=2, metavar=("SERVER", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    try:
        import granian  # noqa: F401
    except ImportError:
        raise SystemExit("granian is not installed here: .venv/bin/pip install granian, then run this again") from None
    measure(args.rounds)


if __name__ == "__main__":
    main()
