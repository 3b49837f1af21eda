"""The memory proxy's last answer of a call, recorded at the call's end (SPEC section 16, "The transcript").

The proxy records a request's messages from the request itself: an assistant's answer is recorded from the
next request, which holds what was spoken of it (cut short by an interruption, with Agora's ``original``).
The call's last answer has no next request, so the proxy keeps every streamed answer here (one per
conversation, the latest replacing the one before), redacted and encoded as an append's message is, and the
call's end records it (:meth:`PendingAnswers.flush`): an explicit end (the SDK's, a platform's) before it
ends the transcript, a service end (inactivity, supersession) before it claims it.

An answer is recorded only if no later message took its place: it is the ``n``-th assistant message of its
conversation (``n``: the assistant messages of the request it answered, plus one), and it is dropped when the
transcript holds ``n`` already (a later request recorded what was spoken of it, or a platform's end event
brought its own transcript). Kept at most :data:`KEEP_MS` (the longest ``end_grace`` a platform connection
may have, and an hour), and dropped with the caller's other data by an erasure (:meth:`PendingAnswers.erase_caller`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson

from ..clock import Clock
from ..errors import CallerMemoryError
from ..limits import RECALL_WINDOW_MS
from ..memory import ErasureCounts
from ..projects import Project
from ..store import CallerRef, Store
from ..store.transcripts import (
    AppendStatus,
    AppendWrite,
    ConversationKey,
    NewMessage,
    TranscriptQuery,
    TranscriptStatus,
)
from .messages import MAX_MESSAGES, MAX_TRANSCRIPT_BYTES, role_of

log = logging.getLogger("caller_memory.conversations")

#: How long an answer is kept for its call's end: the longest ``end_grace`` (P2D), and an hour.
KEEP_MS = (48 + 1) * 3_600_000


@dataclass(frozen=True, slots=True)
class PendingAnswer:
    """A streamed answer waiting for its call's end: its message (encoded, redacted), the assistant
    messages of the request it answered, and when it was streamed."""

    message: NewMessage
    assistants_before: int
    at: int

    def encode(self) -> bytes:
        m = self.message
        return orjson.dumps(
            {
                "turn_id": m.turn_id,
                "body": m.body.decode(),
                "message_id": m.message_id,
                "tokens": m.tokens,
                "assistants_before": self.assistants_before,
                "at": self.at,
            }
        )

    @classmethod
    def decode(cls, document: bytes) -> PendingAnswer:
        d = orjson.loads(document)
        message = NewMessage(int(d["turn_id"]), d["body"].encode(), d["message_id"], int(d["tokens"]))
        return cls(message, int(d["assistants_before"]), int(d["at"]))


class PendingAnswers:
    """Keeps the proxy's last answer of each call and records it at the call's end; an erasure listener."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    async def keep(self, key: ConversationKey, subject: str, answer: PendingAnswer) -> None:
        """Keep ``answer`` as the conversation's last (``subject``: its caller, whose erasure drops it)."""
        await self._store.keep_pending_answer(key, subject, answer.encode(), answer.at + KEEP_MS, answer.at)

    async def flush(self, project: Project, key: ConversationKey) -> bool:
        """Record the conversation's kept answer, if it has one and nothing took its place; whether it was
        recorded. Never raises for the store (an end is not failed for it: the answer is logged as lost)."""
        now = self._clock.now_ms()
        try:
            document = await self._store.take_pending_answer(key, now)
            if document is None:
                return False
            answer = PendingAnswer.decode(document)
            header, stored = await self._store.read_conversation(key, now, TranscriptQuery())
            if header is None or header.status is not TranscriptStatus.OPEN:
                return False
            assistants = sum(1 for m in stored if role_of(m.body) == "assistant")
            if assistants > answer.assistants_before:
                return False  # recorded since, from a later request or the platform's own transcript
            result = await self._store.append_messages(self._write(project, key, answer), answer.at)
        except CallerMemoryError as exc:
            log.warning("the last answer of a call was not recorded: %s", exc.detail)
            return False
        except Exception:  # a call's end is never failed for its last answer
            log.exception("the last answer of a call was not recorded")
            return False
        return result.status is AppendStatus.APPENDED and result.added > 0

    @staticmethod
    def _write(project: Project, key: ConversationKey, answer: PendingAnswer) -> AppendWrite:
        """The append of the answer, as made when it was streamed (its activity then, not now: an inactivity
        end that records it stays due)."""
        cc = project.conversation
        expires_at = answer.at + cc.transcript_retention_ms
        return AppendWrite(
            key=key,
            caller=CallerRef(project.project_id, ""),
            channel="",
            agent="",
            create=False,
            messages=[answer.message],
            checkpoint=None,
            made_at=answer.at,
            expires_at=expires_at,
            forget_at=expires_at + min(RECALL_WINDOW_MS, project.retention_ms),
            due_at=answer.at + cc.end_after_inactivity_ms,
            max_messages=MAX_MESSAGES,
            max_bytes=MAX_TRANSCRIPT_BYTES,
        )

    async def erase_caller(self, caller: CallerRef) -> ErasureCounts:
        """Drop the answers kept for the erased caller's calls."""
        await self._store.drop_pending_answers(caller)
        return ErasureCounts()
