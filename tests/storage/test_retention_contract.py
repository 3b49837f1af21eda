"""Sweeps, leases, tombstones and the audit log: the Store contract, on SQLite and Redis."""

from __future__ import annotations

import json
import random
import time
import uuid

from caller_memory.service.domain.clock import DAY_MS, HOUR_MS, bucket_start
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import (
    AnalyticsInput,
    AuditEntry,
    CallerRef,
    EndStatus,
    EndWrite,
    Outcome,
    Store,
)

PROJECT = "shop"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def field(value: object, at: int, ttl: int) -> StoredField:
    return StoredField(json.dumps(value).encode(), expires_at=at + ttl, written_at=at)


async def sweep_all(store: Store, now: int, batch: int = 1000) -> dict[str, int]:
    total: dict[str, int] = {}
    more = True
    while more:
        counts, more = await store.sweep(now, batch)
        for kind, count in counts.items():
            total[kind] = total.get(kind, 0) + count
    return total


async def test_a_sweep_removes_exactly_what_expired(store: Store) -> None:
    rng = random.Random(5)
    t = now_ms()
    model: dict[tuple[str, str], int] = {}  # (subject, name) -> expires_at
    for _ in range(60):
        subject = uuid.uuid4().hex
        for name in rng.sample(["a", "b", "c", "d"], rng.randint(1, 4)):
            ttl = rng.choice([60_000, 300_000, 3_600_000, 36_000_000])
            await store.patch_fields(CallerRef(PROJECT, subject), {name: field(name, t, ttl)}, [], t)
            model[(subject, name)] = t + ttl
    cutoff = t + 600_000
    dead = [key for key, expires in model.items() if expires <= cutoff]
    subjects = {s for s, _ in model}
    emptied = [s for s in subjects if all(model[(s, n)] <= cutoff for (s2, n) in model if s2 == s)]
    removed = await sweep_all(store, cutoff, batch=7)  # small batches: several rounds
    assert removed["fields"] == len(dead)
    assert removed["callers"] == len(emptied)
    for subject in subjects:
        live = await store.read_fields(
            CallerRef(PROJECT, subject), t
        )  # read "before" the cutoff: only survivors left
        assert set(live) == {n for (s, n), e in model.items() if s == subject and e > cutoff}
    again = await sweep_all(store, cutoff)
    assert again["fields"] == 0 and again["callers"] == 0  # safe to repeat


async def test_an_interrupted_sweep_is_resumed_by_the_next(store: Store) -> None:
    t = now_ms()
    for i in range(30):
        await store.patch_fields(CallerRef(PROJECT, uuid.uuid4().hex), {"a": field(i, t, 60_000)}, [], t)
    counts, more = await store.sweep(t + 120_000, 10)  # one round, then "the process dies"
    assert more and counts["fields"] >= 10
    rest = await sweep_all(store, t + 120_000, batch=10)
    assert counts["fields"] + rest["fields"] == 30 and counts["callers"] + rest["callers"] == 30


async def test_leases(store: Store) -> None:
    t = now_ms()
    assert await store.acquire_lease("sweep", "a", t, 10_000)
    assert not await store.acquire_lease("sweep", "b", t + 5_000, 10_000)
    assert await store.acquire_lease("sweep", "a", t + 5_000, 10_000)  # renewal by the holder
    assert not await store.acquire_lease("sweep", "b", t + 14_000, 10_000)
    assert await store.acquire_lease("sweep", "b", t + 15_001, 10_000)  # expired: free for another
    await store.release_lease("sweep", "a")  # not the holder: nothing happens
    assert not await store.acquire_lease("sweep", "a", t + 16_000, 10_000)
    await store.release_lease("sweep", "b")
    assert await store.acquire_lease("sweep", "a", t + 16_000, 10_000)


async def test_sweep_reports_keep_the_latest_hundred(store: Store) -> None:
    for i in range(105):
        await store.record_sweep(json.dumps({"n": i}).encode())
    latest = [json.loads(r)["n"] for r in await store.list_sweeps(200)]
    assert latest == list(range(104, 4, -1))
    assert len(await store.list_sweeps(3)) == 3


async def test_audit_log_pages_newest_first(store: Store) -> None:
    ids = []
    for i in range(5):
        entry = AuditEntry(at=1000 + i, actor="operator", action="test", details={"n": i}, receipt_id=None)
        ids.append(await store.append_audit(PROJECT, entry))
    assert ids == sorted(ids)
    page = await store.list_audit(PROJECT, 2, None)
    assert [e.details["n"] for e in page] == [4, 3] and page[0].id == ids[4]
    rest = await store.list_audit(PROJECT, 10, page[-1].id)
    assert [e.details["n"] for e in rest] == [2, 1, 0]
    assert await store.list_audit("other", 10, None) == []


def analytics(at: int) -> AnalyticsInput:
    hour = at - at % HOUR_MS
    return AnalyticsInput(hour, bucket_start("day", hour), bucket_start("week", hour), Outcome(), at + DAY_MS)


async def test_the_tombstone_drops_writes_made_before_the_erasure(store: Store) -> None:
    subject, t = uuid.uuid4().hex, now_ms()

    async def end(conv: str, made_at: int, at: int) -> EndStatus:
        sets = {"a": field(conv, at, 60_000)}
        write = EndWrite(
            CallerRef(PROJECT, subject), conv, conv, at + DAY_MS, made_at, sets, (), analytics(at)
        )
        return (await store.end_conversation(write, at)).status

    assert await end("c1", t, t) is EndStatus.APPLIED
    erased = await store.erase_caller(CallerRef(PROJECT, subject), t + 10, t + DAY_MS)
    assert erased.fields == 1 and erased.first_interaction and erased.conversations == 1
    # Made before the erasure, arriving after it: dropped.
    assert await end("c2", t + 5, t + 20) is EndStatus.ERASED
    assert await store.read_fields(CallerRef(PROJECT, subject), t + 20) == {}
    # Made after it (the caller called again): kept, and a first interaction again.
    assert await end("c3", t + 30, t + 30) is EndStatus.APPLIED
    assert set(await store.read_fields(CallerRef(PROJECT, subject), t + 30)) == {"a"}
    # The tombstone does not outlive its time.
    assert await end("c4", t + 5, t + DAY_MS + 1) is EndStatus.APPLIED


async def test_an_erasure_wins_over_a_replay_made_after_it(store: Store) -> None:
    """The erasure removed what c1 wrote: an end of c1 is refused as erased however late it says it was made
    (a retry without ``ended_at`` counts as made when it arrives), for any caller, until c1's record would
    have expired; the receipt still counts the link it cut."""
    subject, other, t = uuid.uuid4().hex, uuid.uuid4().hex, now_ms()

    async def end(conv: str, who: str, at: int, made_at: int | None = None, value: str = "x") -> EndStatus:
        sets = {"a": field(value, at, 7 * DAY_MS)}
        made = at if made_at is None else made_at
        write = EndWrite(
            CallerRef(PROJECT, who), conv, conv + value, at + DAY_MS, made, sets, (), analytics(at)
        )
        return (await store.end_conversation(write, at)).status

    assert await end("c1", subject, t) is EndStatus.APPLIED
    erased = await store.erase_caller(CallerRef(PROJECT, subject), t + 10, t + 7 * DAY_MS)
    assert erased.conversations == 1 and erased.fields == 1
    for at in (t + 20, t + HOUR_MS, t + DAY_MS - 1):  # the record of c1 lived until t + DAY_MS
        assert await end("c1", subject, at) is EndStatus.ERASED  # made after the erasure: still erased
        assert await end("c1", subject, at, value="y") is EndStatus.ERASED  # whatever the body
        assert await end("c1", other, at) is EndStatus.ERASED  # whoever sends it
        assert await store.read_fields(CallerRef(PROJECT, subject), at) == {}
        assert await store.read_fields(CallerRef(PROJECT, other), at) == {}
    # A second erasure finds no link left to cut (the marker names nobody).
    again = await store.erase_caller(CallerRef(PROJECT, subject), t + 30, t + 7 * DAY_MS)
    assert again.conversations == 0 and again.fields == 0
    # Another conversation of the caller after the erasure is kept; c1 is a free id once its time is over.
    assert await end("c2", subject, t + 40) is EndStatus.APPLIED
    assert await end("c1", other, t + DAY_MS) is EndStatus.APPLIED
    assert set(await store.read_fields(CallerRef(PROJECT, other), t + DAY_MS)) == {"a"}
