"""A durable local outbox for end-of-call writes that could not be delivered.

The outbox is a small SQLite file owned by the SDK. An entry is written (and fsynced) before ``conv.end()``
returns a queued result, and removed only once the service has acknowledged it. Delivering an entry twice
is harmless: the service applies the end of a conversation once per conversation id.

Entries hold the request as it will be sent, including the caller's phone number, so the file is created
readable by its owner only and entries are deleted as soon as they are delivered.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    base_url TEXT NOT NULL,
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    body BLOB NOT NULL,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    rejected TEXT
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (base_url, project, rejected, id);
"""


def default_outbox_path() -> Path:
    """``$CALLER_MEMORY_OUTBOX``, else ``$XDG_STATE_HOME/caller-memory/outbox.db`` (``~/.local/state``)."""
    explicit = os.environ.get("CALLER_MEMORY_OUTBOX")
    if explicit:
        return Path(explicit)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "caller-memory" / "outbox.db"


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    id: int
    conversation_id: str
    body: bytes
    created_at: float
    attempts: int
    rejected: str | None = None


class Outbox:
    """Pending end-of-call requests of one service URL and project, kept in a SQLite file."""

    def __init__(self, path: str | os.PathLike[str], base_url: str, project: str) -> None:
        self.path = Path(path)
        self._base_url = base_url
        self._project = project
        self._lock = asyncio.Lock()

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.path.exists():
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        conn = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.executescript(_SCHEMA)
        return conn

    async def _run(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        def run() -> list[tuple[Any, ...]]:
            conn = self._connect()
            try:
                return conn.execute(sql, params).fetchall()
            finally:
                conn.close()

        async with self._lock:
            return await asyncio.to_thread(run)

    async def add(self, conversation_id: str, body: bytes) -> int:
        rows = await self._run(
            "INSERT INTO outbox (base_url, project, conversation_id, body, created_at) "
            "VALUES (?, ?, ?, ?, ?) RETURNING id",
            (self._base_url, self._project, conversation_id, body, time.time()),
        )
        return int(rows[0][0])

    async def pending(self, limit: int = 100) -> list[OutboxEntry]:
        """Entries still to deliver, oldest first."""
        rows = await self._run(
            "SELECT id, conversation_id, body, created_at, attempts FROM outbox "
            "WHERE base_url = ? AND project = ? AND rejected IS NULL ORDER BY id LIMIT ?",
            (self._base_url, self._project, limit),
        )
        return [OutboxEntry(int(r[0]), str(r[1]), bytes(r[2]), float(r[3]), int(r[4])) for r in rows]

    async def rejected(self) -> list[OutboxEntry]:
        """Entries the service refused for good (e.g. the token was revoked); kept for inspection."""
        rows = await self._run(
            "SELECT id, conversation_id, body, created_at, attempts, rejected FROM outbox "
            "WHERE base_url = ? AND project = ? AND rejected IS NOT NULL ORDER BY id",
            (self._base_url, self._project),
        )
        return [
            OutboxEntry(int(r[0]), str(r[1]), bytes(r[2]), float(r[3]), int(r[4]), str(r[5])) for r in rows
        ]

    async def delivered(self, entry_id: int) -> None:
        await self._run("DELETE FROM outbox WHERE id = ?", (entry_id,))

    async def failed(self, entry_id: int) -> None:
        await self._run("UPDATE outbox SET attempts = attempts + 1 WHERE id = ?", (entry_id,))

    async def reject(self, entry_id: int, reason: str) -> None:
        await self._run(
            "UPDATE outbox SET rejected = ?, attempts = attempts + 1 WHERE id = ?", (reason, entry_id)
        )
