"""SQLite backend, the memory proxy's upstream (service/domain/store/llm.py): table ``llm_upstreams``, one
row per project. A mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.llm import LlmStore

T = TypeVar("T")


class SQLiteLlm(LlmStore):
    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def put_llm(self, project: str, document: bytes) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            had = conn.execute("SELECT 1 FROM llm_upstreams WHERE project = ?", (project,)).fetchone()
            conn.execute(
                "INSERT INTO llm_upstreams (project, document) VALUES (?, ?) "
                "ON CONFLICT (project) DO UPDATE SET document = excluded.document",
                (project, document),
            )
            return had is None

        return await self._write(run)

    async def get_llm(self, project: str) -> bytes | None:
        def run(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute("SELECT document FROM llm_upstreams WHERE project = ?", (project,)).fetchone()
            return None if row is None else bytes(row[0])

        return await self._read(run)

    async def delete_llm(self, project: str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM llm_upstreams WHERE project = ?", (project,)).rowcount > 0

        return await self._write(run)
