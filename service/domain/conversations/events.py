"""What the end of a conversation tells those who listen to it (the archive, the webhooks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..store.transcripts import ConversationKey


@dataclass(frozen=True, slots=True)
class EndedEvent:
    """What an end's processing tells the webhooks (no phone number, no pseudonym but ``subject``, which
    only keys the queue entry for erasure)."""

    key: ConversationKey
    subject: str
    channel: str | None
    ended_by: str
    end_reason: str | None
    outcome: dict[str, Any]
    persisted: list[str]
    repeat_caller: dict[str, Any]
    #: When the client or the service made the end (the tombstone check of the queue).
    made_at: int
    #: The conversation's start and its transcript's expiry (0 when there is no transcript).
    started_at: int = 0
    expires_at: int = 0
    late: bool = False
