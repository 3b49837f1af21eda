"""Redis backend, the memory proxy's last answer of a call (service/domain/store/pending_answers.py): one
string per conversation (``"<keep_until>|<document>"``, expiring at ``keep_until``), and per caller a set of
the conversations with one (expiring with the latest), which an erasure walks. Each key is one slot; the set
may name an answer already taken or expired (harmless: deleting it again deletes nothing)."""

from __future__ import annotations

from ...domain.store.pending_answers import PendingAnswerStore
from ...domain.store.refs import CallerRef
from ...domain.store.transcripts import ConversationKey
from . import keys
from .caller_lists import drop_listed, list_conversation
from .transport import Call, RedisTransport


def pending_answer_key(project: str, conversation_id: str) -> str:
    return f"{keys.project_key(project)}:pending-answer:{conversation_id}"


def pending_callers_key(project: str, subject: str) -> str:
    return f"{keys.project_key(project)}:pending-answers-of:{subject}"


class RedisPendingAnswers(PendingAnswerStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def keep_pending_answer(
        self, key: ConversationKey, subject: str, document: bytes, keep_until_ms: int, now_ms: int
    ) -> None:
        if keep_until_ms <= now_ms:
            return
        listed = pending_callers_key(key.project, subject)
        async with Call("keep_pending_answer", self._timeout):
            # The caller's set first: an answer is never kept where an erasure would not find it.
            await list_conversation(self._transport, listed, key.conversation_id, keep_until_ms)
            await self._transport.run(
                (
                    "SET",
                    pending_answer_key(key.project, key.conversation_id),
                    b"%d|%s" % (keep_until_ms, document),
                    "PXAT",
                    keep_until_ms,
                )
            )

    async def take_pending_answer(self, key: ConversationKey, now_ms: int) -> bytes | None:
        async with Call("take_pending_answer", self._timeout):
            (found,) = await self._transport.run(
                ("GETDEL", pending_answer_key(key.project, key.conversation_id))
            )
        if not found:
            return None
        until, _, document = bytes(found).partition(b"|")
        if int(until) <= now_ms:
            return None
        return document

    async def drop_pending_answers(self, caller: CallerRef) -> int:
        listed = pending_callers_key(caller.project, caller.subject)
        async with Call("drop_pending_answers", self._timeout):
            return await drop_listed(
                self._transport,
                listed,
                lambda conversation_id: pending_answer_key(caller.project, conversation_id),
            )
