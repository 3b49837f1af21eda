"""SQLite backend: a caller's conversations as a start and a listing need them (SPEC sections 10 and 14).

:class:`SQLiteCallerIndex` is the base of :class:`~caller_memory.service.storage.sqlite.transcripts.SQLiteTranscripts`. A start reads what
is open on its caller's channel and the newest resumable conversations there through partial indexes
(``schema.sql``), so that it costs what it finds, not what the caller ever had (reading all of a
caller's headers would cost in proportion to them); the listing pages by start time through ``transcripts_by_caller``. The rows
are the headers themselves: nothing to keep in step with them on any transition.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...domain.store.transcripts import RESUMABLE_KEPT, CallerPage, Header, PagePosition
from .transcript_rows import _COLUMNS, _MARKERS, _Row

if TYPE_CHECKING:
    from ...domain.store import CallerRef

T = TypeVar("T")

#: The WHERE of the partial indexes, word for word (SQLite uses a partial index only for a query that says it).
_OPEN_WHERE = "status IN ('open', 'ending')"
_RESUMABLE_WHERE = "status = 'ended' AND (ended_by IN ('inactivity', 'superseded') OR end_reason = 'dropped')"


class SQLiteCallerIndex:
    """The caller's conversations on SQLite: all of them, a page of them, and those a start looks at."""

    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def caller_conversations(self, caller: CallerRef, now_ms: int) -> list[Header]:
        def run(conn: sqlite3.Connection) -> list[Header]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM transcripts WHERE project = ? AND subject = ? AND forget_at > ? "
                "AND status NOT IN (?, ?) ORDER BY started_at DESC, conversation_id DESC",
                (caller.project, caller.subject, now_ms, *_MARKERS),
            ).fetchall()
            return [_Row._make(row).header(now_ms) for row in rows]

        return await self._read(run)

    async def caller_conversations_page(
        self, caller: CallerRef, now_ms: int, limit: int, after: PagePosition | None = None
    ) -> CallerPage:
        def run(conn: sqlite3.Connection) -> CallerPage:
            where, params = "", tuple[object, ...]()
            if after is not None:
                where = "AND (started_at < ? OR (started_at = ? AND conversation_id < ?)) "
                params = (after.started_at, after.started_at, after.conversation_id)
            rows = [
                _Row._make(row)
                for row in conn.execute(
                    f"SELECT {_COLUMNS} FROM transcripts WHERE project = ? AND subject = ? AND forget_at > ? "
                    f"AND status NOT IN (?, ?) {where}ORDER BY started_at DESC, conversation_id DESC LIMIT ?",
                    (caller.project, caller.subject, now_ms, *_MARKERS, *params, limit + 1),
                ).fetchall()
            ]
            page = rows[:limit]
            last = page[-1] if page and len(rows) > limit else None
            return CallerPage(
                [row.header(now_ms) for row in page],
                None if last is None else PagePosition(last.started_at, last.conversation_id),
            )

        return await self._read(run)

    async def channel_conversations(
        self, caller: CallerRef, channel: str | None, now_ms: int, resumable_since: int | None = None
    ) -> list[Header]:
        def run(conn: sqlite3.Connection) -> list[Header]:
            on = "" if channel is None else "AND channel = ? "
            where = (
                (caller.project, caller.subject)
                if channel is None
                else (caller.project, caller.subject, channel)
            )
            conn.execute("BEGIN")  # one snapshot for both reads
            try:
                rows = conn.execute(
                    f"SELECT {_COLUMNS} FROM transcripts WHERE project = ? AND subject = ? {on}AND {_OPEN_WHERE}",
                    where,
                ).fetchall()
                if resumable_since is not None:
                    rows += conn.execute(
                        f"SELECT {_COLUMNS} FROM transcripts WHERE project = ? AND subject = ? {on}"
                        f"AND {_RESUMABLE_WHERE} AND last_activity >= ? "
                        "ORDER BY last_activity DESC LIMIT ?",
                        (*where, resumable_since, RESUMABLE_KEPT),
                    ).fetchall()
            finally:
                conn.execute("COMMIT")
            found = [_Row._make(row) for row in rows]
            # An expired transcript (not swept yet) is nothing a start can end or resume.
            return [row.header(now_ms) for row in found if row.expires_at > now_ms and row.forget_at > now_ms]

        return await self._read(run)
