"""SQLite backend, platform connections (service/domain/store/platforms.py): table ``platform_connections``,
one row per project and platform. A mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.platforms import PlatformStore

T = TypeVar("T")


class SQLitePlatforms(PlatformStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def put_platform_connection(self, project: str, platform: str, document: bytes) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            had = conn.execute(
                "SELECT 1 FROM platform_connections WHERE project = ? AND platform = ?", (project, platform)
            ).fetchone()
            conn.execute(
                "INSERT INTO platform_connections (project, platform, document) VALUES (?, ?, ?) "
                "ON CONFLICT (project, platform) DO UPDATE SET document = excluded.document",
                (project, platform, document),
            )
            return had is None

        return await self._write(run)

    async def get_platform_connection(self, project: str, platform: str) -> bytes | None:
        def run(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute(
                "SELECT document FROM platform_connections WHERE project = ? AND platform = ?",
                (project, platform),
            ).fetchone()
            return None if row is None else bytes(row[0])

        return await self._read(run)

    async def delete_platform_connection(self, project: str, platform: str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "DELETE FROM platform_connections WHERE project = ? AND platform = ?", (project, platform)
            )
            return cursor.rowcount > 0

        return await self._write(run)
