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
``net`` is that less what the process spends anyway while llama-server streams
(its CPU rate over the direct rounds: uvicorn's ticks, the supervisor's threads;
each relay's own, a floor's or an ``--against`` studio's, watched over the same
rounds), which dominates when a loaded machine leaves llama-server few tokens/s.

With the stand-in, the largest concurrency also runs Anthropic's ``/v1/messages``
(against the same request sent directly) and Ollama's ``/api/chat`` on the
Ollama listener (against the direct request with usage, as it sends it). At the
end, ``CPU per request``: the CPU time one request costs the process that relays
it, over ``--requests`` one-token streams, 8 at a time (the studio's ``/v1`` and
``/v1/messages``, and the Python floor's; with ``--runs``, once a run, the paths taking turns, and the
medians), then with a ``--long-kb`` conversation (an
agent sends its whole context every turn: what the studio parses and writes again).

``--after-fan-out`` ends with the idle studio's CPU from 20 to 40 s after a fan-out of the largest
concurrency, and the connections it then holds to the upstream: what a burst leaves behind.

Each concurrency starts with one round per path that is not recorded: the studio keeps as many spare
connections as the last fan-outs wanted, so a new, larger fan-out's first round connects on the way, and
whichever studio path came first paid that alone. The table is of fan-outs the studio has seen before;
the added TTFT of that first round (``studio /v1``'s and the Python floor's) is printed below it.

CPU per chunk is the steady number on a loaded machine; the ratios need
several runs (``--runs`` repeats the whole set and prints the medians).
Targets (issue 19): CPU per chunk <= 40 us at 8 streams, tokens/s >= 0.99x at
1, 8 and 32 streams, added TTFT p50 <= 1 ms. Issue 33, with the stand-in: added
TTFT p50 within the Python floor's + 1 ms at 1 stream and + 3 ms at 8 and 32, CPU
per request <= 1 ms, CPU per chunk <= 1.3x the Python floor's at 8 and 32 streams;
with the floor, each run prints these under its table, met or missed (``targets``).
``--split`` also separates, at 8 and 32 streams, what one more chunk costs from what a
stream costs besides (rounds of 16 and 256 tokens): at 64 tokens a stream's
set-up and end weigh as much in the CPU per chunk as the chunks themselves. Each
split first waits out the spares' demand window (``studio.http.wire.upstream.DEMAND_WINDOW``),
as the CPU per request does after them: right after the 32-stream rounds the
studio still renews the 24 spares that 8 streams leave unused, every few seconds,
and a 5 s round of 256 tokens booked that (~0.6 ms of CPU a second, none of it a
chunk's) to its chunks. Issue 33's CPU per chunk reads the table's figure, a stream's
set-up and end included; the split's part per chunk is also set against its 1.3x.

With ``--stand-in`` a stand-in takes llama-server's place: a small asyncio
server that answers every request the way b11434 streams (its head at once,
as llama-server sends it when it starts reading the prompt, then the first
token's events in one chunk, one chunk per event after that with llama-server's event shapes, the timings and usage
chunks, ``[DONE]``, then it closes the connection) at ``--stand-in-tps``
tokens/s per stream, at next to no CPU. That measures the relay alone at the
token rate of a fast machine, however slow the real llama-server runs here;
the studio then routes to it through a stand-in for a ready resident model.
It also adds two floors, bare byte relays in processes of their own, to set the
studio's figures beside: ``floor py``, the least a Python relay can do per
chunk (one protocol callback and one write on uvloop, nothing parsed), and
``floor C`` (``scripts/floor_relay.c``, built with ``cc`` when there is one),
one epoll wake-up, one read and one write: what the kernel alone charges per
chunk on this machine right now, below which no relay in any language gets.

``--against REV`` (with ``--stand-in``) also runs the studio of an earlier revision (its
``studio``, ``launcher``, ``gguf`` and ``tests`` from ``git archive``, in a process of its own in
front of the same stand-in) as the path ``REV /v1``, interleaved with the others: a before and
after from one run, against the same direct rounds and the same floors. Its figures are in the
table, the split and the CPU per request beside today's.

The client is a bare asyncio socket per stream (``Connection: close``, bytes
counted, nothing parsed), cheap enough not to crowd the paths it measures.

    .venv/bin/python scripts/bench_proxy.py [--runs 3] [--tokens 64] [--streams 1,8,32]
    .venv/bin/python scripts/bench_proxy.py --stand-in [--stand-in-tps 50] [--split] [--after-fan-out] [--against REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

#: This checkout: its packages are the studio measured (an ``--against`` revision's come from its ``git archive``).
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.process import free_port

if TYPE_CHECKING:  # the studio is imported in the processes that serve it, never at the bench's start
    from fastapi import FastAPI

    from tests.standin_manager import StandInModel

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]
#: The model the requests name: the resident's name in both runs, so the studio routes by a look-up, as for a
#: client that names a model from ``/v1/models`` (another name is first checked as a file path, on a thread).
MODEL = "gemma-3-270m-Q4_K_M"
N_PARALLEL = 32
#: Rounds per concurrency in one run: enough single streams for a TTFT percentile, fewer of the long rounds.
ROUNDS = {1: 10, 8: 4, 32: 2}
#: A streamed token: OpenAI's delta with string content (the first chunk's ``"content":null`` is no token).
V1_TOKEN = re.compile(rb'"content":"')
#: A token in Anthropic's Messages stream.
ANTHROPIC_TOKEN = re.compile(rb'"type":"text_delta"')
#: A token in Ollama's NDJSON chunks (the final chunk's empty content is none).
OLLAMA_TOKEN = re.compile(rb'"content": ?"[^"]')
#: Each of Ollama's NDJSON chunks.
OLLAMA_CHUNK = b'"done":'
#: A token in ``/api/chat``'s typed events.
GUI_TOKEN = re.compile(rb'"type": ?"content"')
EVENT = b"data: "
#: The end of a chunked body (neither llama-server nor uvicorn sends trailers).
LAST_CHUNK = b"\r\n0\r\n\r\n"


def serve(port: int, conn: Connection, stand_in: int | None, ollama_port: int | None = None) -> None:
    """Run the studio service on ``port`` as ``ggstudio serve`` does; send (model, URL, auth headers) when ready.

    With ``stand_in`` (a port) its one model is the stand-in llama-server there, and the
    Ollama listener serves on ``ollama_port``.
    """
    if stand_in is not None:
        serve_stand_in(port, conn, stand_in, ollama_port)
        return
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
        manager = ModelManager(
            catalog=Catalog([model.parent]),
            binary=binary,
            make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
            caps=probe(binary, cache_dir=root / "cache"),
            files_root=root,
        )
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


def stand_in_studio(upstream: int, recording: bool = True) -> tuple[FastAPI, StandInModel]:
    """The studio app in front of the stand-in llama-server on ``upstream``, and the model it routes to.

    Its manager is the tests' stand-in (``tests.standin_manager``): one ready resident
    model at the stand-in's URL, what the request path asks of the real one. It keeps a history
    database in a folder of its own, as ``ggstudio serve`` does.
    """
    from studio.history.service import History
    from studio.http.app import create_app
    from tests.standin_manager import StandInManager, StandInModel

    loaded = StandInModel(
        name=MODEL, url=f"http://127.0.0.1:{upstream}", auth_headers={"Authorization": "Bearer stand-in"}
    )
    # a history database of its own, as ``ggstudio serve`` has: what the studio writes there (the activity
    # records) is in the CPU measured, its writer thread's included
    history = History(Path(tempfile.mkdtemp(prefix="bench-history-")))
    if recording:
        return create_app(StandInManager(loaded), history=history), loaded  # type: ignore[arg-type]
    return create_app(StandInManager(loaded), history=history, activity_kept=None), loaded  # type: ignore[arg-type]


def serve_stand_in(port: int, conn: Connection, upstream: int, ollama_port: int | None, recording: bool = True) -> None:
    """The studio service (and its Ollama listener) in front of the stand-in llama-server on ``upstream``; without
    ``recording``, one that makes no activity records (the config's ``activity_days = 0``)."""
    from studio.http.server import run_service

    try:
        from studio.http.clients.ollama_app import create_ollama_app
    except ModuleNotFoundError:  # a revision from before studio/http/ was split into folders (``--against``)
        from studio.http.ollama_app import create_ollama_app  # type: ignore[no-redef]

    app, loaded = stand_in_studio(upstream, recording)
    run_service(
        app,
        host="127.0.0.1",
        port=port,
        announce=lambda: conn.send((loaded.name, loaded.url, loaded.auth_headers)),
        ollama_app=create_ollama_app(app) if ollama_port is not None else None,
        ollama_port=ollama_port,
    )


#: The paths of ``--activity-off``'s two studios, alike but for the recording: each serves its own /v1 rounds
#: only, where "studio /v1" also serves the other dialects' rounds (a few percent per chunk of its own).
UNRECORDED = "no records /v1"
RECORDED = "records /v1"

#: The top-level packages an earlier revision's studio is imported from (its own, not this checkout's).
PACKAGES = ("studio", "launcher", "gguf", "tests")


def serve_earlier(root: str, port: int, conn: Connection, upstream: int, ollama_port: int) -> None:
    """``serve_stand_in`` with the packages of the revision unpacked at ``root`` instead of this checkout's.

    It listens for Ollama too (nothing is asked there), as today's studio does: the same two listeners'
    background in both processes' CPU.

    The bench module imported this checkout's ``launcher`` on the way here: those modules are dropped and
    this checkout leaves ``sys.path``, so that nothing of today's is mixed in.
    """
    for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.path[:] = [root, *(p for p in sys.path if Path(p or ".").resolve() != REPO)]
    import studio

    if not Path(studio.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise SystemExit(f"the earlier studio was imported from {studio.__file__}, not from {root}")
    serve_stand_in(port, conn, upstream, ollama_port)


def unpack(rev: str, into: Path) -> str:
    """Unpack ``rev``'s packages (``PACKAGES``) into ``into``; its short commit id."""
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", f"{rev}^{{commit}}"], capture_output=True, text=True
    )
    if found.returncode != 0:
        raise SystemExit(f"--against {rev}: no such revision here ({found.stderr.strip()})")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev, *PACKAGES], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"--against {rev}: git archive failed: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    build_extensions(into)
    return found.stdout.strip()


#: The C extensions a revision may have (module, source), where each has lived.
EXTENSIONS = (
    ("gguf._skip", "gguf/_skip.c"),
    ("studio.http._pump", "studio/http/_pump.c"),
    ("studio.http.wire._pump", "studio/http/wire/_pump.c"),
)


def build_extensions(root: Path) -> None:
    """Build the unpacked revision's own C extensions in place, as its ``make`` would: without its chunk pump an
    earlier studio would relay in Python, and the before and after would not be like for like."""
    found = [(module, source) for module, source in EXTENSIONS if (root / source).is_file()]
    script = (
        "from setuptools import Extension, setup; "
        f"setup(name='earlier', ext_modules=[Extension(m, [s]) for m, s in {found!r}], "
        "script_args=['-q', 'build_ext', '--inplace'])"
    )
    built = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"--against: building the revision's C extensions failed: {built.stderr.strip()[-500:]}")


def _sse(data: dict[str, object], name: str | None = None) -> bytes:
    """One server-sent event as llama-server writes it (``event:`` line when named)."""
    payload = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    return payload if name is None else b"event: " + name.encode() + b"\n" + payload


def _chunk(*events: bytes) -> bytes:
    """Server-sent events in one HTTP chunk: what llama-server writes for one result."""
    payload = b"".join(events)
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(data: dict[str, object], name: str | None = None) -> bytes:
    """One server-sent event in its own HTTP chunk."""
    return _chunk(_sse(data, name))


def stand_in_llama_server(port: int, tokens_per_s: float) -> None:
    """Answer every chat completion as llama-server b11434 streams one, at ``tokens_per_s`` per stream.

    A stream's first token comes one token period after its request (its prompt's turn), and with it the
    response's head and the role chunk: b11434 waits for a stream's first result before it answers at all
    (``handle_completions_impl`` in ``tools/server/server-context.cpp``), and that first result carries the
    role delta and the first token's delta together (``to_json_oaicompat_chat_stream``; for Anthropic,
    ``message_start`` and ``content_block_start`` with the first delta), written as one HTTP chunk. Its next ones
    come, as llama-server's decode loop makes them (``update_slots``: one batch a step, a token for each
    slot that generates), on steps of one clock all streams share: streams under way together send their
    tokens together, however far apart their requests came. (Each stream on its own timer kept the
    spread of its requests' arrival for its whole length, which no llama-server does, and a relay paid
    one wake-up per chunk where a real one wakes once for several.)
    """
    head = (
        b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5, max=100\r\nX-Accel-Buffering: no\r\n\r\n"
    )
    base = {
        "created": 1764621234,
        "id": "chatcmpl-Pk9Zr1b2c3d4e5f6g7h8i9j0k1l2m3n4",
        "model": "stand-in",
        "system_fingerprint": "b11434-0a1b2c3d",
        "object": "chat.completion.chunk",
    }

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in request.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = json.loads(await reader.readexactly(length))
            # llama-server's own precedence (``oaicompat_chat_params_parse``): ``n_predict`` overrides ``max_tokens``,
            # which the studio fills with the context size when a request names none (Ollama's ``num_predict``
            # arrives as ``n_predict``)
            n = int(body.get("n_predict") or body.get("max_tokens") or 16)
            if request.startswith(b"POST /v1/messages "):
                await anthropic(writer, n)
                return
            role = {
                "choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
                **base,
            }
            writer.write(head)  # b11434 sends a stream's head as it starts reading the prompt, its tokens after
            for i in range(n):
                await (asyncio.sleep(1 / tokens_per_s) if i == 0 else step())
                if writer.transport.is_closing():
                    return  # the client left: llama-server stops generating
                token = {
                    "choices": [{"finish_reason": None, "index": 0, "delta": {"content": " sea" if i % 2 else " the"}}],
                    **base,
                }
                writer.write(_chunk(_sse(role), _sse(token)) if i == 0 else _event(token))
            timings = {
                "prompt_n": 14,
                "prompt_ms": 20.1,
                "predicted_n": n,
                "predicted_ms": n / tokens_per_s * 1000,
                "predicted_per_second": tokens_per_s,
            }
            writer.write(
                _event({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **base, "timings": timings})
            )
            if (body.get("stream_options") or {}).get("include_usage"):
                writer.write(
                    _event(
                        {
                            "choices": [],
                            **base,
                            "usage": {"completion_tokens": n, "prompt_tokens": 14, "total_tokens": n + 14},
                            "timings": timings,
                        }
                    )
                )
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client left: llama-server stops too
        finally:
            writer.close()  # as b11434 does after every stream

    async def anthropic(writer: asyncio.StreamWriter, n: int) -> None:
        """Anthropic's Messages stream as b11434 sends it (``format_anthropic_sse``: an ``event:`` line a data)."""
        start = [
            _sse(
                {
                    "type": "message_start",
                    "message": {
                        "id": base["id"],
                        "type": "message",
                        "role": "assistant",
                        "content": [],
                        "model": "stand-in",
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"cache_read_input_tokens": 0, "input_tokens": 14, "output_tokens": 0},
                    },
                },
                "message_start",
            ),
            _sse(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                "content_block_start",
            ),
        ]
        writer.write(head)  # as for a chat: the head first, the tokens after the prompt
        for i in range(n):
            await (asyncio.sleep(1 / tokens_per_s) if i == 0 else step())
            if writer.transport.is_closing():
                return
            text = {"type": "text_delta", "text": " sea" if i % 2 else " the"}
            delta = _sse({"type": "content_block_delta", "index": 0, "delta": text}, "content_block_delta")
            writer.write(_chunk(*start, delta) if i == 0 else _chunk(delta))
        writer.write(
            _event({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + _event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                    "usage": {"output_tokens": n},
                },
                "message_delta",
            )
            + _event({"type": "message_stop"}, "message_stop")
            + b"0\r\n\r\n"
        )
        await writer.drain()

    steps: list[asyncio.Future[None]] = []  # the next step of the shared clock, while one is awaited

    def step() -> asyncio.Future[None]:
        """The next step of the decode clock: done at the next multiple of the token period."""
        if not steps:
            loop = asyncio.get_running_loop()
            period = 1 / tokens_per_s
            at = (loop.time() // period + 1) * period
            steps.append(loop.create_future())
            loop.call_at(at, lambda: steps.pop().set_result(None))
        return steps[0]

    async def main() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", port, backlog=256)
        await server.serve_forever()

    asyncio.run(main())


def floor_relay(port: int, upstream: int) -> None:
    """The least a Python relay does per chunk: one callback and one write (asyncio protocols on uvloop).

    Each client's bytes go to a new connection to ``upstream`` and back as they
    arrive; nothing is parsed, no coroutine wakes per chunk.
    """
    try:
        import uvloop
    except ImportError:
        uvloop = None

    class Back(asyncio.Protocol):
        """The upstream side: what arrives goes straight to the client."""

        def __init__(self, client: asyncio.Transport) -> None:
            self.client = client

        def data_received(self, data: bytes) -> None:
            self.client.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.client.close()

    class Front(asyncio.Protocol):
        """The client side: its bytes go upstream once the connection there is made."""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.upstream: asyncio.Transport | None = None
            self.early = b""
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            self.upstream, _ = await loop.create_connection(lambda: Back(self.transport), "127.0.0.1", upstream)
            self.upstream.write(self.early)

        def data_received(self, data: bytes) -> None:
            if self.upstream is None:
                self.early += data
            else:
                self.upstream.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.upstream is not None:
                self.upstream.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Front, "127.0.0.1", port, backlog=256)
        await server.serve_forever()

    if uvloop is not None:
        uvloop.run(main())
    else:
        asyncio.run(main())


def c_floor(port: int, upstream: int) -> subprocess.Popen[bytes] | None:
    """Start ``floor_relay.c`` (built with ``cc`` here) on ``port``; ``None`` without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("no C compiler: the floor C path is left out", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as build_dir:  # the running relay outlives its file
        binary = Path(build_dir) / "floor_relay"
        subprocess.run([cc, "-O2", "-o", str(binary), str(Path(__file__).with_name("floor_relay.c"))], check=True)
        return subprocess.Popen([str(binary), str(port), str(upstream)])


@dataclass
class Route:
    """One way to the model: where to send, what to send, and how a token looks in what comes back."""

    name: str
    port: int
    target: str
    headers: dict[str, str]
    extra: dict[str, object]
    token: re.Pattern[bytes]
    studio: bool  # CPU per chunk is reported (the studio's paths and the floor)
    pid: int  # the process whose CPU time the path's rounds are charged (the studio's for direct paths too)
    only: tuple[int, ...] = ()  # the concurrencies it runs at (none named: all)
    event: bytes = EVENT  # what starts each chunk in what comes back


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
    #: CPU time over this path's rounds of other processes watched meanwhile (a baseline's: their background)
    watched_s: dict[int, float] = field(default_factory=dict)


async def one_stream(path: Route, tokens: int) -> Stream:
    """Stream one completion on a fresh connection; TTFT and tokens/s as the client sees them."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": PROMPT,
            "max_tokens": tokens,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
            **path.extra,
        }
    ).encode()
    head = [
        f"POST {path.target} HTTP/1.1",
        f"Host: 127.0.0.1:{path.port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in path.headers.items()),
    ]
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
    return Stream(first - t0, (n - 1) / (last - first), data.count(path.event))


def conversation(kilobytes: int) -> list[dict[str, str]]:
    """A conversation of about ``kilobytes`` KB as an agent sends it again each turn: 50 messages, taking turns."""
    line = "The sea holds the ship; the wind fills the sails; the crew reads the stars. "
    text = (line * (kilobytes * 1024 // 50 // len(line) + 1))[: kilobytes * 1024 // 50]
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(50)]


async def one_request(path: Route, messages: list[dict[str, str]] = PROMPT, *, tokens: int = 1) -> None:
    """One streamed completion of ``tokens`` tokens on a fresh connection, read to its end (no rates measured:
    ``scripts/bench_instructions.py`` streams under valgrind, where a stream's tokens may come in one read)."""
    body = json.dumps(
        {"model": MODEL, "messages": messages, "max_tokens": tokens, "stream": True, **path.extra}
    ).encode()
    head = (
        f"POST {path.target} HTTP/1.1\r\nHost: 127.0.0.1:{path.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in path.headers.items())
        + "\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", path.port)
    writer.write(head.encode() + body)
    data = bytearray()
    try:
        while chunk := await reader.read(65536):
            data += chunk
    finally:
        writer.close()
    if not data.startswith(b"HTTP/1.1 200") or not path.token.search(data):
        raise SystemExit(f"{path.name}: {bytes(data[:300])!r}")


async def requests(path: Route, n: int, at_once: int, messages: list[dict[str, str]] = PROMPT, tokens: int = 1) -> int:
    """``n`` streamed requests of ``tokens`` tokens (``one_request``), ``at_once`` at a time; how many were sent (a
    whole number of ``at_once``)."""
    for _ in range(n // at_once):
        await asyncio.gather(*(one_request(path, messages, tokens=tokens) for _ in range(at_once)))
    return n // at_once * at_once


async def cpu_per_request(path: Route, n: int, at_once: int, messages: list[dict[str, str]] = PROMPT) -> float:
    """Milliseconds of ``path.pid``'s CPU per request over ``n`` one-token requests, ``at_once`` at a time."""
    before = studio_cpu(path.pid)
    sent = await requests(path, n, at_once, messages)
    return (studio_cpu(path.pid) - before) / sent * 1000


async def warm_up(paths: list[Route]) -> None:
    for p in paths:
        await one_stream(p, 8)


def studio_cpu(pid: int) -> float:
    """Seconds of CPU ``pid`` has used, all its threads (ended ones too), to the nanosecond: Linux's process CPU
    clock (``clock_getcpuclockid``'s id); psutil's figure, elsewhere, moves in 10 ms clock ticks, a twentieth of a
    short round's."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # the kernel's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:  # not Linux
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system


async def round_of(path: Route, samples: Samples, concurrency: int, tokens: int, watch: Sequence[int] = ()) -> None:
    """One round of ``concurrency`` streams on ``path``, added to ``samples``; the CPU of the processes in ``watch``
    over it too."""
    others = {pid: studio_cpu(pid) for pid in watch}
    before, t0 = studio_cpu(path.pid), time.perf_counter()
    streams = await asyncio.gather(*(one_stream(path, tokens) for _ in range(concurrency)))
    samples.cpu_s += studio_cpu(path.pid) - before
    for pid, was in others.items():
        samples.watched_s[pid] = samples.watched_s.get(pid, 0.0) + studio_cpu(pid) - was
    samples.wall_s += time.perf_counter() - t0
    samples.streams += streams
    samples.events += sum(s.events for s in streams)


def idle_rate(pid: int, seconds: float) -> float:
    """Seconds of CPU a second ``pid`` uses over the next ``seconds``, while nothing is asked of it."""
    before, t0 = studio_cpu(pid), time.perf_counter()
    time.sleep(seconds)
    return (studio_cpu(pid) - before) / (time.perf_counter() - t0)


def after_fan_out(studio: Route, fan_out: int, upstream_port: int, idle_before: float) -> None:
    """Print the studio's idle CPU from 20 to 40 s after ``fan_out`` one-token streams at once (past the spares'
    demand window: ``studio.http.wire.upstream.DEMAND_WINDOW``), and the connections it then holds to the upstream,
    beside its idle CPU at the start of the run."""
    asyncio.run(cpu_per_request(studio, fan_out, fan_out))
    time.sleep(20)
    rate = idle_rate(studio.pid, 20)
    held = sum(1 for c in psutil.Process(studio.pid).net_connections() if c.raddr and c.raddr.port == upstream_port)
    print(
        f"studio idle 20-40 s after {fan_out} streams at once: {rate * 1000:.2f} ms CPU per second "
        f"(at the start: {idle_before * 1000:.2f}), {held} connection(s) to the upstream held"
    )


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Row:
    """One run's figures for one path at one concurrency."""

    ttft_p50: float
    ttft_p90: float
    tps: float
    #: TTFT p50 of the round before the recorded ones, the first at this concurrency (see the module docstring).
    first_ttft_p50: float
    cpu_us_per_chunk: float | None = None
    #: Less what the studio spends anyway while llama-server streams (its rate over the direct rounds).
    net_us_per_chunk: float | None = None


#: One run's rows, by (concurrency, path name).
Rows = dict[tuple[int, str], Row]


async def run_once(
    paths: list[Route], baseline_of: dict[str, str], streams: Sequence[int], tokens: int, rounds: dict[int, int]
) -> Rows:
    """At each concurrency one round per path that is not recorded (a new fan-out's first: its TTFT is kept
    apart, see the module docstring), then the recorded rounds, interleaved."""
    rows: Rows = {}
    for concurrency in streams:
        here = [p for p in paths if not p.only or concurrency in p.only]
        first = {p.name: Samples() for p in here}
        for p in here:
            await round_of(p, first[p.name], concurrency, tokens)
        samples = {p.name: Samples() for p in here}
        # a baseline's rounds also watch the other processes measured against it: their background
        watch = {
            b.name: sorted({p.pid for p in here if baseline_of.get(p.name) == b.name and p.pid != b.pid}) for b in here
        }
        for i in range(rounds.get(concurrency, 2)):
            order = here if i % 2 == 0 else here[::-1]  # interleaved both ways so drift hits every path alike
            for p in order:
                await round_of(p, samples[p.name], concurrency, tokens, watch[p.name])
        print(f"  {concurrency} streams done, load {psutil.getloadavg()[0]:.1f}", file=sys.stderr)
        for p in here:
            s = samples[p.name]
            row = Row(
                pct([x.ttft for x in s.streams], 0.5) * 1000,
                pct([x.ttft for x in s.streams], 0.9) * 1000,
                statistics.median(x.tokens_per_s for x in s.streams),
                pct([x.ttft for x in first[p.name].streams], 0.5) * 1000,
            )
            if p.studio:
                base = next(b for b in paths if b.name == baseline_of[p.name])
                row.cpu_us_per_chunk = s.cpu_s / s.events * 1e6
                # the background of the process charged: its rate while the baseline's rounds ran
                spent = samples[base.name].cpu_s if base.pid == p.pid else samples[base.name].watched_s[p.pid]
                rate = spent / samples[base.name].wall_s
                row.net_us_per_chunk = (s.cpu_s - rate * s.wall_s) / s.events * 1e6
            rows[concurrency, p.name] = row
    return rows


async def cpu_split(paths: list[Route], concurrency: int, low: int, high: int, rounds: int) -> Parts:
    """Each path's CPU as a part per chunk (us) plus a part per stream (ms), from rounds of ``low`` and ``high``
    tokens.

    CPU per chunk at one stream length mixes the two: a stream's set-up and end (the CPU per request)
    spread over its chunks. The slope between two lengths is what one more chunk costs, the intercept
    what a stream costs besides.
    """
    samples = {(p.name, t): Samples() for p in paths for t in (low, high)}
    for i in range(rounds):
        for t in (low, high):
            for p in paths if i % 2 == 0 else paths[::-1]:
                await round_of(p, samples[p.name, t], concurrency, t)
    parts = {}
    for p in paths:
        lo, hi = samples[p.name, low], samples[p.name, high]
        cpu_lo, cpu_hi = lo.cpu_s / len(lo.streams), hi.cpu_s / len(hi.streams)
        ev_lo, ev_hi = lo.events / len(lo.streams), hi.events / len(hi.streams)
        per_chunk = (cpu_hi - cpu_lo) / (ev_hi - ev_lo)
        parts[p.name] = per_chunk * 1e6, (cpu_lo - per_chunk * ev_lo) * 1e3
    return parts


#: A split's figures by path: CPU per chunk (us), per stream (ms).
Parts = dict[str, tuple[float, float]]


def print_split(
    concurrency: int, low: int, high: int, rounds: int, runs: list[Parts], pairs: list[tuple[str, str]]
) -> None:
    """Print the medians of ``runs`` of ``cpu_split``; against the floor's: the part per chunk as a ratio, the part
    per stream as a difference (the floor's is near nothing, within noise of zero, and a ratio to it read -172x in
    one run). For each of ``pairs`` (after, before), each run's ratio per chunk and difference per stream, then
    their medians: the intercept moves by a tenth of a millisecond from one run to the next."""
    print(
        f"CPU split at {concurrency} streams ({low} and {high} tokens, {rounds} rounds each, medians of {len(runs)}): "
        "per chunk + per stream"
    )
    parts = {name: tuple(statistics.median(r[name][i] for r in runs) for i in (0, 1)) for name in runs[0]}
    floor = parts.get("floor py")
    for name, (chunk, stream) in parts.items():
        ratio = ""
        if floor is not None and name != "floor py":
            ratio = f" ({chunk / floor[0]:.2f}x the floor py's per chunk, {stream - floor[1]:+.3f} ms per stream)"
            if concurrency in CPU_OVER_FLOOR:
                ok = chunk / floor[0] <= CPU_OVER_FLOOR[concurrency]
                ratio += f", per chunk alone <= {CPU_OVER_FLOOR[concurrency]:g}x: {verdict(ok)}"
        print(f"  {name:>14} {chunk:6.1f} us + {stream:5.3f} ms{ratio}")
    for after, before in pairs:
        if after not in parts or before not in parts:
            continue
        ratios = [r[after][0] / r[before][0] for r in runs]
        deltas = [r[after][1] - r[before][1] for r in runs]
        print(
            f"    {after} over {before}, run by run: per chunk {' '.join(f'{x:.3f}' for x in ratios)} "
            f"(median {statistics.median(ratios):.3f}x); per stream {' '.join(f'{x:+.3f}' for x in deltas)} "
            f"(median {statistics.median(deltas):+.3f} ms)"
        )


def median_difference(runs: list[Rows], c: int, name: str, other: str, attr: str) -> float:
    """The median over the runs of ``name``'s figure ``attr`` at ``c`` streams less ``other``'s in the same run."""
    return statistics.median(getattr(r[c, name], attr) - getattr(r[c, other], attr) for r in runs)


def median_ratio(runs: list[Rows], c: int, name: str, other: str, attr: str) -> float:
    """The median over the runs of ``name``'s figure ``attr`` at ``c`` streams over ``other``'s in the same run."""
    return statistics.median(getattr(r[c, name], attr) / getattr(r[c, other], attr) for r in runs)


def report(
    runs: list[Rows],
    paths: list[Route],
    baseline_of: dict[str, str],
    streams: Sequence[int],
    before: set[str],
    pairs: Sequence[tuple[str, str]] = (),
) -> None:
    """Print the table of ``runs``, issue 33's targets, and each of ``pairs``' (after, before) CPU per chunk ratio."""

    def med(c: int, name: str, attr: str) -> float:
        return statistics.median(getattr(r[c, name], attr) for r in runs)

    def added(c: int, name: str, attr: str) -> float:
        """``name``'s TTFT figure ``attr`` less its baseline's (median over the runs)."""
        return median_difference(runs, c, name, baseline_of[name], attr)

    print(f"medians of {len(runs)} run(s)")
    print(
        f"{'streams':>7} {'path':>14} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>7} | {'+TTFT p50':>9} "
        f"{'+TTFT p90':>9} {'tok/s x':>8} {'CPU us/chunk':>12} {'net':>6}"
    )
    for c in streams:
        for p in paths:
            if p.only and c not in p.only:
                continue
            line = (
                f"{c:>7} {p.name:>14} {med(c, p.name, 'ttft_p50'):9.2f} {med(c, p.name, 'ttft_p90'):9.2f} "
                f"{med(c, p.name, 'tps'):7.2f} |"
            )
            if p.studio:
                base = baseline_of[p.name]
                added50, added90 = added(c, p.name, "ttft_p50"), added(c, p.name, "ttft_p90")
                ratio = median_ratio(runs, c, p.name, base, "tps")
                cpu = statistics.median(r[c, p.name].cpu_us_per_chunk for r in runs)
                net = statistics.median(r[c, p.name].net_us_per_chunk for r in runs)
                line += f" {added50:+9.2f} {added90:+9.2f} {ratio:7.3f}x {cpu:12.1f} {net:6.1f}"
            print(line)

    names = {p.name for p in paths}
    if "floor py" in names:
        for name in ("studio /v1", *sorted(before)):
            targets(runs, name, baseline_of[name], streams)

    for after, earlier in pairs:
        for c in streams:
            chunk = median_ratio(runs, c, after, earlier, "cpu_us_per_chunk")
            net = median_ratio(runs, c, after, earlier, "net_us_per_chunk")
            print(f"{after} over {earlier}, {c} streams: CPU per chunk {chunk:.3f}x (net {net:.3f}x), run by run")

    firsts = [p.name for p in paths if p.name in ("studio /v1", "floor py") or p.name in before]
    print("+TTFT p50 of each concurrency's first round, not in the table (the studio's spares a smaller fan-out's):")
    for c in streams:
        figures = [f"{name} {added(c, name, 'first_ttft_p50'):+.2f}" for name in firsts]
        print(f"{c:>7} streams: {', '.join(figures)}")


#: Issue 33's targets against the Python floor, by concurrency: added TTFT p50 at most the floor's + this many ms.
TTFT_OVER_FLOOR = {1: 1.0, 8: 3.0, 32: 3.0}
#: ... and CPU per chunk at most this many times the floor's (at 8 and 32 streams).
CPU_OVER_FLOOR = {8: 1.3, 32: 1.3}


def verdict(ok: bool) -> str:
    """How a figure stands against its target, as every target line says it."""
    return "met" if ok else "MISSED"


def targets(runs: list[Rows], name: str, baseline: str, streams: Sequence[int]) -> None:
    """Print ``name``'s figures against issue 33's targets: each a median over the runs of the run's own ratio or
    difference to ``floor py`` (the targets are set against the floor measured in the same run), tokens/s to
    ``baseline``'s."""

    print(f"issue 33's targets for {name} (medians over the runs of each run's figure against floor py's):")
    for c in streams:
        over = median_difference(runs, c, name, "floor py", "ttft_p50")
        parts = [f"+TTFT p50 {over:+.2f} ms over the floor's"]
        if c in TTFT_OVER_FLOOR:
            parts[-1] += f" (<= +{TTFT_OVER_FLOOR[c]:g}: {verdict(over <= TTFT_OVER_FLOOR[c])})"
        ratio = median_ratio(runs, c, name, "floor py", "cpu_us_per_chunk")
        parts.append(f"CPU per chunk {ratio:.2f}x the floor's")
        if c in CPU_OVER_FLOOR:
            parts[-1] += f" (<= {CPU_OVER_FLOOR[c]:g}x: {verdict(ratio <= CPU_OVER_FLOOR[c])})"
        tps = median_ratio(runs, c, name, baseline, "tps")
        parts.append(f"tokens/s {tps:.3f}x {baseline} (>= 0.99x: {verdict(tps >= 0.99)})")
        print(f"{c:>7} streams: {'; '.join(parts)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole set; medians are printed")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--streams", default="1,8,32", help="concurrencies, comma-separated")
    parser.add_argument(
        "--rounds",
        default=None,
        help="rounds per concurrency, comma-separated like --streams (default 10,4,2 for 1,8,32)",
    )
    parser.add_argument("--no-gui", action="store_true", help="leave out /api/chat")
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="a stand-in streams in llama-server's place (the relay alone); adds the floor paths",
    )
    parser.add_argument("--stand-in-tps", type=float, default=50.0, help="the stand-in's tokens/s per stream")
    parser.add_argument(
        "--requests", type=int, default=256, help="one-token requests for the CPU per request (0: leave it out)"
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="with --stand-in: also split CPU into a part per chunk and a part per stream (16 and 256 tokens, 8 and 32 "
        "streams)",
    )
    parser.add_argument(
        "--request-runs",
        type=int,
        default=0,
        help="measure the CPU per request this many times, the paths taking turns (default: --runs); each takes a "
        "second or so, where a run of the rest takes a minute",
    )
    parser.add_argument("--split-runs", type=int, default=1, help="with --split: repeat it; medians are printed")
    parser.add_argument("--split-rounds", type=int, default=4, help="with --split: rounds of each length a run")
    parser.add_argument(
        "--after-fan-out",
        action="store_true",
        help="with --stand-in: also the idle studio's CPU 20-40 s after a fan-out, and the connections it holds",
    )
    parser.add_argument(
        "--long-kb",
        type=int,
        default=100,
        help="the CPU per request also with a conversation of this many KB, a quarter as many requests (0: not)",
    )
    parser.add_argument(
        "--against",
        metavar="REV",
        help="with --stand-in: also the studio of git revision REV, as the path 'REV /v1' (a before and after)",
    )
    parser.add_argument(
        "--activity-off",
        action="store_true",
        help="with --stand-in: also two studios alike but for the activity records, each serving its /v1 rounds "
        "only: 'records /v1' and 'no records /v1' (activity_days = 0): what recording costs, in the same run",
    )
    args = parser.parse_args()
    if args.activity_off and not args.stand_in:
        raise SystemExit("--activity-off needs --stand-in")
    if args.against and not args.stand_in:
        raise SystemExit("--against needs --stand-in: an earlier studio is run in front of the stand-in")
    streams = [int(s) for s in args.streams.split(",")]
    if max(streams) > N_PARALLEL:
        raise SystemExit(f"at most {N_PARALLEL} streams: llama-server runs {N_PARALLEL} slots")
    rounds = dict(zip(streams, (int(r) for r in args.rounds.split(",")), strict=False)) if args.rounds else ROUNDS
    spawn = multiprocessing.get_context("spawn")
    port, helpers = free_port(), []
    stand_in = floor = floor_c = ollama_port = None
    relay_c: subprocess.Popen[bytes] | None = None
    if args.stand_in:
        stand_in, floor, floor_c, ollama_port = free_port(), free_port(), free_port(), free_port()
        helpers = [
            spawn.Process(target=stand_in_llama_server, args=(stand_in, args.stand_in_tps), daemon=True),
            spawn.Process(target=floor_relay, args=(floor, stand_in), daemon=True),
        ]
    ours, theirs = multiprocessing.Pipe()
    service = spawn.Process(target=serve, args=(port, theirs, stand_in, ollama_port), daemon=True)
    earlier: tuple[str, int, multiprocessing.process.BaseProcess, Connection] | None = None
    unpacked = tempfile.TemporaryDirectory(prefix="bench-proxy-") if args.against else None
    if unpacked is not None and stand_in is not None:
        rev, earlier_port = unpack(args.against, Path(unpacked.name)), free_port()
        earlier_ours, earlier_theirs = multiprocessing.Pipe()
        process = spawn.Process(
            target=serve_earlier,
            args=(unpacked.name, earlier_port, earlier_theirs, stand_in, free_port()),
            daemon=True,
        )
        earlier = f"{rev} /v1", earlier_port, process, earlier_ours  # its path's name
        helpers.append(process)
    alike: list[tuple[str, int, multiprocessing.process.BaseProcess, Connection]] = []
    if args.activity_off and stand_in is not None:
        for path_name, recording in ((RECORDED, True), (UNRECORDED, False)):
            alike_port, (alike_ours, alike_theirs) = free_port(), multiprocessing.Pipe()
            process = spawn.Process(
                target=serve_stand_in,
                args=(alike_port, alike_theirs, stand_in, free_port(), recording),
                daemon=True,
            )
            alike.append((path_name, alike_port, process, alike_ours))
            helpers.append(process)
    for process in (*helpers, service):
        process.start()
    try:
        if floor_c is not None and stand_in is not None:
            relay_c = c_floor(floor_c, stand_in)
        if not ours.poll(300):
            raise SystemExit("the studio service did not start or the model did not load within 300 s")
        ready = ours.recv()
        if ready is None:
            raise SystemExit("the model failed to load")
        name, upstream, auth = ready
        up_port = int(upstream.rsplit(":", 1)[1])
        usage = {"stream_options": {"include_usage": True}}
        paths = [
            Route("direct", up_port, "/v1/chat/completions", auth, {}, V1_TOKEN, False, service.pid),
            Route("studio /v1", port, "/v1/chat/completions", {}, {}, V1_TOKEN, True, service.pid),
        ]
        baseline_of = {"studio /v1": "direct"}
        if floor is not None:
            paths.append(Route("floor py", floor, "/v1/chat/completions", auth, {}, V1_TOKEN, True, helpers[1].pid))
            baseline_of["floor py"] = "direct"
        if relay_c is not None:
            paths.append(Route("floor C", floor_c, "/v1/chat/completions", auth, {}, V1_TOKEN, True, relay_c.pid))
            baseline_of["floor C"] = "direct"
        if earlier is not None:
            earlier_name, earlier_port, process, earlier_ours = earlier
            deadline = time.monotonic() + 120
            while not earlier_ours.poll(0.2):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise SystemExit(f"the studio of {args.against} did not start (its error, if any, is above)")
            earlier_ours.recv()
            paths.append(Route(earlier_name, earlier_port, "/v1/chat/completions", {}, {}, V1_TOKEN, True, process.pid))
            baseline_of[earlier_name] = "direct"
        for path_name, alike_port, process, alike_ours in alike:
            if not alike_ours.poll(120):
                raise SystemExit(f"the studio of '{path_name}' did not start (its error, if any, is above)")
            alike_ours.recv()
            paths.append(Route(path_name, alike_port, "/v1/chat/completions", {}, {}, V1_TOKEN, True, process.pid))
            baseline_of[path_name] = "direct"
        if not args.no_gui:
            paths += [
                Route("direct+usage", up_port, "/v1/chat/completions", auth, usage, V1_TOKEN, False, service.pid),
                Route("studio /api", port, "/api/chat", {}, {}, GUI_TOKEN, True, service.pid),
            ]
            baseline_of["studio /api"] = "direct+usage"
        if ollama_port is not None:  # the other dialects' routes, at the fan-out that matters most
            fan_out = (max(streams),)
            ollama_options: dict[str, object] = {"options": {"num_predict": args.tokens}}
            paths += [
                Route("direct msgs", up_port, "/v1/messages", auth, {}, ANTHROPIC_TOKEN, False, service.pid, fan_out),
                Route("studio msgs", port, "/v1/messages", {}, {}, ANTHROPIC_TOKEN, True, service.pid, fan_out),
                Route(
                    "studio ollama",
                    ollama_port,
                    "/api/chat",
                    {},
                    ollama_options,
                    OLLAMA_TOKEN,
                    True,
                    service.pid,
                    fan_out,
                    OLLAMA_CHUNK,
                ),
            ]
            baseline_of |= {"studio msgs": "direct msgs", "studio ollama": "direct" if args.no_gui else "direct+usage"}
        what = f"stand-in at {args.stand_in_tps:g} tokens/s per stream" if args.stand_in else f"model {name}"
        print(
            f"{what}, {N_PARALLEL} slots, {args.tokens} tokens per stream, streams {args.streams}, "
            f"rounds {[rounds.get(c, 2) for c in streams]}, machine load {psutil.getloadavg()[0]:.1f} "
            f"on {psutil.cpu_count()} CPUs"
        )
        for _ in range(30):  # the helpers listen a moment after the studio announces
            try:
                asyncio.run(warm_up(paths))
                break
            except OSError:
                time.sleep(0.2)
        idle = idle_rate(service.pid, 5)
        print(f"studio process idle: {idle * 1000:.1f} ms CPU per second")
        runs = []
        for i in range(args.runs):
            runs.append(asyncio.run(run_once(paths, baseline_of, streams, args.tokens, rounds)))
            if args.runs > 1:
                print(f"run {i + 1}/{args.runs} done, load {psutil.getloadavg()[0]:.1f}", file=sys.stderr)
        before = ({earlier[0]} if earlier is not None else set()) | {name for name, *_ in alike}
        # (after, before): today's studio against each other one; what recording costs, the two studios alike
        pairs = [("studio /v1", name) for name in sorted(before - {RECORDED})]
        if alike:  # and the studio alike to an earlier one's (its /v1 rounds only) against it
            pairs += [(RECORDED, UNRECORDED)] + ([(RECORDED, earlier[0])] if earlier is not None else [])
        report(runs, paths, baseline_of, streams, before, pairs)
        if args.split and args.stand_in:
            from studio.http.wire.upstream import DEMAND_WINDOW

            split = [p for p in paths if p.name in ("studio /v1", "floor py", "floor C") or p.name in before]
            for concurrency in sorted(CPU_OVER_FLOOR):
                split_runs = []
                for _ in range(args.split_runs):
                    time.sleep(2 * DEMAND_WINDOW)  # a larger fan-out's spares are no longer wanted (the docstring)
                    split_runs.append(asyncio.run(cpu_split(split, concurrency, 16, 256, args.split_rounds)))
                print_split(concurrency, 16, 256, args.split_rounds, split_runs, pairs)
        if args.requests:
            if args.stand_in:  # the spares the rounds above wanted are let go: their renewals are no request's
                from studio.http.wire.upstream import DEMAND_WINDOW

                time.sleep(2 * DEMAND_WINDOW)
            at_once = 8
            measured = [p for p in paths if p.name in ("studio /v1", "floor py", "studio msgs") or p.name in before]
            # with --runs, each path is measured once a run, the paths taking turns, and the medians are printed:
            # one measurement of each, one after the other, moved by more than the differences it was to show
            per_path: dict[str, list[float]] = {p.name: [] for p in measured}
            for run in range(args.request_runs or args.runs):
                for p in measured if run % 2 == 0 else measured[::-1]:  # neither goes first every time
                    per_path[p.name].append(asyncio.run(cpu_per_request(p, args.requests, at_once)))
            figures = [f"{name} {statistics.median(ms):.3f}" for name, ms in per_path.items()]
            print(
                f"CPU per request (ms, {args.requests} one-token streams, {at_once} at a time, median of "
                f"{args.request_runs or args.runs}): {', '.join(figures)}"
            )
            if (args.request_runs or args.runs) > 1:
                for name, ms in per_path.items():
                    print(f"    {name}: {' '.join(f'{m:.3f}' for m in ms)}")
                for name, other in pairs:  # each run's ratio: the drift between runs hits both alike
                    ratios = [a / b for a, b in zip(per_path[name], per_path[other], strict=True)]
                    print(
                        f"    {name} over {other}, run by run: {' '.join(f'{r:.3f}' for r in ratios)}; "
                        f"median {statistics.median(ratios):.3f}"
                    )
            if args.long_kb:
                long = conversation(args.long_kb)
                figures = [
                    f"{p.name} {asyncio.run(cpu_per_request(p, args.requests // 4, at_once, long)):.2f}"
                    for p in measured
                    if p.name != "studio msgs"
                ]
                print(f"CPU per request (ms), a {args.long_kb} KB conversation: {', '.join(figures)}")
        if args.after_fan_out and args.stand_in:
            studio = next(p for p in paths if p.name == "studio /v1")
            after_fan_out(studio, max(streams), up_port, idle)
    finally:
        for process in (service, *helpers):  # SIGTERM: uvicorn shuts down and the app stops llama-server
            process.terminate()
            process.join(30)
            if process.is_alive():
                process.kill()
        if relay_c is not None:
            relay_c.kill()
            relay_c.wait()
        if unpacked is not None:
            unpacked.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
