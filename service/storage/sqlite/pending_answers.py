"""SQLite backend, the memory proxy's last answer of a call (service/domain/store/pending_answers.py): table
``pending_answers``, one row per conversation, with the caller's pseudonym (an erasure deletes by it). Dead
rows are deleted by the next keep. A mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.pending_answers import PendingAnswerStore
from ...domain.store.refs import CallerRef
from ...domain.store.transcripts import ConversationKey

T = TypeVar("T")
#: Dead rows one keep deletes at most (the rest go with the next ones).
SWEEP_ROWS = 100


class SQLitePendingAnswers(PendingAnswerStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def keep_pending_answer(
        self, key: ConversationKey, subject: str, document: bytes, keep_until_ms: int, now_ms: int
    ) -> None:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM pending_answers WHERE (project, conversation_id) IN (SELECT project, "
                "conversation_id FROM pending_answers WHERE keep_until <= ? LIMIT ?)",
                (now_ms, SWEEP_ROWS),
            )
            conn.execute(
                "INSERT INTO pending_answers (project, conversation_id, subject, document, keep_until) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (project, conversation_id) DO UPDATE SET "
                "subject = excluded.subject, document = excluded.document, keep_until = excluded.keep_until",
                (key.project, key.conversation_id, subject, document, keep_until_ms),
            )

        await self._write(run)

    async def take_pending_answer(self, key: ConversationKey, now_ms: int) -> bytes | None:
        def run(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute(
                "DELETE FROM pending_answers WHERE project = ? AND conversation_id = ? "
                "RETURNING document, keep_until",
                (key.project, key.conversation_id),
            ).fetchone()
            if row is None or int(row[1]) <= now_ms:
                return None
            return bytes(row[0])

        return await self._write(run)

    async def drop_pending_answers(self, caller: CallerRef) -> int:
        def run(conn: sqlite3.Connection) -> int:
            return conn.execute(
                "DELETE FROM pending_answers WHERE project = ? AND subject = ?",
                (caller.project, caller.subject),
            ).rowcount

        return await self._write(run)
