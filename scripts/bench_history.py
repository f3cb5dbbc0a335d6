#!/usr/bin/env python3
"""Benchmark the chat history as a user's history grows: list 10,000 conversations, search 100,000 messages.

Builds a history of ``--conversations`` conversations with ``--messages`` messages each (10,000 x 10
by default) through the real schema and its FTS5 triggers, in a temporary folder, then prints the
median of ``--runs`` runs of:

- listing every conversation (``store.list_conversations``, as ``GET /api/conversations?limit=10000``
  answers it, JSON included), next to a bare ``SELECT`` of the same rows as the baseline;
- searching (``store.search``, as ``GET /api/conversations?q=``, 200 conversations at most) for a rare
  word, a common word and a two-word prefix query, next to the search without an index as the
  baseline: a ``LIKE '%word%'`` scan of every message.

    .venv/bin/python scripts/bench_history.py [--conversations 10000] [--messages 10] [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from studio.history import store
from studio.history.database import now, open_database

WORDS = (
    "model context token answer question python llama server memory prompt cache window layer weight "
    "story dragon river castle garden window kitchen music number letter picture table chair"
).split()
RARE = "aardvark"  # in one message in ten thousand


def build(path: Path, conversations: int, messages: int, seed: int = 7) -> None:
    rng = random.Random(seed)
    conn = open_database(path)
    stamp = now()
    n = 0
    with store.transaction(conn):
        for c in range(conversations):
            cid = f"{c:032x}"
            conn.execute(
                "INSERT INTO conversations (id, title, model, created, updated) VALUES (?, ?, 'bench', ?, ?)",
                (cid, " ".join(rng.choices(WORDS, k=5)), stamp, stamp),
            )
            rows = []
            for seq in range(1, messages + 1):
                words = rng.choices(WORDS, k=rng.randint(20, 80))
                n += 1
                if n % 10_000 == 0:
                    words.append(RARE)
                rows.append((cid, seq, "user" if seq % 2 else "assistant", " ".join(words), stamp))
            conn.executemany(
                "INSERT INTO messages (conversation_id, seq, role, content, created) VALUES (?, ?, ?, ?, ?)", rows
            )
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA optimize")
    conn.close()


def median_ms(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=10, help="messages per conversation")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    total = args.conversations * args.messages
    with tempfile.TemporaryDirectory(prefix="bench-history-") as folder:
        path = Path(folder) / "history.db"
        start = time.perf_counter()
        build(path, args.conversations, args.messages)
        size = path.stat().st_size / 2**20
        print(f"history: {args.conversations:,} conversations, {total:,} messages, {size:.1f} MiB "
              f"(built in {time.perf_counter() - start:.1f} s)")  # fmt: skip
        conn = open_database(path)
        conn.execute("PRAGMA query_only = ON")

        def listing() -> int:
            return len(json.dumps(store.list_conversations(conn, limit=args.conversations)))

        def bare() -> int:
            return len(conn.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC").fetchall())

        ms, _ = median_ms(listing, args.runs)
        base, _ = median_ms(bare, args.runs)
        print(f"list {args.conversations:,} conversations: {ms:8.1f} ms median  "
              f"(bare SELECT {base:.1f} ms, x{ms / base:.1f})")  # fmt: skip

        for query in (RARE, "dragon", "story dra"):
            ms, hits = median_ms(lambda q=query: store.search(conn, q, limit=200), args.runs)
            word = query.split()[0]
            base, _ = median_ms(
                lambda w=word: conn.execute(
                    "SELECT DISTINCT conversation_id FROM messages WHERE content LIKE ?", (f"%{w}%",)
                ).fetchall(),
                max(3, args.runs // 2),
            )
            print(f"search {total:,} messages for {query!r:12}: {ms:8.1f} ms median, {len(hits):3} hits  "
                  f"(LIKE scan {base:.1f} ms, x{base / ms:.1f} faster)")  # fmt: skip
        conn.close()


if __name__ == "__main__":
    main()
