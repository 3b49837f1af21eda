"""An erasure holds against every end of the conversations it removed (issue 27, items 1 and 2), on every
backend: whatever record the end is kept under (its own id, a late end's ``#late``, a takeover's
``#takeover``) and whenever it says it was made, an end by the erased caller of a conversation the erasure
removed writes nothing. The check is made in the same atomic step as the end's write (on Redis, in the
caller's slot: the tombstone holds the conversation ids)."""

from __future__ import annotations

from typing import Any

from caller_memory.service.domain.clock import DAY_MS
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import CallerRef, EndStatus, EndWrite, Store

from tests.storage.test_contract import ending
from tests.storage.test_transcripts import (
    MINUTE_MS,
    append,
    new_caller,
    new_key,
    now_ms,
    platform_call,
    state,
)


def end_of(caller: CallerRef, conversation_id: str, at: int, **kw: Any) -> EndWrite:
    """The end of the caller's conversation, made at ``at``, setting their name."""
    return ending(caller.subject, conversation_id, at, sets=named("Ada", at), project=caller.project, **kw)


def named(value: str, at: int) -> dict[str, StoredField]:
    return {"caller_name": StoredField(value=f'"{value}"'.encode(), expires_at=at + DAY_MS, written_at=at)}


async def test_an_end_of_a_removed_conversation_made_after_the_erasure_writes_nothing(store: Store) -> None:
    t = now_ms()
    caller, other = new_caller(), new_caller()
    live = new_key(caller.project)
    assert (await append(store, live, caller, platform_call(t), t, checkpoint=state(a=1))).header is not None
    erased_at = t + MINUTE_MS
    assert (await store.erase_caller(caller, erased_at, erased_at + DAY_MS)).transcripts == 1
    # Made after the erasure (the agent ends the call it was in), under each record an end may use.
    for record in ("", "#late", "#takeover"):
        at = erased_at + 1000
        end = end_of(caller, live.conversation_id + record, at, made_at=at)
        assert (await store.end_conversation(end, at)).status is EndStatus.ERASED, record
        assert await store.read_fields(caller, at) == {}
    # Still refused much later (an SDK outbox), while the conversation id is remembered.
    later = erased_at + 3 * DAY_MS
    end = end_of(caller, live.conversation_id, later)
    assert (await store.end_conversation(end, later)).status is EndStatus.ERASED
    # Another conversation of the same caller, after the erasure, is theirs again.
    fresh = end_of(caller, "call-after", later)
    assert (await store.end_conversation(fresh, later)).status is EndStatus.APPLIED
    # The erasure was the caller's: another caller's end of another id is untouched by it.
    theirs = end_of(other, "call-other", later)
    assert (await store.end_conversation(theirs, later)).status is EndStatus.APPLIED


async def test_a_late_end_of_an_ended_conversation_after_the_erasure_writes_nothing(store: Store) -> None:
    t = now_ms()
    caller = new_caller()
    key = new_key(caller.project)
    await append(store, key, caller, platform_call(t), t)
    # The service ended it (its record under the conversation's id), then the caller is erased.
    first = end_of(caller, key.conversation_id, t + 1)
    assert (await store.end_conversation(first, t + 1)).status is EndStatus.APPLIED
    erased_at = t + MINUTE_MS
    erased = await store.erase_caller(caller, erased_at, erased_at + DAY_MS)
    assert (erased.conversations, erased.fields) == (1, 1)
    late_at = erased_at + 5000  # made after the erasure: its tombstone's time alone would let it through
    late = end_of(caller, key.conversation_id + "#late", late_at)
    assert (await store.end_conversation(late, late_at)).status is EndStatus.ERASED
    assert await store.read_fields(caller, late_at) == {}
    assert await store.read_fields(CallerRef(caller.project, caller.subject), late_at + DAY_MS) == {}


async def test_a_second_erasure_keeps_what_the_first_removed(store: Store) -> None:
    t = now_ms()
    caller = new_caller()
    one, two = new_key(caller.project), new_key(caller.project)
    await append(store, one, caller, platform_call(t), t)
    await store.erase_caller(caller, t + 1000, t + 1000 + DAY_MS)
    await append(store, two, caller, platform_call(t + 2000), t + 2000)
    await store.erase_caller(caller, t + 3000, t + 3000 + DAY_MS)
    at = t + 4000
    for key in (one, two):
        end = end_of(caller, key.conversation_id + "#late", at)
        assert (await store.end_conversation(end, at)).status is EndStatus.ERASED, key
    assert await store.read_fields(caller, at) == {}
