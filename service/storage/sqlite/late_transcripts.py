"""SQLite backend, a platform's late transcript (service/domain/store/late_transcripts.py): the messages
inserted, the header's counts set and the bytes added to the project's volume in one transaction. A mixin of
:class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.late_transcripts import SERVICE_ENDS, LateTranscriptStore
from ...domain.store.transcripts import ConversationKey, NewMessage, TranscriptStatus
from .transcripts import _add_volume

T = TypeVar("T")


class SQLiteLateTranscripts(LateTranscriptStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def add_late_messages(
        self, key: ConversationKey, messages: Sequence[NewMessage], now_ms: int
    ) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                "SELECT id, status, ended_by, messages, expires_at, forget_at FROM transcripts "
                "WHERE project = ? AND conversation_id = ?",
                (key.project, key.conversation_id),
            ).fetchone()
            if row is None or not messages:
                return False
            conv, status, ended_by, count, expires_at, forget_at = row
            if status != TranscriptStatus.ENDED.value or ended_by not in SERVICE_ENDS or count != 0:
                return False
            if expires_at <= now_ms or forget_at <= now_ms:
                return False
            conn.executemany(
                "INSERT INTO transcript_messages (conv, turn_id, seq, message_id, body) VALUES (?, ?, ?, ?, ?)",
                [(conv, m.turn_id, i, m.message_id, m.body) for i, m in enumerate(messages)],
            )
            added = sum(len(m.body) for m in messages)
            _add_volume(conn, key.project, now_ms, added, expires_at)
            conn.execute(
                "UPDATE transcripts SET messages = ?, bytes = ?, tokens = ?, turn_id = ? WHERE id = ?",
                (
                    len(messages),
                    added,
                    sum(m.tokens for m in messages),
                    max(m.turn_id for m in messages),
                    conv,
                ),
            )
            return True

        return await self._write(run)
