"""The Ollama dialect's translations, field by field (studio.dialects.ollama; no server)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path

import ollama as ollama_client
import pytest

from studio.dialects import ollama
from studio.errors import BadRequestError

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 40).decode()
WEBP = base64.b64encode(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 40).decode()


# -- requests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, name",
    [
        ({"model": "gemma"}, "gemma"),
        ({"model": "gemma:latest"}, "gemma"),  # Ollama's default tag
        ({"model": " owner/repo:Q4_K_M "}, "owner/repo:Q4_K_M"),  # other tags are part of the name
        ({"name": "older-client"}, "older-client"),
    ],
)
def test_model_name(body, name):
    assert ollama.model_name(body) == name


def test_a_request_without_a_model_is_refused():
    with pytest.raises(BadRequestError) as info:
        ollama.model_name({"messages": []})
    assert info.value.param == "model"


@pytest.mark.parametrize(
    "value, seconds",
    [
        (0, 0.0),
        (300, 300.0),
        (2.5, 2.5),
        ("0", 0.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1.5s", 1.5),
        (-1, None),
        ("-1", None),
        ("-1m", None),
    ],
)
def test_keep_alive(value, seconds):
    assert ollama.keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", True, [5], {}])
def test_a_bad_keep_alive_is_refused(value):
    with pytest.raises(BadRequestError, match="keep_alive"):
        ollama.keep_alive_seconds(value)


#: (Ollama option, llama-server field, value): the same name unless llama-server renamed it.
SAMPLING_OPTIONS = (
    ("temperature", "temperature", 0.2),
    ("top_k", "top_k", 20),
    ("top_p", "top_p", 0.9),
    ("min_p", "min_p", 0.05),
    ("typical_p", "typical_p", 0.7),
    ("repeat_last_n", "repeat_last_n", 33),
    ("repeat_penalty", "repeat_penalty", 1.2),
    ("presence_penalty", "presence_penalty", 1.5),
    ("frequency_penalty", "frequency_penalty", 1.0),
    ("mirostat", "mirostat", 1),
    ("mirostat_tau", "mirostat_tau", 0.8),
    ("mirostat_eta", "mirostat_eta", 0.6),
    ("seed", "seed", 42),
    ("stop", "stop", ["\n", "user:"]),
    ("num_predict", "n_predict", 100),
    ("num_keep", "n_keep", 5),
)


def test_every_sampling_option_reaches_its_llama_server_field():
    options = {option: value for option, _, value in SAMPLING_OPTIONS}
    assert ollama.sampling(options) == {field: value for _, field, value in SAMPLING_OPTIONS}


def test_the_client_libraries_options_are_all_mapped_or_deliberately_ignored():
    known = set(ollama.OPTION_FIELDS) | ollama.LOAD_OPTIONS | ollama.REMOVED_OPTIONS
    assert set(ollama_client.Options.model_fields) <= known


def test_load_time_and_removed_options_are_ignored():
    options = {
        "num_ctx": 1024,
        "num_gpu": 1,
        "num_thread": 8,
        "num_batch": 2,
        "main_gpu": 0,
        "use_mmap": True,
        "low_vram": False,
        "numa": False,
        "tfs_z": 1.0,
        "penalize_newline": True,
        "temperature": 0,
    }
    assert ollama.sampling(options) == {"temperature": 0}


@pytest.mark.parametrize("num_predict", [-1, -2])
def test_num_predict_without_a_limit(num_predict):
    assert ollama.sampling({"num_predict": num_predict}) == {"n_predict": -1}


def test_options_must_be_an_object():
    with pytest.raises(BadRequestError, match="options"):
        ollama.sampling(["temperature"])


def test_format():
    assert ollama.response_format("json") == {"type": "json_object"}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    assert ollama.response_format(schema) == {
        "type": "json_schema",
        "json_schema": {"name": "ollama_format", "schema": schema},
    }
    assert ollama.response_format(None) is None and ollama.response_format("") is None
    with pytest.raises(BadRequestError, match="format"):
        ollama.response_format("yaml")


def test_think():
    assert ollama.think_controls(True) == {"enable_thinking": True}
    assert ollama.think_controls(False) == {"enable_thinking": False}
    assert ollama.think_controls("high") == {"reasoning_effort": "high"}
    assert ollama.think_controls(None) == {}
    with pytest.raises(BadRequestError, match="think"):
        ollama.think_controls("maximum")


@pytest.mark.parametrize("data, media", [(PNG, "image/png"), (JPEG, "image/jpeg"), (WEBP, "image/webp")])
def test_images_become_data_uris_with_their_type(data, media):
    assert ollama.image_part(data) == {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def test_the_official_clients_image_encoding_arrives_as_a_data_uri(tmp_path):
    """ollama-python sends a file's bytes base64-encoded (``Image.serialize_model``)."""
    image = Path(tmp_path / "pic.png")
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x01" * 100)
    sent = ollama_client.Message(
        role="user", content="what is it?", images=[ollama_client.Image(value=image)]
    ).model_dump(exclude_none=True)
    [message] = ollama.openai_messages([sent])
    assert message["content"][0] == {"type": "text", "text": "what is it?"}
    assert message["content"][1]["image_url"]["url"] == "data:image/png;base64," + sent["images"][0]


def test_messages_with_tool_calls_and_results():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "I should call the tool",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    out = ollama.openai_messages(messages)
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[2]["reasoning_content"] == "I should call the tool"
    [call] = out[2]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {
        "name": "get_weather",
        "arguments": json.dumps({"city": "Paris"}),
    }
    assert out[3] == {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": call["id"]}


def test_a_message_without_a_role_is_refused():
    with pytest.raises(BadRequestError) as info:
        ollama.openai_messages([{"content": "hi"}])
    assert info.value.param == "messages.0"


def test_chat_request():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "options": {"temperature": 0},
        "format": "json",
        "think": True,
        "tools": tools,
    }
    out = ollama.chat_request(body)
    assert out == {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "enable_thinking": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": tools,
    }
    assert ollama.chat_request({**body, "stream": False})["stream"] is False
    assert "stream_options" not in ollama.chat_request({**body, "stream": False})


def test_generate_is_a_chat_turn_where_the_model_has_a_template():
    route, out = ollama.generate_request(
        {"prompt": "hi", "system": "be brief", "images": [PNG], "stream": False}, has_chat_template=True
    )
    assert route == ollama.CHAT
    assert out["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, ollama.image_part(PNG)]},
    ]


@pytest.mark.parametrize("raw, template", [(True, True), (False, False)])
def test_generate_is_the_bare_prompt_when_raw_or_without_a_template(raw, template):
    route, out = ollama.generate_request(
        {"prompt": "Once upon", "raw": raw, "system": "ignored", "stream": False}, has_chat_template=template
    )
    assert (route, out) == (ollama.COMPLETIONS, {"prompt": "Once upon", "stream": False})


def test_generate_with_a_suffix_is_infill():
    route, out = ollama.generate_request(
        {"prompt": "def f(", "suffix": "return 1", "options": {"num_predict": 8}}, has_chat_template=True
    )
    assert route == ollama.INFILL
    assert out == {"input_prefix": "def f(", "input_suffix": "return 1", "n_predict": 8, "stream": True}


def test_embed_request():
    assert ollama.embed_request({"input": "a"}) == {"input": "a"}
    assert ollama.embed_request({"input": ["a", "b"], "truncate": True, "dimensions": 8}) == {"input": ["a", "b"]}
    assert ollama.embed_request({"prompt": "older"}) == {"input": "older"}
    with pytest.raises(BadRequestError, match="input"):
        ollama.embed_request({"input": [1, 2]})


# -- answers -----------------------------------------------------------------------------------------

#: What b11434 answers (recorded from llama-server: /v1/chat/completions, stream and not).
CHAT_ANSWER = {
    "choices": [{"finish_reason": "length", "index": 0, "message": {"role": "assistant", "content": "Hello there"}}],
    "usage": {"completion_tokens": 5, "prompt_tokens": 32, "total_tokens": 37},
    "timings": {
        "cache_n": 0,
        "prompt_n": 32,
        "prompt_ms": 399.694,
        "predicted_n": 5,
        "predicted_ms": 111.309,
        "predicted_per_second": 35.9,
    },
}
STREAM = [
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"reasoning_content": "hmm"}}]},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hel"}}]},
    {
        "choices": [
            {
                "finish_reason": None,
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"ci'},
                        }
                    ]
                },
            }
        ]
    },
    {
        "choices": [
            {
                "finish_reason": None,
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]},
            }
        ]
    },
    {
        "choices": [{"finish_reason": "tool_calls", "index": 0, "delta": {}}],
        "timings": {"prompt_n": 10, "cache_n": 2, "prompt_ms": 20.0, "predicted_n": 7, "predicted_ms": 70.0},
    },
    {"choices": [], "usage": {"completion_tokens": 7, "prompt_tokens": 12, "total_tokens": 19}},
]


def test_a_whole_chat_answer():
    reply = ollama.Reply("chat", "m")
    reply.add(ollama.piece_of(ollama.CHAT, CHAT_ANSWER))
    out = reply.final(ollama.Durations(total_ns=900, load_ns=100), streamed=False)
    assert out.pop("created_at").endswith("Z")
    assert out == {
        "model": "m",
        "message": {"role": "assistant", "content": "Hello there"},
        "done": True,
        "done_reason": "length",
        "total_duration": 900,
        "load_duration": 100,
        "prompt_eval_count": 32,
        "prompt_eval_duration": 399694000,
        "eval_count": 5,
        "eval_duration": 111309000,
    }
    ollama_client.ChatResponse(**out)  # the official client reads it


def test_a_streamed_chat_answer_chunk_by_chunk():
    reply = ollama.Reply("chat", "m")
    chunks = [c for c in (reply.add(ollama.piece_of(ollama.CHAT, data)) for data in STREAM) if c is not None]
    assert [c["message"] for c in chunks] == [
        {"role": "assistant", "content": "", "thinking": "hmm"},
        {"role": "assistant", "content": "Hel"},
    ]
    assert all(c["done"] is False and c["model"] == "m" for c in chunks)
    final = reply.final(ollama.Durations(total_ns=5, load_ns=1), streamed=True)
    assert final["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    assert (final["done"], final["done_reason"]) == (True, "stop")  # Ollama says stop after tool calls
    assert (final["prompt_eval_count"], final["eval_count"], final["eval_duration"]) == (12, 7, 70_000_000)
    for chunk in [*chunks, final]:
        ollama_client.ChatResponse(**chunk)


def test_a_generate_answer_from_completions_and_from_infill():
    completion = {
        "choices": [{"text": "there was", "index": 0, "finish_reason": "stop"}],
        "usage": {"completion_tokens": 2, "prompt_tokens": 3},
    }
    reply = ollama.Reply("generate", "m")
    reply.add(ollama.piece_of(ollama.COMPLETIONS, completion))
    out = reply.final(ollama.Durations(1, 0), streamed=False)
    assert (out["response"], out["done_reason"], out["eval_count"], out["prompt_eval_count"]) == (
        "there was",
        "stop",
        2,
        3,
    )
    infill = {
        "content": "x):",
        "stop": True,
        "stop_type": "limit",
        "tokens_predicted": 3,
        "tokens_evaluated": 9,
        "timings": {"predicted_n": 3, "predicted_ms": 30.0, "prompt_ms": 5.0},
    }
    reply = ollama.Reply("generate", "m")
    reply.add(ollama.piece_of(ollama.INFILL, infill))
    out = reply.final(ollama.Durations(1, 0), streamed=False)
    assert (out["response"], out["done_reason"], out["eval_count"], out["prompt_eval_count"]) == ("x):", "length", 3, 9)
    ollama_client.GenerateResponse(**out)


def test_a_tool_call_whose_arguments_are_not_json_keeps_them_as_text():
    reply = ollama.Reply("chat", "m")
    reply.add(ollama.Piece(tool_calls=({"function": {"name": "f", "arguments": "not json"}},)))
    assert reply.tool_calls() == [{"function": {"name": "f", "arguments": {"raw": "not json"}}}]


def test_load_and_unload_replies():
    assert ollama.load_reply("chat", "m", "load")["message"] == {"role": "assistant", "content": ""}
    out = ollama.load_reply("generate", "m", "unload")
    assert (out["response"], out["done"], out["done_reason"]) == ("", True, "unload")


def test_embed_replies():
    answer = {
        "data": [{"index": 1, "embedding": [0.3]}, {"index": 0, "embedding": [0.1]}],
        "usage": {"prompt_tokens": 4},
    }
    out = ollama.embed_reply("m", answer, ollama.Durations(10, 2))
    assert out == {
        "model": "m",
        "embeddings": [[0.1], [0.3]],
        "total_duration": 10,
        "load_duration": 2,
        "prompt_eval_count": 4,
    }
    ollama_client.EmbedResponse(**out)
    assert ollama.embeddings_reply(answer) == {"embedding": [0.3]}


# -- models ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count, text", [(8_030_261_248, "8.0B"), (268_098_176, "268.10M"), (900_000, "900K")])
def test_parameter_size(count, text):
    assert ollama.parameter_size(count) == text


def test_tags_entry_reads_in_the_official_client(tmp_path):
    entry = ollama.tags_entry(
        "m", tmp_path / "m.gguf", 1234, 1_700_000_000_000_000_000, ollama.details("llama", 134_515_008, "Q4_1")
    )
    parsed = ollama_client.ListResponse(models=[entry]).models[0]
    assert (
        parsed.model,
        parsed.size,
        parsed.details.family,
        parsed.details.parameter_size,
        parsed.details.quantization_level,
    ) == ("m", 1234, "llama", "134.52M", "Q4_1")
    assert parsed.modified_at == datetime.fromtimestamp(1_700_000_000, UTC)
    assert entry["digest"] == ollama.digest(tmp_path / "m.gguf", 1234, 1_700_000_000_000_000_000)
    assert entry["digest"] != ollama.digest(tmp_path / "m.gguf", 1234, 1_700_000_000_000_000_001)


class _Lazy:
    """Stands in for the reader's lazily read arrays (``tokenizer.ggml.tokens``)."""

    def __iter__(self):
        return iter(["a", "b"])


def test_model_info_leaves_big_arrays_empty_unless_verbose():
    metadata = {
        "general.architecture": "llama",
        "llama.context_length": 8192,
        "general.languages": ["en"],
        "tokenizer.ggml.tokens": _Lazy(),
        "tokenizer.chat_template": "{{ x }}",
    }
    out = ollama.model_info(metadata, 135)
    assert out == {
        "general.architecture": "llama",
        "llama.context_length": 8192,
        "general.languages": ["en"],
        "tokenizer.ggml.tokens": [],
        "general.parameter_count": 135,
    }
    assert ollama.model_info(metadata, 135, verbose=True)["tokenizer.ggml.tokens"] == ["a", "b"]


def test_capabilities():
    assert ollama.capabilities(tools=False, thinking=False, vision=False) == ["completion"]
    assert ollama.capabilities(tools=True, thinking=True, vision=True) == ["completion", "tools", "thinking", "vision"]


def test_expires_at():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert ollama.expires_at(60, 300, False, now) == "2026-01-01T00:01:00Z"  # idle: what is left of the TTL
    assert ollama.expires_at(None, 300, False, now) == "2026-01-01T00:05:00Z"  # busy: the TTL runs from the end
    assert ollama.expires_at(None, 0, False, now).startswith("2317-")  # no TTL: Ollama's "forever"
    assert ollama.expires_at(None, 300, True, now).startswith("2317-")  # pinned


def test_pull_lines_from_download_snapshots():
    """One line per file that moved (Ollama reports one per layer), then success or the error."""
    shown: dict[str, int] = {}
    files = [
        {"path": "m-Q4_K_M.gguf", "size": 100, "done": 0, "state": "pending"},
        {"path": "mmproj-F16.gguf", "size": 10, "done": 0, "state": "cached"},
    ]
    first = ollama.pull_lines({"state": "running", "files": files}, shown)
    assert first == [{"status": "pulling mmproj-F16.gguf", "digest": "mmproj-F16.gguf", "total": 10, "completed": 10}]
    files[0].update(done=40, state="downloading")
    assert ollama.pull_lines({"state": "running", "files": files}, shown) == [
        {"status": "pulling m-Q4_K_M.gguf", "digest": "m-Q4_K_M.gguf", "total": 100, "completed": 40}
    ]
    assert ollama.pull_lines({"state": "running", "files": files}, shown) == []  # nothing moved
    files[0].update(done=100, state="done")
    *progress, last = ollama.pull_lines({"state": "done", "files": files}, shown)
    assert progress[0]["completed"] == 100 and last == {"status": "success"}
    failed = ollama.pull_lines({"state": "failed", "files": [], "error": {"message": "the disk is full"}}, {})
    assert failed == [{"error": "the disk is full"}]
    for line in first:
        ollama_client.ProgressResponse(**line)


@pytest.mark.parametrize(
    "name, spec",
    [
        ("owner/repo", "owner/repo"),
        ("owner/repo:Q4_K_M", "owner/repo:Q4_K_M"),
        ("hf.co/owner/repo:Q8_0", "owner/repo:Q8_0"),
        ("https://huggingface.co/owner/repo", "owner/repo"),
    ],
)
def test_pull_spec(name, spec):
    assert ollama.pull_spec(name) == spec


def test_pulling_from_the_ollama_library_is_refused_with_what_to_do():
    with pytest.raises(BadRequestError, match="owner/repo"):
        ollama.pull_spec("llama3.2")
