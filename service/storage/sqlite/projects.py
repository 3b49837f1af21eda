"""SQLite backend, projects and tokens (the :class:`~caller_memory.service.domain.store.core.CoreStore` port's
configuration part): tables ``projects`` and ``tokens``. A mixin of
:class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ...domain.store import TokenRecord

T = TypeVar("T")


class SQLiteProjects:
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...
        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    # Projects -----------------------------------------------------------------------------------------

    async def put_project(self, project: str, document: bytes, now_ms: int) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            existed = conn.execute("SELECT 1 FROM projects WHERE project = ?", (project,)).fetchone()
            conn.execute(
                "INSERT INTO projects (project, document, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT (project) DO UPDATE SET document = excluded.document, updated_at = excluded.updated_at",
                (project, document, now_ms),
            )
            return existed is None

        return await self._write(run)

    async def get_project(self, project: str) -> bytes | None:
        def run(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute("SELECT document FROM projects WHERE project = ?", (project,)).fetchone()
            return bytes(row[0]) if row else None

        return await self._read(run)

    # Tokens -------------------------------------------------------------------------------------------

    async def put_token(self, token: TokenRecord) -> None:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO tokens (token_id, project, role, secret_hash, created_at, label, agent) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    token.token_id,
                    token.project,
                    token.role,
                    token.secret_hash,
                    token.created_at,
                    token.label,
                    token.agent,
                ),
            )

        await self._write(run)

    @staticmethod
    def _token(row: tuple[Any, ...]) -> TokenRecord:
        return TokenRecord(
            token_id=row[0],
            project=row[1],
            role=row[2],
            secret_hash=bytes(row[3]),
            created_at=row[4],
            label=row[5],
            agent=row[6],
        )

    async def get_token(self, token_id: str) -> TokenRecord | None:
        def run(conn: sqlite3.Connection) -> TokenRecord | None:
            row = conn.execute(
                "SELECT token_id, project, role, secret_hash, created_at, label, agent FROM tokens "
                "WHERE token_id = ?",
                (token_id,),
            ).fetchone()
            return self._token(row) if row else None

        return await self._read(run)

    async def list_tokens(self, project: str) -> list[TokenRecord]:
        def run(conn: sqlite3.Connection) -> list[TokenRecord]:
            rows = conn.execute(
                "SELECT token_id, project, role, secret_hash, created_at, label, agent FROM tokens "
                "WHERE project = ? ORDER BY created_at, token_id",
                (project,),
            ).fetchall()
            return [self._token(row) for row in rows]

        return await self._read(run)

    async def delete_token(self, project: str, token_id: str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            cur = conn.execute("DELETE FROM tokens WHERE token_id = ? AND project = ?", (token_id, project))
            return cur.rowcount > 0

        return await self._write(run)
