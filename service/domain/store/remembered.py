"""State keys an agent's model remembered during a call through MCP's ``remember`` tool (SPEC section 17):
kept per conversation, each name with its encoded value and the time it was remembered, until the
conversation's end persists them (any end: the SDK's, a platform's, the service's).

They are kept apart from the conversation's state checkpoint on purpose: the SDK sends its whole
``conv.state`` as the checkpoint with every batch, replacing the one before, so a key the model remembered
would be lost at the agent's next batch. A later ``remember`` of a name replaces its value. Each
conversation's names are kept with the caller's pseudonym, so that an erasure of the caller removes them. A
name whose ``keep_until_ms`` is at or before ``now_ms`` is dead (a backend may remove it any time after).
:class:`~caller_memory.service.domain.store.Store` inherits it; every backend implements it with identical
semantics (tests/storage/test_remembered.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .refs import CallerRef
from .transcripts import ConversationKey


@dataclass(frozen=True, slots=True)
class RememberedValue:
    #: The value, JSON-encoded.
    value: bytes
    #: When it was remembered (epoch ms): an end writes the field as made then.
    made_at: int


class RememberedStore(ABC):
    @abstractmethod
    async def remember_state(
        self,
        key: ConversationKey,
        subject: str,
        name: str,
        value: RememberedValue,
        *,
        keep_until_ms: int,
        now_ms: int,
    ) -> None:
        """Keep ``value`` as the conversation's remembered ``name`` (replacing the one kept) until
        ``keep_until_ms``; ``subject``: the conversation's caller, whose erasure removes it."""

    @abstractmethod
    async def remembered_state(self, key: ConversationKey, now_ms: int) -> dict[str, RememberedValue]:
        """The conversation's live remembered names and values (empty when none)."""

    @abstractmethod
    async def forget_remembered(self, key: ConversationKey) -> None:
        """Remove what the conversation remembered (its transcript was deleted)."""

    @abstractmethod
    async def drop_remembered(self, caller: CallerRef) -> int:
        """Remove what the calls of ``caller`` remembered (an erasure); how many conversations had some."""
