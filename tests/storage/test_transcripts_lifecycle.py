"""The conversation-memory part of the Store contract, continued: ends (claim, take-over, finish), the due index
of inactivity ends, a caller's conversations, deletion, erasure, a project's transcript bytes, and the changes
of the caller-memory records that conversation memory brought (EndWrite.written_at, ConversationEntry.ended_by
and end_reason, TokenRecord.agent). Identical on SQLite, Redis and Redis Cluster; helpers and time conventions
as in test_transcripts.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from caller_memory.service.domain.clock import DAY_MS, HOUR_MS
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import (
    CallerRef,
    ConversationEntry,
    EndStatus,
    EndWrite,
    ListingPage,
    Recording,
    RecordStatus,
    Store,
    TokenRecord,
)
from caller_memory.service.domain.store.transcripts import (
    AppendStatus,
    ClaimResult,
    ClaimStatus,
    ConversationKey,
    EndClaim,
    Header,
    TranscriptStatus,
)

from tests.storage.test_transcripts import (
    APPENDED,
    INACTIVITY,
    MINUTE_MS,
    PROJECT,
    REMEMBER,
    RETENTION,
    append,
    appending,
    assert_refused,
    everything,
    message,
    new_caller,
    new_key,
    now_ms,
    platform_call,
    state,
)

ENDING, ENDED = TranscriptStatus.ENDING, TranscriptStatus.ENDED
LEASE = 5 * MINUTE_MS


async def started(
    store: Store,
    at: int,
    caller: CallerRef | None = None,
    key: ConversationKey | None = None,
    checkpoint: bytes | None = None,
) -> Header:
    """A conversation with the platform example's messages, appended at ``at``."""
    caller = caller or new_caller()
    key = key or new_key(caller.project)
    result = await append(store, key, caller, platform_call(at), at, checkpoint=checkpoint)
    assert result.status is APPENDED and result.header is not None
    return result.header


def claim(
    key: ConversationKey,
    lease_until: int,
    ended_by: str = "explicit",
    end_reason: str = "completed",
    idle_since: int | None = None,
    *,
    end_data: bytes = b"",
) -> EndClaim:
    return EndClaim(key, ended_by, end_reason, idle_since, lease_until, end_data)


def assert_marker(header: Header | None, status: TranscriptStatus, was: Header) -> None:
    """A marker of ``was``: its status, remembered until the header would have been, keeping nothing else."""
    assert header is not None and header.key == was.key
    assert (header.status, header.forget_at) == (status, was.forget_at)
    assert (header.subject, header.channel, header.agent, header.end_reason) == ("", "", "", "")
    assert (header.checkpoint, header.summary, header.end_data) == (None, None, b"")
    assert (header.messages, header.bytes, header.tokens, header.started_at, header.last_activity) == (0,) * 5


# Claims -------------------------------------------------------------------------------------------------------


async def test_an_end_claims_an_open_conversation_once(store: Store) -> None:
    t = now_ms()
    before = await started(store, t)
    at = t + MINUTE_MS
    result = await store.claim_end(claim(before.key, at + LEASE, end_data=b'{"qa": "resolved"}'), at)
    expected = dataclasses.replace(
        before,
        status=ENDING,
        ended_by="explicit",
        end_reason="completed",
        ended_at=at,
        lease_until=at + LEASE,
        end_data=b'{"qa": "resolved"}',
    )
    assert (result.status, result.header) == (ClaimStatus.CLAIMED, expected)
    assert (await everything(store, before.key, at))[0] == expected
    # Appending to it is refused, and so is another claim while the lease holds.
    await assert_refused(
        store,
        appending(before.key, new_caller(), [], at, create=False, checkpoint=state(a=1)),
        at,
        AppendStatus.ENDED,
    )
    for later in (at + 1, at + LEASE - 1):
        for other in (claim(before.key, later + LEASE, "inactivity", ""), claim(before.key, later + LEASE)):
            assert await store.claim_end(other, later) == ClaimResult(ClaimStatus.ALREADY, expected)
    assert (await everything(store, before.key, at + LEASE - 1))[0] == expected

    # Ended, it stays ended, lease or no lease.
    finished = await store.finish_end(before.key, at + 10)
    assert finished is not None  # (what the lease of an ended conversation says is not specified)
    assert finished == dataclasses.replace(expected, status=ENDED, lease_until=finished.lease_until)
    for later in (at + 20, at + LEASE, at + 10 * LEASE):
        again = await store.claim_end(
            claim(before.key, later + LEASE, "inactivity", "", idle_since=later), later
        )
        assert (again.status, again.header) == (ClaimStatus.ALREADY, finished)
    await assert_refused(
        store,
        appending(before.key, new_caller(), [], at, create=False, checkpoint=state(a=1)),
        at + 30,
        AppendStatus.ENDED,
    )


async def test_concurrent_claims_have_one_winner(store: Store) -> None:
    t = now_ms()
    header = await started(store, t)
    results = await asyncio.gather(
        *(
            store.claim_end(claim(header.key, t + LEASE, ended_by), t + 1)
            for ended_by in ["explicit", "inactivity", "superseded"] * 5
        )
    )
    statuses = sorted(r.status.value for r in results)
    assert statuses == ["already"] * 14 + ["claimed"]
    [winner] = [r for r in results if r.status is ClaimStatus.CLAIMED]
    assert all(r.header == winner.header for r in results)


async def test_an_inactivity_end_claims_only_an_idle_conversation(store: Store) -> None:
    t = now_ms()
    caller = new_caller()
    first = await started(store, t, caller)
    active = await append(
        store,
        first.key,
        caller,
        [message(5, "Still here!", t + 10 * MINUTE_MS)],
        t + 10 * MINUTE_MS,
        create=False,
    )
    last = t + 10 * MINUTE_MS
    at = last + INACTIVITY
    not_due = await store.claim_end(claim(first.key, at + LEASE, "inactivity", "", idle_since=last - 1), at)
    assert (not_due.status, not_due.header) == (ClaimStatus.NOT_DUE, active.header)
    assert (await everything(store, first.key, at))[0] == active.header  # nothing changed
    claimed = await store.claim_end(claim(first.key, at + LEASE, "inactivity", "", idle_since=last), at)
    assert claimed.status is ClaimStatus.CLAIMED and claimed.header is not None
    assert (claimed.header.ended_by, claimed.header.end_reason, claimed.header.ended_at) == (
        "inactivity",
        "",
        at,
    )
    # Without idle_since, whatever the last activity; an explicit end names none.
    for ended_by in ("inactivity", "explicit"):
        other = await started(store, at)
        result = await store.claim_end(claim(other.key, at + LEASE, ended_by, idle_since=None), at)
        assert result.status is ClaimStatus.CLAIMED


async def test_a_claim_of_what_is_not_there_is_missing(store: Store) -> None:
    t = now_ms()
    assert (await store.claim_end(claim(new_key(), t + LEASE), t)).status is ClaimStatus.MISSING
    assert (await store.claim_end(claim(ConversationKey("bakery", "call-1"), t + LEASE), t)).status is (
        ClaimStatus.MISSING
    )
    expired = await started(store, t)
    result = await store.claim_end(claim(expired.key, t + RETENTION + LEASE), t + RETENTION)
    assert result.status is ClaimStatus.MISSING
    header, _ = await everything(store, expired.key, t + RETENTION)
    assert header is not None and header.status is TranscriptStatus.OPEN  # the claim changed nothing
    deleted = await started(store, t)
    await store.delete_conversation(deleted.key, t + 1)
    assert (await store.claim_end(claim(deleted.key, t + LEASE), t + 2)).status is ClaimStatus.MISSING
    assert_marker((await everything(store, deleted.key, t + 2))[0], TranscriptStatus.DELETED, deleted)


async def test_a_lapsed_claim_is_taken_over_keeping_the_first_ended_at(store: Store) -> None:
    t = now_ms()
    header = await started(store, t)
    first_at = t + INACTIVITY
    lapse = first_at + LEASE
    first = await store.claim_end(
        claim(header.key, lapse, "inactivity", "", t, end_data=b'{"try": 1}'), first_at
    )
    assert first.status is ClaimStatus.CLAIMED and first.header is not None
    held = await store.claim_end(claim(header.key, lapse + LEASE, "explicit", "dropped"), lapse - 1)
    assert (held.status, held.header) == (ClaimStatus.ALREADY, first.header)
    # At the lease's end exactly, any end takes it over: its own kind, reason, data and lease, the first time.
    over = await store.claim_end(
        claim(header.key, lapse + LEASE, "explicit", "dropped", None, end_data=b'{"try": 2}'), lapse
    )
    expected = dataclasses.replace(
        first.header,
        ended_by="explicit",
        end_reason="dropped",
        end_data=b'{"try": 2}',
        lease_until=lapse + LEASE,
    )
    assert (over.status, over.header) == (ClaimStatus.CLAIMED, expected)
    assert expected.ended_at == first_at
    assert (await everything(store, header.key, lapse))[0] == expected
    # A take-over of the take-over, then the end is done.
    again = await store.claim_end(claim(header.key, lapse + 3 * LEASE, "superseded", ""), lapse + LEASE)
    assert again.status is ClaimStatus.CLAIMED and again.header is not None
    assert (again.header.ended_by, again.header.end_reason, again.header.end_data) == ("superseded", "", b"")
    assert (again.header.ended_at, again.header.status) == (first_at, ENDING)
    done = await store.finish_end(header.key, lapse + LEASE + 1)
    assert done is not None and (done.status, done.ended_by, done.ended_at) == (ENDED, "superseded", first_at)


async def test_finishing_an_end_is_idempotent(store: Store) -> None:
    t = now_ms()
    header = await started(store, t)
    claimed = await store.claim_end(claim(header.key, t + LEASE), t + 1)
    assert claimed.header is not None
    finished = await store.finish_end(header.key, t + 2)
    assert finished is not None and finished.status is ENDED
    assert dataclasses.replace(finished, lease_until=0) == dataclasses.replace(
        claimed.header, status=ENDED, lease_until=0
    )
    assert await store.finish_end(header.key, t + 3) == finished
    assert await store.finish_end(header.key, t + 10 * LEASE) == finished
    assert (await everything(store, header.key, t + 10 * LEASE))[0] == finished
    assert await store.finish_end(new_key(), t) is None
    deleted = await started(store, t)
    await store.delete_conversation(deleted.key, t + 1)
    assert await store.finish_end(deleted.key, t + 2) is None


async def test_a_summary_is_kept_whatever_the_status_but_not_on_a_marker(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    await append(store, key, caller, platform_call(t), t)
    claimed = await store.claim_end(EndClaim(key, "explicit", "completed", None, t + MINUTE_MS), t + 10)
    assert claimed.status is ClaimStatus.CLAIMED and claimed.header is not None
    ending = await store.put_summary(key, b'{"text": "ending"}', t + 20)
    assert ending == dataclasses.replace(claimed.header, summary=b'{"text": "ending"}')
    finished = await store.finish_end(key, t + 30)
    assert finished is not None and finished.status is TranscriptStatus.ENDED
    ended = await store.put_summary(key, b'{"text": "ended"}', t + 40)
    assert ended == dataclasses.replace(finished, summary=b'{"text": "ended"}')
    assert await store.delete_conversation(key, t + 50) is not None
    assert await store.put_summary(key, b'{"text": "deleted"}', t + 60) is None
    header, _ = await everything(store, key, t + 60)
    assert header is not None and header.status is TranscriptStatus.DELETED and header.summary is None


# The due index ------------------------------------------------------------------------------------------------


async def test_due_conversations_come_most_overdue_first(store: Store) -> None:
    t = now_ms()
    # Twelve conversations of two projects (several buckets of a cluster), last active at shuffled times.
    offsets = [7, 3, 11, 0, 5, 9, 1, 10, 4, 8, 2, 6]
    due: dict[int, ConversationKey] = {}
    for i, offset in enumerate(offsets):
        key = new_key(PROJECT if i % 2 else "bakery")
        await started(store, t + offset * MINUTE_MS, key=key)
        due[offset] = key
    in_order = [due[offset] for offset in sorted(due)]
    assert await store.due_conversations(t + INACTIVITY - 1, 100) == []
    assert await store.due_conversations(t + INACTIVITY, 100) == in_order[:1]  # at its due time exactly
    assert await store.due_conversations(t + INACTIVITY + 5 * MINUTE_MS, 100) == in_order[:6]
    assert await store.due_conversations(t + INACTIVITY + 5 * MINUTE_MS, 4) == in_order[:4]
    assert await store.due_conversations(t + DAY_MS, 100) == in_order
    assert await store.due_conversations(t + DAY_MS, 1) == in_order[:1]
    # Activity moves a conversation's due time.
    moved = in_order[0]
    hello = [message(9, "Hello?", t)]
    await append(store, moved, CallerRef(moved.project, ""), hello, t + 20 * MINUTE_MS, create=False)
    assert await store.due_conversations(t + INACTIVITY + 19 * MINUTE_MS, 100) == in_order[1:]
    assert await store.due_conversations(t + INACTIVITY + 20 * MINUTE_MS, 100) == [*in_order[1:], in_order[0]]
    # Earlier too (the project's end_after_inactivity was shortened): due then, before all the others.
    last, at = in_order[-1], t + 21 * MINUTE_MS
    await append(store, last, CallerRef(last.project, ""), hello, at, create=False, due_at=at + MINUTE_MS)
    assert await store.due_conversations(at + MINUTE_MS, 100) == [last]


async def test_a_claimed_conversation_is_due_again_when_its_lease_lapses(store: Store) -> None:
    t = now_ms()
    header, waiting = await started(store, t), await started(store, t + 2 * MINUTE_MS)
    # Claimed well before its inactivity due time: due at the end of the lease, not at the old due time.
    lease = t + 3 * MINUTE_MS
    assert (await store.claim_end(claim(header.key, lease), t + MINUTE_MS)).status is ClaimStatus.CLAIMED
    assert await store.due_conversations(lease - 1, 10) == []
    assert await store.due_conversations(lease, 10) == [header.key]
    assert await store.due_conversations(t + 2 * MINUTE_MS + INACTIVITY, 10) == [header.key, waiting.key]
    # It stays due until claimed again; the new claim moves it to the new lease's end.
    assert await store.due_conversations(lease + MINUTE_MS, 10) == [header.key]
    new_lease = t + INACTIVITY + 10 * MINUTE_MS
    assert (
        await store.claim_end(claim(header.key, new_lease), lease + MINUTE_MS)
    ).status is ClaimStatus.CLAIMED
    assert await store.due_conversations(new_lease - 1, 10) == [waiting.key]
    assert await store.due_conversations(new_lease, 10) == [waiting.key, header.key]
    # Ended, it is never due again.
    await store.finish_end(header.key, lease + 2 * MINUTE_MS)
    assert await store.due_conversations(t + 100 * DAY_MS, 10) == [waiting.key]


async def test_reschedule_moves_the_due_time(store: Store) -> None:
    t = now_ms()
    header = await started(store, t)
    later = t + INACTIVITY + 10 * MINUTE_MS
    await store.reschedule(header.key, later)
    assert await store.due_conversations(later - 1, 10) == []
    assert await store.due_conversations(later, 10) == [header.key]
    await store.reschedule(header.key, t + 1)  # earlier too
    assert await store.due_conversations(t + 1, 10) == [header.key]
    # An ENDING conversation: from its lease's end to the new time.
    await store.claim_end(claim(header.key, t + LEASE), t + 2)
    await store.reschedule(header.key, t + 2 * LEASE)
    assert await store.due_conversations(t + 2 * LEASE - 1, 10) == []
    assert await store.due_conversations(t + 2 * LEASE, 10) == [header.key]
    # Nothing for an ended, a deleted or an unknown conversation.
    await store.finish_end(header.key, t + 3)
    deleted = await started(store, t)
    await store.delete_conversation(deleted.key, t + 4)
    for key in (header.key, deleted.key, new_key()):
        await store.reschedule(key, t + 5)
    assert await store.due_conversations(t + 100 * DAY_MS, 10) == []
    assert await everything(store, new_key(), t) == (None, [])


# A caller's conversations ---------------------------------------------------------------------------------------


async def test_a_callers_conversations_newest_start_first(store: Store) -> None:
    t = now_ms()
    caller = new_caller()
    first = await started(store, t, caller)
    third = await started(store, t + 2 * MINUTE_MS, caller)
    second = await started(store, t + MINUTE_MS, caller)
    await store.claim_end(claim(second.key, t + LEASE), t + 3 * MINUTE_MS)
    await store.finish_end(second.key, t + 3 * MINUTE_MS)
    deleted = await started(store, t + 4 * MINUTE_MS, caller)
    await store.delete_conversation(deleted.key, t + 5 * MINUTE_MS)
    theirs = await started(store, t + 6 * MINUTE_MS)
    elsewhere = await started(store, t, CallerRef("bakery", caller.subject))

    async def keys_of(who: CallerRef, at: int) -> list[ConversationKey]:
        return [h.key for h in await store.caller_conversations(who, at)]

    listed = await store.caller_conversations(caller, t + 5 * MINUTE_MS)
    current = [(await everything(store, h.key, t + 5 * MINUTE_MS))[0] for h in (third, second, first)]
    assert listed == current  # the headers as they are, the ended one included, the deleted one not
    assert await keys_of(CallerRef(theirs.key.project, theirs.subject), t) == [theirs.key]
    assert await keys_of(CallerRef("bakery", caller.subject), t) == [elsewhere.key]
    assert await keys_of(new_caller(), t) == []
    # Expired transcripts are listed until their headers are forgotten.
    assert await keys_of(caller, t + 2 * MINUTE_MS + RETENTION) == [third.key, second.key, first.key]
    assert await keys_of(caller, t + REMEMBER) == [third.key, second.key]
    assert await keys_of(caller, t + 2 * MINUTE_MS + REMEMBER) == []


# Deletion ---------------------------------------------------------------------------------------------------


async def test_a_deleted_transcript_leaves_a_marker(store: Store) -> None:
    t = now_ms()
    caller = new_caller()
    header = await started(store, t, caller, checkpoint=state(a=1))
    before = await store.put_summary(header.key, b'{"text": "s"}', t)
    assert before is not None
    at = t + MINUTE_MS
    assert await store.delete_conversation(before.key, at) == before  # the header as it was
    marker, messages = await everything(store, before.key, at)
    assert marker is not None
    assert_marker(marker, TranscriptStatus.DELETED, before)
    assert messages == []
    # Appends are refused as erased, whoever makes them; it is not listed nor due.
    for create, who in ((False, CallerRef(PROJECT, "")), (True, caller), (True, new_caller())):
        write = appending(before.key, who, platform_call(at), at, create=create, checkpoint=state(a=2))
        await assert_refused(store, write, at, AppendStatus.ERASED)
    assert await store.caller_conversations(caller, at) == []
    assert await store.due_conversations(t + 100 * DAY_MS, 10) == []
    # Deleting it again, or what never was, changes nothing.
    assert await store.delete_conversation(before.key, at + 1) is None
    assert await store.delete_conversation(new_key(), at + 1) is None
    assert_marker((await everything(store, before.key, at + 1))[0], TranscriptStatus.DELETED, before)
    assert await everything(store, before.key, before.forget_at) == (None, [])


async def test_an_ending_conversation_can_be_deleted(store: Store) -> None:
    t = now_ms()
    header = await started(store, t)
    claimed = await store.claim_end(claim(header.key, t + LEASE), t + 1)
    assert await store.delete_conversation(header.key, t + 2) == claimed.header
    assert_marker((await everything(store, header.key, t + 2))[0], TranscriptStatus.DELETED, header)
    assert await store.due_conversations(t + 100 * DAY_MS, 10) == []  # not even when the lease lapses


# Erasure ------------------------------------------------------------------------------------------------------


async def test_an_erasure_removes_the_callers_transcripts(store: Store) -> None:
    t = now_ms()
    caller, other = new_caller(), new_caller()
    open_one = await started(store, t, caller, checkpoint=state(a=1))
    await store.put_summary(open_one.key, b'{"text": "s"}', t)
    ended = await started(store, t + 1, caller)
    await store.claim_end(claim(ended.key, t + LEASE), t + 2)
    await store.finish_end(ended.key, t + 3)
    kept = await started(store, t, other)
    erased_at = t + 10 * MINUTE_MS
    result = await store.erase_caller(caller, erased_at, erased_at + DAY_MS)
    assert result.transcripts == 2
    for before in (open_one, ended):
        header, messages = await everything(store, before.key, erased_at)
        assert_marker(header, TranscriptStatus.ERASED, before)
        assert messages == []
        assert (
            await store.claim_end(claim(before.key, erased_at + LEASE), erased_at)
        ).status is ClaimStatus.MISSING
        assert await store.put_summary(before.key, b"{}", erased_at) is None
        assert await store.finish_end(before.key, erased_at) is None
        assert await store.delete_conversation(before.key, erased_at) is None
    assert await store.caller_conversations(caller, erased_at) == []
    assert (await everything(store, kept.key, erased_at))[0] == kept  # another caller's is untouched
    # Nothing of the erased ones is due (a marker would be found due, and skipped, forever).
    assert await store.due_conversations(t + 100 * DAY_MS, 10) == [kept.key]
    assert (await store.erase_caller(caller, erased_at + 1, erased_at + DAY_MS)).transcripts == 0
    assert (await store.erase_caller(new_caller(), erased_at, erased_at + DAY_MS)).transcripts == 0


async def test_an_append_made_before_an_erasure_creates_nothing(store: Store) -> None:
    t = now_ms()
    caller = new_caller()
    old = await started(store, t, caller)
    erased_at = t + MINUTE_MS
    await store.erase_caller(caller, erased_at, erased_at + DAY_MS)
    arrives = erased_at + MINUTE_MS
    # Made before the erasure (or at its instant), delivered after it (an outbox, a retry): dropped.
    for made_at in (t + 30_000, erased_at):
        key = new_key()
        write = appending(key, caller, platform_call(t), arrives, checkpoint=state(a=1), made_at=made_at)
        result = await store.append_messages(write, arrives)
        assert (result.status, result.header, result.added) == (AppendStatus.ERASED, None, 0)
        assert await everything(store, key, arrives) == (None, [])
        start = await store.append_messages(appending(key, caller, [], arrives, made_at=made_at), arrives)
        assert (start.status, start.header) == (AppendStatus.ERASED, None)
    # The erased conversation stays a marker, whenever an append to it was made.
    for made_at in (t + 30_000, arrives):
        write = appending(old.key, caller, platform_call(arrives), arrives, made_at=made_at)
        await assert_refused(store, write, arrives, AppendStatus.ERASED)
    assert await store.caller_conversations(caller, arrives) == []
    assert (await store.erase_caller(caller, arrives, arrives + DAY_MS)).transcripts == 0
    # Made after the erasure (the second one, at ``arrives``): a new conversation of the caller.
    new = new_key()
    result = await append(store, new, caller, platform_call(arrives), arrives + 1)
    assert (result.status, result.added) == (APPENDED, 6)
    assert [h.key for h in await store.caller_conversations(caller, arrives + 1)] == [new]


async def test_an_append_made_before_an_erasure_is_dropped_by_a_later_conversation(store: Store) -> None:
    """Erasure reaches what is in flight (SPEC section 14; AppendStatus.ERASED: "its caller was erased after
    the append was made"): a conversation created after the erasure takes no append made before it."""
    t = now_ms()
    caller = new_caller()
    erased_at = t + MINUTE_MS
    await store.erase_caller(caller, erased_at, erased_at + DAY_MS)
    after = erased_at + MINUTE_MS
    header = await started(store, after, caller)
    for create, who in ((False, CallerRef(PROJECT, "")), (True, caller)):
        write = appending(
            header.key, who, [message(7, "Sent before.", t)], after + 1, create=create, made_at=t
        )
        await assert_refused(store, write, after + 1, AppendStatus.ERASED)


# A project's transcript bytes --------------------------------------------------------------------------------


async def test_transcript_bytes_count_a_projects_appended_bytes(store: Store) -> None:
    t = now_ms()
    hour = t - t % HOUR_MS
    caller = new_caller()
    one, two = await started(store, t, caller), await started(store, t + 1, new_caller())
    elsewhere = await started(store, t, CallerRef("bakery", caller.subject))
    at = t + 2

    async def counted(project: str = PROJECT, since: int = hour) -> int:
        return await store.transcript_bytes(project, at, since)

    assert await counted() == one.bytes + two.bytes > 0
    assert await counted(since=t) == one.bytes + two.bytes  # appended at or after since
    assert await counted(since=hour + 2 * HOUR_MS) == 0  # nothing appended in that window
    assert await counted("bakery") == elsewhere.bytes
    assert await counted("nobody") == 0
    # What is refused or already there adds nothing; a new message adds its bytes.
    await append(store, one.key, caller, platform_call(t), at, create=False)
    limited = appending(one.key, caller, [message(9, "Bye!", at)], at, create=False, max_bytes=one.bytes)
    assert (await store.append_messages(limited, at)).status is AppendStatus.TOO_MANY_BYTES
    assert await counted() == one.bytes + two.bytes
    bye = message(9, "Bye!", at)
    grown = await append(store, one.key, caller, [bye], at, create=False)
    assert grown.header is not None and await counted() == grown.header.bytes + two.bytes
    # Deleted and erased transcripts are taken off.
    await store.delete_conversation(two.key, at)
    assert await counted() == grown.header.bytes
    await store.erase_caller(caller, at, at + DAY_MS)
    assert await counted() == 0
    assert await counted("bakery") == elsewhere.bytes  # the same pseudonym in another project: another caller


# What conversation memory changed in the caller-memory records ------------------------------------------------


def field(value: object, written_at: int) -> StoredField:
    return StoredField(json.dumps(value).encode(), expires_at=written_at + DAY_MS, written_at=written_at)


async def fields_of(store: Store, caller: CallerRef, at: int) -> dict[str, object]:
    return {name: json.loads(f.value) for name, f in (await store.read_fields(caller, at)).items()}


async def test_an_end_does_not_overwrite_a_later_write(store: Store) -> None:
    """An end that applies a checkpoint writes at the checkpoint's time: a field written after it stays."""
    t = now_ms()
    caller = new_caller()
    earlier = {"early": field("a", t), "same": field("a", t + 50), "gone": field("a", t)}
    later = {"late": field("a", t + 100), "kept": field("a", t + 100)}
    await store.patch_fields(caller, earlier | later, [], t + 100)
    sets = {name: field("b", t + 50) for name in ("early", "same", "late", "new")}
    end = EndWrite(caller, "call-1", "fp", t + DAY_MS, t + 50, sets, ("gone", "kept"), written_at=t + 50)
    assert (await store.end_conversation(end, t + 200)).status is EndStatus.APPLIED
    assert await fields_of(store, caller, t + 200) == {
        "early": "b",
        "same": "b",
        "new": "b",
        "late": "a",
        "kept": "a",
    }

    # Without a write time, the end writes at now_ms.
    other = new_caller()
    await store.patch_fields(
        other, {"a": field("a", t + 100), "b": field("a", t + 300), "c": field("a", t + 300)}, [], t + 300
    )
    sets = {"a": field("b", t + 200), "b": field("b", t + 200)}
    end = EndWrite(other, "call-2", "fp", t + DAY_MS, t + 200, sets, ("c",))
    assert (await store.end_conversation(end, t + 200)).status is EndStatus.APPLIED
    assert await fields_of(store, other, t + 300) == {"a": "b", "b": "a", "c": "a"}


async def test_analytics_entries_keep_how_the_conversation_ended(store: Store) -> None:
    t = now_ms()
    hour = t - t % HOUR_MS
    entries = [
        ConversationEntry("c1", hour, "voice", None, None, None, None),  # ended by the end call, no reason
        ConversationEntry("c2", hour, "voice", "resolved", None, None, None, "inactivity", "dropped"),
        ConversationEntry("c3", hour, None, None, None, None, None, "superseded", None),
        ConversationEntry("c4", hour, "sip", None, "billing", "human", None, "explicit", "transferred"),
    ]
    for entry in entries:
        recording = Recording(CallerRef(PROJECT, "0" * 32), entry, [], t + DAY_MS, 0)
        assert await store.record_conversation(recording, hour) is RecordStatus.RECORDED
    listed = await store.list_conversations(PROJECT, ListingPage("0", "9", limit=10), t)
    assert listed == entries
    assert [(e.ended_by, e.end_reason) for e in listed] == [
        ("explicit", None),
        ("inactivity", "dropped"),
        ("superseded", None),
        ("explicit", "transferred"),
    ]


async def test_a_token_keeps_the_agent_it_acts_as(store: Store) -> None:
    t = now_ms()
    billing = TokenRecord(
        "tok-billing", PROJECT, "agent", bytes(range(32)), t, "billing line", agent="billing"
    )
    shared = TokenRecord("tok-shared", PROJECT, "agent", bytes(32), t + 1)
    for token in (billing, shared):
        await store.put_token(token)
    assert await store.get_token("tok-billing") == billing
    assert await store.get_token("tok-shared") == shared and shared.agent == ""
    assert await store.list_tokens(PROJECT) == [billing, shared]
