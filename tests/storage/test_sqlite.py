"""SQLite-specific behaviour: a damaged file is refused, never served as an empty store."""

from __future__ import annotations

from pathlib import Path

import pytest
from caller_memory.service.domain.errors import StoreCorrupt
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import CallerRef, ListingPage
from caller_memory.service.storage.sqlite.store import SQLiteStore


async def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    path.write_bytes(b"this is not a SQLite database, just some text " * 100)
    store = SQLiteStore(path)
    with pytest.raises(StoreCorrupt, match="cannot be read"):
        await store.open()
    assert path.read_bytes().startswith(b"this is not")  # left as it was, for the operator to inspect


async def test_a_truncated_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    store = SQLiteStore(path)
    await store.open()
    for i in range(300):
        field = StoredField(value=b'"%d"' % i, expires_at=2**42, written_at=1)
        await store.patch_fields(CallerRef("p", f"{i:032x}"), {"name": field}, [], 0)
    await store.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreCorrupt):
        await SQLiteStore(path).open()


async def test_reopening_keeps_the_data(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    store = SQLiteStore(path)
    await store.open()
    field = StoredField(value=b'"Ada"', expires_at=2**42, written_at=1)
    await store.patch_fields(CallerRef("p", "a" * 32), {"caller_name": field}, [], 0)
    await store.close()
    again = SQLiteStore(path)
    await again.open()
    assert await again.read_fields(CallerRef("p", "a" * 32), 0) == {"caller_name": field}
    await again.close()


async def test_a_file_of_the_earlier_release_gains_the_recording_times(tmp_path: Path) -> None:
    """Files made before analytics kept their recording times get the columns, filled from each row's hour
    (counters: left empty, judged by their expiry alone), and keep working."""
    import sqlite3

    from caller_memory.service.domain.clock import HOUR_MS
    from caller_memory.service.domain.store import ConversationEntry, Recording

    path = tmp_path / "memory.db"
    store = SQLiteStore(path)
    await store.open()
    hour = 1000 * HOUR_MS
    old = ConversationEntry("old", hour, "voice", None, None, None, None)
    await store.record_conversation(Recording(CallerRef("p", "a" * 32), old, [], 2**42, made_at=0), hour + 5)
    await store.close()
    # Make it a file of the earlier release: without the added columns and their index.
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX analytics_conversations_by_recorded")
    for table, column in (
        ("first_interactions", "created_at"),
        ("analytics_conversations", "recorded_at"),
        ("analytics_counters", "recorded_at"),
    ):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.commit()
    conn.close()
    again = SQLiteStore(path)
    await again.open()
    try:
        listed = await again.list_conversations(
            "p", ListingPage("0", "9", limit=10, recorded_after=hour - 1), hour
        )
        assert listed == [old]  # counted as recorded at its hour
        counts, _ = await again.sweep(hour, 100, {"p": hour})
        assert counts["analytics_entries"] == 1
    finally:
        await again.close()
