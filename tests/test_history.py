"""The chat history: the real SQLite store behind the real app under uvicorn, chats through the replay upstream.

``/api/chat`` runs its real proxy path against ``tests.replay_upstream`` (scripted answers,
delays to leave mid-answer); the store is the real one on disk in a temporary studio home.
What the real llama-server and a real ``kill -9`` show is in ``test_history_serve.py``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.history import store
from studio.history.database import SCHEMA_VERSION, open_database
from studio.history.recorder import begin_turn
from studio.history.service import History
from studio.http.app import create_app
from tests.helpers import serving, wait_for
from tests.replay_upstream import WEATHER_TOOL, Answer, ReplayUpstream
from tests.standin_manager import StandInManager, StandInModel

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "history"


def studio(replay: ReplayUpstream, folder: Path):
    """The app with the replay model and the history in ``folder``, served; a context manager yielding its URL."""
    return serving(create_app(StandInManager(StandInModel(name="replay", url=replay.url)), history=History(folder)))


def chat(base: str, cid: str | None, text: str, **extra: Any) -> list[dict[str, Any]]:
    body = {"messages": [{"role": "user", "content": text}], **extra}
    if cid is not None:
        body["conversation_id"] = cid
    with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]


def new_conversation(base: str, **fields: Any) -> str:
    resp = httpx.post(f"{base}/api/conversations", json=fields, timeout=10)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def stored(base: str, cid: str) -> dict[str, Any]:
    resp = httpx.get(f"{base}/api/conversations/{cid}", timeout=10)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


# -- chats are stored as they happen --------------------------------------------------------------


def test_a_chat_with_a_conversation_id_stores_the_question_the_answer_and_its_settings(replay, home):
    replay.script(Answer(content=["Paris ", "is the ", "capital."], reasoning=["Easy."]))
    with studio(replay, home) as base:
        cid = new_conversation(base)
        events = chat(base, cid, "What is the capital of France, please tell me now?", temperature=0.2)
        assert events[-1]["type"] == "done" and not [e for e in events if e["type"] == "history"]
        c = stored(base, cid)
    assert c["title"] == "What is the capital of France, please tell"  # the first words of the first message
    assert c["model"] == "replay" and c["load"]["n_ctx"] == 4096 and c["options"] == {"temperature": 0.2}
    user, answer = c["messages"]
    assert (user["role"], user["content"], user["cut"]) == (
        "user",
        "What is the capital of France, please tell me now?",
        False,
    )
    assert (answer["role"], answer["content"], answer["reasoning"]) == ("assistant", "Paris is the capital.", "Easy.")
    assert answer["cut"] is False and answer["usage"]["completion_tokens"] == 4
    assert answer["timings"]["prompt_n"] == 10 and answer["timings"]["finish_reason"] == "stop"


def test_history_survives_a_restart_of_the_studio(replay, home):
    replay.script(Answer.text("Kept."))
    with studio(replay, home) as base:
        cid = new_conversation(base, title="Keep me")
        chat(base, cid, "Remember this")
    with studio(replay, home) as base:
        listed = httpx.get(f"{base}/api/conversations", timeout=10).json()["conversations"]
        assert [(c["id"], c["title"], c["message_count"]) for c in listed] == [(cid, "Keep me", 2)]
        assert [m["content"] for m in stored(base, cid)["messages"]] == ["Remember this", "Kept."]


def test_an_answer_cut_by_a_disconnect_is_kept_with_what_was_streamed_and_marked_cut(replay, home):
    pieces = [f"word{i} " for i in range(200)]
    replay.script(Answer(content=pieces, delay=0.02))
    with studio(replay, home) as base:
        cid = new_conversation(base)
        body = {"messages": [{"role": "user", "content": "Tell a long story"}], "conversation_id": cid}
        with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=30) as resp:
            seen = ""
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    seen += json.loads(line[5:]).get("text", "")
                    if seen.count("word") >= 40:
                        break  # the client leaves, as a Stop or a closed tab does
        answer = wait_for(
            lambda: (m := stored(base, cid)["messages"])[-1]["content"].count("word") >= 40 and m[-1],
            timeout=10,
            what="the cut answer to be saved",
        )
    assert answer["cut"] is True and answer["usage"] is None
    assert "".join(pieces).startswith(answer["content"]) and seen.startswith(answer["content"][: len(seen) - 20])


def test_an_error_before_any_word_keeps_the_question_but_no_empty_answer(replay, home):
    replay.script(Answer(status=500, error={"code": 500, "message": "boom", "type": "server_error"}))
    with studio(replay, home) as base:
        cid = new_conversation(base)
        events = chat(base, cid, "Hello?")
        assert events[-1]["type"] == "error"
        wait_for(lambda: len(stored(base, cid)["messages"]) == 1, timeout=5, what="the empty answer to go")
        assert [m["role"] for m in stored(base, cid)["messages"]] == ["user"]


def test_an_unknown_conversation_id_is_refused_before_the_model_runs(replay, home):
    with studio(replay, home) as base:
        before = len(replay.requests)
        resp = httpx.post(
            f"{base}/api/chat", json={"messages": [{"role": "user", "content": "hi"}], "conversation_id": "nope"}
        )
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "conversation_not_found"
        assert "nope" in resp.json()["error"]["message"] and len(replay.requests) == before


# -- two tabs on one conversation -------------------------------------------------------------------


def test_two_tabs_writing_one_conversation_lose_no_message_and_keep_each_ones_order(replay, home):
    with studio(replay, home) as base:
        cid = new_conversation(base)

        def tab(name: str) -> None:
            with httpx.Client(base_url=base, timeout=30) as client:
                for i in range(25):
                    body = {"messages": [{"role": "user", "content": f"{name} {i}"}]}
                    assert client.post(f"/api/conversations/{cid}/messages", json=body).status_code == 201

        tabs = [threading.Thread(target=tab, args=(n,)) for n in ("left", "right")]
        for t in tabs:
            t.start()
        for t in tabs:
            t.join(60)
        messages = stored(base, cid)["messages"]
    assert [m["seq"] for m in messages] == list(range(1, 51))
    for name in ("left", "right"):
        assert [m["content"] for m in messages if m["content"].startswith(name)] == [f"{name} {i}" for i in range(25)]


def test_two_chats_at_once_on_one_conversation_keep_each_question_next_to_its_answer(replay, home):
    replay.script(*(Answer(content=[f"answer{i} ", "done"], delay=0.05) for i in range(2)))
    with studio(replay, home) as base:
        cid = new_conversation(base)
        tabs = [threading.Thread(target=chat, args=(base, cid, f"question{i}")) for i in range(2)]
        for t in tabs:
            t.start()
        for t in tabs:
            t.join(60)
        messages = stored(base, cid)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2 and not any(m["cut"] for m in messages)
    assert {m["content"] for m in messages[::2]} == {"question0", "question1"}


# -- faults -------------------------------------------------------------------------------------------


def _disk_full(*args: object) -> None:
    """A store write on a full disk: SQLite's own error for it."""
    raise sqlite3.OperationalError("database or disk is full")


def test_a_full_disk_leaves_the_chat_answering_and_the_page_is_told_the_answer_was_not_saved(replay, home, monkeypatch):
    """A full disk is imitated at the store's boundary (no tiny filesystem here): the answer's saves raise
    ``sqlite3.OperationalError("database or disk is full")``, as SQLite raises it on a full disk."""
    replay.script(Answer(content=["still ", "answering"]))
    with studio(replay, home) as base:
        cid = new_conversation(base)

        monkeypatch.setattr(store, "update_message", _disk_full)
        events = chat(base, cid, "Hello")
        assert "".join(e.get("text", "") for e in events) == "still answering" and events[-1]["type"] == "done"
        told = [e for e in events if e["type"] == "history"]
        assert len(told) == 1 and told[0]["saved"] is False and told[0]["code"] == "history_write_failed"
        assert "database or disk is full" in told[0]["message"] and "free some disk space" in told[0]["message"]


def test_a_full_disk_before_the_question_is_stored_still_answers(replay, home, monkeypatch):
    """As above, at the first write of the turn (the question): ``append_messages`` raises SQLite's full-disk error."""
    replay.script(Answer(content=["answered"]))
    with studio(replay, home) as base:
        cid = new_conversation(base)

        monkeypatch.setattr(store, "append_messages", _disk_full)
        events = chat(base, cid, "Hello")
        assert events[0]["type"] == "history" and events[0]["saved"] is False
        assert "".join(e.get("text", "") for e in events) == "answered" and events[-1]["type"] == "done"


def _refused(replay: ReplayUpstream, folder: Path) -> dict[str, Any]:
    """Start the studio on ``folder``; return what ``/api/status`` and the history routes say."""
    with studio(replay, folder) as base:
        status = wait_for(
            lambda: (s := httpx.get(f"{base}/api/status", timeout=10).json()["history"])["state"] != "opening" and s,
            timeout=10,
        )
        listed = httpx.get(f"{base}/api/conversations", timeout=10)
        created = httpx.post(f"{base}/api/conversations", json={}, timeout=10)
        assert httpx.get(f"{base}/health").status_code == 200  # the studio itself runs
    assert listed.status_code == 503 and created.status_code == 503
    assert listed.json()["error"]["code"] == "history_unavailable"
    assert listed.json()["error"]["message"] == status["problem"]
    return status


def test_a_corrupt_database_file_is_refused_and_left_as_it_was(replay, home):
    home.mkdir()
    garbage = b"this is not a database\x00" * 500
    (home / "history.db").write_bytes(garbage)
    status = _refused(replay, home)
    assert status["state"] == "unavailable" and "is not a SQLite database" in status["problem"]
    assert "left as it is" in status["problem"]
    assert (home / "history.db").read_bytes() == garbage
    assert sorted(p.name for p in home.iterdir()) == ["history.db"]


def test_a_database_damaged_inside_is_refused_and_left_as_it_was(replay, home):
    conn = open_database(home / "history.db")
    for i in range(300):
        store.create_conversation(conn, title=f"chat {i} " + "x" * 200)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    damaged = bytearray((home / "history.db").read_bytes())
    damaged[8192:24576] = b"\xa5" * 16384  # pages 3-6 of 4096 bytes: b-tree pages overwritten
    (home / "history.db").write_bytes(bytes(damaged))
    status = _refused(replay, home)
    assert status["state"] == "unavailable" and "damaged" in status["problem"]
    assert (home / "history.db").read_bytes() == bytes(damaged)


def test_a_database_from_a_newer_studio_is_refused_and_left_as_it_was(replay, home):
    conn = open_database(home / "history.db")
    conn.execute("INSERT INTO schema_version (version, applied) VALUES (?, 'later')", (SCHEMA_VERSION + 1,))
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = (home / "history.db").read_bytes()
    status = _refused(replay, home)
    assert f"newer GGUF Studio (schema {SCHEMA_VERSION + 1}" in status["problem"]
    assert (home / "history.db").read_bytes() == before


def test_a_chat_with_an_unusable_history_still_answers_and_says_it_was_not_saved(replay, home):
    home.mkdir()
    (home / "history.db").write_bytes(b"garbage" * 100)
    replay.script(Answer.text("answered anyway"))
    with studio(replay, home) as base:
        events = chat(base, "0" * 32, "Hello")
    assert events[0]["type"] == "history" and events[0]["code"] == "history_unavailable"
    assert events[-1]["type"] == "done" and "answered anyway" in "".join(e.get("text", "") for e in events)


# -- schema migrations ------------------------------------------------------------------------------


def test_a_database_of_the_first_schema_version_is_migrated_and_its_old_messages_are_searchable(replay, home):
    conn = open_database(home / "history.db", upto=1)
    conn.execute(
        "INSERT INTO conversations (id, title, model, created, updated) VALUES ('old', 'From long ago', 'm', "
        "'2025-01-01T00:00:00.000+00:00', '2025-01-01T00:00:00.000+00:00')"
    )
    conn.execute(
        "INSERT INTO messages (conversation_id, seq, role, content, created) VALUES "
        "('old', 1, 'user', 'the aardvark sleeps', '2025-01-01T00:00:00.000+00:00')"
    )
    conn.close()
    with studio(replay, home) as base:
        found = httpx.get(f"{base}/api/conversations", params={"q": "aardvark"}, timeout=10).json()["conversations"]
        by_title = httpx.get(f"{base}/api/conversations", params={"q": "long"}, timeout=10).json()["conversations"]
        assert httpx.get(f"{base}/api/status").json()["history"]["schema_version"] == SCHEMA_VERSION
    assert [(c["id"], c["snippet"]) for c in found] == [("old", "the aardvark sleeps")]
    assert [c["id"] for c in by_title] == ["old"]
    versions = sqlite3.connect(home / "history.db").execute("SELECT version FROM schema_version").fetchall()
    assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


# -- search ---------------------------------------------------------------------------------------------


def test_search_finds_a_word_from_an_old_message_among_many(replay, home):
    conn = open_database(home / "history.db")
    old = store.create_conversation(conn, title="Gardening")
    store.append_messages(conn, old["id"], [{"role": "user", "content": "How deep do I plant tulip bulbs?"}])
    for i in range(200):
        c = store.create_conversation(conn, title=f"chat {i}")
        store.append_messages(conn, c["id"], [{"role": "user", "content": f"question number {i} about nothing"}])
    conn.close()
    with studio(replay, home) as base:

        def search(q: str) -> list[dict[str, Any]]:
            resp = httpx.get(f"{base}/api/conversations", params={"q": q}, timeout=10)
            assert resp.status_code == 200, resp.text
            return list(resp.json()["conversations"])

        assert [(c["id"], c["title"]) for c in search("tulip")] == [(old["id"], "Gardening")]
        assert [c["id"] for c in search("tul")] == [old["id"]]  # the last word as a prefix, as one types
        assert [c["id"] for c in search("plant tulip")] == [old["id"]]
        assert search("tulip nothing") == []
        assert search('"tulip') == [] or search('"tulip')[0]["id"] == old["id"]  # quotes are no syntax error
        assert search("AND OR NOT (") == []


# -- export and import ------------------------------------------------------------------------------------


def _filled(replay: ReplayUpstream, base: str) -> None:
    replay.script(Answer(content=["A ", "picture."], reasoning=["Look."]), Answer.text("Hi again"))
    cid = new_conversation(base, title="With a picture")
    chat(base, cid, "Hello ünïcode ✓")
    other = new_conversation(base, model="replay", options={"temperature": 0.5})
    chat(base, other, "second chat")


def test_export_then_import_round_trips_byte_for_byte(replay, tmp_path):
    with studio(replay, tmp_path / "one") as base:
        _filled(replay, base)
        history = History(tmp_path / "one")  # a second handle on the same files: attach a picture directly
        conn = open_database(history.path)
        digest = hashlib.sha256(PNG).hexdigest()
        history.attachments.mkdir(exist_ok=True)
        (history.attachments / digest).write_bytes(PNG)
        store.add_attachment(conn, digest, "image/png", len(PNG))
        cid = httpx.get(f"{base}/api/conversations").json()["conversations"][-1]["id"]
        store.append_messages(
            conn,
            cid,
            [{"role": "user", "content": "see", "attachments": [{"hash": digest, "media_type": "image/png"}]}],
        )
        conn.close()
        exported = httpx.get(f"{base}/api/conversations/export", timeout=10)
        assert exported.status_code == 200 and "attachment" in exported.headers["content-disposition"]
    document = exported.json()
    assert len(document["conversations"]) == 2 and [a["hash"] for a in document["attachments"]] == [digest]
    with studio(replay, tmp_path / "two") as base:
        imported = httpx.post(
            f"{base}/api/conversations/import",
            content=exported.content,
            headers={"content-type": "application/json"},
            timeout=10,
        )
        assert imported.status_code == 201, imported.text
        again = httpx.get(f"{base}/api/conversations/export", timeout=10).content
        picture = httpx.get(f"{base}/api/attachments/{digest}", timeout=10)
    assert again == exported.content
    assert picture.content == PNG and picture.headers["content-type"] == "image/png"


def test_a_second_import_of_the_same_file_adds_copies_and_overwrites_nothing(replay, tmp_path):
    with studio(replay, tmp_path / "one") as base:
        _filled(replay, base)
        exported = httpx.get(f"{base}/api/conversations/export", timeout=10).content
        resp = httpx.post(
            f"{base}/api/conversations/import", content=exported, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 201
        listed = httpx.get(f"{base}/api/conversations").json()["conversations"]
    assert len(listed) == 4 and len({c["id"] for c in listed}) == 4


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda d: d["conversations"][1]["messages"][0].update(role="robot"), "conversations.1.messages.0.role"),
        (lambda d: d["conversations"][0].update(colour="red"), "conversations.0.colour"),
        (lambda d: d["conversations"][0].pop("created"), "conversations.0.created"),
        (lambda d: d.update(version=7), "version"),
        (lambda d: d["attachments"][0].update(data=base64.b64encode(b"other").decode()), "attachments[0].hash"),
        (lambda d: d["attachments"].clear(), "conversations[0].messages[2].attachments[0]"),
    ],
)
def test_an_import_of_a_malformed_file_names_what_is_wrong_and_imports_nothing(replay, tmp_path, damage, named):
    with studio(replay, tmp_path / "one") as base:
        _filled(replay, base)
        conn = open_database(tmp_path / "one" / "history.db")
        digest = hashlib.sha256(PNG).hexdigest()
        (tmp_path / "one" / "attachments").mkdir(exist_ok=True)
        (tmp_path / "one" / "attachments" / digest).write_bytes(PNG)
        store.add_attachment(conn, digest, "image/png", len(PNG))
        first = httpx.get(f"{base}/api/conversations").json()["conversations"][-1]["id"]
        store.append_messages(
            conn,
            first,
            [{"role": "user", "content": "see", "attachments": [{"hash": digest, "media_type": "image/png"}]}],
        )
        conn.close()
        document = httpx.get(f"{base}/api/conversations/export", timeout=10).json()
    damage(document)
    with studio(replay, tmp_path / "two") as base:
        resp = httpx.post(f"{base}/api/conversations/import", json=document, timeout=10)
        assert resp.status_code in (400, 422), resp.text
        error = resp.json()["error"]
        assert named in error["message"] or named == error.get("param"), error
        assert httpx.get(f"{base}/api/conversations").json()["conversations"] == []
    assert not (tmp_path / "two" / "attachments").exists() or not list((tmp_path / "two" / "attachments").iterdir())


def test_a_conversation_exports_as_markdown(replay, home):
    replay.script(Answer(content=["Forty-two."], reasoning=["Think."]))
    with studio(replay, home) as base:
        cid = new_conversation(base, title="The answer")
        chat(base, cid, "What is the answer?")
        resp = httpx.get(f"{base}/api/conversations/{cid}/export", params={"format": "markdown"}, timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/markdown")
    text = resp.text
    assert text.startswith("# The answer\n") and "## You\n\nWhat is the answer?" in text
    assert "## Assistant (replay)" in text and "Think." in text and text.rstrip().endswith("Forty-two.")


# -- the rest of the API ---------------------------------------------------------------------------------


def test_rename_delete_and_their_errors(replay, home):
    with studio(replay, home) as base:
        cid = new_conversation(base)
        renamed = httpx.patch(f"{base}/api/conversations/{cid}", json={"title": "Named"}, timeout=10)
        assert renamed.status_code == 200 and renamed.json()["title"] == "Named"
        typo = httpx.patch(f"{base}/api/conversations/{cid}", json={"titel": "x"}, timeout=10)
        assert typo.status_code == 422 and "did you mean title" in typo.json()["error"]["message"]
        assert httpx.delete(f"{base}/api/conversations/{cid}", timeout=10).json() == {"deleted": cid}
        gone = httpx.get(f"{base}/api/conversations/{cid}", timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "conversation_not_found"
        assert httpx.delete(f"{base}/api/conversations/{cid}", timeout=10).status_code == 404


def test_deleting_the_last_conversation_that_names_an_attachment_deletes_its_file(replay, home):
    with studio(replay, home) as base:
        cid = new_conversation(base)
        conn = open_database(home / "history.db")
        digest = hashlib.sha256(PNG).hexdigest()
        (home / "attachments").mkdir(exist_ok=True)
        (home / "attachments" / digest).write_bytes(PNG)
        store.add_attachment(conn, digest, "image/png", len(PNG))
        store.append_messages(
            conn, cid, [{"role": "user", "content": "x", "attachments": [{"hash": digest, "media_type": "image/png"}]}]
        )
        conn.close()
        assert httpx.get(f"{base}/api/attachments/{digest}").content == PNG
        httpx.delete(f"{base}/api/conversations/{cid}", timeout=10).raise_for_status()
        assert httpx.get(f"{base}/api/attachments/{digest}").status_code == 404
    assert not (home / "attachments" / digest).exists()


def test_a_tool_call_the_page_is_to_run_is_stored_with_the_answer(replay, home):
    replay.script(Answer(content=["Checking."], tool_calls=[("get_weather", '{"city": "Paris"}')]))
    with studio(replay, home) as base:
        cid = new_conversation(base)
        events = chat(base, cid, "Weather in Paris?", tools=[WEATHER_TOOL])
        assert events[-1]["type"] == "done"
        answer = stored(base, cid)["messages"][-1]
    assert answer["tool_calls"] == [{"id": "replay0", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert answer["content"] == "Checking." and answer["timings"]["finish_reason"] == "tool_calls"


def test_an_image_in_a_question_is_stored_once_by_its_hash(home):
    """``begin_turn`` on the real store (the replay model takes no images, so the chat route refuses them)."""
    url = f"data:image/png;base64,{base64.b64encode(PNG).decode()}"
    question = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    history = History(home)

    async def twice() -> list[dict[str, Any]]:
        cid = (await history.write(store.create_conversation))["id"]
        for _ in range(2):
            await begin_turn(history, cid, {"messages": [{"role": "user", "content": question}]}, "m", {})
        return list(await history.read(store.list_messages, cid))

    try:
        messages = asyncio.run(twice())
    finally:
        history.close()
    digest = hashlib.sha256(PNG).hexdigest()
    users = [m for m in messages if m["role"] == "user"]
    assert [m["content"] for m in users] == ["What is this?"] * 2
    assert all(m["attachments"] == [{"hash": digest, "media_type": "image/png"}] for m in users)
    assert [p.name for p in (home / "attachments").iterdir()] == [digest]
    assert (home / "attachments" / digest).read_bytes() == PNG


def test_history_requests_hung_forever_when_no_app_had_started_the_store(home):
    """An app served without its lifespan (a bare ``TestClient``) must not leave history requests waiting forever."""
    history = History(home)
    try:
        created = asyncio.run(asyncio.wait_for(history.write(store.create_conversation), 10))
        listed = asyncio.run(asyncio.wait_for(history.read(lambda c: store.list_conversations(c, limit=10)), 10))
    finally:
        history.close()
    assert [c["id"] for c in listed] == [created["id"]]
