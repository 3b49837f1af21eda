"""SQLite backend, linked identifiers (:mod:`caller_memory.service.domain.store.links`, SPEC section 13).

Two tables (``schema.sql``, schema version 4), as the contract has two records: ``aliases``, an
alias's record by ``(project, subject)`` (an identifier is an alias of one profile at most), and ``links``,
the profile's list by ``(project, profile, subject)``. Both are written in one ``IMMEDIATE`` transaction on
the store's single writer, so a link and its merge are one atomic step here: no link is ever left
``merging``. A list entry counts (listed, counted against the limit, renewed) only while the alias record
names its profile too: an alias erased on its own (its record gone, the entry left for the profile's
erasure) is no link any more.

:class:`SQLiteLinks` is a mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`; the functions below are what the store's
memory writes and erasure use inside their own transactions.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.fields import StoredField
from ...domain.store.links import Link, LinkResult, LinkStatus, LinkStore, ProfileMoved

if TYPE_CHECKING:
    from ...domain.store import CallerRef

T = TypeVar("T")

_LINK_COLUMNS = "l.link_id, l.kind, l.subject, l.linked_at, l.expires_at"

#: The live entries of one profile's list (parameters: project, profile, now_ms, now_ms).
_LIVE_ENTRIES = (
    "FROM links l JOIN aliases a ON a.project = l.project AND a.subject = l.subject AND a.profile = l.profile "
    "WHERE l.project = ? AND l.profile = ? AND l.expires_at > ? AND a.expires_at > ?"
)

#: The subject whose memory a read of ``(project, subject)`` sees: the profile a live alias record names,
#: else the subject itself. An uncorrelated scalar subquery: SQLite evaluates it once, and the outer query
#: still uses the fields' primary key (one statement, so one snapshot). Parameters: project, subject,
#: now_ms, subject.
RESOLVED = "coalesce((SELECT profile FROM aliases WHERE project = ? AND subject = ? AND expires_at > ?), ?)"

#: The first-interaction columns copied by a merge, after (project, subject).
_FIRST_COLUMNS = (
    "conversation_id, hour, qa, handoff_reason, handoff_to, expires_at, seen_hour, seen_day, seen_week, "
    "created_at"
)


def profile_of(conn: sqlite3.Connection, project: str, subject: str, now_ms: int) -> str | None:
    """The profile ``subject`` is a live alias of, or None."""
    row = conn.execute(
        "SELECT profile FROM aliases WHERE project = ? AND subject = ? AND expires_at > ?",
        (project, subject, now_ms),
    ).fetchone()
    return None if row is None else str(row[0])


def refuse_alias(conn: sqlite3.Connection, project: str, subject: str, now_ms: int) -> None:
    """Raise :class:`ProfileMoved` if ``subject`` is a live alias (inside a write: before anything is
    written, so the write's transaction is rolled back having changed nothing)."""
    profile = profile_of(conn, project, subject, now_ms)
    if profile is not None:
        raise ProfileMoved(profile)


def erase_links(
    conn: sqlite3.Connection, project: str, subject: str, now_ms: int
) -> tuple[int, str, tuple[str, ...]]:
    """Delete the subject's list of links (as a profile) and its alias record (as an alias), dead ones too.
    Returns how many live ones went (as Redis counts: a dead one may be gone there already), the profile its
    live alias record named ("" if none) and the subjects of its live links: the aliases the list named keep
    their records, and the domain erases each of them (and that profile) with its own subject."""
    key = (project, subject, now_ms)
    listed = conn.execute(
        "DELETE FROM links WHERE project = ? AND profile = ? RETURNING expires_at > ?, subject", key
    ).fetchall()
    alias = conn.execute(
        "DELETE FROM aliases WHERE project = ? AND subject = ? RETURNING expires_at > ?, profile", key
    ).fetchall()
    count = sum(bool(row[0]) for row in listed + alias)
    profile = next((str(row[1]) for row in alias if row[0]), "")
    return count, profile, tuple(sorted(str(row[1]) for row in listed if row[0]))


def _link(row: tuple[object, ...]) -> Link:
    link_id, kind, subject, linked_at, expires_at = row
    return Link(str(link_id), str(kind), str(subject), int(str(linked_at)), int(str(expires_at)))


def _set_link(conn: sqlite3.Connection, project: str, profile: str, link: Link) -> None:
    """Write the alias record and the list entry (over a dead record of the subject, or its dead entry)."""
    conn.execute(
        "INSERT OR REPLACE INTO aliases (project, subject, profile, expires_at) VALUES (?, ?, ?, ?)",
        (project, link.subject, profile, link.expires_at),
    )
    conn.execute(
        "INSERT OR REPLACE INTO links (project, profile, subject, link_id, kind, linked_at, expires_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (project, profile, link.subject, link.link_id, link.kind, link.linked_at, link.expires_at),
    )


def _has_memory(conn: sqlite3.Connection, project: str, subject: str, now_ms: int) -> bool:
    """A live field or a live first-interaction record (what a link without ``merge`` refuses)."""
    key = (project, subject, now_ms)
    return any(
        conn.execute(
            f"SELECT 1 FROM {table} WHERE project = ? AND subject = ? AND expires_at > ? LIMIT 1", key
        ).fetchone()
        for table in ("fields", "first_interactions")
    )


def _live_fields(conn: sqlite3.Connection, project: str, subject: str, now_ms: int) -> dict[str, StoredField]:
    rows = conn.execute(
        "SELECT name, value, expires_at, written_at FROM fields "
        "WHERE project = ? AND subject = ? AND expires_at > ?",
        (project, subject, now_ms),
    ).fetchall()
    return {name: StoredField(bytes(value), expires, written) for name, value, expires, written in rows}


def _merge_fields(
    conn: sqlite3.Connection, project: str, profile: str, alias: dict[str, StoredField], now_ms: int
) -> int:
    """Move each of the alias's live fields into the profile unless the profile's own was written as late or
    later (the profile wins a tie). Returns how many moved."""
    mine = _live_fields(conn, project, profile, now_ms)
    moving = {
        name: f for name, f in alias.items() if name not in mine or f.written_at > mine[name].written_at
    }
    conn.executemany(
        "INSERT INTO fields (project, subject, name, value, expires_at, written_at) VALUES (?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (project, subject, name) DO UPDATE SET value = excluded.value, "
        "expires_at = excluded.expires_at, written_at = excluded.written_at",
        [(project, profile, name, f.value, f.expires_at, f.written_at) for name, f in moving.items()],
    )
    return len(moving)


def _merge_first_interaction(
    conn: sqlite3.Connection, project: str, profile: str, alias: str, now_ms: int
) -> bool:
    """Keep the earlier of the two live first-interaction records for the profile (a record without its
    creation time counts as created at its hour; the profile's wins a tie). Returns whether the alias's
    replaced the profile's."""
    live = (
        f"SELECT {_FIRST_COLUMNS}, coalesce(created_at, hour) FROM first_interactions "
        "WHERE project = ? AND subject = ? AND expires_at > ?"
    )
    theirs = conn.execute(live, (project, alias, now_ms)).fetchone()
    if theirs is None:
        return False
    mine = conn.execute(live, (project, profile, now_ms)).fetchone()
    won = mine is None or theirs[-1] < mine[-1]
    if won:
        conn.execute(
            f"INSERT OR REPLACE INTO first_interactions (project, subject, {_FIRST_COLUMNS}) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (project, profile, *theirs[:-1]),
        )
    if mine is not None:
        # Either identifier having been seen in a bucket means the one caller was: keep the later of the two
        # "last seen" buckets of each kind, so that a bucket does not count the merged caller as new twice.
        seen = [max(a, b) for a, b in zip(theirs[6:9], mine[6:9], strict=True)]
        conn.execute(
            "UPDATE first_interactions SET seen_hour = ?, seen_day = ?, seen_week = ? "
            "WHERE project = ? AND subject = ?",
            (*seen, project, profile),
        )
    return won


class SQLiteLinks(LinkStore):
    """The linked-identifier methods of the Store interface on SQLite."""

    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def resolve_profile(self, caller: CallerRef, now_ms: int) -> str:
        def run(conn: sqlite3.Connection) -> str:
            key = (caller.project, caller.subject, now_ms, caller.subject)
            return str(conn.execute(f"SELECT {RESOLVED}", key).fetchone()[0])

        return await self._read(run)

    async def link_identifier(
        self, profile: CallerRef, link: Link, *, merge: bool, max_links: int, now_ms: int
    ) -> LinkResult:
        project, owner, subject = profile.project, profile.subject, link.subject

        def run(conn: sqlite3.Connection) -> LinkResult:
            # The refusals in the order the cluster's steps meet them: the profile's side, then the alias's.
            refuse_alias(conn, project, owner, now_ms)
            if subject == owner:
                return LinkResult(LinkStatus.SAME)
            live = conn.execute(f"SELECT {_LINK_COLUMNS} {_LIVE_ENTRIES}", (project, owner, now_ms, now_ms))
            entries = [_link(row) for row in live.fetchall()]
            existing = next((entry for entry in entries if entry.subject == subject), None)
            if existing is not None:
                # Renewed: the same id and linking time, the new expiry (a merge is never left half done
                # here: there is nothing to finish).
                renewed = dataclasses.replace(existing, expires_at=link.expires_at)
                _set_link(conn, project, owner, renewed)
                return LinkResult(LinkStatus.RENEWED, renewed)
            if len(entries) >= max_links:
                return LinkResult(LinkStatus.TOO_MANY)
            if profile_of(conn, project, subject, now_ms) is not None:
                return LinkResult(LinkStatus.ELSEWHERE)
            if conn.execute(
                f"SELECT 1 {_LIVE_ENTRIES} LIMIT 1", (project, subject, now_ms, now_ms)
            ).fetchone():
                return LinkResult(LinkStatus.HAS_LINKS)
            if not merge and _has_memory(conn, project, subject, now_ms):
                return LinkResult(LinkStatus.NEEDS_MERGE)
            fields = _merge_fields(conn, project, owner, _live_fields(conn, project, subject, now_ms), now_ms)
            first = _merge_first_interaction(conn, project, owner, subject, now_ms)
            # The alias's own memory goes (dead fields too): from now on its reads are the profile's.
            for table in ("fields", "first_interactions"):
                conn.execute(f"DELETE FROM {table} WHERE project = ? AND subject = ?", (project, subject))
            stored = dataclasses.replace(link, merging=False)
            _set_link(conn, project, owner, stored)
            return LinkResult(LinkStatus.LINKED, stored, fields, first)

        return await self._write(run)

    async def list_links(self, profile: CallerRef, now_ms: int) -> list[Link]:
        def run(conn: sqlite3.Connection) -> list[Link]:
            rows = conn.execute(
                f"SELECT {_LINK_COLUMNS} {_LIVE_ENTRIES} ORDER BY l.linked_at, l.link_id",
                (profile.project, profile.subject, now_ms, now_ms),
            ).fetchall()
            return [_link(row) for row in rows]

        return await self._read(run)

    async def unlink_identifier(
        self, profile: CallerRef, now_ms: int, *, subject: str | None = None, link_id: str | None = None
    ) -> Link | None:
        if subject is None and link_id is None:
            return None
        project, owner = profile.project, profile.subject

        def run(conn: sqlite3.Connection) -> Link | None:
            row = conn.execute(
                f"SELECT {_LINK_COLUMNS} {_LIVE_ENTRIES} AND (? IS NULL OR l.subject = ?) "
                "AND (? IS NULL OR l.link_id = ?)",
                (project, owner, now_ms, now_ms, subject, subject, link_id, link_id),
            ).fetchone()
            if row is None:
                return None
            removed = _link(row)
            conn.execute(
                "DELETE FROM aliases WHERE project = ? AND subject = ? AND profile = ?",
                (project, removed.subject, owner),
            )
            conn.execute(
                "DELETE FROM links WHERE project = ? AND profile = ? AND subject = ?",
                (project, owner, removed.subject),
            )
            return removed

        return await self._write(run)
