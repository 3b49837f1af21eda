"""The archive part of the Store interface (SPEC sections 11 and 14): which archived objects are a caller's.

An archived conversation holds no caller pseudonym, so erasure could not find a caller's objects in the
archive itself: the store keeps, in the caller's slot, the keys of the caller's archived objects for as long as
they live. An object is listed *before* it is written (an erasure then always finds it), and never for a
caller erased since the end that archives it was made. :class:`~caller_memory.service.domain.store.core.Store` inherits it; every backend
implements it with identical semantics (tests/storage/test_archive_index.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .refs import CallerRef


class ArchiveStore(ABC):
    @abstractmethod
    async def list_archived(
        self, caller: CallerRef, object_key: str, expires_at: int, made_at: int, now_ms: int
    ) -> bool:
        """List ``object_key`` among the caller's archived objects until ``expires_at`` (listing it again
        keeps the later expiry). False, and nothing listed, when the caller was erased at or after
        ``made_at`` (their tombstone, as for ends): such a conversation must not be archived."""

    @abstractmethod
    async def archived_objects(self, caller: CallerRef, now_ms: int) -> list[str]:
        """The keys listed for the caller that have not expired, in key order."""

    @abstractmethod
    async def unlist_archived(self, caller: CallerRef, object_keys: Sequence[str]) -> int:
        """Remove these keys from the caller's listing; how many were listed."""
