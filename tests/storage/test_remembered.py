"""State keys remembered through MCP (service/domain/store/remembered.py) on every backend: per conversation
and name (a later remember replaces a name's value), dead at their time, conversations and projects apart, a
deleted conversation's forgotten, and an erasure of the caller dropping what their calls remembered (and
only theirs)."""

from __future__ import annotations

import asyncio
import uuid

from caller_memory.service.domain.store import CallerRef, Store
from caller_memory.service.domain.store.remembered import RememberedValue
from caller_memory.service.domain.store.transcripts import ConversationKey

NOW = 1_800_000_000_000
HOUR = 3_600_000


def project_id() -> str:
    return f"shop-{uuid.uuid4().hex[:8]}"


async def test_names_are_kept_per_conversation_and_a_later_value_replaces(store: Store) -> None:
    project = project_id()
    call = ConversationKey(project, "call-1")
    assert await store.remembered_state(call, NOW) == {}
    await store.remember_state(
        call, "s1", "name", RememberedValue(b'"Ada"', NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    await store.remember_state(
        call, "s1", "plan", RememberedValue(b'{"a": "b|c"}', NOW + 1), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    await store.remember_state(
        call, "s1", "name", RememberedValue(b'"Ada L."', NOW + 2), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    assert await store.remembered_state(call, NOW + 3) == {
        "name": RememberedValue(b'"Ada L."', NOW + 2),
        "plan": RememberedValue(b'{"a": "b|c"}', NOW + 1),
    }
    assert await store.remembered_state(ConversationKey(project_id(), "call-1"), NOW) == {}
    assert await store.remembered_state(ConversationKey(project, "call-2"), NOW) == {}


async def test_concurrent_remembers_of_different_names_all_stay(store: Store) -> None:
    call = ConversationKey(project_id(), "call-1")
    await asyncio.gather(
        *(
            store.remember_state(
                call, "s1", f"k{i}", RememberedValue(b"%d" % i, NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
            )
            for i in range(20)
        )
    )
    assert {n: v.value for n, v in (await store.remembered_state(call, NOW)).items()} == {
        f"k{i}": b"%d" % i for i in range(20)
    }


async def test_a_value_is_dead_at_its_time(store: Store) -> None:
    call = ConversationKey(project_id(), "call-1")
    await store.remember_state(
        call, "s1", "short", RememberedValue(b"1", NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    await store.remember_state(
        call, "s1", "long", RememberedValue(b"2", NOW), keep_until_ms=NOW + 2 * HOUR, now_ms=NOW
    )
    assert set(await store.remembered_state(call, NOW + HOUR)) == {"long"}
    assert await store.remembered_state(call, NOW + 2 * HOUR) == {}
    # Kept until a time already passed: nothing is kept.
    await store.remember_state(call, "s1", "late", RememberedValue(b"3", NOW), keep_until_ms=NOW, now_ms=NOW)
    assert await store.remembered_state(call, NOW - 1) == {
        "short": RememberedValue(b"1", NOW),
        "long": RememberedValue(b"2", NOW),
    }


async def test_a_deleted_conversation_forgets_and_an_erasure_drops_the_callers_only(store: Store) -> None:
    project = project_id()
    one, two, three = (ConversationKey(project, f"call-{i}") for i in (1, 2, 3))
    await store.remember_state(
        one, "erased", "a", RememberedValue(b"1", NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    await store.remember_state(
        two, "erased", "a", RememberedValue(b"2", NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    await store.remember_state(
        two, "erased", "b", RememberedValue(b"3", NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    await store.remember_state(
        three, "kept", "a", RememberedValue(b"4", NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    # Another project's caller of the same pseudonym is not this one.
    elsewhere = ConversationKey(project_id(), "call-1")
    await store.remember_state(
        elsewhere, "erased", "a", RememberedValue(b"5", NOW), keep_until_ms=NOW + HOUR, now_ms=NOW
    )
    assert await store.drop_remembered(CallerRef(project, "erased")) == 2
    assert await store.remembered_state(one, NOW) == {}
    assert await store.remembered_state(two, NOW) == {}
    assert await store.remembered_state(three, NOW) == {"a": RememberedValue(b"4", NOW)}
    assert await store.remembered_state(elsewhere, NOW) == {"a": RememberedValue(b"5", NOW)}
    assert await store.drop_remembered(CallerRef(project, "erased")) == 0
    await store.forget_remembered(three)
    assert await store.remembered_state(three, NOW) == {}
