"""SQLite backend, conversation memory: a conversation's header row as the transcript methods
(:mod:`caller_memory.service.storage.sqlite.transcripts`) and a caller's listings (:mod:`caller_memory.service.storage.sqlite.caller_index`) read and write it."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import NamedTuple

from ...domain.store.transcripts import ConversationKey, Header, TranscriptStatus

_OPEN, _ENDING, _ENDED = (
    TranscriptStatus.OPEN.value,
    TranscriptStatus.ENDING.value,
    TranscriptStatus.ENDED.value,
)
_MARKERS = (TranscriptStatus.ERASED.value, TranscriptStatus.DELETED.value)

#: The columns of a header row, in the order of :class:`_Row`.
_COLUMNS = (
    "id, project, conversation_id, status, subject, channel, agent, started_at, last_activity, turn_id, "
    "messages, bytes, tokens, checkpoint, checkpoint_at, summary, ended_by, end_reason, ended_at, "
    "expires_at, forget_at, lease_until, end_data, region"
)

#: What turns a header into a marker: nothing about the caller or the conversation stays but its expiries.
_TO_MARKER = (
    "UPDATE transcripts SET status = ?, subject = '', channel = '', agent = '', started_at = 0, "
    "last_activity = 0, turn_id = -1, messages = 0, bytes = 0, tokens = 0, checkpoint = NULL, "
    "checkpoint_at = 0, summary = NULL, ended_by = '', end_reason = '', ended_at = 0, lease_until = 0, "
    "end_data = x'', due_at = NULL, purge_at = NULL WHERE id = ?"
)


class _Row(NamedTuple):
    id: int
    project: str
    conversation_id: str
    status: str
    subject: str
    channel: str
    agent: str
    started_at: int
    last_activity: int
    turn_id: int
    messages: int
    size: int  # the bytes column
    tokens: int
    checkpoint: bytes | None
    checkpoint_at: int
    summary: bytes | None
    ended_by: str
    end_reason: str
    ended_at: int
    expires_at: int
    forget_at: int
    lease_until: int
    end_data: bytes
    region: str

    @property
    def marker(self) -> bool:
        return self.status in _MARKERS

    def header(self, now_ms: int) -> Header:
        """The header as the port shows it: a marker, or a header whose transcript expired, keeps only its
        status and expiries (what is still in the row serves the caller's list and erasure alone)."""
        key = ConversationKey(self.project, self.conversation_id)
        status = TranscriptStatus(self.status)
        if self.marker or self.expires_at <= now_ms:
            return Header(
                key, status, "", "", "", 0, 0, -1, 0, 0, 0, None, 0, None, "", "", 0,
                self.expires_at, self.forget_at,
            )  # fmt: skip
        return Header(
            key=key,
            status=status,
            subject=self.subject,
            channel=self.channel,
            agent=self.agent,
            started_at=self.started_at,
            last_activity=self.last_activity,
            turn_id=self.turn_id,
            messages=self.messages,
            bytes=self.size,
            tokens=self.tokens,
            checkpoint=None if self.checkpoint is None else bytes(self.checkpoint),
            checkpoint_at=self.checkpoint_at,
            summary=None if self.summary is None else bytes(self.summary),
            ended_by=self.ended_by,
            end_reason=self.end_reason,
            ended_at=self.ended_at,
            expires_at=self.expires_at,
            forget_at=self.forget_at,
            lease_until=self.lease_until,
            end_data=bytes(self.end_data),
            region=self.region,
        )


def _load(conn: sqlite3.Connection, key: ConversationKey, now_ms: int) -> _Row | None:
    """The conversation's header row, or None when there is none or it is forgotten (``forget_at`` passed,
    whether or not a sweep removed it yet)."""
    row = conn.execute(
        f"SELECT {_COLUMNS} FROM transcripts WHERE project = ? AND conversation_id = ?",
        (key.project, key.conversation_id),
    ).fetchone()
    if row is None:
        return None
    found = _Row._make(row)
    return None if found.forget_at <= now_ms else found


def _update(conn: sqlite3.Connection, sql: str, params: Sequence[object]) -> _Row:
    """Run an ``UPDATE transcripts ... WHERE id = ?`` and return the row after it."""
    return _Row._make(conn.execute(f"{sql} RETURNING {_COLUMNS}", params).fetchone())
