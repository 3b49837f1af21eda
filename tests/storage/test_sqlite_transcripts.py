"""SQLite-specific behaviour of conversation memory: a file of the previous release opens and keeps working,
the sweep removes what expired (rows, not only what reads show) in bounded batches, an erasure leaves no row
about the caller, and WAL lets reads through while another writer holds the file. The backend-independent
contract is tests/storage/test_transcripts.py; these look at the file itself with a plain sqlite3 connection.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from caller_memory.service.domain.errors import StoreCorrupt
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import CallerRef, TokenRecord
from caller_memory.service.domain.store.transcripts import (
    ClaimStatus,
    EndClaim,
    TranscriptQuery,
    TranscriptStatus,
)
from caller_memory.service.storage.sqlite.store import SCHEMA_VERSION, SQLiteStore

from tests.storage.test_transcripts import (
    INACTIVITY,
    REMEMBER,
    RETENTION,
    append,
    message,
    new_caller,
    new_key,
    now_ms,
    platform_call,
    state,
)

#: The tables conversation memory added (schema version 2).
NEW_TABLES = ("transcripts", "transcript_messages", "transcript_volume")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    backend = SQLiteStore(tmp_path / "memory.db")
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


def rows(path: Path, sql: str, *params: object) -> list[tuple[object, ...]]:
    """What the file holds, read by a connection of its own (the store's writes are committed)."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


# Migration --------------------------------------------------------------------------------------------------


def make_previous_release(path: Path) -> None:
    """Turn a file made now into one of the previous release: schema version 1, no transcript tables, no
    tokens.agent column (the previous release's schema is this one without them)."""
    conn = sqlite3.connect(path)
    for table in NEW_TABLES:
        conn.execute(f"DROP TABLE {table}")
    conn.execute("ALTER TABLE tokens DROP COLUMN agent")
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()


async def test_a_file_of_the_previous_release_opens_and_gains_conversation_memory(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    caller, t = CallerRef("shop", "a" * 32), now_ms()
    name = StoredField(b'"Ada"', expires_at=t + RETENTION, written_at=t)
    token = TokenRecord("tok-1", "shop", "agent", b"h" * 32, t, label="front desk")
    old = SQLiteStore(path)
    await old.open()
    await old.patch_fields(caller, {"caller_name": name}, [], t)
    await old.put_token(token)
    await old.close()
    make_previous_release(path)
    assert {r[0] for r in rows(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}.isdisjoint(
        NEW_TABLES
    )

    again = SQLiteStore(path)
    await again.open()
    try:
        # What the previous release stored is all there; its tokens act as no agent.
        assert await again.read_fields(caller, t) == {"caller_name": name}
        fetched = await again.get_token("tok-1")
        assert fetched == token and fetched.agent == ""
        # New tokens keep their agent.
        billing = TokenRecord("tok-2", "shop", "agent", b"i" * 32, t + 1, agent="billing")
        await again.put_token(billing)
        assert await again.list_tokens("shop") == [token, billing]
        # Conversation memory works on it.
        key, call = new_key("shop"), platform_call(t)
        result = await append(again, key, caller, call, t, checkpoint=state(a=1))
        assert result.added == 6
        header, messages = await again.read_conversation(key, t, TranscriptQuery())
        assert header is not None and header.checkpoint == state(a=1) and len(messages) == 6
        erased = await again.erase_caller(caller, t + 1, t + REMEMBER)
        assert (erased.fields, erased.transcripts) == (1, 1)
    finally:
        await again.close()
    # Marked with the version that opened it, so that the previous release refuses the file rather than
    # serve it without sweeping or erasing transcripts.
    assert rows(path, "SELECT value FROM meta WHERE key = 'schema_version'") == [(str(SCHEMA_VERSION),)]
    assert SCHEMA_VERSION == 5
    # Opening it again changes nothing (every step of the migration is idempotent).
    third = SQLiteStore(path)
    await third.open()
    assert await third.list_tokens("shop") == [token, billing]
    await third.close()


async def test_a_file_of_a_later_release_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    store = SQLiteStore(path)
    await store.open()
    await store.close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.commit()
    conn.close()
    with pytest.raises(StoreCorrupt, match="newer than this release"):
        await SQLiteStore(path).open()
    assert rows(path, "SELECT value FROM meta WHERE key = 'schema_version'") == [(str(SCHEMA_VERSION + 1),)]


async def test_transcripts_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    caller, key, t = new_caller(), new_key(), now_ms()
    store = SQLiteStore(path)
    await store.open()
    await append(store, key, caller, platform_call(t), t, checkpoint=state(step=1))
    await store.put_summary(key, b'{"text": "a joke"}', t)
    before = await store.read_conversation(key, t, TranscriptQuery())
    await store.close()
    again = SQLiteStore(path)
    await again.open()
    try:
        assert await again.read_conversation(key, t, TranscriptQuery()) == before
        assert await again.due_conversations(t + INACTIVITY, 10) == [key]
    finally:
        await again.close()


# The sweep --------------------------------------------------------------------------------------------------


async def test_the_sweep_removes_expired_transcripts_then_forgotten_headers(store: SQLiteStore) -> None:
    caller, t = new_caller(), now_ms()
    expired, live = new_key(), new_key()
    await append(store, expired, caller, platform_call(t), t, checkpoint=state(a=1))
    await store.put_summary(expired, b'{"text": "summary"}', t)
    later = t + 10
    await append(store, live, caller, platform_call(later), later, checkpoint=state(a=2))
    path = store.path

    # Before its expiry nothing is swept.
    counts, more = await store.sweep(t + RETENTION - 1, 100)
    assert (counts["transcripts"], counts["conversation_headers"], more) == (0, 0, False)

    at = t + RETENTION
    counts, more = await store.sweep(at, 100)
    assert (counts["transcripts"], counts["conversation_headers"], more) == (1, 0, False)
    # The rows are gone, not only hidden: messages, checkpoint, summary; the live transcript is untouched.
    conv = rows(path, "SELECT id FROM transcripts WHERE conversation_id = ?", expired.conversation_id)[0][0]
    assert rows(path, "SELECT count(*) FROM transcript_messages WHERE conv = ?", conv) == [(0,)]
    assert rows(path, "SELECT checkpoint, summary, due_at FROM transcripts WHERE id = ?", conv) == [
        (None, None, None)
    ]
    header, messages = await store.read_conversation(live, at, TranscriptQuery())
    assert header is not None and header.checkpoint == state(a=2) and len(messages) == 6
    # The header lives on, saying "expired", until it is forgotten; a repeated sweep finds nothing more.
    header, _ = await store.read_conversation(expired, at)
    assert header is not None and header.expired(at) and header.status is TranscriptStatus.OPEN
    counts, _ = await store.sweep(at, 100)
    assert (counts["transcripts"], counts["conversation_headers"]) == (0, 0)
    # Nor is it due for an inactivity end any more.
    assert await store.due_conversations(later + INACTIVITY, 10) == [live]

    counts, more = await store.sweep(t + REMEMBER, 100)
    assert (counts["conversation_headers"], more) == (1, False)
    assert rows(path, "SELECT conversation_id FROM transcripts") == [(live.conversation_id,)]
    assert await store.read_conversation(expired, t + REMEMBER) == (None, [])


async def test_the_sweep_works_in_bounded_batches(store: SQLiteStore) -> None:
    """A round removes at most ``batch`` messages and headers; the rounds together remove everything, and
    report that more remains until then."""
    caller, t = new_caller(), now_ms()
    keys = [new_key() for _ in range(3)]
    for key in keys:
        await append(store, key, caller, platform_call(t), t)  # 6 messages each
    emptied, rounds, more = 0, 0, True
    while more:
        counts, more = await store.sweep(t + RETENTION, 4)
        emptied += counts["transcripts"]
        rounds += 1
        left = rows(store.path, "SELECT count(*) FROM transcript_messages")[0][0]
        assert more or left == 0
        assert rounds < 20
    assert (emptied, rounds) == (3, 5)  # 18 messages, at most 4 a round (the last round finds the end)
    forgotten, more = 0, True
    while more:
        counts, more = await store.sweep(t + REMEMBER, 2)
        forgotten += counts["conversation_headers"]
    assert forgotten == 3 and rows(store.path, "SELECT count(*) FROM transcripts") == [(0,)]


async def test_markers_are_swept_when_forgotten(store: SQLiteStore) -> None:
    caller, t = new_caller(), now_ms()
    deleted, erased = new_key(), new_key()
    for key in (deleted, erased):
        await append(store, key, caller, platform_call(t), t)
    await store.delete_conversation(deleted, t + 1)
    await store.erase_caller(caller, t + 2, t + REMEMBER)
    counts, _ = await store.sweep(t + RETENTION, 100)
    assert (counts["transcripts"], counts["conversation_headers"]) == (0, 0)  # nothing left to empty
    assert len(rows(store.path, "SELECT id FROM transcripts")) == 2
    counts, more = await store.sweep(t + REMEMBER, 100)
    assert (counts["conversation_headers"], more) == (2, False)
    assert rows(store.path, "SELECT count(*) FROM transcripts") == [(0,)]


async def test_the_sweep_removes_expired_volume_buckets(store: SQLiteStore) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    result = await append(store, key, caller, platform_call(t), t)
    assert result.header is not None
    assert await store.transcript_bytes(key.project, t, t - RETENTION) == result.header.bytes
    counts, _ = await store.sweep(t + RETENTION - 1, 100)
    assert counts["transcript_volume"] == 0
    counts, _ = await store.sweep(t + RETENTION, 100)
    assert counts["transcript_volume"] == 1
    assert rows(store.path, "SELECT count(*) FROM transcript_volume") == [(0,)]
    assert await store.transcript_bytes(key.project, t + RETENTION, t) == 0


async def test_an_expired_transcript_leaves_the_due_index_when_an_end_finds_it(store: SQLiteStore) -> None:
    """Its end claim is MISSING (nothing to end): it leaves the due index then, not only at the next sweep,
    so that expired transcripts (the most overdue) cannot fill every page of due conversations."""
    caller, t = new_caller(), now_ms()
    stale, fresh = new_key(), new_key()
    await append(store, stale, caller, platform_call(t), t)
    at = t + RETENTION
    await append(store, fresh, caller, platform_call(at - INACTIVITY), at - INACTIVITY)
    assert await store.due_conversations(at, 1) == [stale]
    claim = EndClaim(stale, "inactivity", "", at - INACTIVITY, at + 60_000)
    assert (await store.claim_end(claim, at)).status is ClaimStatus.MISSING
    assert await store.due_conversations(at, 1) == [fresh]


# Erasure ----------------------------------------------------------------------------------------------------


async def test_an_erasure_leaves_no_row_about_the_caller(store: SQLiteStore) -> None:
    caller, other, t = new_caller(), new_caller(), now_ms()
    mine = [new_key() for _ in range(2)]
    theirs = new_key()
    for key in mine:
        await append(store, key, caller, platform_call(t), t, checkpoint=state(a=1))
        await store.put_summary(key, b'{"text": "summary"}', t)
    await append(store, theirs, other, platform_call(t), t)
    result = await store.erase_caller(caller, t + 1, t + REMEMBER)
    assert result.transcripts == 2
    path = store.path
    assert rows(path, "SELECT count(*) FROM transcripts WHERE subject = ?", caller.subject) == [(0,)]
    markers = rows(
        path,
        "SELECT status, subject, channel, agent, checkpoint, summary, messages, bytes, due_at, purge_at "
        "FROM transcripts WHERE subject = '' ORDER BY id",
    )
    assert markers == [("erased", "", "", "", None, None, 0, 0, None, None)] * 2
    left = (
        "SELECT count(*) FROM transcript_messages "
        "WHERE conv IN (SELECT id FROM transcripts WHERE subject = '')"
    )
    assert rows(path, left) == [(0,)]
    # The other caller's transcript is untouched.
    assert rows(path, "SELECT count(*) FROM transcript_messages") == [(6,)]


# WAL and concurrency ----------------------------------------------------------------------------------------


async def test_reads_go_on_while_another_writer_holds_the_file(store: SQLiteStore) -> None:
    """WAL: a read does not wait for a write transaction of another connection (another process sharing the
    file); an append waits for it (busy timeout) and then lands."""
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    await append(store, key, caller, call[:3], t)
    other = sqlite3.connect(store.path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("INSERT INTO meta (key, value) VALUES ('held', '1')")
        pending = asyncio.ensure_future(append(store, key, caller, call[3:], t + 10, create=False))
        header, messages = await asyncio.wait_for(store.read_conversation(key, t + 10, TranscriptQuery()), 2)
        assert header is not None and len(messages) == 3
        await asyncio.sleep(0.05)
        assert not pending.done()  # the append waits for the other writer
        other.execute("COMMIT")
        assert (await asyncio.wait_for(pending, 5)).added == 3
    finally:
        other.close()
    _, messages = await store.read_conversation(key, t + 10, TranscriptQuery())
    assert [m.seq for m in messages] == list(range(6))


async def test_two_stores_on_one_file_append_to_one_conversation(tmp_path: Path) -> None:
    """Two services sharing a file: every append is one IMMEDIATE transaction, so positions, counts and
    message ids stay consistent across them."""
    path = tmp_path / "memory.db"
    first, second = SQLiteStore(path), SQLiteStore(path)
    await first.open()
    await second.open()
    try:
        caller, key, t = new_caller(), new_key(), now_ms()
        await append(first, key, caller, [], t)
        lines = [message(1, f"line {i}", t, message_id=f"m-{i}") for i in range(20)]
        # Each line sent through both stores: one of the two adds it, the other finds it there.
        results = await asyncio.gather(
            *(append(s, key, caller, [m], t + 1, create=False) for m in lines for s in (first, second))
        )
        assert sum(r.added for r in results) == 20
        header, messages = await second.read_conversation(key, t + 1, TranscriptQuery())
        assert header is not None and header.messages == 20
        assert [m.seq for m in messages] == list(range(20))
        assert sorted(m.message_id or "" for m in messages) == sorted(f"m-{i}" for i in range(20))
    finally:
        await first.close()
        await second.close()


async def test_a_read_sees_header_and_messages_of_one_moment(store: SQLiteStore) -> None:
    """The header and the messages of a read come from one snapshot: while appends land, every read's
    message count is its header's."""
    caller, key, t = new_caller(), new_key(), now_ms()
    await append(store, key, caller, [], t)

    async def writer() -> None:
        for i in range(40):
            await append(store, key, caller, [message(1, f"line {i}", t)], t + 1, create=False)

    async def reader() -> None:
        for _ in range(40):
            header, messages = await store.read_conversation(key, t + 1, TranscriptQuery())
            assert header is not None and header.messages == len(messages)
            await asyncio.sleep(0)

    await asyncio.gather(writer(), reader())
