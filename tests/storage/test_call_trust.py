"""A conversation's call trust (service/domain/store/call_trust.py) on every backend: the start's attestation
kept once (a later keep never replaces it), step-up raised and never cleared, the record gone at its expiry
(and replaced whole by a keep after it), conversations and projects apart."""

from __future__ import annotations

import uuid

from caller_memory.service.domain.store import Store

NOW = 1_800_000_000_000
HOUR = 3_600_000


async def test_trust_is_kept_once_and_only_rises(store: Store) -> None:
    project, other = f"shop-{uuid.uuid4().hex[:8]}", f"deli-{uuid.uuid4().hex[:8]}"
    assert await store.call_trust(project, "call-1", NOW) is None
    await store.keep_call_trust(project, "call-1", "A", step_up=False, expires_at_ms=NOW + HOUR, now_ms=NOW)
    assert await store.call_trust(project, "call-1", NOW) == ("A", False)
    # A second keep (a retried start) never lowers the attestation.
    await store.keep_call_trust(project, "call-1", "C", step_up=False, expires_at_ms=NOW + HOUR, now_ms=NOW)
    assert await store.call_trust(project, "call-1", NOW) == ("A", False)
    await store.raise_step_up(project, "call-1", expires_at_ms=NOW + HOUR, now_ms=NOW)
    assert await store.call_trust(project, "call-1", NOW) == ("A", True)
    await store.keep_call_trust(project, "call-1", "A", step_up=False, expires_at_ms=NOW + HOUR, now_ms=NOW)
    assert await store.call_trust(project, "call-1", NOW) == ("A", True)
    # A step-up without a kept start: attestation unknown.
    await store.raise_step_up(project, "call-2", expires_at_ms=NOW + HOUR, now_ms=NOW)
    assert await store.call_trust(project, "call-2", NOW) == ("unknown", True)
    assert await store.call_trust(other, "call-1", NOW) is None


async def test_trust_expires_with_its_record(store: Store) -> None:
    project = f"shop-{uuid.uuid4().hex[:8]}"
    await store.keep_call_trust(project, "call-1", "B", step_up=True, expires_at_ms=NOW + HOUR, now_ms=NOW)
    # A shorter expiry does not shorten it.
    await store.keep_call_trust(project, "call-1", "B", step_up=False, expires_at_ms=NOW + 5, now_ms=NOW)
    assert await store.call_trust(project, "call-1", NOW + HOUR - 1) == ("B", True)
    assert await store.call_trust(project, "call-1", NOW + HOUR) is None
    # Once expired, a keep starts afresh.
    later = NOW + HOUR
    await store.keep_call_trust(
        project, "call-1", "C", step_up=False, expires_at_ms=later + HOUR, now_ms=later
    )
    assert await store.call_trust(project, "call-1", later) == ("C", False)
