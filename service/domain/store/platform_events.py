"""Platform webhooks' replay refusal (SPEC section 15): the ids of the events a project's platform has sent,
each kept for a while so that the same event sent again is refused.

"Seen before?" and "remember it for this long" are one atomic step (:meth:`PlatformEventStore.first_sighting`):
of two deliveries of one event racing through two processes, exactly one is new. An id is kept until its
expiry (a time the caller computes from its clock); an id whose expiry is at or before ``now_ms`` counts as
never seen. Event ids are the platform's own (never a phone number); backends may hash them.
:class:`~caller_memory.service.domain.store.Store` inherits it; every backend implements it with identical
semantics (tests/storage/test_platform_events.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class PlatformEventStore(ABC):
    @abstractmethod
    async def first_sighting(
        self, project: str, platform: str, event_id: str, now_ms: int, keep_until_ms: int
    ) -> bool:
        """True when ``event_id`` of ``platform`` was not seen for ``project`` (or its sighting expired), and
        keep it until ``keep_until_ms``; False when it is still kept (its expiry unchanged). Atomic."""

    @abstractmethod
    async def hold_inactivity_end(
        self, project: str, conversation_id: str, until_ms: int, now_ms: int
    ) -> None:
        """Keep the conversation from an inactivity end until ``until_ms`` (a platform's call: its platform
        sends nothing between start and end, the proxy's turns aside); a later hold replaces it."""

    @abstractmethod
    async def inactivity_end_held_until(self, project: str, conversation_id: str, now_ms: int) -> int | None:
        """The time a hold keeps the conversation from an inactivity end, or None when none holds after
        ``now_ms``."""

    @abstractmethod
    async def hold_platform_end(
        self, project: str, conversation_id: str, document: bytes, due_ms: int
    ) -> bool:
        """Keep a platform's first end event of a conversation (an opaque document) until its analysis comes
        or ``due_ms`` passes; True when kept, False when one is held already (that one stays, due unchanged).
        Held ends live in the store, so that they survive a restart and any process may run them."""

    @abstractmethod
    async def take_platform_end(self, project: str, conversation_id: str) -> bytes | None:
        """Remove and answer the held end of the conversation (None when none): of two takers, one has it."""

    @abstractmethod
    async def due_platform_ends(self, now_ms: int, limit: int) -> list[tuple[str, str]]:
        """Up to ``limit`` (project, conversation id) whose held end is due at or before ``now_ms``, most
        overdue first (they stay until taken)."""
