"""The memory proxy's last answer of a call (service/domain/store/pending_answers.py) on every backend: one
per conversation (a later keep replaces it), taken once, dead at its time, conversations and projects apart,
and an erasure of the caller dropping every answer kept for their calls (and only theirs)."""

from __future__ import annotations

import asyncio
import uuid

from caller_memory.service.domain.store import CallerRef, Store
from caller_memory.service.domain.store.transcripts import ConversationKey

NOW = 1_800_000_000_000
HOUR = 3_600_000


def project_id() -> str:
    return f"shop-{uuid.uuid4().hex[:8]}"


async def test_an_answer_is_kept_replaced_and_taken_once(store: Store) -> None:
    project, other = project_id(), project_id()
    call = ConversationKey(project, "call-1")
    assert await store.take_pending_answer(call, NOW) is None
    await store.keep_pending_answer(call, "s1", b"first", NOW + HOUR, NOW)
    await store.keep_pending_answer(call, "s1", b"second | with a bar", NOW + HOUR, NOW)
    assert await store.take_pending_answer(ConversationKey(other, "call-1"), NOW) is None
    assert await store.take_pending_answer(ConversationKey(project, "call-2"), NOW) is None
    # Of two takers, one has it.
    found = await asyncio.gather(store.take_pending_answer(call, NOW), store.take_pending_answer(call, NOW))
    assert sorted(found, key=lambda f: f is None) == [b"second | with a bar", None]
    assert await store.take_pending_answer(call, NOW) is None


async def test_an_answer_is_dead_at_its_time(store: Store) -> None:
    project = project_id()
    call = ConversationKey(project, "call-1")
    await store.keep_pending_answer(call, "s1", b"answer", NOW + HOUR, NOW)
    assert await store.take_pending_answer(call, NOW + HOUR) is None
    # Taken dead, it is gone: a keep after it starts afresh.
    await store.keep_pending_answer(call, "s1", b"later", NOW + 2 * HOUR, NOW + HOUR)
    assert await store.take_pending_answer(call, NOW + HOUR + 1) == b"later"


async def test_an_erasure_drops_the_callers_answers_only(store: Store) -> None:
    project = project_id()
    await store.keep_pending_answer(ConversationKey(project, "call-1"), "erased", b"one", NOW + HOUR, NOW)
    await store.keep_pending_answer(ConversationKey(project, "call-2"), "erased", b"two", NOW + HOUR, NOW)
    await store.keep_pending_answer(ConversationKey(project, "call-3"), "kept", b"three", NOW + HOUR, NOW)
    # Another project's caller of the same pseudonym is not this one.
    await store.keep_pending_answer(ConversationKey(project_id(), "call-1"), "erased", b"x", NOW + HOUR, NOW)
    assert await store.drop_pending_answers(CallerRef(project, "erased")) == 2
    assert await store.take_pending_answer(ConversationKey(project, "call-1"), NOW) is None
    assert await store.take_pending_answer(ConversationKey(project, "call-2"), NOW) is None
    assert await store.take_pending_answer(ConversationKey(project, "call-3"), NOW) == b"three"
    assert await store.drop_pending_answers(CallerRef(project, "erased")) == 0
