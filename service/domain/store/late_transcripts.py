"""A platform's transcript for a conversation the service ended before the platform's end event came (SPEC
section 15): added once, after the end, to a transcript that has no messages.

Only a conversation ENDED by the service (``ended_by`` ``inactivity`` or ``superseded``), whose transcript
has not expired and holds no message, takes one; the messages keep their order, and the header's counts and
turn id follow. Not activity: the conversation's times, expiry and due time are unchanged. Once it has
messages, nothing more is added (the operation is idempotent). :class:`~caller_memory.service.domain.store.Store`
inherits it; every backend implements it with identical semantics (tests/storage/test_late_transcripts.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from .transcripts import ConversationKey, NewMessage

#: The ends after which a platform's transcript may still be added.
SERVICE_ENDS = ("inactivity", "superseded")


class LateTranscriptStore(ABC):
    @abstractmethod
    async def add_late_messages(
        self, key: ConversationKey, messages: Sequence[NewMessage], now_ms: int
    ) -> bool:
        """Add ``messages`` (in order) to the conversation when the service ended it and it has none; True
        when added, False when nothing was (any other state, or added before). Atomic."""
