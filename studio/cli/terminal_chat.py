"""``ggstudio run``: the studio in-process on a loopback port, and a chat with it in the terminal.

The service is the app ``serve`` runs (``ModelManager`` + ``create_app`` under
uvicorn), in a background thread with its own event loop. The chat talks to it
over ``/api/chat`` as the GUI does, so closing the stream is what stops a
generation: the app closes its upstream request and llama-server stops decoding.

Ctrl-C is Python's ``KeyboardInterrupt`` in the main thread (uvicorn installs no
signal handlers outside the main thread): during a reply it closes the stream and
returns to the prompt; at the prompt it ends the session. ``LocalStudio.close``
runs on every way out and stops llama-server; the supervisor's atexit hook and
the child's parent-death signal cover the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

import httpx
import uvicorn

from studio.errors import AnsweredError
from studio.http.app import create_app
from studio.http.server import StudioServer
from studio.residency.manager import ModelManager
from studio.residency.requests import LoadRequest
from studio.residency.resident import LoadedModel
from studio.views.residency import status_json

T = TypeVar("T")

PROMPT = ">>> "
BYE = "/bye"
HELP = f"commands: {BYE} (or Ctrl-D) ends the chat, /clear forgets the conversation; Ctrl-C stops a reply"
DIM, RESET = "\x1b[2m", "\x1b[0m"


class LocalStudio:
    """The studio service around ``manager``, on ``127.0.0.1`` at a port the OS picks.

    Use as a context manager: leaving it (normally, by an error or by Ctrl-C) shuts
    the service down and stops llama-server.
    """

    def __init__(self, manager: ModelManager, *, shutdown_grace: float = 15.0) -> None:
        self.manager = manager
        self.shutdown_grace = shutdown_grace
        self.token = secrets.token_urlsafe(24)  # only this process may use the port it opens
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for a "free" port
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        config = uvicorn.Config(create_app(manager, api_token=self.token), log_level="warning", lifespan="on")
        self._server = StudioServer(config)
        self._thread = threading.Thread(target=self._serve, name="studio-service", daemon=True)

    def _serve(self) -> None:
        # The Runner cancels whatever is still pending (a cancelled load) before the loop closes.
        with asyncio.Runner(loop_factory=lambda: self._loop) as runner:
            runner.run(self._server.serve(sockets=[self._sock]))

    def __enter__(self) -> LocalStudio:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process studio service did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the service down (its lifespan stops llama-server); bounded in time, idempotent."""
        try:
            if self._thread.is_alive():
                self._server.should_exit = True
                self._server.wake()
                self._thread.join(self.shutdown_grace)
                if self._thread.is_alive():  # a connection that will not close: stop waiting for it
                    self._server.force_exit = True
                    self._thread.join(self.shutdown_grace)
        finally:
            self.manager.close_now()  # no-op when the lifespan already did it
            self._sock.close()

    def call(self, coro: Coroutine[Any, Any, T], *, tick: Callable[[], None] | None = None) -> T:
        """Run ``coro`` on the service's loop and return its result; ``tick`` runs every 0.2 s meanwhile.

        Ctrl-C cancels ``coro`` and re-raises.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            while True:
                try:
                    return future.result(timeout=0.2)
                except concurrent.futures.TimeoutError:
                    if tick is not None:
                        tick()
        except BaseException:
            future.cancel()
            raise

    def load(self, request: LoadRequest, *, progress: TextIO | None = None) -> LoadedModel:
        """Load ``request`` and return the live model; a progress line goes to ``progress`` meanwhile."""
        shown = [False]
        name = request.model.rsplit("/", 1)[-1]

        def tick() -> None:
            if progress is None:
                return
            p = status_json(self.manager).get("progress") or {}
            total, done = p.get("bytes_total") or 0, p.get("bytes_loaded") or 0
            percent = f" {done * 100 // total:3d}%" if total else ""
            progress.write(f"\rloading {name}: {p.get('phase') or 'starting'}{percent}\x1b[K")
            progress.flush()
            shown[0] = True

        try:
            return self.call(self.manager.load(request), tick=tick)
        finally:
            if shown[0] and progress is not None:
                progress.write("\r\x1b[K")
                progress.flush()

    def client(self) -> httpx.Client:
        """An HTTP client for this service (no read timeout: a reply takes as long as it takes)."""
        return httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(None, connect=5), headers={"Authorization": f"Bearer {self.token}"}
        )


@dataclass
class Reply:
    """One assistant turn as it was streamed."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None  # the final ``done`` event (usage, tokens/s), if it came

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def answer(self) -> str:
        """The text, or the reasoning when the model gave nothing else: shown as the answer, as the reference does."""
        return self.text if self.text.strip() else "".join(self.reasoning).strip()


def stream_reply(
    client: httpx.Client,
    messages: list[dict[str, Any]],
    *,
    options: Mapping[str, Any],
    on_content: Callable[[str], None],
    on_reasoning: Callable[[str], None],
    reply: Reply | None = None,
    model: str | None = None,
) -> Reply:
    """Stream one chat turn from ``/api/chat`` and return it; text goes to the callbacks as it arrives.

    A ``KeyboardInterrupt`` while streaming closes the stream (which stops the
    generation) and propagates; ``reply`` then holds what arrived.

    Raises:
        AnsweredError: the studio or llama-server answered with an error.
    """
    reply = reply if reply is not None else Reply()
    body: dict[str, Any] = {"messages": messages}
    if model is not None:  # a shared studio: name the model, whatever its default is now
        body["model"] = model
    body.update(options)
    with client.stream("POST", "/api/chat", json=body) as resp:
        if resp.status_code != 200:
            raise AnsweredError.from_body(resp.status_code, resp.read())
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event.get("type")
            if kind == "content":
                reply.content.append(event["text"])
                on_content(event["text"])
            elif kind == "reasoning":
                reply.reasoning.append(event["text"])
                on_reasoning(event["text"])
            elif kind == "tool_call":
                fn = event.get("function") or {}
                on_reasoning(f"[tool call {fn.get('name') or ''}{fn.get('arguments') or ''}]")
            elif kind == "error":
                error = event.get("error") or {}
                raise AnsweredError(
                    str(error.get("message") or "the chat failed"),
                    status=int(event.get("status") or 500),
                    type=error.get("type"),
                    code=error.get("code"),
                )
            elif kind == "done":
                reply.done = event
    return reply


def base_model_notice(client: httpx.Client, model: str) -> str | None:
    """What to tell a person about to chat with ``model`` when it is a base model, else None.

    A base model has no chat template of its own: llama-server renders its chats with a borrowed one
    (ChatML), and the model may ramble on past its turn, so it is said before the first message.
    """
    resp = client.get("/api/status")
    rows = resp.json().get("models", []) if resp.status_code == 200 else []
    row = next((r for r in rows if r.get("model") == model and r.get("instance") == "chat"), None)
    if row is None or not (row.get("capabilities") or {}).get("fallback_template"):
        return None
    limit = ((row.get("sampling") or {}).get("max_tokens") or {}).get("value")
    return (
        f"note: {model} is a base model with no chat template of its own: it chats through a borrowed ChatML "
        f"template and may ramble (its answers end at a turn marker or after {limit} tokens). For a chat, try an "
        "instruct model (e.g. `ggstudio run SmolLM2-135M-Instruct.Q4_1`); for raw text, use /v1/completions."
    )


def answer_once(
    client: httpx.Client,
    prompt: str,
    *,
    options: Mapping[str, Any],
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    model: str | None = None,
) -> Reply:
    """Answer ``prompt`` as plain text on ``out`` (reasoning, dimmed, on ``err`` if it is a terminal)."""
    dim = err.isatty()

    def reasoning(text: str) -> None:
        if dim:
            err.write(f"{DIM}{text}{RESET}")
            err.flush()

    reply = stream_reply(
        client,
        [{"role": "user", "content": prompt}],
        options=options,
        on_content=lambda text: _write(out, text),
        on_reasoning=reasoning,
        model=model,
    )
    out.write(("" if reply.text.strip() else reply.answer) + "\n")
    out.flush()
    return reply


def chat_loop(
    client: httpx.Client,
    *,
    model: str,
    options: Mapping[str, Any],
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    request_model: str | None = None,
) -> None:
    """Chat until ``/bye``, end of input, or Ctrl-C at the prompt; Ctrl-C during a reply stops that reply."""
    # No `import readline` here: GNU readline installs its own SIGTERM handling while it
    # waits for a line, and a SIGTERM at the prompt then left the chat hanging (seen under
    # load in tests/test_cli.py). Plain input() wakes up and exits cleanly.
    tty = out.isatty()
    messages: list[dict[str, Any]] = []
    _write(out, f"chatting with {model}; {HELP}\n")
    while True:
        try:
            line = read(PROMPT)
        except (EOFError, KeyboardInterrupt):
            _write(out, "\n")
            return
        prompt = line.strip()
        if not prompt:
            continue
        if prompt == BYE:
            return
        if prompt in ("/?", "/help"):
            _write(out, HELP + "\n")
            continue
        if prompt == "/clear":
            messages.clear()
            _write(out, "conversation cleared\n")
            continue
        messages.append({"role": "user", "content": prompt})
        reply = Reply()
        in_reasoning = [False]

        def content(text: str) -> None:
            if in_reasoning[0]:
                in_reasoning[0] = False
                _write(out, (RESET if tty else "") + "\n")
            _write(out, text)

        def reasoning(text: str) -> None:
            if not in_reasoning[0]:
                in_reasoning[0] = True
                _write(out, DIM if tty else "")
            _write(out, text)

        try:
            stream_reply(
                client,
                messages,
                options=options,
                on_content=content,
                on_reasoning=reasoning,
                reply=reply,
                model=request_model,
            )
        except KeyboardInterrupt:
            _write(out, (RESET if tty else "") + "\n[stopped]\n")
        except AnsweredError as exc:
            _write(out, (RESET if tty else "") + f"\nerror: {exc}\n")
            messages.pop()
            continue
        else:
            _write(out, (RESET if tty else "") + "\n" + _stats(reply, tty))
        if not reply.answer:
            messages.pop()  # an empty assistant turn would go back to the model as if it had answered nothing
            continue
        if not reply.text.strip():  # it only reasoned: that is its answer
            _write(out, reply.answer + "\n")
        messages.append({"role": "assistant", "content": reply.answer})


def _stats(reply: Reply, tty: bool) -> str:
    done = reply.done or {}
    tokens = (done.get("usage") or {}).get("completion_tokens")
    speed = done.get("tokens_per_second")
    if not tty or tokens is None:
        return ""
    return f"{DIM}({tokens} tokens" + (f", {speed:.1f} tokens/s" if speed else "") + f"){RESET}\n"


def _write(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()
