"""Platform connections' part of the Store interface (SPEC section 15): how a project meets a voice platform.

A project has at most one connection per platform (``agora``, ``vapi``, ``retell``, ``elevenlabs``,
``telnyx``): a document the domain encodes (service/domain/platforms/connections.py; its secret is sealed
before it gets here, so the store never sees a secret in the clear) and the store keeps as opaque bytes.
Erasing a caller never touches connections. :class:`~caller_memory.service.domain.store.Store` inherits it;
every backend implements it with identical semantics (tests/storage/test_platform_connections.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class PlatformStore(ABC):
    @abstractmethod
    async def put_platform_connection(self, project: str, platform: str, document: bytes) -> bool:
        """Keep ``document`` as the project's connection to ``platform``, replacing any; True when there
        was none before."""

    @abstractmethod
    async def get_platform_connection(self, project: str, platform: str) -> bytes | None:
        """The project's connection document for ``platform``, or None when it has none."""

    @abstractmethod
    async def delete_platform_connection(self, project: str, platform: str) -> bool:
        """Remove the project's connection to ``platform``; whether there was one."""
