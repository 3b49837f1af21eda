"""Platform events (service/domain/store/platform_events.py) on every backend: an event id is new once until
its expiry (concurrent sightings: exactly one new), projects and platforms apart; a held end is kept once,
due at its time, taken by exactly one taker, and still there for another store on the same backend (a
restart)."""

from __future__ import annotations

import asyncio
import uuid

from caller_memory.service.domain.store import Store

HOUR = 3_600_000


async def test_an_event_is_new_once_until_its_expiry(store: Store) -> None:
    project, other = f"shop-{uuid.uuid4().hex[:8]}", f"deli-{uuid.uuid4().hex[:8]}"
    now = 1_800_000_000_000
    assert await store.first_sighting(project, "retell", "evt-1", now, now + HOUR) is True
    assert await store.first_sighting(project, "retell", "evt-1", now + 1, now + 2 * HOUR) is False
    # The refusal did not extend the expiry: at the first expiry it is new again.
    assert await store.first_sighting(project, "retell", "evt-1", now + HOUR - 1, now + 3 * HOUR) is False
    assert await store.first_sighting(project, "retell", "evt-1", now + HOUR, now + 2 * HOUR) is True
    assert await store.first_sighting(project, "retell", "evt-1", now + HOUR + 5, now + 2 * HOUR) is False
    # Another platform, another project, another id: each its own.
    assert await store.first_sighting(project, "telnyx", "evt-1", now, now + HOUR) is True
    assert await store.first_sighting(other, "retell", "evt-1", now, now + HOUR) is True
    assert await store.first_sighting(project, "retell", "evt-2" * 200, now, now + HOUR) is True


async def test_of_concurrent_sightings_exactly_one_is_new(store: Store) -> None:
    project = f"shop-{uuid.uuid4().hex[:8]}"
    now = 1_800_000_000_000
    answers = await asyncio.gather(
        *(store.first_sighting(project, "agora", "notice-9", now, now + 24 * HOUR) for _ in range(20))
    )
    assert answers.count(True) == 1


async def test_a_held_end_is_kept_once_due_and_taken_once(store: Store) -> None:
    project, other = f"shop-{uuid.uuid4().hex[:8]}", f"deli-{uuid.uuid4().hex[:8]}"
    now = 1_800_000_000_000
    assert await store.hold_platform_end(project, "retell:a1", b"\x00first", now + 600_000) is True
    # A second hold keeps the first document and its due time.
    assert await store.hold_platform_end(project, "retell:a1", b"second", now + 5) is False
    assert await store.hold_platform_end(other, "retell:a1", b"other", now + 300_000) is True
    assert await store.due_platform_ends(now + 299_999, 10) == []
    assert await store.due_platform_ends(now + 600_000, 10) == [(other, "retell:a1"), (project, "retell:a1")]
    assert await store.due_platform_ends(now + 600_000, 1) == [(other, "retell:a1")]
    taken = await asyncio.gather(*(store.take_platform_end(project, "retell:a1") for _ in range(5)))
    assert [t for t in taken if t is not None] == [b"\x00first"]
    assert await store.due_platform_ends(now + 600_000, 10) == [(other, "retell:a1")]
    assert await store.take_platform_end(project, "retell:a1") is None
    # Taken, it may be held again.
    assert await store.hold_platform_end(project, "retell:a1", b"again", now + 1) is True
    assert await store.take_platform_end(project, "retell:a1") == b"again"


async def test_an_inactivity_hold_lasts_until_its_time_and_is_replaced(store: Store) -> None:
    project = f"shop-{uuid.uuid4().hex[:8]}"
    now = 1_800_000_000_000
    assert await store.inactivity_end_held_until(project, "vapi:c-1", now) is None
    await store.hold_inactivity_end(project, "vapi:c-1", now + 2 * HOUR, now)
    assert await store.inactivity_end_held_until(project, "vapi:c-1", now + HOUR) == now + 2 * HOUR
    assert await store.inactivity_end_held_until(project, "vapi:c-1", now + 2 * HOUR) is None
    await store.hold_inactivity_end(project, "vapi:c-1", now + 3 * HOUR, now)
    assert await store.inactivity_end_held_until(project, "vapi:c-1", now + 2 * HOUR) == now + 3 * HOUR
    assert await store.inactivity_end_held_until(project, "vapi:c-2", now) is None
