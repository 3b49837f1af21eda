"""The outbox with message batches beside ends (a real SQLite file): each conversation's order is kept
whoever delivers, an end waits behind its batches, and files written before batches existed still work."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import orjson
import pytest
from caller_memory.sdk import Outbox

URL = "http://127.0.0.1:1"


async def test_a_conversations_order_is_kept_whoever_takes_its_entries(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.db", URL, "p")
    await outbox.open()
    end_a, _ = await outbox.keep("conv-a", {"caller": "x", "state": {}}, lease=0)
    first, second = await outbox.add_many("conv-a", [b'{"n": 1}', b'{"n": 2}'])
    other = await outbox.add("conv-b", b'{"n": 3}', lease=0, kind="messages")
    # Taken together, in order: the end of conv-a is not (its batches wait), conv-b's batch is.
    taken = await outbox.claim(limit=10, lease=60)
    assert [e.id for e in taken] == [first, second, other]
    await outbox.release(*(e.id for e in taken))
    # While someone sends the first batch, nobody takes the second (it would overtake it).
    [held] = await outbox.claim(limit=1, lease=60)
    assert held.id == first
    assert [e.id for e in await outbox.claim(limit=10, lease=60)] == [other]
    await outbox.delivered(first)
    await outbox.release(other)
    assert [e.id for e in await outbox.claim(limit=10, lease=60, conversation_id="conv-a")] == [second]
    await outbox.delivered(second)
    # Its batches delivered, the end is taken.
    assert [e.id for e in await outbox.claim(limit=10, lease=60, kind="end")] == [end_a]
    await outbox.close()


async def test_a_set_aside_batch_does_not_hold_its_end_back(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.db", URL, "p")
    await outbox.open()
    end, _ = await outbox.keep("conv-a", {"caller": "x"}, lease=0)
    batch = await outbox.add("conv-a", b"{}", lease=0, kind="messages")
    await outbox.reject(batch, "401: revoked")
    assert [e.id for e in await outbox.claim(limit=10, lease=60)] == [end]
    assert [(e.id, e.kind) for e in await outbox.rejected()] == [(batch, "messages")]
    await outbox.close()


async def test_an_end_of_a_conversation_is_one_entry_beside_its_batches(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.db", URL, "p")
    await outbox.open()
    await outbox.add_many("conv-a", [b"{}"])
    first, _ = await outbox.keep("conv-a", {"ended_at": "2030-01-01T00:00:00.000+00:00"}, lease=0)
    again, body = await outbox.keep("conv-a", {"ended_at": "2030-01-02T00:00:00.000+00:00"}, lease=0)
    assert again == first and orjson.loads(body)["ended_at"].startswith(
        "2030-01-01"
    )  # taken over, not a batch
    assert sorted(e.kind for e in await outbox.pending("conv-a")) == ["end", "messages"]
    assert [e.kind for e in await outbox.pending("conv-a", "messages")] == ["messages"]
    await outbox.close()


async def test_a_file_from_before_message_batches_still_works(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    with sqlite3.connect(path) as conn:  # the table as the first releases of the SDK made it
        conn.execute(
            "CREATE TABLE outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, base_url TEXT NOT NULL, project TEXT NOT "
            "NULL, conversation_id TEXT NOT NULL, body BLOB NOT NULL, created_at REAL NOT NULL, attempts INTEGER "
            "NOT NULL DEFAULT 0, claimed_until REAL NOT NULL DEFAULT 0, rejected TEXT)"
        )
        conn.execute(
            "INSERT INTO outbox (base_url, project, conversation_id, body, created_at) VALUES (?, 'p', 'old', ?, 0)",
            (URL, b'{"caller": "x", "ended_at": "2030-01-01T00:00:00.000+00:00"}'),
        )
    outbox = Outbox(path, URL, "p")
    await outbox.open()
    [entry] = await outbox.pending()
    assert entry.kind == "end" and entry.conversation_id == "old"
    entry_id, body = await outbox.keep("old", {"caller": "x"}, lease=0)
    assert entry_id == entry.id and b"2030-01-01" in body
    await outbox.close()


async def test_a_claim_cancelled_while_its_statement_runs_hands_its_entries_back(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    outbox = Outbox(path, URL, "p", timeout=5)
    await outbox.open()
    entry = await outbox.add("conv-a", b"{}", lease=0, kind="messages")
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds the file: the claim's statement waits
    claiming = asyncio.create_task(outbox.claim(limit=10, lease=600))
    await asyncio.sleep(0.2)  # the statement is waiting for the lock in its thread (nothing signals it)
    claiming.cancel()
    blocker.execute("COMMIT")  # now it runs to its end, taking the entry for someone who is gone
    blocker.close()
    with pytest.raises(asyncio.CancelledError):
        await claiming
    assert [e.id for e in await outbox.claim(limit=10, lease=60)] == [entry]  # not held for 600 s
    await outbox.close()
