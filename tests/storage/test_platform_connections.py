"""Platform connections (service/domain/store/platforms.py) on every backend: one document per project and
platform, replaced whole, read back byte for byte, deleted; platforms and projects apart; erasing a caller
leaves them alone."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

from caller_memory.service.domain.store import Store
from caller_memory.service.domain.store.refs import CallerRef
from caller_memory.service.storage.sqlite.store import SQLiteStore


async def test_a_connection_is_kept_replaced_and_deleted_per_project_and_platform(store: Store) -> None:
    project, other = f"shop-{uuid.uuid4().hex[:8]}", f"deli-{uuid.uuid4().hex[:8]}"
    assert await store.get_platform_connection(project, "vapi") is None
    assert await store.put_platform_connection(project, "vapi", b'{"channel": "phone"}') is True
    assert await store.put_platform_connection(project, "retell", b"\x00\xffretell") is True
    assert await store.put_platform_connection(other, "vapi", b"other") is True
    assert await store.get_platform_connection(project, "vapi") == b'{"channel": "phone"}'
    # Replaced whole, and the answer says there was one already.
    assert await store.put_platform_connection(project, "vapi", b"\x01sealed\x00bytes") is False
    assert await store.get_platform_connection(project, "vapi") == b"\x01sealed\x00bytes"
    assert await store.delete_platform_connection(project, "vapi") is True
    assert await store.get_platform_connection(project, "vapi") is None
    assert await store.delete_platform_connection(project, "vapi") is False
    # The other platform of the project, and the other project's, stay.
    assert await store.get_platform_connection(project, "retell") == b"\x00\xffretell"
    assert await store.get_platform_connection(other, "vapi") == b"other"


async def test_erasing_a_caller_leaves_connections(store: Store) -> None:
    project = f"shop-{uuid.uuid4().hex[:8]}"
    await store.put_platform_connection(project, "telnyx", b"doc")
    now = 1_800_000_000_000
    await store.erase_caller(CallerRef(project, "ab" * 16), now, now + 3_600_000)
    assert await store.get_platform_connection(project, "telnyx") == b"doc"


async def test_a_file_of_an_earlier_release_gains_the_table(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    first = SQLiteStore(path)
    await first.open()
    await first.close()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE platform_connections")
    again = SQLiteStore(path)
    await again.open()
    try:
        assert await again.put_platform_connection("shop", "agora", b"doc") is True
        assert await again.get_platform_connection("shop", "agora") == b"doc"
    finally:
        await again.close()
