"""The analytics part of the Store contract, identical on SQLite and Redis."""

from __future__ import annotations

import time
import uuid

from caller_memory.service.domain.analytics import AnalyticsService, increments
from caller_memory.service.domain.clock import DAY_MS, HOUR_MS, bucket_start
from caller_memory.service.domain.identifiers import Pseudonymizer
from caller_memory.service.domain.projects import Project, compile_project, parse_config
from caller_memory.service.domain.store import (
    AnalyticsInput,
    CallerRef,
    ConversationEntry,
    Counters,
    EndAnalytics,
    EndStatus,
    EndWrite,
    FirstInteraction,
    ListingPage,
    Outcome,
    Recording,
    RecordStatus,
    Store,
)

PROJECT = "shop"
RETENTION = 30 * DAY_MS


def now_ms() -> int:
    """Now, or the start of the next hour if that is less than 5 minutes away: a test that adds a few minutes
    to it stays in one hour bucket whatever the time of the run (and no time it writes is already past)."""
    now = time.time_ns() // 1_000_000
    return now - now % HOUR_MS + HOUR_MS if now % HOUR_MS > HOUR_MS - 5 * 60_000 else now


#: A project keeping data for RETENTION (30 days), as the domain compiles it.
SHOP = compile_project(
    PROJECT, parse_config({"memory": {"repeat_caller": {"retention": "P30D"}}}), Pseudonymizer(b"k" * 32)
)


def analytics_at(at: int, qa: str | None = None, to: str | None = None) -> AnalyticsInput:
    """What the service gives the store for a conversation ending at ``at``."""
    return AnalyticsService.input_for(SHOP, at, Outcome(qa=qa, handoff_to=to))


def ending(conv: str, subject: str, at: int, analytics: AnalyticsInput | None = None) -> EndWrite:
    return EndWrite(CallerRef(PROJECT, subject), conv, conv, at + DAY_MS, at, analytics=analytics)


async def end(store: Store, conv: str, subject: str, at: int, **outcome: str) -> EndAnalytics:
    result = await store.end_conversation(ending(conv, subject, at, analytics_at(at, **outcome)), at)
    assert result.status is EndStatus.APPLIED and result.analytics is not None
    return result.analytics


async def test_first_interaction_is_recorded_once_and_expires(store: Store) -> None:
    subject, t = uuid.uuid4().hex, now_ms()
    hour = t - t % HOUR_MS
    first = await end(store, "c1", subject, t, qa="unresolved", to="human")
    assert first == EndAnalytics(hour=hour, first=None, new_buckets=("hour", "day", "week"))
    second = await end(store, "c2", subject, t + 60_000, qa="resolved")
    assert second.first == FirstInteraction(
        conversation_id="c1", hour=hour, qa="unresolved", handoff_reason=None, handoff_to="human"
    )
    assert second.new_buckets == ()  # same hour, day and week: nothing new
    third = await end(store, "c3", subject, t + 2 * DAY_MS)
    assert third.first == second.first  # the first interaction, not the second
    assert "day" in third.new_buckets and "hour" in third.new_buckets
    # After the retention period the next call is a first interaction again.
    later = t + RETENTION
    again = await end(store, "c4", subject, later)
    assert again.first is None
    repeat = await end(store, "c5", subject, later + 1000)
    assert repeat.first is not None and repeat.first.conversation_id == "c4"


async def test_a_replay_returns_the_stored_analytics(store: Store) -> None:
    subject, t = uuid.uuid4().hex, now_ms()
    await end(store, "c1", subject, t)
    applied = await end(store, "c2", subject, t + 1000)
    later = t + 5 * HOUR_MS
    replay = await store.end_conversation(
        EndWrite(CallerRef(PROJECT, subject), "c2", "c2", t + DAY_MS, later, analytics=analytics_at(later)),
        later,
    )
    assert replay.status is EndStatus.REPLAYED
    assert replay.analytics == applied


def entry(
    conv: str, hour: int, first: FirstInteraction | None = None, qa: str | None = None
) -> ConversationEntry:
    return ConversationEntry(conv, hour, "voice", qa, None, None, first)


async def record(
    store: Store,
    e: ConversationEntry,
    counts: list[Counters],
    expires: int,
    at: int | None = None,
    *,
    project: str = PROJECT,
    subject: str = "0" * 32,
    made_at: int = 0,
) -> RecordStatus:
    """Record ``e`` at ``at`` (by default its hour) for a caller never erased, unless told otherwise."""
    recording = Recording(CallerRef(project, subject), e, counts, expires, made_at)
    return await store.record_conversation(recording, e.hour if at is None else at)


async def test_recording_is_idempotent_and_counts(store: Store) -> None:
    t = now_ms()
    hour = t - t % HOUR_MS
    first = FirstInteraction("c0", hour - 3 * HOUR_MS, "unresolved", None, "human")
    repeat = entry("c1", hour, first, qa="resolved")
    expires = t + DAY_MS
    counts = increments(repeat, ["hour", "day"])
    assert await record(store, repeat, counts, expires) is RecordStatus.RECORDED
    assert await record(store, repeat, counts, expires) is RecordStatus.DUPLICATE
    one = entry("c2", hour)
    assert (
        await record(store, one, increments(one, ["hour", "day", "week"]), expires) is RecordStatus.RECORDED
    )
    [hourly] = await store.counters(PROJECT, "hour", hour, hour, t)
    assert hourly.bucket == hour
    assert dict(hourly.values) == {
        "conversations": 2,
        "repeat": 1,
        "first": 1,
        "distinct": 2,
        "ttc:under_1_day": 1,
        'first_qa:"unresolved"': 1,
        "first_handoff_reason:null": 1,
        'first_handoff_to:"human"': 1,
        "repeat_attestation:null": 1,
    }
    [weekly] = await store.counters(
        PROJECT, "week", bucket_start("week", hour), bucket_start("week", hour), t
    )
    assert weekly.values["distinct"] == 1 and weekly.values["conversations"] == 2
    # Counters expire with their latest conversation.
    assert await store.counters(PROJECT, "hour", hour, hour, expires) == []
    assert await store.counters("other-project", "hour", hour, hour, t) == []


async def test_listing_order_paging_filters_and_expiry(store: Store) -> None:
    t = now_ms()
    hour = t - t % HOUR_MS
    first = FirstInteraction("a", hour - 2 * HOUR_MS, None, None, None)
    recorded = [
        entry("a", hour - 2 * HOUR_MS),
        entry("b", hour - HOUR_MS, first),
        entry("c", hour - HOUR_MS),
        entry("d", hour, first),
    ]
    for e in recorded:
        expires = t + (1000 if e.conversation_id == "c" else DAY_MS)
        await record(store, e, increments(e, []), expires)

    async def ids(**options: object) -> list[str]:
        args: dict[str, object] = {
            "start": f"{hour - 5 * HOUR_MS:013d}:",
            "stop": f"{hour + HOUR_MS:013d}:",
            "repeat": None,
            "after": None,
            "limit": 10,
            "descending": False,
            "now_ms": t,
        } | options
        now = args.pop("now_ms")
        assert isinstance(now, int)
        page = ListingPage(**args)  # type: ignore[arg-type]
        return [e.conversation_id for e in await store.list_conversations(PROJECT, page, now)]

    assert await ids() == ["a", "b", "c", "d"]
    assert await ids(descending=True) == ["d", "c", "b", "a"]
    assert await ids(repeat=True) == ["b", "d"]
    assert await ids(repeat=False) == ["a", "c"]
    assert await ids(limit=2) == ["a", "b"]
    assert await ids(limit=2, after=recorded[1].sort_key) == ["c", "d"]
    assert await ids(limit=2, descending=True, after=recorded[2].sort_key) == ["b", "a"]
    assert await ids(start=f"{hour - HOUR_MS:013d}:", stop=f"{hour:013d}:") == ["b", "c"]
    assert await ids(now_ms=t + 1000) == ["a", "b", "d"]  # c has expired
    listed = await store.list_conversations(PROJECT, ListingPage("0", "9", repeat=True, limit=1), t)
    assert listed == [recorded[1]]  # entries come back exactly as recorded


#: The same project once its retention was shortened to 7 days.
SHORT = compile_project(
    PROJECT, parse_config({"memory": {"repeat_caller": {"retention": "P7D"}}}), Pseudonymizer(b"k" * 32)
)


async def test_a_shortened_retention_applies_to_stored_first_interactions(store: Store) -> None:
    subject, t = uuid.uuid4().hex, now_ms()
    await end(store, "c1", subject, t)  # created under 30 days: it would be stored until t + 30 days
    later = t + 7 * DAY_MS  # exactly 7 days on: past the new retention

    async def first_of(conv: str, at: int, project: Project) -> str | None:
        a = AnalyticsService.input_for(project, at, Outcome())
        result = await store.end_conversation(ending(conv, subject, at, a), at)
        assert result.status is EndStatus.APPLIED and result.analytics is not None
        return None if result.analytics.first is None else result.analytics.first.conversation_id

    assert await first_of("c2", later - 1, SHORT) == "c1"
    assert await first_of("c3", later, SHORT) is None  # older than the current retention: a first again
    assert await first_of("c4", later + 1, SHORT) == "c3"
    # Under the longer retention again, the new record stands (the old one was replaced, not hidden).
    assert await first_of("c5", later + 2, SHOP) == "c3"


async def test_listing_and_counters_obey_a_retention_shorter_than_their_expiry(store: Store) -> None:
    t = now_ms()
    hour = t - t % HOUR_MS
    expires = t + 30 * DAY_MS  # recorded under 30 days
    old, new = entry("old", hour), entry("new", hour + 2 * HOUR_MS)
    await record(store, old, increments(old, ["hour", "day"]), expires, hour + 10)
    await record(store, new, increments(new, ["hour"]), expires, hour + 2 * HOUR_MS + 10)

    async def ids(recorded_after: int | None) -> list[str]:
        listed = await store.list_conversations(
            PROJECT, ListingPage("0", "9", limit=10, recorded_after=recorded_after), t
        )
        return [e.conversation_id for e in listed]

    assert await ids(None) == ["old", "new"]
    assert await ids(hour + 9) == ["old", "new"]
    assert await ids(hour + 10) == ["new"]  # recorded at the cutoff: past it (as expiry is exclusive)
    assert await ids(hour + 2 * HOUR_MS + 10) == []

    async def buckets(kind: str, recorded_after: int | None) -> list[int]:
        start = bucket_start(kind, hour)
        got = await store.counters(
            PROJECT, kind, start, start + 3 * HOUR_MS, t, recorded_after=recorded_after
        )
        return [c.bucket for c in got]

    assert await buckets("hour", None) == [hour, hour + 2 * HOUR_MS]
    assert await buckets("hour", hour + 10) == [hour + 2 * HOUR_MS]
    # A bucket is as old as its latest conversation: the day still counts "old" while "new" is in retention.
    day = bucket_start("day", hour)
    if day == bucket_start("day", hour + 2 * HOUR_MS):
        assert await buckets("day", hour + 10) == [day]
        assert await buckets("day", hour + 2 * HOUR_MS + 10) == []


async def test_a_sweep_removes_listed_conversations_past_the_current_retention(store: Store) -> None:
    t = now_ms()
    hour = t - t % HOUR_MS
    expires = t + 30 * DAY_MS
    for i in range(5):
        e = entry(f"c{i}", hour + i * HOUR_MS)
        await record(store, e, increments(e, []), expires, hour + i * HOUR_MS + 1)
    other = entry("elsewhere", hour)
    await record(store, other, increments(other, []), expires, hour + 1, project="other")
    removed = 0
    more = True
    while more:  # batches of 2: several rounds
        counts, more = await store.sweep(t, 2, {PROJECT: hour + 2 * HOUR_MS + 1})
        removed += counts["analytics_entries"]
    assert removed == 3  # c0, c1, c2: recorded at or before the cutoff
    for project, remaining in ((PROJECT, ["c3", "c4"]), ("other", ["elsewhere"])):
        listed = await store.list_conversations(project, ListingPage("0", "9", limit=10), t)
        assert [e.conversation_id for e in listed] == remaining
    counts, _ = await store.sweep(t, 2, {PROJECT: hour + 2 * HOUR_MS + 1})
    assert counts["analytics_entries"] == 0  # safe to repeat


def listed(entries: list[ConversationEntry]) -> list[str]:
    return [e.conversation_id for e in entries]


async def all_listed(store: Store, now: int) -> list[str]:
    return listed(await store.list_conversations(PROJECT, ListingPage("0", "9"), now))


async def test_a_recording_after_an_erasure_is_not_listed(store: Store) -> None:
    """The two steps of an end (memory, then analytics) with the caller's erasure in between: the erasure
    could not see the listing yet, so the recording must not list it (the race a Redis Cluster has between
    slots, and any backend between two calls). Counters are anonymous: they count it, as they keep a
    conversation whose caller is erased later."""
    subject, t = uuid.uuid4().hex, now_ms()
    hour = t - t % HOUR_MS
    ended = await end(store, "c1", subject, t)
    erased = await store.erase_caller(CallerRef(PROJECT, subject), t + 10, t + DAY_MS)
    assert erased.conversations == 1 and erased.listed == 0  # nothing listed yet
    e = entry("c1", ended.hour)
    counts = increments(e, ended.new_buckets)
    assert (
        await record(store, e, counts, t + DAY_MS, t + 20, subject=subject, made_at=t) is RecordStatus.ERASED
    )
    assert await all_listed(store, t + 20) == []
    [hourly] = await store.counters(PROJECT, "hour", hour, hour, t + 20)
    assert hourly.values["conversations"] == 1
    # A retry of the recording (a replay of the end) lists nothing either.
    assert (
        await record(store, e, counts, t + DAY_MS, t + 30, subject=subject, made_at=t) is RecordStatus.ERASED
    )
    assert await all_listed(store, t + 30) == []
    # A conversation made after the erasure is listed; so is one of a caller never erased.
    later = entry("c2", hour)
    assert await record(store, later, [], t + DAY_MS, t + 40, subject=subject, made_at=t + 10 + 1) is (
        RecordStatus.RECORDED
    )
    other = entry("c3", hour)
    assert await record(store, other, [], t + DAY_MS, t + 40, subject=uuid.uuid4().hex, made_at=t) is (
        RecordStatus.RECORDED
    )
    assert await all_listed(store, t + 40) == ["c2", "c3"]
    # Once the tombstone is gone, nothing is held against the caller's old conversations.
    old = entry("c4", hour)
    assert await record(store, old, [], t + 2 * DAY_MS, t + DAY_MS, subject=subject, made_at=t) is (
        RecordStatus.RECORDED
    )


async def test_an_erasure_unlists_what_was_recorded_before_it(store: Store) -> None:
    subject, t = uuid.uuid4().hex, now_ms()
    ended = await end(store, "c1", subject, t)
    e = entry("c1", ended.hour)
    status = await record(
        store, e, increments(e, ended.new_buckets), t + DAY_MS, t + 1, subject=subject, made_at=t
    )
    assert status is RecordStatus.RECORDED
    assert await all_listed(store, t + 1) == ["c1"]
    erased = await store.erase_caller(CallerRef(PROJECT, subject), t + 10, t + DAY_MS)
    assert (erased.conversations, erased.listed) == (1, 1)
    assert await all_listed(store, t + 10) == []
    # Recording it again (a retry that got past the end before the erasure) does not bring it back.
    status = await record(
        store, e, increments(e, ended.new_buckets), t + DAY_MS, t + 20, subject=subject, made_at=t
    )
    assert status is RecordStatus.ERASED
    assert await all_listed(store, t + 20) == []
