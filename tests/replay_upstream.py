"""A stand-in for llama-server's ``/v1/chat/completions`` that replays recorded answers.

A real model cannot be made to leak tool-call markup on demand, so the healing
and tool-loop tests run the studio's real proxy against this small real HTTP
server instead. It speaks what llama-server b11434 speaks (chunk layout copied
from a recorded SmolLM2 stream, ``tools/server/server-task.cpp``): a first chunk
with ``role``, one chunk per content, reasoning or tool-call piece, a finish chunk
(``timings`` on it), a usage chunk (empty ``choices``, ``usage`` and ``timings``)
when ``stream_options.include_usage`` asks, then ``data: [DONE]``; chunked
transfer encoding for streams, ``Content-Length`` JSON otherwise.

``LEAKS`` holds the leaked outputs it replays, in the shapes users reported:

* ``hermes``: Qwen2.5 / Hermes ``<tool_call>{json}</tool_call>`` after a sentence, the raw
  block at the end of a stream that QwenPaw #3560 shows for llama.cpp;
* ``hermes_unclosed``: the same with ``</tool_call>`` missing at the end of the answer;
* ``qwen3_coder``: Qwen3-Coder / Qwen3.6 ``<tool_call><function=..><parameter=..>`` as logged
  unparsed in llama.cpp #24807 and #22878, with the doubled ``</parameter>`` of #24807;
* ``function_unclosed``: a bare ``<function=...>`` whose ``</function>`` never came;
* ``mistral``: Mistral's ``[TOOL_CALLS][{...}]`` list streamed as content (Ollama #5796,
  ollama-python #279), and ``mistral_unclosed`` without its closing ``]``;
* ``mistral_args``: the newer Mistral / Devstral ``[TOOL_CALLS]NAME[ARGS]{json}``.

Each answer is scripted (``Answer``) and served in order; every request body is kept
in ``requests`` so tests can assert what reached "llama-server".
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

#: Leaked answers (see the module docstring) and the call each one means.
LEAKS: dict[str, str] = {
    "hermes": 'I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "hermes_unclosed": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    ),
    "function_unclosed": "Checking.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "mistral_unclosed": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
}
#: The ``(name, arguments)`` each leak must heal into.
LEAK_CALLS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    name: [("get_weather", {"city": "Paris", "days": 3} if name == "qwen3_coder" else {"city": "Paris"})]
    for name in LEAKS
}


@dataclass
class Answer:
    """One scripted answer.

    ``content`` and ``reasoning`` are streamed one piece per chunk; ``tool_calls`` are calls
    llama-server parsed itself (``(name, arguments JSON)``), streamed as it streams them.
    ``split_at`` cuts the SSE body into two writes at that byte; ``delay`` sleeps before each
    chunk; ``status``/``error`` answer with an error instead. ``events`` and ``whole`` answer as they are
    (another dialect's stream, an event a chunk, and a whole answer), in place of a chat's.
    """

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 10
    split_at: int | None = None
    delay: float = 0.0
    status: int = 200
    error: dict[str, Any] | None = None
    events: list[bytes] | None = None
    whole: bytes | None = None

    @classmethod
    def text(cls, text: str, **kw: Any) -> Answer:
        return cls(content=[text], **kw)


class ReplayUpstream:
    """The stand-in server on 127.0.0.1 at a port the OS picks; a context manager."""

    def __init__(self) -> None:
        self.answers: deque[Answer] = deque()
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with replay._lock:
                    replay.requests.append(body)
                    answer = replay.answers.popleft() if replay.answers else Answer.text("(no answer scripted)")
                replay._serve(self, body, answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ReplayUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def script(self, *answers: Answer) -> None:
        """Queue answers for the next requests, in order."""
        with self._lock:
            self.answers.extend(answers)

    # -- serving --------------------------------------------------------------------------
    def _serve(self, handler: BaseHTTPRequestHandler, body: dict[str, Any], answer: Answer) -> None:
        if answer.status != 200:
            self._send_json(
                handler,
                answer.status,
                {
                    "error": answer.error
                    or {"code": answer.status, "message": "scripted failure", "type": "server_error"}
                },
            )
            return
        if body.get("stream"):
            self._send_stream(handler, body, answer)
        elif answer.whole is not None:
            self._send_body(handler, 200, answer.whole)
        else:
            self._send_json(handler, 200, self._completion(answer))

    @classmethod
    def _send_json(cls, handler: BaseHTTPRequestHandler, status: int, payload: dict[str, Any]) -> None:
        cls._send_body(handler, status, json.dumps(payload).encode())

    @staticmethod
    def _send_body(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json; charset=utf-8")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _send_stream(self, handler: BaseHTTPRequestHandler, body: dict[str, Any], answer: Answer) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        events = answer.events
        if events is None:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = [
                b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in self._chunks(answer, usage)
            ]
            events.append(b"data: [DONE]\n\n")
        if answer.split_at is not None:
            raw = b"".join(events)
            events = [raw[: answer.split_at], raw[answer.split_at :]]
        try:
            for piece in events:
                if answer.delay:
                    time.sleep(answer.delay)
                if piece:
                    handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the studio closed the stream: as llama-server sees it
            pass

    @staticmethod
    def _envelope() -> dict[str, Any]:
        return {
            "created": int(time.time()),
            "id": "chatcmpl-replay",
            "model": "replay",
            "system_fingerprint": "b11434-replay",
            "object": "chat.completion.chunk",
        }

    def _chunks(self, answer: Answer, include_usage: bool) -> list[dict[str, Any]]:
        env = self._envelope()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], **env}

        out = [chunk({"role": "assistant", "content": None})]
        out += [chunk({"reasoning_content": r}) for r in answer.reasoning]
        out += [chunk({"content": c}) for c in answer.content]
        for i, (name, arguments) in enumerate(answer.tool_calls):
            out.append(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": i,
                                "id": f"replay{i}",
                                "type": "function",
                                "function": {"name": name, "arguments": arguments[:1]},
                            }
                        ]
                    }
                )
            )
            out += [
                chunk({"tool_calls": [{"index": i, "function": {"arguments": arguments[j : j + 4]}}]})
                for j in range(1, len(arguments), 4)
            ]
        final = chunk({}, self._finish(answer))
        timings = self._timings(answer)
        if include_usage:
            out += [final, {"choices": [], **env, "usage": self._usage(answer), "timings": timings}]
        else:
            out.append({**final, "timings": timings})
        return out

    def _completion(self, answer: Answer) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(answer.content)}
        if answer.reasoning:
            message["reasoning_content"] = "".join(answer.reasoning)
        if answer.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": a}, "id": f"replay{i}"}
                for i, (n, a) in enumerate(answer.tool_calls)
            ]
        return {
            "choices": [{"finish_reason": self._finish(answer), "index": 0, "message": message}],
            **self._envelope(),
            "object": "chat.completion",
            "usage": self._usage(answer),
            "timings": self._timings(answer),
        }

    @staticmethod
    def _finish(answer: Answer) -> str:
        return answer.finish_reason or ("tool_calls" if answer.tool_calls else "stop")

    @staticmethod
    def _completion_tokens(answer: Answer) -> int:
        return len(answer.content) + len(answer.reasoning) + 5 * len(answer.tool_calls) or 1

    def _usage(self, answer: Answer) -> dict[str, int]:
        n = self._completion_tokens(answer)
        return {"completion_tokens": n, "prompt_tokens": answer.prompt_tokens, "total_tokens": n + answer.prompt_tokens}

    def _timings(self, answer: Answer) -> dict[str, float]:
        n = self._completion_tokens(answer)
        return {
            "cache_n": 0,
            "prompt_n": answer.prompt_tokens,
            "prompt_ms": 10.0 * answer.prompt_tokens,
            "predicted_n": n,
            "predicted_ms": 20.0 * n,
            "predicted_per_second": 50.0,
        }
