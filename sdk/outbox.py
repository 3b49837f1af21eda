"""A durable local outbox for end-of-call writes and for message batches that could not be sent.

The outbox is a small SQLite file owned by the SDK (WAL, ``synchronous=FULL``). ``conv.end()`` writes its
request here *before* the first attempt to send it, and deletes it once the service acknowledged it: if the
agent process dies, or the call's task is cancelled, while the service is unreachable, the write is still
delivered later. Delivering an entry twice is harmless: the service applies the end of a conversation once
per conversation id, and a message batch once per message id.

Entries are of two kinds: ``end`` (the end of a conversation) and ``messages`` (a batch of transcript
messages, kept when the service stayed unreachable, or at close). Both are delivered oldest first, and the
order within a conversation is kept whoever delivers: a batch is not taken while an earlier batch of its
conversation is being sent by someone else, and an end is not taken while a batch of its conversation is
still to deliver (the service would refuse the batch once the conversation ended).

There is at most one entry per conversation: an ``end()`` called again for a conversation that is still in
the outbox (after a cancellation, or in a new process after a crash) takes that entry over and keeps its
``ended_at``, so that an erasure of the caller in between still wins.

Each entry carries a lease (``claimed_until``) and its holder (``owner``: host and process id): whoever is
sending it (the ``end()`` that wrote it, or one delivery run, in this process or another one sharing the
file) holds it, and nobody else picks it up until the lease runs out, or until the holder is seen to be dead
(a process of this host that no longer exists). So several processes may share one outbox file without
sending the same entries, and the entries of a killed process are delivered by the next one at once.

Every failure of the file (it cannot be created or written, it is corrupt, it stays locked by another
process for longer than ``timeout``) is an :class:`~caller_memory.sdk.errors.OutboxUnavailableError`.

Entries hold the request as it will be sent, including the caller's phone number: the file is created
readable by its owner only, deleted rows are overwritten (``secure_delete``), and entries are removed as
soon as they are delivered.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from .errors import OutboxUnavailableError

_TABLE = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    base_url TEXT NOT NULL,
    project TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    body BLOB NOT NULL,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    claimed_until REAL NOT NULL DEFAULT 0,
    rejected TEXT,
    owner TEXT NOT NULL DEFAULT '',
    kind TEXT NOT NULL DEFAULT 'end'
);
"""
_INDEXES = """
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (base_url, project, rejected, id);
CREATE INDEX IF NOT EXISTS outbox_conversation ON outbox (base_url, project, conversation_id);
"""

T = TypeVar("T")

#: Seconds a statement waits for another process's lock on the file before it fails.
DEFAULT_TIMEOUT = 2.0


def default_outbox_path() -> Path:
    """``$CALLER_MEMORY_OUTBOX``, else ``$XDG_STATE_HOME/caller-memory/outbox.db`` (``~/.local/state``)."""
    explicit = os.environ.get("CALLER_MEMORY_OUTBOX")
    if explicit:
        return Path(explicit)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "caller-memory" / "outbox.db"


#: The kinds of entries: the end of a conversation, a batch of its messages.
END = "end"
MESSAGES = "messages"


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    id: int
    conversation_id: str
    #: The request body; it holds the caller's number, so it is left out of ``repr``.
    body: bytes = field(repr=False)
    created_at: float
    attempts: int
    rejected: str | None = None
    #: ``end`` or ``messages``.
    kind: str = END


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What :meth:`~caller_memory.sdk.MemoryClient.flush_outbox` did."""

    delivered: int
    remaining: int
    rejected: int
    #: Message batches the service refused for good (the caller's error, or a conversation that is over):
    #: deleted, and logged.
    dropped: int = 0


_COLUMNS = "id, conversation_id, body, created_at, attempts, rejected, kind"


def _entry(row: tuple[Any, ...]) -> OutboxEntry:
    return OutboxEntry(
        int(row[0]), str(row[1]), bytes(row[2]), float(row[3]), int(row[4]), row[5], str(row[6])
    )


# Which entries may be taken: none while an earlier batch of the same conversation is held by someone (it is
# being sent: a later one would overtake it), and no end while a batch of its conversation waits (the end
# would make the service refuse the batch). Entries taken together go in id order, so a batch and the later
# batches of its conversation may be taken at once.
_TAKEABLE = (
    "NOT EXISTS (SELECT 1 FROM outbox AS b WHERE b.base_url = outbox.base_url AND b.project = outbox.project "
    "AND b.conversation_id = outbox.conversation_id AND b.kind = 'messages' AND b.rejected IS NULL AND ("
    "(b.id < outbox.id AND b.claimed_until >= :now) OR outbox.kind = 'end'))"
)


def _this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _is_dead(owner: str) -> bool:
    """Whether ``owner`` ("host:pid") is a process of this host that no longer runs (or is a zombie).
    Owners on other hosts, and owners of unknown form, count as alive: their lease applies."""
    host, _, pid_text = owner.rpartition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists, run by another user
        return False
    try:  # a killed process that its parent has not reaped yet still answers signal 0
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def _ended_at(body: bytes) -> str | None:
    try:
        stored = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    value = stored.get("ended_at") if isinstance(stored, dict) else None
    return value if isinstance(value, str) else None


class Outbox:
    """The entries of one service URL and project in an outbox file.

    ``timeout``: seconds one operation may wait for another process's lock on the file (default 2);
    beyond it, and for any other failure of the file, operations raise OutboxUnavailableError.
    """

    def __init__(
        self, path: str | os.PathLike[str], base_url: str, project: str, *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if not timeout > 0:
            raise ValueError("the outbox timeout must be a positive number of seconds")
        self.path = Path(path)
        self.timeout = timeout
        self._base_url = base_url
        self._project = project
        self._owner = _this_process()
        self._conn: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<Outbox {str(self.path)!r} project={self._project!r}>"

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            os.close(fd)
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA secure_delete = ON")
                conn.executescript(_TABLE)
                columns = {row[1] for row in conn.execute("PRAGMA table_info(outbox)")}
                if "owner" not in columns:  # a file written by an earlier version of the SDK
                    conn.execute("ALTER TABLE outbox ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
                if "kind" not in columns:  # ... or by one from before message batches
                    conn.execute("ALTER TABLE outbox ADD COLUMN kind TEXT NOT NULL DEFAULT 'end'")
                conn.executescript(_INDEXES)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    async def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            try:
                return work(self._connection())
            except (sqlite3.Error, OSError) as exc:
                raise OutboxUnavailableError(f"the outbox {self.path} cannot be used: {exc}") from exc

        async with self._lock:  # one connection, one statement at a time
            work_done = asyncio.ensure_future(asyncio.to_thread(run))
            try:
                return await asyncio.shield(work_done)
            except asyncio.CancelledError:
                # A thread cannot be stopped: keep the connection to it until its statement finished (within
                # the busy timeout), so that no other statement runs on the connection in the meantime.
                await asyncio.wait([work_done])
                raise

    async def _run(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        return await self._call(lambda conn: conn.execute(sql, params).fetchall())

    async def _transaction(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def run(conn: sqlite3.Connection) -> T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = work(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return result

        return await self._call(run)

    async def open(self) -> None:
        """Create or open the file now, so that a path that cannot be written fails at start-up."""
        await self._run("SELECT 1")

    async def close(self) -> None:
        async with self._lock:
            if self._conn is not None:
                await asyncio.to_thread(self._conn.close)
                self._conn = None

    async def add(self, conversation_id: str, body: bytes, *, lease: float, kind: str = END) -> int:
        """Keep a request, claimed for ``lease`` seconds by the caller that is about to send it (0: by
        nobody, for the next delivery)."""
        return (await self.add_many(conversation_id, [body], lease=lease, kind=kind))[0]

    async def add_many(
        self, conversation_id: str, bodies: list[bytes], *, lease: float = 0, kind: str = MESSAGES
    ) -> list[int]:
        """Keep several requests of one conversation, in order, in one transaction; returns their ids."""

        def add(conn: sqlite3.Connection) -> list[int]:
            now = time.time()
            claimed = now + lease if lease > 0 else 0
            return [
                int(
                    conn.execute(
                        "INSERT INTO outbox (base_url, project, conversation_id, body, created_at, "
                        "claimed_until, owner, kind) VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                        (
                            self._base_url,
                            self._project,
                            conversation_id,
                            body,
                            now,
                            claimed,
                            self._owner,
                            kind,
                        ),
                    ).fetchone()[0]
                )
                for body in bodies
            ]

        return await self._transaction(add)

    async def keep(self, conversation_id: str, body: dict[str, Any], *, lease: float) -> tuple[int, bytes]:
        """Keep the end of a conversation, claimed for ``lease`` seconds; returns (entry id, body to send).

        If the conversation is already in the outbox (an earlier ``end()`` was cancelled, or its process
        died), that entry is taken over (and put back in line if it had been set aside) and its ``ended_at``
        is kept: the body sent carries the first call's time.
        """

        def keep(conn: sqlite3.Connection) -> tuple[int, bytes]:
            now = time.time()
            row = conn.execute(
                "SELECT id, body FROM outbox WHERE base_url = ? AND project = ? AND conversation_id = ? "
                "AND kind = 'end' ORDER BY id LIMIT 1",
                (self._base_url, self._project, conversation_id),
            ).fetchone()
            first = _ended_at(bytes(row[1])) if row is not None else None
            encoded = orjson.dumps(body | {"ended_at": first} if first else body)
            if row is None:
                inserted = conn.execute(
                    "INSERT INTO outbox (base_url, project, conversation_id, body, created_at, claimed_until, "
                    "owner) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                    (self._base_url, self._project, conversation_id, encoded, now, now + lease, self._owner),
                ).fetchone()
                return int(inserted[0]), encoded
            conn.execute(
                "UPDATE outbox SET body = ?, claimed_until = ?, owner = ?, rejected = NULL WHERE id = ?",
                (encoded, now + lease, self._owner, row[0]),
            )
            return int(row[0]), encoded

        return await self._transaction(keep)

    async def claim(
        self, limit: int, lease: float, *, conversation_id: str | None = None, kind: str | None = None
    ) -> list[OutboxEntry]:
        """Take up to ``limit`` unclaimed entries, oldest first, for ``lease`` seconds (only those of
        ``conversation_id`` and of ``kind``, when given), keeping each conversation's order (see the module's
        docstring). Entries whose holder is a dead process of this host count as unclaimed."""

        taken: list[float] = []  # the lease this claim wrote (it marks its entries)

        def claim(conn: sqlite3.Connection) -> list[OutboxEntry]:
            now = time.time()
            taken[:] = [now + lease]
            scope = (self._base_url, self._project)
            holders = conn.execute(
                "SELECT DISTINCT owner FROM outbox WHERE base_url = ? AND project = ? AND rejected IS NULL "
                "AND claimed_until >= ? AND owner != ?",
                (*scope, now, self._owner),
            ).fetchall()
            for (owner,) in holders:
                if _is_dead(owner):
                    conn.execute(
                        "UPDATE outbox SET claimed_until = 0 WHERE base_url = ? AND project = ? AND owner = ?",
                        (*scope, owner),
                    )
            rows = conn.execute(
                "UPDATE outbox SET claimed_until = :until, owner = :owner WHERE id IN (SELECT id FROM outbox "
                "WHERE base_url = :base_url AND project = :project AND rejected IS NULL AND claimed_until < :now "
                "AND (:conversation IS NULL OR conversation_id = :conversation) AND (:kind IS NULL OR kind = :kind) "
                f"AND {_TAKEABLE} ORDER BY id LIMIT :limit) RETURNING {_COLUMNS}",
                {
                    "until": now + lease,
                    "owner": self._owner,
                    "base_url": self._base_url,
                    "project": self._project,
                    "now": now,
                    "conversation": conversation_id,
                    "kind": kind,
                    "limit": limit,
                },
            ).fetchall()
            return sorted((_entry(row) for row in rows), key=lambda entry: entry.id)

        try:
            return await self._transaction(claim)
        except asyncio.CancelledError:
            # The statement ran to its end in its thread (see _call) and the entries are taken, but whoever
            # asked will never know them: hand them back, or they would wait for their lease to run out.
            if taken:
                await self._run(
                    "UPDATE outbox SET claimed_until = 0 WHERE base_url = ? AND project = ? AND owner = ? "
                    "AND claimed_until = ?",
                    (self._base_url, self._project, self._owner, taken[0]),
                )
            raise

    async def release(self, *entry_ids: int) -> None:
        """Give entries back after a failed attempt: the next delivery picks them up."""
        if entry_ids:
            marks = ", ".join("?" * len(entry_ids))
            await self._run(
                f"UPDATE outbox SET claimed_until = 0, attempts = attempts + 1 WHERE id IN ({marks})",
                entry_ids,
            )

    async def release_conversation(self, conversation_id: str) -> None:
        """Give back this process's end entry of a conversation (its writer was cancelled before it learnt
        the entry's id)."""
        await self._run(
            "UPDATE outbox SET claimed_until = 0 WHERE base_url = ? AND project = ? AND conversation_id = ? "
            "AND owner = ? AND kind = 'end'",
            (self._base_url, self._project, conversation_id, self._owner),
        )

    async def delivered(self, entry_id: int) -> None:
        await self._run("DELETE FROM outbox WHERE id = ?", (entry_id,))

    async def reject(self, entry_id: int, reason: str) -> None:
        """Set an entry aside: the service refused it. It is kept (see :meth:`retry_rejected`)."""
        await self._run(
            "UPDATE outbox SET rejected = ?, claimed_until = 0, attempts = attempts + 1 WHERE id = ?",
            (reason, entry_id),
        )

    async def pending(self, conversation_id: str | None = None, kind: str | None = None) -> list[OutboxEntry]:
        """Every entry still to deliver (claimed or not), oldest first (of ``conversation_id`` and of
        ``kind`` only, when given)."""
        return [
            _entry(row)
            for row in await self._run(
                f"SELECT {_COLUMNS} FROM outbox WHERE base_url = ? AND project = ? AND rejected IS NULL "
                "AND (? IS NULL OR conversation_id = ?) AND (? IS NULL OR kind = ?) ORDER BY id",
                (self._base_url, self._project, conversation_id, conversation_id, kind, kind),
            )
        ]

    async def rejected(self) -> list[OutboxEntry]:
        """Entries the service refused (e.g. the token was revoked), oldest first."""
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
