"""SQLite backend, retention: the expiry sweep (for transcripts, with
:func:`~caller_memory.service.storage.sqlite.transcripts.sweep_transcripts`), its lease and its reports, erasure, and the audit log.

:class:`SQLiteRetention` is a mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`: it runs its statements through the
store's writer and reader (``_write``: one ``IMMEDIATE`` transaction on the writer thread; ``_read``: the
reader's connection), as every other operation does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

from ...domain.store import AuditEntry, CallerRef, ErasureResult
from ..codec import audit_id, decode_audit, encode_audit
from .links import erase_links
from .transcripts import erase_transcripts, sweep_transcripts

#: The ``subject`` of a conversation record whose caller was erased (a pseudonym is never empty).
ERASED_SUBJECT = ""

T = TypeVar("T")


class SQLiteRetention:
    """The retention methods of the Store interface on SQLite (expired rows are found by ``expires_at``)."""

    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    #: Tables swept by their expires_at index: kind reported -> (table, primary key columns).
    _EXPIRING: ClassVar[dict[str, tuple[str, str]]] = {
        "first_interactions": ("first_interactions", "project, subject"),
        "conversations": ("conversations", "project, conversation_id"),
        "analytics_entries": ("analytics_conversations", "project, sort_key"),
        "analytics_counters": ("analytics_counters", "project, kind, bucket, name"),
        "tombstones": ("tombstones", "project, subject"),
        "erased_conversations": ("erased_conversations", "project, subject, conversation_id"),
        "transcript_volume": ("transcript_volume", "project, hour"),
        "webhook_deliveries": ("webhook_deliveries", "project, delivery_id"),
        "archive_index": ("archive_index", "project, subject, object_key"),
        "links": ("links", "project, profile, subject"),
        "aliases": ("aliases", "project, subject"),
    }

    async def list_projects(self) -> list[str]:
        def run(conn: sqlite3.Connection) -> list[str]:
            return [row[0] for row in conn.execute("SELECT project FROM projects ORDER BY project")]

        return await self._read(run)

    async def sweep(
        self, now_ms: int, batch: int, listed_after: Mapping[str, int] | None = None
    ) -> tuple[dict[str, int], bool]:
        def run(conn: sqlite3.Connection) -> tuple[dict[str, int], bool]:
            counts: dict[str, int] = {}
            more = False
            dead = conn.execute(
                "SELECT project, subject, name FROM fields WHERE expires_at <= ? LIMIT ?", (now_ms, batch)
            ).fetchall()
            conn.executemany("DELETE FROM fields WHERE project = ? AND subject = ? AND name = ?", dead)
            callers = {(p, s) for p, s, _ in dead}
            counts["fields"] = len(dead)
            counts["callers"] = sum(
                conn.execute("SELECT 1 FROM fields WHERE project = ? AND subject = ? LIMIT 1", c).fetchone()
                is None
                for c in callers
            )
            more = more or len(dead) == batch
            for kind, (table, key) in self._EXPIRING.items():
                removed = conn.execute(
                    f"DELETE FROM {table} WHERE ({key}) IN "
                    f"(SELECT {key} FROM {table} WHERE expires_at <= ? LIMIT ?)",
                    (now_ms, batch),
                ).rowcount
                counts[kind] = removed
                more = more or removed == batch
            transcripts, more_transcripts = sweep_transcripts(conn, now_ms, batch)
            counts.update(transcripts)
            more = more or more_transcripts
            for project, cutoff in sorted((listed_after or {}).items()):
                # Past the project's current retention (shortened since they were recorded).
                removed = conn.execute(
                    "DELETE FROM analytics_conversations WHERE (project, sort_key) IN (SELECT project, sort_key "
                    "FROM analytics_conversations WHERE project = ? AND recorded_at <= ? LIMIT ?)",
                    (project, cutoff, batch),
                ).rowcount
                counts["analytics_entries"] += removed
                more = more or removed == batch
            return counts, more

        return await self._write(run)

    async def acquire_lease(self, name: str, holder: str, now_ms: int, ttl_ms: int) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "INSERT INTO leases (name, holder, expires_at) VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE "
                "SET holder = excluded.holder, expires_at = excluded.expires_at "
                "WHERE leases.holder = excluded.holder OR leases.expires_at <= ?",
                (name, holder, now_ms + ttl_ms, now_ms),
            )
            return cur.rowcount > 0

        return await self._write(run)

    async def release_lease(self, name: str, holder: str) -> None:
        await self._write(
            lambda conn: conn.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))
        )

    async def record_sweep(self, record: bytes) -> None:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO sweeps (record) VALUES (?)", (record,))
            conn.execute("DELETE FROM sweeps WHERE id <= (SELECT max(id) FROM sweeps) - 100")

        await self._write(run)

    async def list_sweeps(self, limit: int) -> list[bytes]:
        def run(conn: sqlite3.Connection) -> list[bytes]:
            rows = conn.execute("SELECT record FROM sweeps ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
            return [bytes(row[0]) for row in rows]

        return await self._read(run)

    async def append_audit(self, project: str, entry: AuditEntry) -> str:
        def run(conn: sqlite3.Connection) -> str:
            row = conn.execute(
                "INSERT INTO audit (project, entry) VALUES (?, ?) RETURNING id",
                (project, encode_audit(entry)),
            ).fetchone()
            return audit_id(int(row[0]))

        return await self._write(run)

    async def list_audit(self, project: str, limit: int, before: str | None) -> list[AuditEntry]:
        def run(conn: sqlite3.Connection) -> list[AuditEntry]:
            # Either form of id (the other backend's ``ms-seq`` too): "older than 5-3" is "at most 5" here
            # (said as <=, not < 6: 2^63 - 1 is a valid part, and 2^63 is no SQLite integer).
            ms, _, seq = (before or "").partition("-")
            inclusive = before is None or bool(seq and int(seq))
            bound = int(ms) if before is not None else 2**63 - 1
            rows = conn.execute(
                f"SELECT id, entry FROM audit WHERE project = ? AND id {'<=' if inclusive else '<'} ? "
                "ORDER BY id DESC LIMIT ?",
                (project, bound, limit),
            ).fetchall()
            return [decode_audit(audit_id(int(row[0])), bytes(row[1])) for row in rows]

        return await self._read(run)

    async def erase_caller(self, caller: CallerRef, now_ms: int, tombstone_until: int) -> ErasureResult:
        project, subject = caller.project, caller.subject

        def run(conn: sqlite3.Connection) -> ErasureResult:
            key = (project, subject)
            fields = conn.execute("DELETE FROM fields WHERE project = ? AND subject = ?", key).rowcount
            first = conn.execute(
                "DELETE FROM first_interactions WHERE project = ? AND subject = ?", key
            ).rowcount
            # Each record loses what linked it to the caller (subject, fingerprint, stored answer) but stays,
            # as a marker, until it would have expired: a later end of the id is then refused as erased,
            # whenever the client says it was made.
            records = conn.execute(
                "UPDATE conversations SET subject = ?, fingerprint = '', extra = x'' "
                "WHERE project = ? AND subject = ? RETURNING conversation_id, expires_at",
                (ERASED_SUBJECT, *key),
            ).fetchall()
            ids = [row[0] for row in records]
            listed = self._unlist(conn, project, ids)
            # Every conversation the erasure removes something of (a record, a transcript) is kept by id, so
            # that no end of it by this caller brings them back (end_conversation), for as long as it lives.
            held = [
                *records,
                *conn.execute(
                    "SELECT conversation_id, forget_at FROM transcripts "
                    "WHERE project = ? AND subject = ? AND forget_at > ?",
                    (*key, now_ms),
                ).fetchall(),
            ]
            conn.executemany(
                "INSERT INTO erased_conversations (project, subject, conversation_id, expires_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE SET expires_at = max(expires_at, excluded.expires_at)",
                [(project, subject, i.partition("#")[0], until) for i, until in held if until > now_ms],
            )
            transcripts = erase_transcripts(conn, caller, now_ms)
            links, alias_of, aliases = erase_links(conn, project, subject, now_ms)
            conn.execute(
                "INSERT OR REPLACE INTO tombstones (project, subject, erased_at, expires_at) VALUES (?, ?, ?, ?)",
                (project, subject, now_ms, tombstone_until),
            )
            return ErasureResult(
                fields=fields,
                first_interaction=first > 0,
                conversations=len(ids),
                listed=listed,
                transcripts=transcripts,
                links=links,
                alias_of=alias_of,
                aliases=aliases,
            )

        return await self._write(run)

    @staticmethod
    def _unlist(conn: sqlite3.Connection, project: str, ids: Sequence[str]) -> int:
        return sum(
            conn.execute(
                "DELETE FROM analytics_conversations WHERE project = ? AND conversation_id = ?", (project, i)
            ).rowcount
            for i in ids
        )
