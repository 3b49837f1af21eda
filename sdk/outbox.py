"""A durable local outbox for end-of-call writes.

The outbox is a small SQLite file owned by the SDK (WAL, ``synchronous=FULL``). ``conv.end()`` writes its
request here *before* the first attempt to send it, and deletes it once the service acknowledged it: if the
agent process dies, or the call's task is cancelled, while the service is unreachable, the write is still
delivered later. Delivering an entry twice is harmless: the service applies the end of a conversation once
per conversation id.

Each entry carries a lease (``claimed_until``): whoever is sending it (the ``end()`` that wrote it, or one
delivery run, in this process or another one sharing the file) holds it, and nobody else picks it up until
the lease runs out. So several processes may share one outbox file without sending the same entries.

Entries hold the request as it will be sent, including the caller's phone number: the file is created
readable by its owner only, deleted rows are overwritten (``secure_delete``), and entries are removed as
soon as they are delivered.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from dataclasses import dataclass, field
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
    claimed_until REAL NOT NULL DEFAULT 0,
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
    #: The request body; it holds the caller's number, so it is left out of ``repr``.
    body: bytes = field(repr=False)
    created_at: float
    attempts: int
    rejected: str | None = None


_COLUMNS = "id, conversation_id, body, created_at, attempts, rejected"


def _entry(row: tuple[Any, ...]) -> OutboxEntry:
    return OutboxEntry(int(row[0]), str(row[1]), bytes(row[2]), float(row[3]), int(row[4]), row[5])


class Outbox:
    """The entries of one service URL and project in an outbox file."""

    def __init__(self, path: str | os.PathLike[str], base_url: str, project: str) -> None:
        self.path = Path(path)
        self._base_url = base_url
        self._project = project
        self._conn: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<Outbox {str(self.path)!r} project={self._project!r}>"

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            os.close(fd)
            conn = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA secure_delete = ON")
            conn.executescript(_SCHEMA)
            self._conn = conn
        return self._conn

    async def _run(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        def run() -> list[tuple[Any, ...]]:
            return self._connection().execute(sql, params).fetchall()

        async with self._lock:  # one connection, one statement at a time
            return await asyncio.to_thread(run)

    async def open(self) -> None:
        """Create or open the file now, so that a path that cannot be written fails at start-up."""
        await self._run("SELECT 1")

    async def close(self) -> None:
        async with self._lock:
            if self._conn is not None:
                await asyncio.to_thread(self._conn.close)
                self._conn = None

    async def add(self, conversation_id: str, body: bytes, *, lease: float) -> int:
        """Keep a request, claimed for ``lease`` seconds by the caller that is about to send it."""
        now = time.time()
        rows = await self._run(
            "INSERT INTO outbox (base_url, project, conversation_id, body, created_at, claimed_until) "
            "VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
            (self._base_url, self._project, conversation_id, body, now, now + lease),
        )
        return int(rows[0][0])

    async def claim(self, limit: int, lease: float) -> list[OutboxEntry]:
        """Take up to ``limit`` unclaimed entries, oldest first, for ``lease`` seconds."""
        now = time.time()
        return [
            _entry(row)
            for row in await self._run(
                "UPDATE outbox SET claimed_until = ? WHERE id IN (SELECT id FROM outbox WHERE base_url = ? "
                "AND project = ? AND rejected IS NULL AND claimed_until < ? ORDER BY id LIMIT ?) "
                f"RETURNING {_COLUMNS}",
                (now + lease, self._base_url, self._project, now, limit),
            )
        ]

    async def release(self, entry_id: int) -> None:
        """Give an entry back after a failed attempt: the next delivery picks it up."""
        await self._run(
            "UPDATE outbox SET claimed_until = 0, attempts = attempts + 1 WHERE id = ?", (entry_id,)
        )

    async def delivered(self, entry_id: int) -> None:
        await self._run("DELETE FROM outbox WHERE id = ?", (entry_id,))

    async def reject(self, entry_id: int, reason: str) -> None:
        """Set an entry aside: the service refused it for good. It is kept for inspection."""
        await self._run(
            "UPDATE outbox SET rejected = ?, attempts = attempts + 1 WHERE id = ?", (reason, entry_id)
        )

    async def pending(self) -> list[OutboxEntry]:
        """Every entry still to deliver (claimed or not), oldest first."""
        return [
            _entry(row)
            for row in await self._run(
                f"SELECT {_COLUMNS} FROM outbox WHERE base_url = ? AND project = ? AND rejected IS NULL ORDER BY id",
                (self._base_url, self._project),
            )
        ]

    async def rejected(self) -> list[OutboxEntry]:
        """Entries the service refused for good (e.g. the token was revoked), oldest first."""
        return [
            _entry(row)
            for row in await self._run(
                f"SELECT {_COLUMNS} FROM outbox WHERE base_url = ? AND project = ? AND rejected IS NOT NULL "
                "ORDER BY id",
                (self._base_url, self._project),
            )
        ]

    async def retry_rejected(self) -> int:
        """Put rejected entries back in line (after fixing what made the service refuse them)."""
        rows = await self._run(
            "UPDATE outbox SET rejected = NULL, claimed_until = 0 WHERE base_url = ? AND project = ? "
            "AND rejected IS NOT NULL RETURNING id",
            (self._base_url, self._project),
        )
        return len(rows)

    async def purge_rejected(self) -> int:
        """Delete rejected entries for good (they hold phone numbers: do not keep them longer than needed)."""
        rows = await self._run(
            "DELETE FROM outbox WHERE base_url = ? AND project = ? AND rejected IS NOT NULL RETURNING id",
            (self._base_url, self._project),
        )
        return len(rows)
