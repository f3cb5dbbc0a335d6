#!/usr/bin/env python3
"""Would another ASGI server relay a stream more cheaply than uvicorn, and how much does uvicorn itself cost?

Issue 33 asked whether a Rust-based server (granian) gets closer to the Python floor than
uvicorn. This runs one minimal ASGI app (parse llama-server's answer with httptools, send each
arrival through the server's ``send``, nothing else) under uvicorn (uvloop, httptools) and, if it
is installed, under granian (one worker, uvloop, one runtime thread) in front of ``bench_proxy``'s
stand-in, beside ``bench_proxy``'s Python floor, interleaved, and prints the server process's CPU
per relayed chunk (64-token streams) at 8 and 32 streams and per one-token request.

More rows set the studio's figures in their place, each adding one layer to the one before, so that
what each layer costs reads off one run. ``uvicorn direct`` is the least any relay under uvicorn can
do: nothing parsed, each arrival written on the client's connection as it came
(``studio.http.wire.client_wire``, as the studio's ``Framed`` does), under the studio's own server
class (``studio.http.server.StudioServer``, its main loop waking once a second): what uvicorn
alone adds to the floor's stream. ``studio relay`` adds the studio's upstream client and relay (a
spare connection, the answer's head parsed, the watcher of the client, ``Framed``) and nothing else;
``studio routes`` adds the forwarded routes' own work (routing, the checks, the lease, the metrics),
with no FastAPI or middleware around it (``studio_part``); ``studio /v1`` is the studio itself
(``bench_proxy``'s service: FastAPI, auth, the guards and all). Issue 33's target is the studio at
1.3x the floor.

granian is no dependency of the studio; for its row install it into the environment first:

    .venv/bin/pip install granian
    .venv/bin/python scripts/bench_asgi_servers.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
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

from studio.http.wire.client_wire import ChunkWriter, client_wire
from studio.http.wire.relay import send_now  # the studio's own: run ``send`` up to its first wait

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


async def request_body(receive: Any) -> bytes:
    """The request's whole body, as the ASGI server hands it over."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def ask_stand_in(protocol: asyncio.Protocol, body: bytes) -> asyncio.Transport:
    """Send ``body`` as a chat completion to the stand-in on a new connection whose protocol is ``protocol``."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(lambda: protocol, "127.0.0.1", int(os.environ["BENCH_UPSTREAM"]))
    transport.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: stand-in\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return transport


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The bare relay: the request's body to the stand-in on a new connection, its answer's payload back."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    body = await request_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes] = loop.create_future()
    back = Back(send, done)
    transport = await ask_stand_in(back, body)
    last = await done
    for left in back.pending:
        await left
    transport.close()
    await send({"type": "http.response.body", "body": last, "more_body": False})


class Passed(asyncio.Protocol):
    """The upstream connection under ``direct_app``: its answer's head dropped, each arrival then written on as it
    came (chunk framing and all); the end is the connection's, as the stand-in closes it after the body."""

    def __init__(self, write: ChunkWriter, done: asyncio.Future[None]) -> None:
        self.write, self.done = write, done
        self.head = b""  # the answer's head until it is whole
        self.in_body = False
        self.pending: list[asyncio.Future[None]] = []

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            data, self.head, self.in_body = self.head[end + 4 :], b"", True
            if not data:
                return
        left = self.write(data)
        if left is not None:  # a slow client: its drain goes on meanwhile
            self.pending.append(asyncio.ensure_future(left))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def direct_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The least a relay under uvicorn can do: the request's body to the stand-in, its chunked answer written on the
    client's connection as it arrives, unparsed (``studio.http.wire.client_wire``, the studio's own way past
    ``send``)."""
    if scope["type"] == "lifespan":
        await app(scope, receive, send)
        return
    body = await request_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    wire = client_wire(send)
    if wire is None:
        raise RuntimeError("uvicorn did not start a chunked response")
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    passed = Passed(wire.write_framed, done)
    transport = await ask_stand_in(passed, body)
    await done
    for left in passed.pending:
        await left
    transport.close()
    wire.ended_framed()  # the stand-in's own last chunk ended the body
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def studio_part(part: str) -> Any:
    """The studio with its outer layers taken off, in front of the stand-in, as an ASGI app.

    ``studio routes`` is the forwarded routes' own handler (``AheadRoutes``: routing, the checks, the
    lease, the metrics and the relay) with no FastAPI and no middleware around it. ``studio relay`` is the
    studio's upstream client and relay alone (``Upstream.send`` on a spare connection, the answer's head
    parsed, ``Relay`` with its watcher of the client and ``Framed``): the body parsed and written again as
    the studio does, nothing checked, leased or counted. Both run on the studio app's own state (its lifespan
    makes the pooled upstream), with the tests' stand-in manager as ``bench_proxy``'s service has.
    """
    import bench_proxy

    from studio import json_codec
    from studio.http.ahead import AheadRoutes
    from studio.http.errors import error_response
    from studio.http.server import settle_heap
    from studio.http.wire.relay import Relay, with_server_send

    studio, loaded = bench_proxy.stand_in_studio(int(os.environ["BENCH_UPSTREAM"]))
    routes = AheadRoutes(studio, routes=studio.router.routes, on_error=error_response)
    url = loaded.url + "/v1/chat/completions"

    async def relayed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await studio(scope, receive, send)
            return
        if part == "studio routes":
            scope["app"] = studio  # where the routes find the manager, the upstream and the metrics
            await routes(scope, receive, send)
            return
        body = json_codec.loads(await request_body(receive))
        resp = await studio.state.upstream.send("POST", url, loaded.auth_headers, body)

        async def closed(first_at: float | None, tail: bytes) -> None:
            await resp.aclose()

        async def broken(exc: Exception) -> bytes:
            return b""

        relay = Relay(resp, headers={"content-type": "text/event-stream"}, on_close=closed, on_break=broken)
        await relay(scope, receive, send)

    settle_heap()  # as the studio's service does once it listens: the app's heap out of the collector's way
    return with_server_send(relayed)


#: The rows served under the studio's own server class (``StudioServer``): all but plain ``uvicorn``.
UNDER_STUDIO_SERVER = ("uvicorn direct", "studio relay", "studio routes")


def serve(server: str, port: int) -> None:
    """Serve ``server``'s app on ``port``; print ``ready`` once it accepts connections."""
    sys.path.insert(0, str(HERE))  # granian imports the app by name
    if server in ("uvicorn", *UNDER_STUDIO_SERVER):
        import uvicorn

        from studio.http.server import StudioServer

        served = {"uvicorn": app, "uvicorn direct": direct_app}.get(server) or studio_part(server)
        config = uvicorn.Config(served, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        # these run as the studio's own listener does: its main loop wakes once a second, not ten times
        uvicorn_server = uvicorn.Server(config) if server == "uvicorn" else StudioServer(config)
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
    if server != "granian":
        return process.pid
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    return int(children[0])


def measure(rounds: int, granian: bool) -> None:
    """Print CPU per chunk at 8 and 32 streams and per request: the floor, the bare relays under uvicorn (and under
    granian if ``granian``) and the studio, interleaved."""
    sys.path.insert(0, str(HERE))
    import bench_proxy as bench

    from launcher.process import free_port

    spawn = multiprocessing.get_context("spawn")
    stand_in, floor = free_port(), free_port()
    helpers = [
        spawn.Process(target=bench.stand_in_llama_server, args=(stand_in, 50.0), daemon=True),
        spawn.Process(target=bench.floor_relay, args=(floor, stand_in), daemon=True),
    ]
    studio_port = free_port()
    ours, theirs = multiprocessing.Pipe()
    studio = spawn.Process(target=bench.serve, args=(studio_port, theirs, stand_in, None), daemon=True)
    helpers.append(studio)
    for helper in helpers:
        helper.start()
    servers: list[subprocess.Popen[str]] = []
    auth = {"Authorization": "Bearer stand-in"}
    routes = [bench.Route("floor py", floor, "/v1/chat/completions", auth, {}, bench.V1_TOKEN, True, helpers[1].pid)]
    try:
        if not ours.poll(120):
            raise SystemExit("the studio service did not start within 120 s")
        ours.recv()
        for name in ("uvicorn", *UNDER_STUDIO_SERVER, *(("granian",) if granian else ())):
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
        routes.append(
            bench.Route("studio /v1", studio_port, "/v1/chat/completions", {}, {}, bench.V1_TOKEN, True, studio.pid)
        )
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
                print(f"{streams:>3} streams {route.name:>14}: {cpu * 1e6:6.1f} us per chunk ({ratio:.2f}x floor py)")
        per: dict[str, list[float]] = {route.name: [] for route in routes}
        for block in range(4):
            for route in routes if block % 2 == 0 else routes[::-1]:
                per[route.name].append(asyncio.run(bench.cpu_per_request(route, 128, 8)))
        for name, values in per.items():
            blocks = " ".join(f"{v:.3f}" for v in values)
            print(f"CPU per request {name:>14}: {statistics.median(values):.3f} ms (blocks: {blocks})")
    finally:
        for process in servers:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
        for helper in helpers:  # SIGTERM: the studio's uvicorn shuts down, the others just end
            helper.terminate()
            helper.join(30)
            if helper.is_alive():
                helper.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8, help="rounds at 8 streams (half as many at 32)")
    parser.add_argument("--serve", nargs=2, metavar=("SERVER", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    granian = importlib.util.find_spec("granian") is not None
    if not granian:
        print("granian is not installed here (.venv/bin/pip install granian for its row)", flush=True)
    measure(args.rounds, granian)


if __name__ == "__main__":
    main()
