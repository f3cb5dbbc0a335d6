"""The Ollama API in llama-server's terms: pure functions, one per direction, no I/O.

Requests become the bodies llama-server's OpenAI-compatible routes take (``chat_request``,
``generate_request``, ``embed_request``); its answers and stream chunks come back as
``Piece``s (``piece_of``) and are written as Ollama's answers by a ``Reply``. Routing,
queueing, residency and streaming stay in ``studio.http.clients.ollama_app``. Field names follow the
Ollama API docs (``docs/api.md``) and the official client's types (ollama-python ``_types.py``).

How the fields map:

- ``model``: a studio model name; Ollama's default tag ``:latest`` is dropped (``gemma:latest``
  is ``gemma``). ``keep_alive`` (seconds, or a duration such as ``"5m"``) becomes the resident
  model's idle TTL; negative keeps it loaded; 0 unloads it once its requests are done (a
  request without a prompt and with ``keep_alive`` 0 unloads it at once, as ``/api/unload``).
- ``options`` (``OPTION_FIELDS``): the sampling options go to llama-server's fields of the same
  meaning (``num_predict`` -> ``n_predict``, ``num_keep`` -> ``n_keep``, the rest by name). The
  load-time options (``LOAD_OPTIONS``: ``num_ctx``, ``num_gpu``, ``num_thread``...) are ignored:
  llama-server cannot change them per request, and restarting a model because a client sends
  its own ``num_ctx`` on every request (Ollama does) would make clients that disagree thrash. The
  context is the studio's load setting (the config's ``[models.NAME] n_ctx``, ``/api/load``, the
  GUI), and ``/api/ps`` and ``/api/show`` report it as ``context_length``. ``tfs_z`` and
  ``penalize_newline`` no longer exist in llama.cpp and are ignored too.
- ``format``: ``"json"`` -> ``response_format`` ``json_object``; a JSON schema -> ``json_schema``.
- ``think``: ``true``/``false`` -> the studio's ``enable_thinking``; ``"low"``/``"medium"``/
  ``"high"`` -> ``reasoning_effort`` (``studio.http.clients.openai_proxy.prepare_chat_body`` turns both
  into the model's own template switches). The answer's reasoning comes back as ``thinking``.
- ``images`` (base64, on a chat message or a generate request): OpenAI ``image_url`` parts with
  a ``data:`` URI; llama-server reads them where the model has a projector and says so where not.
- ``tools``, ``tool_calls``, ``tool_name``: OpenAI's function tools; a call's ``arguments`` are an
  object in Ollama and a JSON string in OpenAI. A tool result's ``tool_name`` is matched to the
  id of the latest call of that name (Ollama's calls carry no id; templates want one).
- ``/api/generate``: a chat turn (``system`` + ``prompt``) where the model has a chat template;
  the bare prompt through ``/v1/completions`` with ``raw`` or where it has none (Ollama uses
  ``{{ .Prompt }}`` then); llama-server's ``/infill`` when a ``suffix`` is given. ``template``
  and ``context`` (deprecated) are ignored; no ``context`` is returned.
- ``/api/embed``: ``input`` (a string or a list) to ``/v1/embeddings``; ``truncate`` and
  ``dimensions`` are ignored (llama-server embeds the whole input at the model's width).
- Durations are nanoseconds: ``total_duration`` from the request's arrival, ``load_duration``
  the time it waited for a model load, ``prompt_eval_duration``/``eval_duration`` llama-server's
  ``timings``; ``prompt_eval_count`` and ``eval_count`` its usage.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from studio.errors import BadRequestError

#: The Ollama API release whose routes and fields this dialect answers (``/api/version``).
OLLAMA_API_VERSION = "0.12.0"

#: Ollama's sampling options and the llama-server fields they set (``tools/server/server-schema.cpp``).
OPTION_FIELDS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_last_n": "repeat_last_n",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "n_predict",
    "num_keep": "n_keep",
}
#: Options that set how a model is loaded, not how a request samples: ignored (module docstring).
LOAD_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "numa",
    }
)
#: Options llama.cpp has removed: ignored.
REMOVED_OPTIONS = frozenset({"tfs_z", "penalize_newline"})

Kind = Literal["chat", "generate"]
#: llama-server routes an Ollama request may go to.
CHAT, COMPLETIONS, INFILL, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/infill", "/v1/embeddings"

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
#: What ``expires_at`` says for a model without a TTL (Ollama's "forever" is ~292 years ahead).
_FOREVER = timedelta(days=365 * 292)


# -- requests ----------------------------------------------------------------------------------------


def model_name(body: Mapping[str, Any]) -> str:
    """The studio model a request names (``model``, or the older ``name``), without Ollama's ``:latest``.

    Raises:
        BadRequestError: no model named.
    """
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequestError("`model` is required: a model name from /api/tags", param="model")
    name = name.strip()
    return name.removesuffix(":latest")


def keep_alive_seconds(value: Any) -> float | None:
    """Seconds a model stays loaded once idle, from Ollama's ``keep_alive``; ``None``: forever (negative).

    Raises:
        BadRequestError: neither a number nor a duration such as ``"5m"``, ``"1h30m"``, ``"-1"``.
    """
    seconds: float | None = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            seconds = sign * float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if parts and "".join(n + u for n, u in parts) == text:
                seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    if seconds is None or math.isnan(seconds):
        raise BadRequestError(
            f'keep_alive must be seconds or a duration such as "5m", not {value!r}', param="keep_alive"
        )
    return None if seconds < 0 else seconds


def wants_stream(body: Mapping[str, Any]) -> bool:
    """Whether to stream: Ollama streams unless ``"stream": false``."""
    return body.get("stream") is not False


def sampling(options: Any) -> dict[str, Any]:
    """llama-server's sampling fields for Ollama's ``options`` (load-time and removed options dropped).

    Raises:
        BadRequestError: ``options`` is not an object.
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise BadRequestError("`options` must be an object", param="options")
    out: dict[str, Any] = {}
    for key, value in options.items():
        target = OPTION_FIELDS.get(key)
        if target is None or value is None:
            continue
        if key == "num_predict" and isinstance(value, (int, float)) and value < 0:
            value = -1  # Ollama's -1 (no limit) and -2 (fill the context): the context bounds it either way
        out[target] = value
    return out


def response_format(fmt: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` for Ollama's ``format`` (``"json"`` or a JSON schema); None for none.

    Raises:
        BadRequestError: anything else.
    """
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, Mapping):
        return {"type": "json_schema", "json_schema": {"name": "ollama_format", "schema": dict(fmt)}}
    raise BadRequestError('`format` must be "json" or a JSON schema object', param="format")


def think_controls(think: Any) -> dict[str, Any]:
    """The studio's reasoning controls for Ollama's ``think``.

    Raises:
        BadRequestError: neither a boolean nor low/medium/high.
    """
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in ("low", "medium", "high"):
        return {"reasoning_effort": think}
    raise BadRequestError('`think` must be true, false, "low", "medium" or "high"', param="think")


def image_part(data: Any) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part for one of Ollama's base64 images.

    Raises:
        BadRequestError: not base64 text.
    """
    if not isinstance(data, str) or not data:
        raise BadRequestError("each image must be a base64 string", param="images")
    if data.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": data}}
    try:
        head = base64.b64decode(data[:32] + "=" * (-len(data[:32]) % 4), validate=False)
    except (binascii.Error, ValueError):
        raise BadRequestError("an image is not valid base64", param="images") from None
    return {"type": "image_url", "image_url": {"url": f"data:{_image_type(head)};base64,{data}"}}


def _image_type(head: bytes) -> str:
    """The media type of an image from its first bytes (llama-server decodes by content; the URI needs one)."""
    if head.startswith(b"\x89PNG"):
        return "image/png"
    if head.startswith(b"GIF8"):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"BM"):
        return "image/bmp"
    return "image/jpeg"


def _content(text: Any, images: Any) -> Any:
    """A message's content: the text alone, or text and image parts."""
    text = "" if text is None else text
    if not images:
        return text
    if not isinstance(images, Sequence) or isinstance(images, str):
        raise BadRequestError("`images` must be a list of base64 strings", param="images")
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return parts + [image_part(image) for image in images]


def openai_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages for Ollama's: images as parts, tool calls with ids, thinking as reasoning.

    Raises:
        BadRequestError: ``messages`` is not a list of objects with a ``role``.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise BadRequestError("`messages` must be a list of messages", param="messages")
    out: list[dict[str, Any]] = []
    call_ids: dict[str, str] = {}  # tool name -> id of its latest call
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRequestError(f"messages[{i}] must be an object with a `role`", param=f"messages.{i}")
        item: dict[str, Any] = {
            "role": message["role"],
            "content": _content(message.get("content"), message.get("images")),
        }
        if message.get("thinking"):
            item["reasoning_content"] = message["thinking"]
        calls = message.get("tool_calls") or []
        if calls:
            item["tool_calls"] = []
            for n, call in enumerate(calls):
                call = call if isinstance(call, Mapping) else {}
                function = call.get("function") or {}
                call_id = call.get("id") or f"call_{i}_{n}"
                call_ids[str(function.get("name"))] = call_id
                arguments = function.get("arguments", {})
                item["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": function.get("name"),
                            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                        },
                    }
                )
        if message["role"] == "tool":
            name = message.get("tool_name") or message.get("name")
            if name:
                item["name"] = name
                if name in call_ids:
                    item["tool_call_id"] = call_ids[name]
        out.append(item)
    return out


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every generating request shares: sampling, format, reasoning, streaming."""
    out = sampling(body.get("options"))
    fmt = response_format(body.get("format"))
    if fmt is not None:
        out["response_format"] = fmt
    out.update(think_controls(body.get("think")))
    stream = wants_stream(body)
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body for an Ollama ``/api/chat`` request (``model`` set by the caller)."""
    out = {"messages": openai_messages(body.get("messages") or []), **_common(body)}
    if body.get("tools"):
        out["tools"] = list(body["tools"])
    return out


def generate_request(body: Mapping[str, Any], *, has_chat_template: bool) -> tuple[str, dict[str, Any]]:
    """The llama-server route and body for an Ollama ``/api/generate`` request (see the module docstring)."""
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise BadRequestError("`prompt` must be a string", param="prompt")
    common = _common(body)
    if body.get("suffix"):
        common.pop("stream_options", None)  # the native route streams its own final chunk with timings
        return INFILL, {"input_prefix": prompt, "input_suffix": str(body["suffix"]), **common}
    if body.get("raw") or (not has_chat_template and not body.get("images")):
        return COMPLETIONS, {"prompt": prompt, **common}
    messages: list[dict[str, Any]] = []
    if body.get("system"):
        messages.append({"role": "system", "content": str(body["system"])})
    messages.append({"role": "user", "content": _content(prompt, body.get("images"))})
    return CHAT, {"messages": messages, **common}


def embed_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/embeddings`` body for ``/api/embed`` (``input``) or the older ``/api/embeddings`` (``prompt``).

    Raises:
        BadRequestError: no text to embed.
    """
    text = body.get("input", body.get("prompt"))
    if isinstance(text, str) or (isinstance(text, Sequence) and text and all(isinstance(t, str) for t in text)):
        return {"input": text if isinstance(text, str) else list(text)}
    raise BadRequestError("`input` must be a string or a list of strings", param="input")


# -- answers -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """What one llama-server answer or stream chunk says, whichever route it came from."""

    content: str = ""
    thinking: str = ""
    tool_calls: tuple[Mapping[str, Any], ...] = ()  # OpenAI tool calls, or streamed fragments of them
    finish: str | None = None  # OpenAI's finish_reason
    usage: Mapping[str, Any] | None = None
    timings: Mapping[str, Any] | None = None


def piece_of(route: str, data: Mapping[str, Any]) -> Piece:
    """The ``Piece`` in one parsed answer or chunk of ``route`` (``CHAT``, ``COMPLETIONS`` or ``INFILL``)."""
    usage, timings = data.get("usage"), data.get("timings")
    if route == INFILL:  # the native shape: content, stop, stop_type
        finish = None
        if data.get("stop"):
            finish = "length" if data.get("stop_type") == "limit" else "stop"
        return Piece(
            content=data.get("content") or "",
            finish=finish,
            timings=timings,
            usage={"prompt_tokens": data["tokens_evaluated"], "completion_tokens": data["tokens_predicted"]}
            if "tokens_predicted" in data and "tokens_evaluated" in data
            else None,
        )
    choices = data.get("choices") or [{}]
    choice = choices[0]
    if route == COMPLETIONS:
        return Piece(content=choice.get("text") or "", finish=choice.get("finish_reason"), usage=usage, timings=timings)
    message = choice.get("delta") or choice.get("message") or {}
    return Piece(
        content=message.get("content") or "",
        thinking=message.get("reasoning_content") or "",
        tool_calls=tuple(message.get("tool_calls") or ()),
        finish=choice.get("finish_reason"),
        usage=usage,
        timings=timings,
    )


@dataclass(frozen=True)
class Durations:
    """The request's own clock, in nanoseconds: from its arrival, and waiting for a model load."""

    total_ns: int
    load_ns: int


def created_at(now: datetime | None = None) -> str:
    """Ollama's ``created_at``: RFC 3339 in UTC."""
    return (now or datetime.now(UTC)).isoformat().replace("+00:00", "Z")


@dataclass
class Reply:
    """One Ollama answer being written, from the ``Piece``s of llama-server's answer.

    ``chunk`` gives each streamed chunk (``done: false``); ``final`` the last one (``done: true``,
    with the counts and durations), which for an answer that was not streamed carries the whole text.
    A streamed answer's tool calls arrive in fragments; they are joined and sent in the final chunk.
    """

    kind: Kind
    model: str
    content: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # index -> {"name", "arguments" (text)}
    finish: str | None = None
    usage: Mapping[str, Any] | None = None
    timings: Mapping[str, Any] | None = None

    def add(self, piece: Piece) -> dict[str, Any] | None:
        """Take in one piece; return the chunk to stream for it, or None when it carries no text."""
        self.finish = piece.finish or self.finish
        self.usage = piece.usage or self.usage
        self.timings = piece.timings or self.timings
        for n, call in enumerate(piece.tool_calls):
            index = call.get("index", n)
            slot = self.calls.setdefault(index, {"name": "", "arguments": ""})
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            arguments = function.get("arguments") or ""
            slot["arguments"] += arguments if isinstance(arguments, str) else json.dumps(arguments)
        if piece.content:
            self.content.append(piece.content)
        if piece.thinking:
            self.thinking.append(piece.thinking)
        if not piece.content and not piece.thinking:
            return None
        return {**self._head(), **self._body(piece.content, piece.thinking, ()), "done": False}

    def keep_alive(self) -> dict[str, Any]:
        """A chunk that says nothing (empty text, ``done: false``): sent while the model loads, so the stream
        is not idle; Ollama's clients add its empty text to the answer."""
        return {**self._head(), **self._body("", "", ()), "done": False}

    def final(self, durations: Durations, *, streamed: bool) -> dict[str, Any]:
        """The last chunk (streamed) or the whole answer (not streamed)."""
        text = "" if streamed else "".join(self.content)
        thinking = "" if streamed else "".join(self.thinking)
        out = {
            **self._head(),
            **self._body(text, thinking, self.tool_calls()),
            "done": True,
            "done_reason": "length" if self.finish == "length" else "stop",
            "total_duration": durations.total_ns,
            "load_duration": durations.load_ns,
        }
        return {**out, **counts(self.usage, self.timings)}

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls in Ollama's shape: ``arguments`` as an object (``{"raw": text}`` if the model's is not JSON)."""
        out = []
        for _, call in sorted(self.calls.items()):
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                arguments = None
            out.append(
                {
                    "function": {
                        "name": call["name"],
                        "arguments": arguments if isinstance(arguments, dict) else {"raw": call["arguments"]},
                    }
                }
            )
        return out

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": created_at()}

    def _body(self, text: str, thinking: str, calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if self.kind == "generate":
            return {"response": text, **({"thinking": thinking} if thinking else {})}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = list(calls)
        return {"message": message}


def counts(usage: Mapping[str, Any] | None, timings: Mapping[str, Any] | None) -> dict[str, int]:
    """Ollama's token counts and eval durations from llama-server's ``usage`` and ``timings``."""
    u, t = usage or {}, timings or {}
    out: dict[str, int] = {}
    prompt = u.get("prompt_tokens")
    if prompt is None and "prompt_n" in t:
        prompt = t["prompt_n"] + t.get("cache_n", 0)
    if prompt is not None:
        out["prompt_eval_count"] = int(prompt)
    if "prompt_ms" in t:
        out["prompt_eval_duration"] = int(t["prompt_ms"] * 1e6)
    generated = u.get("completion_tokens", t.get("predicted_n"))
    if generated is not None:
        out["eval_count"] = int(generated)
    if "predicted_ms" in t:
        out["eval_duration"] = int(t["predicted_ms"] * 1e6)
    return out


def load_reply(kind: Kind, model: str, reason: Literal["load", "unload"]) -> dict[str, Any]:
    """The answer to a request without a prompt (or messages): the model was loaded, or unloaded."""
    body: dict[str, Any] = {"response": ""} if kind == "generate" else {"message": {"role": "assistant", "content": ""}}
    return {"model": model, "created_at": created_at(), **body, "done": True, "done_reason": reason}


def embed_reply(model: str, answer: Mapping[str, Any], durations: Durations) -> dict[str, Any]:
    """``/api/embed``'s answer from llama-server's ``/v1/embeddings`` answer."""
    data = sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))
    out = {
        "model": model,
        "embeddings": [d["embedding"] for d in data],
        "total_duration": durations.total_ns,
        "load_duration": durations.load_ns,
    }
    prompt = (answer.get("usage") or {}).get("prompt_tokens")
    return {**out, "prompt_eval_count": prompt} if prompt is not None else out


def embeddings_reply(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The older ``/api/embeddings``' answer: one vector."""
    data = answer.get("data") or [{}]
    return {"embedding": data[0].get("embedding", [])}


# -- models ------------------------------------------------------------------------------------------


def parameter_size(count: int) -> str:
    """Ollama's ``parameter_size``: ``8.0B``, ``134.52M``, ``900K``."""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    if count >= 1_000_000:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.0f}K"


def details(architecture: str, parameter_count: int, quant: str | None) -> dict[str, Any]:
    """Ollama's ``details`` of a model."""
    return {
        "parent_model": "",
        "format": "gguf",
        "family": architecture,
        "families": [architecture],
        "parameter_size": parameter_size(parameter_count),
        "quantization_level": quant or "",
    }


def digest(path: Path, size: int, mtime_ns: int) -> str:
    """A stable identity of a model file for Ollama's ``digest``: its path, size and mtime, not its content
    (hashing gigabytes per listing would cost seconds)."""
    return hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()


def modified_at(mtime_ns: int) -> str:
    """A file's modification time as Ollama writes ``modified_at``."""
    return created_at(datetime.fromtimestamp(mtime_ns / 1e9, UTC))


def tags_entry(name: str, path: Path, size: int, mtime_ns: int, details_: Mapping[str, Any]) -> dict[str, Any]:
    """One model of ``/api/tags``."""
    return {
        "name": name,
        "model": name,
        "modified_at": modified_at(mtime_ns),
        "size": size,
        "digest": digest(path, size, mtime_ns),
        "details": dict(details_),
    }


def model_info(metadata: Mapping[str, Any], parameter_count: int, *, verbose: bool = False) -> dict[str, Any]:
    """``/api/show``'s ``model_info``: the GGUF metadata; big arrays (the vocabulary) as ``[]`` unless ``verbose``."""
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if key == "tokenizer.chat_template":  # shown as ``template``
            continue
        if isinstance(value, (str, int, float, bool)) or value is None:
            out[key] = value
        elif isinstance(value, (list, tuple)):
            out[key] = list(value)
        else:  # a lazily read array (tokens, merges...)
            out[key] = list(value) if verbose else []
    out.setdefault("general.parameter_count", parameter_count)
    return out


def capabilities(*, tools: bool, thinking: bool, vision: bool) -> list[str]:
    """``/api/show``'s ``capabilities``."""
    return ["completion"] + ["tools"] * tools + ["thinking"] * thinking + ["vision"] * vision


def expires_at(ttl_left: float | None, ttl: float, pinned: bool, now: datetime | None = None) -> str:
    """``/api/ps``' ``expires_at``: when the idle TTL runs out (from now if busy), or Ollama's "forever"."""
    now = now or datetime.now(UTC)
    if ttl_left is not None:
        return created_at(now + timedelta(seconds=ttl_left))
    if ttl > 0 and not pinned:  # busy: the TTL runs from the end of its last request
        return created_at(now + timedelta(seconds=ttl))
    return created_at(now + _FOREVER)


def pull_lines(snapshot: Mapping[str, Any], shown: dict[str, int]) -> list[dict[str, Any]]:
    """``/api/pull``'s progress lines for a download snapshot (``studio.library.downloads``): one per file
    that moved since the bytes ``shown`` (updated here), as Ollama reports one line per layer; then the
    last line, ``success`` or the error."""
    out = []
    for f in snapshot.get("files") or ():
        if shown.get(f["path"]) != f["done"] and (f["done"] or f["state"] != "pending"):
            shown[f["path"]] = f["done"]
            completed = f["size"] if f["state"] == "cached" else f["done"]
            out.append(
                {"status": f"pulling {f['path']}", "digest": f["path"], "total": f["size"], "completed": completed}
            )
    state = snapshot.get("state")
    if state == "done":
        out.append({"status": "success"})
    elif state in ("failed", "cancelled"):
        error = snapshot.get("error") or {}
        out.append({"error": error.get("message") or f"the download was {state}"})
    return out


def pull_spec(name: str) -> str:
    """The Hugging Face ``owner/repo[:VARIANT]`` a pull names; Ollama's ``hf.co/`` prefix is dropped.

    Raises:
        BadRequestError: an Ollama library name (``llama3.2``): the studio pulls from Hugging Face only.
    """
    spec = re.sub(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/", "", name.strip())
    repo = spec.partition(":")[0]
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise BadRequestError(
            f"{name!r} is not a Hugging Face model: pull takes owner/repo[:VARIANT] "
            "(or hf.co/owner/repo[:VARIANT]); the studio does not read the Ollama library",
            param="model",
        )
    return spec
