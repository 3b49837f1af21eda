"""SQLite backend, platform events (service/domain/store/platform_events.py): tables ``platform_events``
(an event id's sighting and its expiry; expired rows are removed a few at a time by later sightings) and
``platform_held_ends`` (a held end's document and due time). A mixin of
:class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.platform_events import PlatformEventStore

T = TypeVar("T")

#: How many expired sightings one sighting removes at most.
_PRUNE = 100


class SQLitePlatformEvents(PlatformEventStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def first_sighting(
        self, project: str, platform: str, event_id: str, now_ms: int, keep_until_ms: int
    ) -> bool:
        digest = hashlib.sha256(event_id.encode("utf-8")).hexdigest()

        def run(conn: sqlite3.Connection) -> bool:
            conn.execute(
                "DELETE FROM platform_events WHERE rowid IN "
                "(SELECT rowid FROM platform_events WHERE expires_at <= ? LIMIT ?)",
                (now_ms, _PRUNE),
            )
            row = conn.execute(
                "SELECT expires_at FROM platform_events WHERE project = ? AND platform = ? AND event = ?",
                (project, platform, digest),
            ).fetchone()
            if row is not None and int(row[0]) > now_ms:
                return False
            conn.execute(
                "INSERT INTO platform_events (project, platform, event, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (project, platform, event) DO UPDATE SET expires_at = excluded.expires_at",
                (project, platform, digest, keep_until_ms),
            )
            return True

        return await self._write(run)

    async def hold_inactivity_end(
        self, project: str, conversation_id: str, until_ms: int, now_ms: int
    ) -> None:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM platform_inactivity_holds WHERE until_at <= ?", (now_ms,))
            conn.execute(
                "INSERT INTO platform_inactivity_holds (project, conversation_id, until_at) VALUES (?, ?, ?) "
                "ON CONFLICT (project, conversation_id) DO UPDATE SET until_at = excluded.until_at",
                (project, conversation_id, until_ms),
            )

        await self._write(run)

    async def inactivity_end_held_until(self, project: str, conversation_id: str, now_ms: int) -> int | None:
        def run(conn: sqlite3.Connection) -> int | None:
            row = conn.execute(
                "SELECT until_at FROM platform_inactivity_holds "
                "WHERE project = ? AND conversation_id = ? AND until_at > ?",
                (project, conversation_id, now_ms),
            ).fetchone()
            return None if row is None else int(row[0])

        return await self._read(run)

    async def hold_platform_end(
        self, project: str, conversation_id: str, document: bytes, due_ms: int
    ) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            return (
                conn.execute(
                    "INSERT INTO platform_held_ends (project, conversation_id, document, due_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (project, conversation_id) DO NOTHING",
                    (project, conversation_id, document, due_ms),
                ).rowcount
                > 0
            )

        return await self._write(run)

    async def take_platform_end(self, project: str, conversation_id: str) -> bytes | None:
        def run(conn: sqlite3.Connection) -> bytes | None:
            where = "FROM platform_held_ends WHERE project = ? AND conversation_id = ?"
            row = conn.execute(f"SELECT document {where}", (project, conversation_id)).fetchone()
            if row is None:
                return None
            conn.execute(f"DELETE {where}", (project, conversation_id))
            return bytes(row[0])

        return await self._write(run)

    async def due_platform_ends(self, now_ms: int, limit: int) -> list[tuple[str, str]]:
        def run(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            rows = conn.execute(
                "SELECT project, conversation_id FROM platform_held_ends WHERE due_at <= ? "
                "ORDER BY due_at LIMIT ?",
                (now_ms, limit),
            ).fetchall()
            return [(str(r[0]), str(r[1])) for r in rows]

        return await self._read(run)
