"""The last streamed answer of a call through the memory proxy (SPEC section 16, "The transcript"): an
answer is recorded from the next request, which knows what was spoken of it; the call's last answer has no
next request, so the proxy keeps it here and the call's end records it.

One answer is kept per conversation (a later one replaces it), as an opaque document (the proxy's: its
message already redacted and encoded), with the caller's pseudonym, so that an erasure of the caller removes
the answers of their calls. A kept answer whose ``keep_until_ms`` is at or before ``now_ms`` is dead (a
backend may remove it any time after). Taking it removes it: of two takers, one has it.
:class:`~caller_memory.service.domain.store.Store` inherits it; every backend implements it with identical
semantics (tests/storage/test_pending_answers.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .refs import CallerRef
from .transcripts import ConversationKey


class PendingAnswerStore(ABC):
    @abstractmethod
    async def keep_pending_answer(
        self, key: ConversationKey, subject: str, document: bytes, keep_until_ms: int, now_ms: int
    ) -> None:
        """Keep ``document`` as the conversation's last answer (replacing the one kept), until
        ``keep_until_ms``; ``subject``: the conversation's caller, whose erasure removes it."""

    @abstractmethod
    async def take_pending_answer(self, key: ConversationKey, now_ms: int) -> bytes | None:
        """Remove and answer the conversation's kept answer (None when none is, or it is dead)."""

    @abstractmethod
    async def drop_pending_answers(self, caller: CallerRef) -> int:
        """Remove the answers kept for the calls of ``caller`` (an erasure); how many were kept."""
