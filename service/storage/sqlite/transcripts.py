"""SQLite backend, conversation memory (SPEC section 10): transcripts, lifecycle, checkpoints, summaries.

:class:`SQLiteTranscripts` is a mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`; each method is one ``IMMEDIATE``
transaction on the store's writer (or one read transaction on its reader), so every check and write of one
call is atomic with respect to every other. Tables (``schema.sql``): ``transcripts`` (one header per
conversation, markers included), ``transcript_messages`` (keyed by the header's row id) and
``transcript_volume`` (bytes appended per project and hour). :func:`erase_transcripts` and
:func:`sweep_transcripts` are the parts of an erasure and of a sweep that concern transcripts; the store's
``erase_caller`` and ``sweep`` run them inside their own transactions.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from ...domain.clock import HOUR_MS
from ...domain.store.transcripts import (
    AppendResult,
    AppendStatus,
    AppendWrite,
    ClaimResult,
    ClaimStatus,
    ConversationKey,
    EndClaim,
    Header,
    NewMessage,
    StoredMessage,
    TranscriptQuery,
    TranscriptStatus,
)
from .caller_index import SQLiteCallerIndex
from .transcript_rows import (
    _COLUMNS,
    _ENDED,
    _ENDING,
    _MARKERS,
    _OPEN,
    _TO_MARKER,
    _load,
    _Row,
    _update,
)

if TYPE_CHECKING:
    from ...domain.fields import StoredField
    from ...domain.store import CallerRef
    from .point_reads import PointReads

T = TypeVar("T")


def _erased_since(conn: sqlite3.Connection, project: str, subject: str, made_at: int, now_ms: int) -> bool:
    row = conn.execute(
        "SELECT erased_at FROM tombstones WHERE project = ? AND subject = ? AND expires_at > ?",
        (project, subject, now_ms),
    ).fetchone()
    return row is not None and row[0] >= made_at


def _add_volume(conn: sqlite3.Connection, project: str, at: int, amount: int, expires_at: int) -> None:
    conn.execute(
        "INSERT INTO transcript_volume (project, hour, bytes, expires_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (project, hour) DO UPDATE SET bytes = bytes + excluded.bytes, "
        "expires_at = max(expires_at, excluded.expires_at)",
        (project, at - at % HOUR_MS, amount, expires_at),
    )


def _remove(conn: sqlite3.Connection, row: _Row, status: str, now_ms: int) -> None:
    """Delete the transcript of ``row`` and leave a marker (``status``) in its place.

    Its bytes leave the project's volume at the hour it started: exact for every ``since`` up to that hour,
    and for a later ``since`` an over-count (the domain wants an upper bound, never less than what lives)."""
    conn.execute("DELETE FROM transcript_messages WHERE conv = ?", (row.id,))
    if row.size and row.expires_at > now_ms:
        _add_volume(conn, row.project, row.started_at, -row.size, row.expires_at)
    conn.execute(_TO_MARKER, (status, row.id))


def erase_transcripts(conn: sqlite3.Connection, caller: CallerRef, now_ms: int) -> int:
    """Replace every transcript of the caller by an ERASED marker (inside ``erase_caller``'s transaction);
    returns how many transcripts were still live (an expired one had nothing left to remove)."""
    rows = [
        _Row._make(row)
        for row in conn.execute(
            f"SELECT {_COLUMNS} FROM transcripts WHERE project = ? AND subject = ? AND status NOT IN (?, ?)",
            (caller.project, caller.subject, *_MARKERS),
        ).fetchall()
    ]
    live = 0
    for row in rows:
        if row.forget_at <= now_ms:  # forgotten, not yet swept: nothing to keep of it at all
            conn.execute("DELETE FROM transcript_messages WHERE conv = ?", (row.id,))
            conn.execute("DELETE FROM transcripts WHERE id = ?", (row.id,))
            continue
        live += row.expires_at > now_ms
        _remove(conn, row, TranscriptStatus.ERASED.value, now_ms)
    return live


def sweep_transcripts(conn: sqlite3.Connection, now_ms: int, batch: int) -> tuple[dict[str, int], bool]:
    """Remove expired transcripts' messages (at most ``batch`` messages), checkpoints and summaries, and at
    most ``batch`` forgotten headers, each found by its index on the time it expires (inside ``sweep``'s
    transaction). Returns counts (``transcripts`` emptied, ``conversation_headers`` forgotten) and whether
    more remains."""
    budget, emptied = batch, 0
    expired = conn.execute(
        "SELECT id FROM transcripts WHERE purge_at <= ? ORDER BY purge_at LIMIT ?", (now_ms, batch)
    ).fetchall()
    more = len(expired) == batch
    for (conv,) in expired:
        removed = conn.execute(
            "DELETE FROM transcript_messages WHERE (conv, turn_id, seq) IN "
            "(SELECT conv, turn_id, seq FROM transcript_messages WHERE conv = ? LIMIT ?)",
            (conv, budget),
        ).rowcount
        budget -= removed
        if (
            budget == 0
            and conn.execute("SELECT 1 FROM transcript_messages WHERE conv = ? LIMIT 1", (conv,)).fetchone()
        ):
            more = True  # this transcript is finished by the next round
            break
        # The due time goes too: an end can no longer claim an expired transcript (claim_end: MISSING).
        conn.execute(
            "UPDATE transcripts SET purge_at = NULL, due_at = NULL, checkpoint = NULL, summary = NULL, "
            "end_data = x'' WHERE id = ?",
            (conv,),
        )
        emptied += 1
        if budget == 0:
            more = more or emptied < len(expired)
            break
    # A header is forgotten once its transcript is gone (a marker's, or an expired one's emptied above).
    forgotten = conn.execute(
        "DELETE FROM transcripts WHERE id IN (SELECT id FROM transcripts "
        "WHERE forget_at <= ? AND purge_at IS NULL LIMIT ?)",
        (now_ms, batch),
    ).rowcount
    more = more or forgotten == batch
    return {"transcripts": emptied, "conversation_headers": forgotten}, more


class _Plan(NamedTuple):
    """What an accepted append writes."""

    new: list[NewMessage]
    turn_id: int
    keep_checkpoint: bool


def _check_messages(
    conn: sqlite3.Connection, row: _Row | None, write: AppendWrite, now_ms: int
) -> AppendResult | _Plan:
    """The message checks of an append, in the port's order (ids, turn order, limits)."""
    before = None if row is None else row.header(now_ms)
    known: dict[str, bytes] = {}
    ids = [m.message_id for m in write.messages if m.message_id is not None]
    if ids and row is not None:
        marks = ", ".join("?" * len(ids))
        known = {
            mid: bytes(body)
            for mid, body in conn.execute(
                f"SELECT message_id, body FROM transcript_messages "
                f"WHERE conv = ? AND message_id IS NOT NULL AND message_id IN ({marks})",
                (row.id, *ids),
            )
        }
    new: list[NewMessage] = []
    for message in write.messages:
        if message.message_id is not None:
            seen = known.get(message.message_id)
            if seen is not None:
                if seen != message.body:
                    return AppendResult(AppendStatus.ID_CONFLICT, before, detail=message.message_id)
                continue  # the same message again (a retry): already there
            known[message.message_id] = message.body
        new.append(message)
    turn = -1 if row is None else row.turn_id
    for message in new:
        if message.turn_id < turn:
            return AppendResult(AppendStatus.TURN_ORDER, before, detail=str(message.turn_id))
        turn = message.turn_id
    if new:
        if (0 if row is None else row.messages) + len(new) > write.max_messages:
            return AppendResult(AppendStatus.TOO_MANY_MESSAGES, before)
        if (0 if row is None else row.size) + sum(len(m.body) for m in new) > write.max_bytes:
            return AppendResult(AppendStatus.TOO_MANY_BYTES, before)
    keep = write.checkpoint is not None and (
        row is None or row.checkpoint is None or row.checkpoint_at <= write.made_at
    )
    return _Plan(new, turn, keep)


def _refusal(conn: sqlite3.Connection, row: _Row, write: AppendWrite, now_ms: int) -> AppendStatus | None:
    """Why an append to an existing conversation is refused before its messages are looked at, or None."""
    if row.marker:
        return AppendStatus.ERASED
    if write.create and (write.caller.project, write.caller.subject) != (row.project, row.subject):
        return AppendStatus.OTHER_CALLER
    # A conversation started after its caller's erasure takes nothing made before it (an outbox's retry).
    if _erased_since(conn, row.project, row.subject, write.made_at, now_ms):
        return AppendStatus.ERASED
    if row.expires_at <= now_ms:
        return AppendStatus.EXPIRED
    if row.status != _OPEN:
        return AppendStatus.ENDED
    return None


def _append(conn: sqlite3.Connection, write: AppendWrite, now_ms: int) -> AppendResult:
    key = write.key
    row = _load(conn, key, now_ms)
    if row is None:
        if not write.create:
            return AppendResult(AppendStatus.NOT_FOUND, None)
        if _erased_since(conn, write.caller.project, write.caller.subject, write.made_at, now_ms):
            return AppendResult(AppendStatus.ERASED, None)
    else:
        refused = _refusal(conn, row, write, now_ms)
        if refused is not None:
            return AppendResult(refused, row.header(now_ms))
    plan = _check_messages(conn, row, write, now_ms)
    if isinstance(plan, AppendResult):
        return plan
    if row is not None and not plan.new and not plan.keep_checkpoint:
        return AppendResult(AppendStatus.APPENDED, row.header(now_ms))  # a retry: nothing changes
    added_bytes = sum(len(m.body) for m in plan.new)
    added_tokens = sum(m.tokens for m in plan.new)
    if row is None:
        # A forgotten header not yet swept gives its place to the new conversation.
        stale = conn.execute(
            "SELECT id FROM transcripts WHERE project = ? AND conversation_id = ?",
            (key.project, key.conversation_id),
        ).fetchone()
        if stale is not None:
            conn.execute("DELETE FROM transcript_messages WHERE conv = ?", stale)
            conn.execute("DELETE FROM transcripts WHERE id = ?", stale)
        row = _Row._make(
            conn.execute(
                "INSERT INTO transcripts (project, conversation_id, status, subject, channel, agent, "
                "started_at, last_activity, turn_id, messages, bytes, tokens, checkpoint, checkpoint_at, "
                "summary, ended_by, end_reason, ended_at, expires_at, forget_at, lease_until, end_data, "
                "due_at, purge_at, region) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 0, 0, ?, ?, NULL, '', '', 0, ?, ?, 0, x'', ?, ?, ?) "
                f"RETURNING {_COLUMNS}",
                (
                    key.project, key.conversation_id, _OPEN, write.caller.subject, write.channel, write.agent,
                    now_ms, now_ms, plan.turn_id, write.checkpoint if plan.keep_checkpoint else None,
                    write.made_at if plan.keep_checkpoint else 0, write.expires_at, write.forget_at,
                    write.due_at, write.expires_at, write.region,
                ),
            ).fetchone()
        )  # fmt: skip
    conn.executemany(
        "INSERT INTO transcript_messages (conv, turn_id, seq, message_id, body) VALUES (?, ?, ?, ?, ?)",
        [(row.id, m.turn_id, row.messages + i, m.message_id, m.body) for i, m in enumerate(plan.new)],
    )
    if added_bytes:
        _add_volume(conn, key.project, now_ms, added_bytes, write.expires_at)
    checkpoint = (
        (write.checkpoint, write.made_at) if plan.keep_checkpoint else (row.checkpoint, row.checkpoint_at)
    )
    after = _update(
        conn,
        "UPDATE transcripts SET last_activity = ?, turn_id = ?, messages = messages + ?, bytes = bytes + ?, "
        "tokens = tokens + ?, checkpoint = ?, checkpoint_at = ?, expires_at = ?, forget_at = ?, due_at = ?, "
        "purge_at = ? WHERE id = ?",
        (
            now_ms, plan.turn_id, len(plan.new), added_bytes, added_tokens, *checkpoint, write.expires_at,
            write.forget_at, write.due_at, write.expires_at, row.id,
        ),
    )  # fmt: skip
    return AppendResult(AppendStatus.APPENDED, after.header(now_ms), added=len(plan.new))


def _header(
    conn: sqlite3.Connection, key: ConversationKey, now_ms: int
) -> tuple[Header | None, list[StoredMessage]]:
    row = _load(conn, key, now_ms)
    return (None if row is None else row.header(now_ms)), []


def _messages(conn: sqlite3.Connection, conv: int, query: TranscriptQuery) -> list[StoredMessage]:
    after = -1 if query.after_turn is None else query.after_turn  # turn ids are 0 or more
    columns = "seq, turn_id, body, message_id"
    if query.last is not None:
        rows = conn.execute(
            f"SELECT {columns} FROM transcript_messages WHERE conv = ? AND turn_id > ? "
            "ORDER BY turn_id DESC, seq DESC LIMIT ?",
            (conv, after, query.last),
        ).fetchall()
        rows.reverse()
        if query.limit is not None:
            rows = rows[: query.limit]
    else:
        rows = conn.execute(
            f"SELECT {columns} FROM transcript_messages WHERE conv = ? AND turn_id > ? "
            "ORDER BY turn_id, seq LIMIT ?",
            (conv, after, -1 if query.limit is None else query.limit),
        ).fetchall()
    return [StoredMessage(seq, turn, bytes(body), mid) for seq, turn, body, mid in rows]


def _claim(conn: sqlite3.Connection, claim: EndClaim, now_ms: int) -> ClaimResult:
    row = _load(conn, claim.key, now_ms)
    if row is None or row.marker:
        return ClaimResult(ClaimStatus.MISSING, None)
    if row.expires_at <= now_ms:
        # Nothing is left to end: out of the due index now, not only at the sweep, lest expired transcripts,
        # the most overdue, fill every due_conversations page until then.
        conn.execute("UPDATE transcripts SET due_at = NULL WHERE id = ? AND due_at IS NOT NULL", (row.id,))
        return ClaimResult(ClaimStatus.MISSING, None)
    if row.status == _ENDED or (row.status == _ENDING and row.lease_until > now_ms):
        return ClaimResult(ClaimStatus.ALREADY, row.header(now_ms))
    if row.status == _OPEN and claim.idle_since is not None and row.last_activity > claim.idle_since:
        return ClaimResult(ClaimStatus.NOT_DUE, row.header(now_ms))
    # OPEN, or ENDING with a lapsed lease (a crashed end, taken over: the first claim's ended_at stays). While
    # ENDING it is due again when the lease lapses.
    after = _update(
        conn,
        "UPDATE transcripts SET status = ?, ended_by = ?, end_reason = ?, end_data = ?, lease_until = ?, "
        "ended_at = CASE WHEN status = ? THEN ended_at ELSE ? END, due_at = ? WHERE id = ?",
        (
            _ENDING, claim.ended_by, claim.end_reason, claim.end_data, claim.lease_until, _ENDING, now_ms,
            claim.lease_until, row.id,
        ),
    )  # fmt: skip
    return ClaimResult(ClaimStatus.CLAIMED, after.header(now_ms))


class SQLiteTranscripts(SQLiteCallerIndex):
    """The conversation-memory methods of the Store interface on SQLite."""

    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        _points: PointReads

        @staticmethod
        def _fields(
            conn: sqlite3.Connection, project: str, subject: str, now_ms: int
        ) -> dict[str, StoredField]: ...

    async def append_messages(self, write: AppendWrite, now_ms: int) -> AppendResult:
        return await self._write(lambda conn: _append(conn, write, now_ms))

    async def read_conversation(
        self, key: ConversationKey, now_ms: int, query: TranscriptQuery | None = None
    ) -> tuple[Header | None, list[StoredMessage]]:
        if query is None:  # the header alone: one statement, a point read
            return await self._points.read(lambda conn: _header(conn, key, now_ms), self._read)

        def run(conn: sqlite3.Connection) -> tuple[Header | None, list[StoredMessage]]:
            # One read transaction: the header and the messages are of the same moment (WAL snapshot).
            conn.execute("BEGIN")
            try:
                row = _load(conn, key, now_ms)
                if row is None:
                    return None, []
                live = query is not None and not row.marker and row.expires_at > now_ms
                return row.header(now_ms), _messages(conn, row.id, query) if live and query else []
            finally:
                conn.execute("COMMIT")

        return await self._read(run)

    async def read_context(
        self, key: ConversationKey, subject: str | None, now_ms: int, query: TranscriptQuery | None = None
    ) -> tuple[Header | None, list[StoredMessage], dict[str, StoredField] | None]:
        def run(
            conn: sqlite3.Connection,
        ) -> tuple[Header | None, list[StoredMessage], dict[str, StoredField] | None]:
            # One read transaction: header, messages and the caller's memory of one moment.
            conn.execute("BEGIN")
            try:
                row = _load(conn, key, now_ms)
                if row is None:
                    return None, [], None
                header = row.header(now_ms)
                live = not row.marker and row.expires_at > now_ms
                messages = _messages(conn, row.id, query) if live and query else []
                fields = None
                if subject and live and header.subject == subject:
                    fields = self._fields(conn, key.project, subject, now_ms)
                return header, messages, fields
            finally:
                conn.execute("COMMIT")

        return await self._read(run)

    async def put_summary(self, key: ConversationKey, summary: bytes, now_ms: int) -> Header | None:
        def run(conn: sqlite3.Connection) -> Header | None:
            row = _load(conn, key, now_ms)
            if row is None or row.marker or row.expires_at <= now_ms:
                return None
            return _update(conn, "UPDATE transcripts SET summary = ? WHERE id = ?", (summary, row.id)).header(
                now_ms
            )

        return await self._write(run)

    async def claim_end(self, claim: EndClaim, now_ms: int) -> ClaimResult:
        return await self._write(lambda conn: _claim(conn, claim, now_ms))

    async def finish_end(self, key: ConversationKey, now_ms: int) -> Header | None:
        def run(conn: sqlite3.Connection) -> Header | None:
            row = _load(conn, key, now_ms)
            if row is None or row.marker:
                return None
            if row.status == _ENDING:
                row = _update(
                    conn, "UPDATE transcripts SET status = ?, due_at = NULL WHERE id = ?", (_ENDED, row.id)
                )
            return row.header(now_ms)

        return await self._write(run)

    async def due_conversations(self, now_ms: int, limit: int) -> list[ConversationKey]:
        def run(conn: sqlite3.Connection) -> list[ConversationKey]:
            rows = conn.execute(
                "SELECT project, conversation_id FROM transcripts WHERE due_at <= ? "
                "ORDER BY due_at, id LIMIT ?",
                (now_ms, limit),
            ).fetchall()
            return [ConversationKey(project, conversation_id) for project, conversation_id in rows]

        return await self._read(run)

    async def reschedule(self, key: ConversationKey, due_at: int) -> None:
        await self._write(
            lambda conn: conn.execute(
                "UPDATE transcripts SET due_at = ? WHERE project = ? AND conversation_id = ? "
                "AND status IN (?, ?)",
                (due_at, key.project, key.conversation_id, _OPEN, _ENDING),
            )
        )

    async def delete_conversation(self, key: ConversationKey, now_ms: int) -> Header | None:
        def run(conn: sqlite3.Connection) -> Header | None:
            row = _load(conn, key, now_ms)
            if row is None or row.marker:
                return None
            _remove(conn, row, TranscriptStatus.DELETED.value, now_ms)
            return row.header(now_ms)

        return await self._write(run)

    async def transcript_bytes(self, project: str, now_ms: int, since: int) -> int:
        def run(conn: sqlite3.Connection) -> int:
            # Every bucket that ends after ``since`` (one that straddles it counts whole).
            row = conn.execute(
                "SELECT coalesce(sum(bytes), 0) FROM transcript_volume "
                "WHERE project = ? AND hour > ? AND expires_at > ?",
                (project, since - HOUR_MS, now_ms),
            ).fetchone()
            return max(0, int(row[0]))

        return await self._read(run)
