"""SQLite backend, the archive index (service/domain/store/archive.py): which archived objects are a caller's.
A mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`; table ``archive_index`` (schema version 3), swept on expiry like the
other tables (retention.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.archive import ArchiveStore

if TYPE_CHECKING:
    from ...domain.store import CallerRef

T = TypeVar("T")


class SQLiteArchiveIndex(ArchiveStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        @staticmethod
        def _erased_since(conn: sqlite3.Connection, caller: CallerRef, made_at: int, now_ms: int) -> bool: ...

    async def list_archived(
        self, caller: CallerRef, object_key: str, expires_at: int, made_at: int, now_ms: int
    ) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            # Read in the transaction that writes: an erasure commits wholly before or after it.
            if self._erased_since(conn, caller, made_at, now_ms):
                return False
            conn.execute(
                "INSERT INTO archive_index (project, subject, object_key, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (project, subject, object_key) DO UPDATE SET "
                "expires_at = max(archive_index.expires_at, excluded.expires_at)",
                (caller.project, caller.subject, object_key, expires_at),
            )
            return True

        return await self._write(run)

    async def archived_objects(self, caller: CallerRef, now_ms: int) -> list[str]:
        def run(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT object_key FROM archive_index WHERE project = ? AND subject = ? AND expires_at > ? "
                "ORDER BY object_key",
                (caller.project, caller.subject, now_ms),
            )
            return [row[0] for row in rows]

        return await self._read(run)

    async def unlist_archived(self, caller: CallerRef, object_keys: Sequence[str]) -> int:
        def run(conn: sqlite3.Connection) -> int:
            removed = 0
            for key in dict.fromkeys(object_keys):
                removed += conn.execute(
                    "DELETE FROM archive_index WHERE project = ? AND subject = ? AND object_key = ?",
                    (caller.project, caller.subject, key),
                ).rowcount
            return removed

        return await self._write(run)
