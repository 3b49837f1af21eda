"""SQLite backend, state keys remembered through MCP (service/domain/store/remembered.py): table
``remembered_state``, one row per conversation and name, with the caller's pseudonym (an erasure deletes by
it). Dead rows are deleted by the next remember. A mixin of
:class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.refs import CallerRef
from ...domain.store.remembered import RememberedStore, RememberedValue
from ...domain.store.transcripts import ConversationKey

T = TypeVar("T")
#: Dead rows one remember deletes at most (the rest go with the next ones).
SWEEP_ROWS = 100


class SQLiteRemembered(RememberedStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...
        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def remember_state(
        self,
        key: ConversationKey,
        subject: str,
        name: str,
        value: RememberedValue,
        *,
        keep_until_ms: int,
        now_ms: int,
    ) -> None:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM remembered_state WHERE rowid IN (SELECT rowid FROM remembered_state "
                "WHERE keep_until <= ? LIMIT ?)",
                (now_ms, SWEEP_ROWS),
            )
            conn.execute(
                "INSERT INTO remembered_state (project, conversation_id, name, subject, value, made_at, "
                "keep_until) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (project, conversation_id, name) DO "
                "UPDATE SET subject = excluded.subject, value = excluded.value, made_at = excluded.made_at, "
                "keep_until = excluded.keep_until",
                (key.project, key.conversation_id, name, subject, value.value, value.made_at, keep_until_ms),
            )

        if keep_until_ms > now_ms:
            await self._write(run)

    async def remembered_state(self, key: ConversationKey, now_ms: int) -> dict[str, RememberedValue]:
        def run(conn: sqlite3.Connection) -> dict[str, RememberedValue]:
            rows = conn.execute(
                "SELECT name, value, made_at FROM remembered_state WHERE project = ? AND conversation_id = ? "
                "AND keep_until > ?",
                (key.project, key.conversation_id, now_ms),
            ).fetchall()
            return {str(r[0]): RememberedValue(bytes(r[1]), int(r[2])) for r in rows}

        return await self._read(run)

    async def forget_remembered(self, key: ConversationKey) -> None:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM remembered_state WHERE project = ? AND conversation_id = ?",
                (key.project, key.conversation_id),
            )

        await self._write(run)

    async def drop_remembered(self, caller: CallerRef) -> int:
        def run(conn: sqlite3.Connection) -> int:
            rows = conn.execute(
                "DELETE FROM remembered_state WHERE project = ? AND subject = ? RETURNING conversation_id",
                (caller.project, caller.subject),
            ).fetchall()
            return len({r[0] for r in rows})

        return await self._write(run)
