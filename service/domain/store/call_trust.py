"""A conversation's call trust (SPEC section 15, "Trust"): the attestation of its start and whether a step-up
check passed since, kept with the conversation (until its transcript expires) so that what reads memory for
the call later (the memory proxy, MCP, a platform's end) uses the trust of the call, not of its request.

Trust only rises: a start's attestation is kept once (a later keep never replaces it), and step-up, once
passed, stays. A record whose ``expires_at`` is at or before ``now_ms`` is dead.
:class:`~caller_memory.service.domain.store.Store` inherits it; every backend implements it with identical
semantics (tests/storage/test_call_trust.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class CallTrustStore(ABC):
    @abstractmethod
    async def keep_call_trust(
        self,
        project: str,
        conversation_id: str,
        attestation: str,
        *,
        step_up: bool,
        expires_at_ms: int,
        now_ms: int,
    ) -> None:
        """Keep the trust of the conversation's start: its attestation unless one is kept already, its
        step-up if passed (never cleared); the record lives until ``expires_at_ms`` (the later one). One kept that expired by ``now_ms``
        is replaced whole."""

    @abstractmethod
    async def raise_step_up(
        self, project: str, conversation_id: str, expires_at_ms: int, now_ms: int
    ) -> None:
        """Mark the conversation's step-up as passed (an attestation kept stays; none kept: ``unknown``)."""

    @abstractmethod
    async def call_trust(self, project: str, conversation_id: str, now_ms: int) -> tuple[str, bool] | None:
        """(attestation, step_up) kept for the conversation, or None when none is (or it expired)."""
