"""A conversation survives an eviction: slots saved before a stop, restored for the chat that continues them.

The real studio on the pinned llama-server with SmolLM2 (plain attention): an evicted model used to come
back cold, its whole conversation processed again on the next turn.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import time
from pathlib import Path

import httpx
import pytest

from launcher.errors import SlotFileError
from launcher.planner import PlanRequest, plan
from launcher.slot_files import SEQ_MAGIC, SEQ_VERSION, read_tokens
from studio.residency.slot_cache import SlotCache
from studio.settings import ModelDefaults
from tests.support.studio import running_studio
from tests.test_command import cpu_only

STORY = " ".join(f"Sentence {i} of a long story about a lighthouse keeper and her cat." for i in range(30))
TURN1 = [{"role": "user", "content": f"{STORY}\nWho is the story about? Answer in one short sentence."}]


def slot_file(path: Path, tokens: list[int], *, packed: bool = True, extra: bytes = b"state") -> Path:
    words = [-1, 1, len(tokens), *tokens, 0] if packed else tokens
    path.write_bytes(struct.pack(f"<III{len(words)}i", SEQ_MAGIC, SEQ_VERSION, len(words), *words) + extra)
    return path


# --- the file format and the disk budget ---------------------------------------------------------------


def test_the_tokens_of_a_slot_file_are_read_from_its_head(tmp_path):
    assert read_tokens(slot_file(tmp_path / "a.bin", [5, 6, 7])) == [5, 6, 7]
    assert read_tokens(slot_file(tmp_path / "b.bin", [5, 6], packed=False)) == [5, 6]


@pytest.mark.parametrize(
    "data, why",
    [
        (b"", "cut short"),
        (b"GGUF" + bytes(8), "not a slot file"),
        (struct.pack("<III", SEQ_MAGIC, SEQ_VERSION, 10) + bytes(8), "cut short"),
        (struct.pack("<III", SEQ_MAGIC, SEQ_VERSION, 1 << 30), "claims"),
        (struct.pack("<IIIiii", SEQ_MAGIC, SEQ_VERSION, 3, -1, 1, 99), "malformed"),
    ],
)
def test_a_bad_slot_file_is_a_clear_error(tmp_path, data, why):
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    with pytest.raises(SlotFileError, match=why):
        read_tokens(path)


def test_the_disk_budget_drops_the_least_recently_used_files_first(tmp_path):
    cache = SlotCache(tmp_path, binary=Path("/nonexistent"), disk_budget=2500)
    folder = tmp_path / "model-key"
    folder.mkdir()
    files = []
    for i in range(4):
        path = slot_file(folder / f"{i}.bin", [i] * 10, extra=bytes(1000))
        os.utime(path, ns=(time.time_ns() - (10 - i) * 10**9,) * 2)  # 0 oldest ... 3 newest
        files.append(path)
    os.utime(files[0], None)  # 0 was just used (restored): now the newest
    cache.prune()
    assert [p.exists() for p in files] == [True, False, False, True]


# --- through the studio, on the real llama-server -------------------------------------------------------


def chat(base: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": "smollm", "messages": messages, "max_tokens": 12, "temperature": 0}
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def unload(base: str) -> None:
    assert httpx.post(f"{base}/api/unload", json={"model": "smollm"}, timeout=60).status_code == 200


def studio(tmp_path: Path, binary: Path, model: Path, n_ctx: int = 2048):
    cache = SlotCache(tmp_path / "slots", binary=binary, disk_budget=1 << 30)
    defaults = {"smollm": ModelDefaults(n_ctx=n_ctx, spec="off")}
    return running_studio(tmp_path, binary, {"smollm": model}, defaults=defaults, slot_cache=cache), cache


def turn2(first: dict) -> list[dict[str, str]]:
    return [*TURN1, first["choices"][0]["message"], {"role": "user", "content": "And what is the cat called?"}]


@pytest.mark.slow
def test_an_evicted_conversation_continues_warm_with_the_same_greedy_answer(tmp_path, llama_server_bin, smollm_model):
    """The next turn after an eviction processed the whole conversation again."""
    running, cache = studio(tmp_path, llama_server_bin, smollm_model)
    with running as s:
        first = chat(s.url, TURN1)
        resident = chat(s.url, turn2(first))  # the next turn on a model never evicted
        unload(s.url)
        for old in cache.root.glob("*/*.bin"):
            old.unlink()
        chat(s.url, TURN1)  # the first turn again, on a fresh llama-server
        unload(s.url)  # evicted after the first turn: its slot is saved
        assert len(list(cache.root.glob("*/*.bin"))) == 1, "no slot was saved before the unload"
        again = chat(s.url, turn2(first))  # loads the model anew: the saved slot comes back first
        conversation = again["timings"]["prompt_n"] + again["timings"].get("cache_n", 0)
        assert again["choices"][0]["message"]["content"] == resident["choices"][0]["message"]["content"]
        assert again["timings"]["prompt_n"] <= 0.1 * conversation, again["timings"]
        assert again["timings"]["cache_n"] >= 0.9 * conversation


def _anthropic_turn(base: str, messages: list[dict]) -> tuple[str, int, int]:
    body = {"model": "smollm", "messages": messages, "max_tokens": 12, "temperature": 0}
    resp = httpx.post(f"{base}/v1/messages", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    usage = data["usage"]
    return data["content"][0]["text"], usage["input_tokens"], usage["cache_read_input_tokens"]


def _responses_turn(base: str, messages: list[dict]) -> tuple[str, int, int]:
    items = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": m["content"]}]}
        if m["role"] == "assistant"
        else m
        for m in messages
    ]
    body = {"model": "smollm", "input": items, "max_output_tokens": 12, "temperature": 0}
    resp = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    text = "".join(c["text"] for o in data["output"] if o["type"] == "message" for c in o["content"])
    cached = data["usage"]["input_tokens_details"]["cached_tokens"]
    return text, data["usage"]["input_tokens"] - cached, cached


@pytest.mark.slow
@pytest.mark.parametrize("turn", [_anthropic_turn, _responses_turn], ids=["anthropic", "responses"])
def test_an_evicted_conversation_on_the_anthropic_and_responses_routes_continues_warm(
    tmp_path, llama_server_bin, smollm_model, turn
):
    """Only the OpenAI chat route looked for a saved slot: an Anthropic or Responses conversation came back cold
    after an eviction, its whole history processed again."""
    running, cache = studio(tmp_path, llama_server_bin, smollm_model)
    with running as s:
        answer, _, _ = turn(s.url, TURN1)
        unload(s.url)  # evicted: its slot is saved
        assert len(list(cache.root.glob("*/*.bin"))) == 1, "no slot was saved before the unload"
        turn2 = [*TURN1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the cat's name?"}]
        _, processed, cached = turn(s.url, turn2)
        assert processed <= 0.1 * (processed + cached), (processed, cached)


@pytest.mark.slow
def test_a_stored_conversation_resumed_on_the_page_after_an_eviction_restores_its_slot(
    tmp_path, llama_server_bin, smollm_model
):
    """``/api/chat`` (the page, and so the chat history) never looked for a saved slot: a conversation resumed
    from the history after its model was evicted processed every stored message again."""
    import json

    def page_chat(base: str, messages: list[dict[str, str]], cid: str) -> list[dict]:
        body = {"model": "smollm", "messages": messages, "conversation_id": cid, "max_tokens": 12, "temperature": 0}
        with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            return [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]

    running, cache = studio(tmp_path, llama_server_bin, smollm_model)
    with running as s:
        cid = httpx.post(f"{s.url}/api/conversations", json={}, timeout=10).json()["id"]
        first = page_chat(s.url, TURN1, cid)
        answer = "".join(e.get("text", "") for e in first)
        unload(s.url)  # evicted: its slot is saved
        assert len(list(cache.root.glob("*/*.bin"))) == 1, "no slot was saved before the unload"
        turn2 = [*TURN1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the cat's name?"}]
        done = page_chat(s.url, turn2, cid)[-1]
        assert done["type"] == "done", done
        timings = done["timings"]
        conversation = timings["prompt_n"] + timings.get("cache_n", 0)
        assert timings["prompt_n"] <= 0.1 * conversation, timings


def test_a_slot_file_from_another_model_file_or_build_is_never_restored(tmp_path, gemma, real, gemma_model):
    """Restores look only in the launch's own folder: another model file or a rebuilt llama-server has another."""
    binary = tmp_path / "llama-server"
    binary.write_bytes(b"build one")
    cache = SlotCache(tmp_path / "slots", binary=binary, disk_budget=1 << 30)
    launch = plan(gemma, cpu_only(), real, PlanRequest(n_ctx=4096))
    home = cache.folder(launch)
    assert cache.folder(launch) == home  # the same model, settings and build find their files again
    other_file = tmp_path / "copy.gguf"
    other_file.symlink_to(gemma_model)  # the same bytes under another name: another model file to the user
    other = dataclasses.replace(launch, model=dataclasses.replace(launch.model, path=other_file))
    assert cache.folder(other) != home
    binary.write_bytes(b"build two, rebuilt")
    assert cache.folder(launch) != home


@pytest.mark.slow
def test_a_slot_saved_under_another_context_is_never_restored_and_a_corrupt_one_is_skipped(
    tmp_path, llama_server_bin, smollm_model
):
    """Files are keyed by what shapes the KV; an unreadable file is dropped with a log line, not a failure."""
    running, cache = studio(tmp_path, llama_server_bin, smollm_model, n_ctx=2048)
    with running as s:
        chat(s.url, TURN1)
        unload(s.url)
        (saved,) = cache.root.glob("*/*.bin")
    running, cache = studio(tmp_path, llama_server_bin, smollm_model, n_ctx=1024)
    with running as s:
        cold = chat(s.url, TURN1)  # another context: another folder, the 2048 file stays out of it
        assert cold["timings"]["prompt_n"] > 300 and saved.exists()
        (folder,) = {p for p in cache.root.iterdir() if p != saved.parent}
        garbage = folder / "garbage.bin"
        garbage.write_bytes(b"not a slot file at all")
        unload(s.url)
        warm = chat(s.url, TURN1)
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        assert not garbage.exists()


@pytest.mark.slow
def test_only_the_first_chats_after_a_start_look_for_a_saved_slot(tmp_path, llama_server_bin, smollm_model):
    """Each chat rendered and tokenized its prompt and read every saved file's head while any file stayed
    unrestored: a model with an old conversation on disk paid for it on every request."""
    from studio.residency.slot_cache import MAX_MISSES

    running, cache = studio(tmp_path, llama_server_bin, smollm_model)
    other = [{"role": "user", "content": "Name three colours."}]
    with running as s:
        chat(s.url, TURN1)
        unload(s.url)  # the first conversation is saved
        for _ in range(MAX_MISSES):
            chat(s.url, other)  # continues nothing saved
        (resident,) = s.manager.residents
        warmth = cache._warm[resident.loaded.url]
        assert warmth.done and warmth.misses == MAX_MISSES and warmth.slots_restored == 0
        later = chat(s.url, TURN1)  # too late: this llama-server stopped looking
        assert later["timings"].get("cache_n", 0) < 0.5 * later["timings"]["prompt_n"]
