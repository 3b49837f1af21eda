"""What the end of a conversation tells those who listen to it (the archive, the webhooks), and what those
listeners are: one protocol per event, passed to the use cases that make the event at their construction
(service/app.py builds the listeners first), never set afterwards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..store.transcripts import ConversationKey, Header

if TYPE_CHECKING:
    from ..projects import Project
    from ..store.webhooks import Delivery


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
    #: The platform whose end event this is (``vapi``, ``retell``...; SPEC 15), None for the API's ends.
    source: str | None = None


class EndListener(Protocol):
    """Told of every end by its processing, before the end's webhook events are made (the archive writes
    the conversation). One that fails fails the end, which is then redone whole."""

    async def conversation_ended(self, project: Project, event: EndedEvent) -> None: ...


class EndDeliveries(Protocol):
    """The webhook side of an end: the deliveries it makes (queued with the end's analytics, in one store
    call), then told they are queued (the delivery worker looks at once)."""

    async def ended_deliveries(self, project: Project, event: EndedEvent) -> list[Delivery]: ...

    def queued(self, deliveries: Sequence[Delivery]) -> None: ...


class DeletionListener(Protocol):
    """Told of a transcript an admin deleted (the archive deletes its copy)."""

    async def conversation_deleted(self, project: Project, header: Header) -> None: ...


class StartListener(Protocol):
    """Told of a conversation an append started (no start came first: the lifecycle supersedes the caller's
    open ones, as a start does)."""

    async def conversation_started(self, project: Project, header: Header) -> None: ...
