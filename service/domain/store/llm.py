"""The memory proxy's part of the Store interface (SPEC section 16): a project's upstream model.

A project has at most one upstream: a document the domain encodes (service/proxy/upstream.py; its API key
is sealed before it gets here, so the store never sees a key in the clear) and the store keeps as opaque
bytes. :class:`~caller_memory.service.domain.store.Store` inherits it; every backend implements it with
identical semantics (tests/storage/test_llm.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class LlmStore(ABC):
    @abstractmethod
    async def put_llm(self, project: str, document: bytes) -> bool:
        """Keep ``document`` as the project's upstream, replacing any; True when there was none before."""

    @abstractmethod
    async def get_llm(self, project: str) -> bytes | None:
        """The project's upstream document, or None when it has none."""

    @abstractmethod
    async def delete_llm(self, project: str) -> bool:
        """Remove the project's upstream; whether there was one."""
