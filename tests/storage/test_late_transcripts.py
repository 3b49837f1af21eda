"""A platform's late transcript (service/domain/store/late_transcripts.py) on every backend: added once to a
conversation the service ended (inactivity, supersession) that has no messages, in order, with its counts and
turn id, read back like any transcript, idempotent; never to an open, ending, explicitly ended or expired
conversation, nor to one with messages; not activity (times, expiry unchanged)."""

from __future__ import annotations

import asyncio
import dataclasses

from caller_memory.service.domain.clock import HOUR_MS
from caller_memory.service.domain.store import Store
from caller_memory.service.domain.store.transcripts import EndClaim, Header, TranscriptStatus

from tests.storage.test_transcripts import (
    APPENDED,
    MINUTE_MS,
    append,
    everything,
    message,
    new_caller,
    new_key,
    now_ms,
    platform_call,
    stored,
)


async def ended(
    store: Store, at: int, ended_by: str, *, with_messages: bool = False, finish: bool = True
) -> Header:
    caller, key = new_caller(), new_key()
    result = await append(store, key, caller, platform_call(at) if with_messages else [], at)
    assert result.status is APPENDED and result.header is not None
    claimed = await store.claim_end(EndClaim(key, ended_by, "", None, at + 5 * MINUTE_MS), at + 1)
    assert claimed.header is not None
    if finish:
        await store.finish_end(key, at + 1)
    header, _ = await everything(store, key, at + 1)
    assert header is not None
    return header


async def test_a_service_ended_conversation_takes_a_late_transcript_once(store: Store) -> None:
    t = now_ms()
    for ended_by in ("inactivity", "superseded"):
        before = await ended(store, t, ended_by)
        late = [message(0, "Hello, cheese shop.", t, role="assistant"), message(1, "Brie, please", t)]
        late += [message(1, "Brie it is.", t, role="assistant", message_id="retell-end-2")]
        at = t + 10 * MINUTE_MS
        volume = await store.transcript_bytes(before.key.project, at, t - HOUR_MS)
        assert await store.add_late_messages(before.key, late, at) is True
        # Its bytes count towards the project's bound like an append's.
        added = sum(len(m.body) for m in late)
        assert await store.transcript_bytes(before.key.project, at, t - HOUR_MS) == volume + added
        header, messages = await everything(store, before.key, at)
        assert messages == stored(late)
        assert header == dataclasses.replace(
            before,
            messages=3,
            turn_id=1,
            bytes=sum(len(m.body) for m in late),
            tokens=sum(m.tokens for m in late),
        )
        # Once: another late transcript (or the same again) adds nothing.
        assert await store.add_late_messages(before.key, late[:1], at + 1) is False
        assert (await everything(store, before.key, at + 1))[1] == stored(late)


async def test_no_other_conversation_takes_one(store: Store) -> None:
    t = now_ms()
    late = [message(1, "Brie, please", t)]
    explicit = await ended(store, t, "explicit")
    ending = await ended(store, t, "inactivity", finish=False)
    with_messages = await ended(store, t, "inactivity", with_messages=True)
    open_key, caller = new_key(), new_caller()
    assert (await append(store, open_key, caller, [], t)).status is APPENDED
    for key in (explicit.key, ending.key, with_messages.key, open_key, new_key()):
        assert await store.add_late_messages(key, late, t + 2) is False
    assert (await everything(store, explicit.key, t + 2))[1] == []
    assert (await everything(store, open_key, t + 2))[0].messages == 0  # type: ignore[union-attr]
    assert len((await everything(store, with_messages.key, t + 2))[1]) == len(platform_call(t))
    # Nor one whose transcript expired, nor with no messages to add.
    inactive = await ended(store, t, "inactivity")
    assert await store.add_late_messages(inactive.key, [], t + 2) is False
    assert await store.add_late_messages(inactive.key, late, inactive.expires_at) is False
    assert inactive.status is TranscriptStatus.ENDED


async def test_of_concurrent_late_transcripts_one_is_added(store: Store) -> None:
    t = now_ms()
    before = await ended(store, t, "inactivity")
    batches = [[message(0, f"take {i}", t)] for i in range(5)]
    added = await asyncio.gather(*(store.add_late_messages(before.key, b, t + 2) for b in batches))
    assert added.count(True) == 1
    assert len((await everything(store, before.key, t + 2))[1]) == 1
