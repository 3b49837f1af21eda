"""SQLite backend, call trust (service/domain/store/call_trust.py): table ``call_trust``, one row per
conversation, written by one upsert that only raises. A mixin of
:class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.call_trust import CallTrustStore

if TYPE_CHECKING:
    from .point_reads import PointReads

T = TypeVar("T")


class SQLiteCallTrust(CallTrustStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        _points: PointReads

    async def keep_call_trust(
        self,
        project: str,
        conversation_id: str,
        attestation: str,
        *,
        step_up: bool,
        expires_at_ms: int,
        now_ms: int,
    ) -> None:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM call_trust WHERE project = ? AND conversation_id = ? AND expires_at <= ?",
                (project, conversation_id, now_ms),
            )
            conn.execute(
                "INSERT INTO call_trust (project, conversation_id, attestation, step_up, expires_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (project, conversation_id) DO UPDATE SET "
                "step_up = max(step_up, excluded.step_up), expires_at = max(expires_at, excluded.expires_at)",
                (project, conversation_id, attestation, int(step_up), expires_at_ms),
            )

        await self._write(run)

    async def raise_step_up(
        self, project: str, conversation_id: str, expires_at_ms: int, now_ms: int
    ) -> None:
        await self.keep_call_trust(
            project, conversation_id, "unknown", step_up=True, expires_at_ms=expires_at_ms, now_ms=now_ms
        )

    async def call_trust(self, project: str, conversation_id: str, now_ms: int) -> tuple[str, bool] | None:
        def run(conn: sqlite3.Connection) -> tuple[str, bool] | None:
            row = conn.execute(
                "SELECT attestation, step_up FROM call_trust "
                "WHERE project = ? AND conversation_id = ? AND expires_at > ?",
                (project, conversation_id, now_ms),
            ).fetchone()
            return None if row is None else (str(row[0]), bool(row[1]))

        return await self._points.read(run, self._read)  # a point read (point_reads.py)
