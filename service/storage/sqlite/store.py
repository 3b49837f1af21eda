"""SQLite backend: the embedded default. One file, WAL mode, the same semantics as Redis.

Writes run on one dedicated thread with one connection (SQLite has one writer at a time anyway), each in an
``IMMEDIATE`` transaction so that read-modify-write is atomic. ``synchronous=FULL`` makes every acknowledged
write durable (the WAL is fsynced before commit returns). Reads use a connection on a second thread, point
reads one on the event loop's thread (``point_reads.py``); WAL lets both proceed while a write is under way.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import TypeVar

from ...domain.errors import StoreCorrupt, StoreUnavailable
from ...domain.fields import StoredField, WriteCondition, live_fields
from ...domain.store import (
    BUCKET_KINDS,
    AnalyticsInput,
    CallerRef,
    ConversationEntry,
    Counters,
    EndAnalytics,
    EndResult,
    EndStatus,
    EndWrite,
    FirstInteraction,
    ListingPage,
    PatchResult,
    Recording,
    RecordStatus,
    Store,
)
from ...domain.store.links import ProfileMoved
from ...domain.store.webhooks import Delivery
from ..codec import decode_end_analytics, decode_entry, encode_end_analytics, encode_entry
from .archive import SQLiteArchiveIndex
from .call_trust import SQLiteCallTrust
from .late_transcripts import SQLiteLateTranscripts
from .links import RESOLVED, SQLiteLinks, profile_of, refuse_alias
from .llm import SQLiteLlm
from .pending_answers import SQLitePendingAnswers
from .platform_events import SQLitePlatformEvents
from .platforms import SQLitePlatforms
from .point_reads import PointReads
from .projects import SQLiteProjects
from .remembered import SQLiteRemembered
from .retention import ERASED_SUBJECT, SQLiteRetention
from .transcripts import SQLiteTranscripts
from .webhooks import SQLiteWebhooks

T = TypeVar("T")

#: 2: conversation memory (the transcript tables) and tokens.agent; 3: webhooks (the endpoint and delivery
#: tables, created when missing like the transcript tables); 4: linked identifiers (the alias and link tables,
#: the same way); 5: the conversations an erasure removed (erased_conversations: an earlier release would let
#: an end of one bring its caller back). A file is marked with the version that last opened it, so that an earlier release, which
#: would neither sweep nor erase what it does not know (a transcript, a queued delivery, a link), refuses it
#: (and an earlier release would not follow a link either: it would write to an alias).
SCHEMA_VERSION = 5

#: The tables and indexes (``schema.sql``, package data), created by every open if missing.
_SCHEMA = resources.files(__package__).joinpath("schema.sql").read_text(encoding="utf-8")

#: Columns added after the first release: (table, column, its type, how existing rows are filled). A first
#: interaction or a listed conversation of an older file counts as created (recorded) at its hour; a counter
#: bucket without its latest recording time is judged by its expiry alone; an older token acts as no agent.
_ADDED_COLUMNS = (
    ("first_interactions", "created_at", "INTEGER", "UPDATE first_interactions SET created_at = hour"),
    (
        "analytics_conversations",
        "recorded_at",
        "INTEGER",
        "UPDATE analytics_conversations SET recorded_at = CAST(substr(sort_key, 1, 13) AS INTEGER)",
    ),
    ("analytics_counters", "recorded_at", "INTEGER", None),
    ("tokens", "agent", "TEXT NOT NULL DEFAULT ''", None),
    # A conversation's caller's region (for redaction): unknown ('') for one started by an earlier release.
    ("transcripts", "region", "TEXT NOT NULL DEFAULT ''", None),
    # A delivery's latest attempts: none kept for one queued by an earlier release.
    ("webhook_deliveries", "attempt_log", "TEXT NOT NULL DEFAULT ''", None),
)
#: Indexes on added columns (made once the columns exist).
_ADDED_INDEXES = """
CREATE INDEX IF NOT EXISTS analytics_conversations_by_recorded ON analytics_conversations (project, recorded_at);
"""


def _migrate(conn: sqlite3.Connection) -> None:
    """Add what a file made by an earlier release lacks (idempotent; inside the caller's transaction), and
    mark the file with this release's schema version; a file of a later release is refused, untouched."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is not None and int(row[0]) > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"schema version {row[0]} is newer than this release supports")
    for table, column, kind, fill in _ADDED_COLUMNS:
        if not any(row[1] == column for row in conn.execute(f"PRAGMA table_info({table})")):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            if fill is not None:
                conn.execute(fill)
    for statement in _ADDED_INDEXES.strip().splitlines():
        conn.execute(statement)
    conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
    )


class SQLiteStore(
    SQLiteProjects,
    SQLiteRetention,
    SQLiteTranscripts,
    SQLiteWebhooks,
    SQLiteArchiveIndex,
    SQLiteLinks,
    SQLiteLlm,
    SQLitePlatforms,
    SQLitePlatformEvents,
    SQLiteCallTrust,
    SQLiteLateTranscripts,
    SQLitePendingAnswers,
    SQLiteRemembered,
    Store,
):
    """:class:`Store` on one SQLite file: each capability a mixin, in the module named like its port."""

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path)
        self._busy_timeout_ms = busy_timeout_ms
        self._writer_pool: ThreadPoolExecutor | None = None
        self._reader_pool: ThreadPoolExecutor | None = None
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._points = PointReads(self.path, lambda: self._reader is not None)

    @classmethod
    def from_url(cls, url: str) -> SQLiteStore:
        prefix = "sqlite:///"
        if not url.startswith(prefix) or len(url) == len(prefix):
            raise ValueError(
                "a SQLite store URL is sqlite:///relative/path.db or sqlite:////absolute/path.db"
            )
        return cls(url[len(prefix) :])

    # Plumbing -----------------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        return conn

    async def _run(self, pool: ThreadPoolExecutor | None, fn: Callable[[], T]) -> T:
        if pool is None:
            raise StoreUnavailable("the SQLite store is not open")
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):
                raise StoreUnavailable(f"SQLite store error: {exc}") from exc
            raise StoreCorrupt(f"the SQLite file {self.path} cannot be read: {exc}") from exc

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            assert self._writer is not None
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

        return await self._run(self._writer_pool, run)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            assert self._reader is not None
            return fn(self._reader)

        return await self._run(self._reader_pool, run)

    async def open(self) -> None:
        if self._writer_pool is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer_pool = ThreadPoolExecutor(1, thread_name_prefix="sqlite-writer")
        self._reader_pool = ThreadPoolExecutor(1, thread_name_prefix="sqlite-reader")

        def open_writer() -> None:
            self._writer = self._connect()
            check = self._writer.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check[0] if check else 'no answer'}")
            self._writer.executescript(_SCHEMA)
            self._writer.execute("BEGIN IMMEDIATE")
            try:
                _migrate(self._writer)
            except BaseException:
                self._writer.execute("ROLLBACK")
                raise
            self._writer.execute("COMMIT")

        try:
            await self._run(self._writer_pool, open_writer)
            self._reader = await self._run(self._reader_pool, self._connect)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._points.close()
        for pool, attr in ((self._reader_pool, "_reader"), (self._writer_pool, "_writer")):
            if pool is None:
                continue
            conn: sqlite3.Connection | None = getattr(self, attr)
            if conn is not None:
                await asyncio.get_running_loop().run_in_executor(pool, conn.close)
                setattr(self, attr, None)
            pool.shutdown(wait=True)
        self._reader_pool = self._writer_pool = None

    async def ping(self) -> None:
        await self._read(lambda conn: conn.execute("SELECT 1").fetchone())

    # Caller memory ------------------------------------------------------------------------------------

    @staticmethod
    def _fields(
        conn: sqlite3.Connection, project: str, subject: str, now_ms: int, *, follow: bool = False
    ) -> dict[str, StoredField]:
        # ``follow``: through a live alias to its profile's fields, in the same statement (see RESOLVED).
        who, params = (RESOLVED, (project, subject, now_ms, subject)) if follow else ("?", (subject,))
        rows = conn.execute(
            f"SELECT name, value, expires_at, written_at FROM fields WHERE project = ? AND subject = {who} "
            "AND expires_at > ?",
            (project, *params, now_ms),
        ).fetchall()
        return {name: StoredField(bytes(value), expires, written) for name, value, expires, written in rows}

    async def read_fields(self, caller: CallerRef, now_ms: int) -> dict[str, StoredField]:
        return await self._points.read(
            lambda conn: self._fields(conn, caller.project, caller.subject, now_ms, follow=True), self._read
        )

    @classmethod
    def _apply(
        cls,
        conn: sqlite3.Connection,
        project: str,
        subject: str,
        sets: Mapping[str, StoredField],
        deletes: Sequence[str],
        *,
        now_ms: int,
    ) -> None:
        conn.execute(
            "DELETE FROM fields WHERE project = ? AND subject = ? AND expires_at <= ?",
            (project, subject, now_ms),
        )
        if deletes:
            conn.executemany(
                "DELETE FROM fields WHERE project = ? AND subject = ? AND name = ?",
                [(project, subject, name) for name in deletes],
            )
        if sets:
            conn.executemany(
                "INSERT INTO fields (project, subject, name, value, expires_at, written_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (project, subject, name) DO UPDATE SET "
                "value = excluded.value, expires_at = excluded.expires_at, written_at = excluded.written_at",
                [(project, subject, name, f.value, f.expires_at, f.written_at) for name, f in sets.items()],
            )

    async def patch_fields(
        self,
        caller: CallerRef,
        sets: Mapping[str, StoredField],
        deletes: Sequence[str],
        now_ms: int,
        condition: WriteCondition | None = None,
    ) -> PatchResult:
        project, subject = caller.project, caller.subject

        def run(conn: sqlite3.Connection) -> PatchResult:
            refuse_alias(conn, project, subject, now_ms)
            current = self._fields(conn, project, subject, now_ms)
            if condition is not None and not condition.holds(live_fields(current, condition.ttl_ms, now_ms)):
                return PatchResult(applied=False, fields=current)
            self._apply(conn, project, subject, sets, deletes, now_ms=now_ms)
            for name in deletes:
                current.pop(name, None)
            current.update(sets)
            return PatchResult(applied=True, fields=current)

        return await self._write(run)

    async def end_conversation(self, end: EndWrite, now_ms: int) -> EndResult:
        project, subject, conversation_id = end.caller.project, end.caller.subject, end.conversation_id

        def run(conn: sqlite3.Connection) -> EndResult:
            if self._erased_since(conn, end.caller, end.made_at, now_ms):
                return EndResult(EndStatus.ERASED)
            # An erasure of this caller removed this conversation: whenever the end says it was made, and
            # under whichever record it is kept (a late end's, a takeover's), it must not bring them back.
            if conn.execute(
                "SELECT 1 FROM erased_conversations "
                "WHERE project = ? AND subject = ? AND conversation_id = ? AND expires_at > ?",
                (project, subject, conversation_id.partition("#")[0], now_ms),
            ).fetchone():
                return EndResult(EndStatus.ERASED)
            row = conn.execute(
                "SELECT subject, fingerprint, extra FROM conversations "
                "WHERE project = ? AND conversation_id = ? AND expires_at > ?",
                (project, conversation_id, now_ms),
            ).fetchone()
            if row is not None:
                if row[0] == ERASED_SUBJECT:  # an erasure removed what this id wrote: it wins
                    return EndResult(EndStatus.ERASED)
                if row[0] == subject and row[1] == end.fingerprint:
                    return EndResult(EndStatus.REPLAYED, decode_end_analytics(bytes(row[2])))
            # Not a replay of this subject's: an alias writes nothing, and the domain's retry on the profile
            # decides (a record it stored there is a replay there, another body a conflict).
            profile = profile_of(conn, project, subject, now_ms)
            if profile is not None:
                raise ProfileMoved(profile)
            if row is not None:
                return EndResult(EndStatus.CONFLICT)
            # A field written after the end's write time (a later patch, a later end) is left as it is.
            written_at = now_ms if end.written_at is None else end.written_at
            later = {
                name
                for name, stored in self._fields(conn, project, subject, now_ms).items()
                if stored.written_at > written_at
            }
            sets = {name: f for name, f in end.sets.items() if name not in later}
            deletes = [name for name in end.deletes if name not in later]
            self._apply(conn, project, subject, sets, deletes, now_ms=now_ms)
            found = (
                None
                if end.analytics is None
                else self._first_interaction(conn, end.caller, conversation_id, end.analytics, now_ms)
            )
            conn.execute(
                "INSERT OR REPLACE INTO conversations "
                "(project, conversation_id, subject, fingerprint, extra, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    project,
                    conversation_id,
                    subject,
                    end.fingerprint,
                    encode_end_analytics(found),
                    end.expires_at,
                ),
            )
            return EndResult(EndStatus.APPLIED, found)

        return await self._write(run)

    @staticmethod
    def _erased_since(conn: sqlite3.Connection, caller: CallerRef, made_at: int, now_ms: int) -> bool:
        """Whether the caller's live tombstone says they were erased at or after ``made_at``."""
        row = conn.execute(
            "SELECT erased_at FROM tombstones WHERE project = ? AND subject = ? AND expires_at > ?",
            (caller.project, caller.subject, now_ms),
        ).fetchone()
        return row is not None and row[0] >= made_at

    @staticmethod
    def _first_interaction(
        conn: sqlite3.Connection, caller: CallerRef, conversation_id: str, a: AnalyticsInput, now_ms: int
    ) -> EndAnalytics:
        """Look up (or start) the caller's first interaction; see Store.end_conversation."""
        key = (caller.project, caller.subject)
        row = conn.execute(
            "SELECT conversation_id, hour, qa, handoff_reason, handoff_to, seen_hour, seen_day, seen_week "
            "FROM first_interactions WHERE project = ? AND subject = ? AND expires_at > ? "
            "AND coalesce(created_at, hour) > ?",  # the current retention, not the one it was made under
            (*key, now_ms, a.first_after),
        ).fetchone()
        outcome = a.outcome
        if row is None:
            first = None
            seen: tuple[int | None, ...] = (None, None, None)
            conn.execute(
                "INSERT OR REPLACE INTO first_interactions (project, subject, conversation_id, hour, qa, "
                "handoff_reason, handoff_to, expires_at, seen_hour, seen_day, seen_week, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    *key, conversation_id, a.hour, outcome.qa, outcome.handoff_reason, outcome.handoff_to,
                    a.first_expires_at, a.hour, a.day, a.week, now_ms,
                ),
            )  # fmt: skip
        else:
            first = FirstInteraction(*row[:5])
            seen = (row[5], row[6], row[7])
            conn.execute(
                "UPDATE first_interactions SET seen_hour = ?, seen_day = ?, seen_week = ? "
                "WHERE project = ? AND subject = ?",
                (a.hour, a.day, a.week, *key),
            )
        current = (a.hour, a.day, a.week)
        new = tuple(kind for kind, last, now in zip(BUCKET_KINDS, seen, current, strict=True) if last != now)
        return EndAnalytics(hour=a.hour, first=first, new_buckets=new)

    async def record_conversation(
        self, recording: Recording, now_ms: int, deliveries: Sequence[Delivery] = ()
    ) -> RecordStatus:
        project, entry = recording.caller.project, recording.entry
        # The events in the same transaction (the enqueue reads the tombstone itself).
        enqueue = (
            self._enqueuing(deliveries, recording.caller, recording.made_at, now_ms) if deliveries else None
        )

        def run(conn: sqlite3.Connection) -> RecordStatus:
            cur = conn.execute(
                "INSERT OR IGNORE INTO analytics_conversations "
                "(project, sort_key, conversation_id, repeat, entry, expires_at, recorded_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    project,
                    entry.sort_key,
                    entry.conversation_id,
                    entry.first is not None,
                    encode_entry(entry),
                    recording.expires_at,
                    now_ms,
                ),
            )
            status = RecordStatus.DUPLICATE if cur.rowcount == 0 else RecordStatus.RECORDED
            if status is RecordStatus.RECORDED:
                self._count(conn, recording, now_ms)
            if enqueue is not None:
                enqueue(conn)
            # In the same transaction, so an erasure ran wholly before (its tombstone is seen here) or after
            # (it unlists the entry itself). Counters are anonymous: they keep the conversation.
            if self._erased_since(conn, recording.caller, recording.made_at, now_ms):
                self._unlist(conn, project, [entry.conversation_id])
                return RecordStatus.ERASED
            return status

        return await self._write(run)

    @staticmethod
    def _count(conn: sqlite3.Connection, recording: Recording, now_ms: int) -> None:
        conn.executemany(
            "INSERT INTO analytics_counters (project, kind, bucket, name, count, expires_at, recorded_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (project, kind, bucket, name) DO UPDATE SET "
            "count = count + excluded.count, expires_at = max(expires_at, excluded.expires_at), "
            "recorded_at = max(coalesce(recorded_at, 0), excluded.recorded_at)",
            [
                (recording.caller.project, c.kind, c.bucket, name, amount, recording.expires_at, now_ms)
                for c in recording.increments
                for name, amount in c.values.items()
                if amount
            ],
        )

    async def list_conversations(
        self, project: str, page: ListingPage, now_ms: int
    ) -> list[ConversationEntry]:
        start, stop, repeat, after = page.start, page.stop, page.repeat, page.after
        limit, descending, recorded_after = page.limit, page.descending, page.recorded_after

        def run(conn: sqlite3.Connection) -> list[ConversationEntry]:
            where = ["project = ?", "sort_key >= ?", "sort_key < ?", "expires_at > ?"]
            params: list[object] = [project, start, stop, now_ms]
            if recorded_after is not None:
                where.append("coalesce(recorded_at, CAST(substr(sort_key, 1, 13) AS INTEGER)) > ?")
                params.append(recorded_after)
            if repeat is not None:
                where.append("repeat = ?")
                params.append(int(repeat))
            if after is not None:
                where.append("sort_key < ?" if descending else "sort_key > ?")
                params.append(after)
            order = "DESC" if descending else "ASC"
            rows = conn.execute(
                f"SELECT entry FROM analytics_conversations WHERE {' AND '.join(where)} "
                f"ORDER BY sort_key {order} LIMIT ?",
                (*params, limit),
            ).fetchall()
            return [decode_entry(bytes(row[0])) for row in rows]

        return await self._read(run)

    async def counters(
        self,
        project: str,
        kind: str,
        first: int,
        last: int,
        now_ms: int,
        *,
        recorded_after: int | None = None,
    ) -> list[Counters]:
        def run(conn: sqlite3.Connection) -> list[Counters]:
            rows = conn.execute(
                "SELECT bucket, name, count, recorded_at FROM analytics_counters "
                "WHERE project = ? AND kind = ? AND bucket >= ? AND bucket <= ? AND expires_at > ? "
                "ORDER BY bucket",
                (project, kind, first, last, now_ms),
            ).fetchall()
            out: dict[int, dict[str, int]] = {}
            latest: dict[int, int] = {}
            for bucket, name, count, recorded in rows:
                out.setdefault(bucket, {})[name] = count
                if recorded is not None:
                    latest[bucket] = max(latest.get(bucket, recorded), recorded)
            return [
                Counters(kind, bucket, values)
                for bucket, values in out.items()
                # A bucket is as old as its latest conversation (as on Redis, one time per bucket).
                if recorded_after is None or latest.get(bucket, recorded_after + 1) > recorded_after
            ]

        return await self._read(run)
