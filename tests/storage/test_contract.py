"""The Store contract: every test taking ``store`` runs identically against SQLite and Redis.

Times are explicit ``now_ms`` values based on the real clock (Redis itself expires the hash at the latest
field expiry in *its* time, so a base far in the past would let Redis delete data the test still expects).
The Redis-only tests at the end look at the keys the backend leaves on the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
import uuid
from typing import Any, cast

import pytest
import redis.asyncio
from caller_memory.service.domain.clock import HOUR_MS, bucket_start
from caller_memory.service.domain.errors import StoreCorrupt, StoreUnavailable
from caller_memory.service.domain.fields import StoredField, WriteCondition, compute_etag, live_fields
from caller_memory.service.domain.store import (
    AnalyticsInput,
    CallerRef,
    ConversationEntry,
    EndResult,
    EndStatus,
    EndWrite,
    ListingPage,
    Outcome,
    Store,
    TokenRecord,
)
from caller_memory.service.storage.codec import encode_entry
from caller_memory.service.storage.redis import keys
from caller_memory.service.storage.redis.store import RedisStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from tests.support.redis_server import RedisServer
from tests.support.replies import raw, raws

PROJECT = "cheese-shop"
TTL = 60_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_subject() -> str:
    return uuid.uuid4().hex


def field(value: Any, at: int, ttl: int = TTL) -> StoredField:
    return StoredField(value=json.dumps(value).encode(), expires_at=at + ttl, written_at=at)


def values(fields: dict[str, StoredField]) -> dict[str, Any]:
    return {name: json.loads(f.value) for name, f in fields.items()}


def token(token_id: str, project: str, created_at: int, role: str = "agent") -> TokenRecord:
    # A secret hash with every awkward byte: it must come back exactly, not as text.
    return TokenRecord(token_id, project, role, bytes(range(256))[::8] + b"\x00\xff|", created_at, "label é")


# Projects ---------------------------------------------------------------------------------------------


async def test_project_put_get_replace(store: Store) -> None:
    t = now_ms()
    assert await store.get_project(PROJECT) is None
    assert await store.put_project(PROJECT, b'{"v": 1}', t) is True
    assert await store.get_project(PROJECT) == b'{"v": 1}'
    assert await store.put_project(PROJECT, b'{"v": 2}', t + 1) is False
    assert await store.get_project(PROJECT) == b'{"v": 2}'
    assert await store.get_project("other") is None


async def test_projects_are_listed_in_order(store: Store) -> None:
    t = now_ms()
    assert await store.list_projects() == []
    for project in ("zoo", PROJECT, "bakery"):
        await store.put_project(project, b"{}", t)
    await store.put_project(PROJECT, b'{"v": 2}', t + 1)  # replaced, not listed twice
    assert await store.list_projects() == ["bakery", PROJECT, "zoo"]


async def test_open_ping_and_close(store: Store) -> None:
    await store.open()  # opening an open store changes nothing
    await store.ping()
    await store.close()
    await store.close()  # closing twice is safe
    with pytest.raises(StoreUnavailable):
        await store.ping()  # closed: unavailable, not a driver error
    await store.open()  # and it can be opened again
    await store.ping()
    assert await store.read_fields(CallerRef(PROJECT, new_subject()), now_ms()) == {}


# Tokens -----------------------------------------------------------------------------------------------


async def test_tokens_put_get_list_delete(store: Store) -> None:
    t = now_ms()
    newer, older, same_time, theirs = (
        token("tok-b", PROJECT, t + 10, "admin"),
        token("tok-c", PROJECT, t),
        token("tok-a", PROJECT, t + 10),
        token("tok-z", "other", t),
    )
    for record in (newer, older, same_time, theirs):
        await store.put_token(record)

    assert await store.get_token("tok-b") == newer
    assert await store.get_token("tok-z") == theirs
    assert await store.get_token("missing") is None
    # Oldest first; equal creation times by token id.
    assert await store.list_tokens(PROJECT) == [older, same_time, newer]
    assert await store.list_tokens("other") == [theirs]
    assert await store.list_tokens("nobody") == []

    assert await store.delete_token(PROJECT, "tok-z") is False  # another project's token
    assert await store.get_token("tok-z") == theirs
    assert await store.list_tokens("other") == [theirs]
    assert await store.delete_token(PROJECT, "tok-b") is True
    assert await store.get_token("tok-b") is None
    assert await store.list_tokens(PROJECT) == [older, same_time]
    assert await store.delete_token(PROJECT, "tok-b") is False


# Caller memory ----------------------------------------------------------------------------------------


async def test_unknown_caller_reads_empty(store: Store) -> None:
    assert await store.read_fields(CallerRef(PROJECT, new_subject()), now_ms()) == {}


async def test_patch_sets_and_returns_fields(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    sets = {"cheese_type": field("gouda", t), "visits": field({"n": 3, "tags": ["a|b"]}, t)}
    result = await store.patch_fields(CallerRef(PROJECT, subject), sets, [], t)
    assert result.applied is True
    assert result.fields == sets
    assert await store.read_fields(CallerRef(PROJECT, subject), t) == sets
    assert await store.read_fields(CallerRef("other", subject), t) == {}  # projects do not share callers


async def test_patch_is_a_merge(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"cheese_type": field("gouda", t)}, [], t)
    result = await store.patch_fields(
        CallerRef(PROJECT, subject), {"booking_day": field("Friday", t + 5)}, [], t + 5
    )
    assert values(result.fields) == {"cheese_type": "gouda", "booking_day": "Friday"}
    assert values(await store.read_fields(CallerRef(PROJECT, subject), t + 5)) == {
        "cheese_type": "gouda",
        "booking_day": "Friday",
    }


async def test_latest_write_wins(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"booking_day": field("Friday", t)}, [], t)
    await store.patch_fields(CallerRef(PROJECT, subject), {"booking_day": field("Monday", t + 1)}, [], t + 1)
    assert await store.read_fields(CallerRef(PROJECT, subject), t + 1) == {
        "booking_day": field("Monday", t + 1)
    }


async def test_deletes_remove_fields(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t), "b": field(2, t)}, [], t)
    result = await store.patch_fields(CallerRef(PROJECT, subject), {}, ["a", "never_there"], t + 1)
    assert result.applied is True
    assert values(result.fields) == {"b": 2}
    assert values(await store.read_fields(CallerRef(PROJECT, subject), t + 1)) == {"b": 2}


async def test_expired_fields_are_not_returned_and_go_on_next_write(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(
        CallerRef(PROJECT, subject), {"short": field(1, t, 10_000), "long": field(2, t)}, [], t
    )
    assert set(await store.read_fields(CallerRef(PROJECT, subject), t + 9_999)) == {"short", "long"}
    # Dead at its expiry instant exactly, without any sweep.
    assert set(await store.read_fields(CallerRef(PROJECT, subject), t + 10_000)) == {"long"}
    assert set(await store.read_fields(CallerRef(PROJECT, subject), t + 10_001)) == {"long"}

    # A write at the expiry instant: the field is dead then, so the write removes it.
    result = await store.patch_fields(
        CallerRef(PROJECT, subject), {"new": field(3, t + 10_000)}, [], t + 10_000
    )
    assert set(result.fields) == {"long", "new"}
    # The dead field was physically removed by that write: erasure finds only two fields.
    assert (await store.erase_caller(CallerRef(PROJECT, subject), now_ms(), now_ms() + TTL)).fields == 2


async def test_rewriting_a_field_renews_it(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"a": field("x", t, 10_000)}, [], t)
    await store.patch_fields(CallerRef(PROJECT, subject), {"a": field("x", t + 5_000, 10_000)}, [], t + 5_000)
    assert await store.read_fields(CallerRef(PROJECT, subject), t + 12_000) == {
        "a": field("x", t + 5_000, 10_000)
    }
    assert await store.read_fields(CallerRef(PROJECT, subject), t + 15_000) == {}


async def test_all_fields_deleted_leaves_the_caller_gone(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t), "b": field(2, t)}, [], t)
    result = await store.patch_fields(CallerRef(PROJECT, subject), {}, ["a", "b"], t + 1)
    assert result.applied is True
    assert result.fields == {}
    assert await store.read_fields(CallerRef(PROJECT, subject), t + 1) == {}
    assert (await store.erase_caller(CallerRef(PROJECT, subject), now_ms(), now_ms() + TTL)).fields == 0


async def test_erase_removes_everything_and_counts_fields(store: Store) -> None:
    subject, other, t = new_subject(), new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t, 1_000), "b": field(2, t)}, [], t)
    await store.patch_fields(CallerRef(PROJECT, other), {"a": field(1, t)}, [], t)
    # Dead fields not yet removed count too: erasure reports what it physically removed.
    assert (await store.erase_caller(CallerRef(PROJECT, subject), now_ms(), now_ms() + TTL)).fields == 2
    assert await store.read_fields(CallerRef(PROJECT, subject), t) == {}
    assert (await store.erase_caller(CallerRef(PROJECT, subject), now_ms(), now_ms() + TTL)).fields == 0
    assert values(await store.read_fields(CallerRef(PROJECT, other), t)) == {"a": 1}


# Write conditions (If-Match) -------------------------------------------------------------------------

# Names whose byte order differs from case-insensitive or locale-aware orders (the ETag sorts by code point).
AWKWARD_NAMES = ["Zeta", "_under", "a_b", "ab", "alpha", "B"]
TTLS = dict.fromkeys(AWKWARD_NAMES, TTL)


async def test_matching_etag_applies(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    first = await store.patch_fields(
        CallerRef(PROJECT, subject), {n: field(n, t) for n in AWKWARD_NAMES}, [], t
    )
    etag = compute_etag(live_fields(first.fields, TTLS, t + 1))
    condition = WriteCondition(etags=('"0000"', etag), any_existing=False, ttl_ms=TTLS)
    result = await store.patch_fields(
        CallerRef(PROJECT, subject), {"B": field("new", t + 1)}, [], t + 1, condition
    )
    assert result.applied is True
    assert values(result.fields)["B"] == "new"


async def test_stale_etag_refuses_and_changes_nothing(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    first = await store.patch_fields(CallerRef(PROJECT, subject), {"ab": field(1, t)}, [], t)
    stale = compute_etag(live_fields(first.fields, TTLS, t))
    second = await store.patch_fields(CallerRef(PROJECT, subject), {"ab": field(2, t + 1)}, [], t + 1)
    condition = WriteCondition(etags=(stale,), any_existing=False, ttl_ms=TTLS)
    refused = await store.patch_fields(
        CallerRef(PROJECT, subject), {"alpha": field(3, t + 2)}, ["ab"], t + 2, condition
    )
    assert refused.applied is False
    assert refused.fields == second.fields
    assert await store.read_fields(CallerRef(PROJECT, subject), t + 2) == second.fields


async def test_any_existing_condition(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    star = WriteCondition(etags=(), any_existing=True, ttl_ms=TTLS)
    refused = await store.patch_fields(CallerRef(PROJECT, subject), {"ab": field(1, t)}, [], t, star)
    assert refused.applied is False
    assert refused.fields == {}
    assert await store.read_fields(CallerRef(PROJECT, subject), t) == {}
    assert (
        await store.erase_caller(CallerRef(PROJECT, subject), now_ms(), now_ms() + TTL)
    ).fields == 0  # nothing was created on the way

    await store.patch_fields(CallerRef(PROJECT, subject), {"ab": field(1, t)}, [], t)
    applied = await store.patch_fields(CallerRef(PROJECT, subject), {"ab": field(2, t + 1)}, [], t + 1, star)
    assert applied.applied is True
    assert values(applied.fields) == {"ab": 2}


async def test_condition_is_evaluated_under_the_current_ttls(store: Store) -> None:
    """A field hidden by a shortened TTL (or dropped from state_keys) is not part of the ETag."""
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {n: field(n, t) for n in AWKWARD_NAMES}, [], t)
    later = t + 1_000  # Zeta's effective expiry under the shortened TTL, exactly: no longer live
    shortened = {**TTLS, "Zeta": 1_000}
    del shortened["alpha"]
    stored = await store.read_fields(CallerRef(PROJECT, subject), later)
    assert set(stored) == set(AWKWARD_NAMES)  # all still stored...
    visible = live_fields(stored, shortened, later)
    assert set(visible) == set(AWKWARD_NAMES) - {"Zeta", "alpha"}  # ...but two no longer live

    with_hidden = WriteCondition(etags=(compute_etag(stored),), any_existing=False, ttl_ms=shortened)
    refused = await store.patch_fields(
        CallerRef(PROJECT, subject), {"ab": field(0, later)}, [], later, with_hidden
    )
    assert refused.applied is False

    live_only = WriteCondition(etags=(compute_etag(visible),), any_existing=False, ttl_ms=shortened)
    result = await store.patch_fields(
        CallerRef(PROJECT, subject), {"ab": field(0, later)}, [], later, live_only
    )
    assert result.applied is True


async def test_empty_etag_list_never_holds(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"ab": field(1, t)}, [], t)
    nothing = WriteCondition(etags=(), any_existing=False, ttl_ms=TTLS)
    assert (await store.patch_fields(CallerRef(PROJECT, subject), {}, ["ab"], t, nothing)).applied is False


# Concurrency -----------------------------------------------------------------------------------------


async def test_concurrent_patches_all_land(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    names = [f"f{i}" for i in range(50)]
    await asyncio.gather(
        *(store.patch_fields(CallerRef(PROJECT, subject), {n: field(n, t)}, [], t) for n in names)
    )
    assert values(await store.read_fields(CallerRef(PROJECT, subject), t)) == {n: n for n in names}


# Ended conversations --------------------------------------------------------------------------------


def ending(
    subject: str,
    conversation_id: str,
    at: int,
    fingerprint: str = "fp",
    sets: dict[str, StoredField] | None = None,
    *,
    deletes: tuple[str, ...] = (),
    ttl: int = TTL,
    made_at: int | None = None,
    analytics: AnalyticsInput | None = None,
    project: str = PROJECT,
) -> EndWrite:
    """The end of a conversation made at ``at`` (unless ``made_at`` says otherwise), remembered for ``ttl``."""
    return EndWrite(
        caller=CallerRef(project, subject),
        conversation_id=conversation_id,
        fingerprint=fingerprint,
        expires_at=at + ttl,
        made_at=at if made_at is None else made_at,
        sets=sets or {},
        deletes=deletes,
        analytics=analytics,
    )


def analytics_at(at: int, retention: int = 10 * TTL, qa: str | None = None) -> AnalyticsInput:
    hour = at - at % HOUR_MS
    return AnalyticsInput(
        hour,
        bucket_start("day", hour),
        bucket_start("week", hour),
        Outcome(qa=qa),
        at + retention,
        at - retention,
    )


async def test_end_applies_once_and_replays(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    first = await store.end_conversation(
        ending(subject, "conv-1", t, "fp-1", {"a": field("x", t)}, analytics=analytics_at(t, qa="resolved")),
        t,
    )
    assert first.status is EndStatus.APPLIED and first.analytics is not None
    assert values(await store.read_fields(CallerRef(PROJECT, subject), t)) == {"a": "x"}
    await store.patch_fields(CallerRef(PROJECT, subject), {"a": field("newer", t + 1)}, [], t + 1)
    # A retry writes nothing (the newer value stays) and returns what was found the first time, whatever
    # analytics it sends (another hour) or none.
    for analytics in (analytics_at(t + 2 * HOUR_MS), None):
        again = await store.end_conversation(
            ending(subject, "conv-1", t + 2, "fp-1", {"a": field("x", t + 2)}, analytics=analytics), t + 2
        )
        assert again.status is EndStatus.REPLAYED
        assert again.analytics == first.analytics
    assert values(await store.read_fields(CallerRef(PROJECT, subject), t + 2)) == {"a": "newer"}
    # Without analytics when first applied: none on a replay either, whatever it sends.
    plain = await store.end_conversation(ending(subject, "conv-2", t, "fp-2"), t)
    assert plain == EndResult(EndStatus.APPLIED, None)
    replay = await store.end_conversation(
        ending(subject, "conv-2", t + 3, "fp-2", analytics=analytics_at(t)), t + 3
    )
    assert replay == EndResult(EndStatus.REPLAYED, None)


async def test_end_with_another_body_or_caller_is_a_conflict(store: Store) -> None:
    subject, other, t = new_subject(), new_subject(), now_ms()
    await store.end_conversation(ending(subject, "conv-1", t, "fp-1", {"a": field(1, t)}), t)
    changed = await store.end_conversation(ending(subject, "conv-1", t, "fp-2", {"a": field(2, t)}), t)
    assert changed == EndResult(EndStatus.CONFLICT, None)
    elsewhere = await store.end_conversation(ending(other, "conv-1", t, "fp-1", {"a": field(3, t)}), t)
    assert elsewhere == EndResult(EndStatus.CONFLICT, None)
    assert values(await store.read_fields(CallerRef(PROJECT, subject), t)) == {"a": 1}
    assert await store.read_fields(CallerRef(PROJECT, other), t) == {}
    # The same id in another project is another conversation.
    assert (
        await store.end_conversation(ending(other, "conv-1", t, "fp-9", project="bakery"), t)
    ).status is EndStatus.APPLIED


async def test_end_deletes_and_expired_records(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    await store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t), "b": field(2, t)}, [], t)
    applied = await store.end_conversation(ending(subject, "conv-2", t, "fp", deletes=("a",), ttl=1_500), t)
    assert applied.status is EndStatus.APPLIED
    assert values(await store.read_fields(CallerRef(PROJECT, subject), t)) == {"b": 2}
    # Once its record has expired, the id can be used again (it is a new conversation then).
    later = t + 2_000
    again = await store.end_conversation(
        ending(subject, "conv-2", later, "other", {"a": field(5, later)}), later
    )
    assert again.status is EndStatus.APPLIED
    assert values(await store.read_fields(CallerRef(PROJECT, subject), later)) == {"a": 5, "b": 2}


async def test_an_expired_conversation_id_is_free_for_another_caller(store: Store) -> None:
    subject, other, t = new_subject(), new_subject(), now_ms()
    await store.end_conversation(ending(subject, "conv-4", t, "fp", ttl=1_000), t)
    later = t + 1_000
    reused = await store.end_conversation(ending(other, "conv-4", later, "fp", {"a": field(1, later)}), later)
    assert reused.status is EndStatus.APPLIED
    assert values(await store.read_fields(CallerRef(PROJECT, other), later)) == {"a": 1}


async def test_concurrent_identical_ends_apply_once(store: Store) -> None:
    subject, t = new_subject(), now_ms()
    results = await asyncio.gather(
        *(
            store.end_conversation(ending(subject, "conv-3", t, "fp", {"n": field(1, t)}), t)
            for _ in range(20)
        )
    )
    statuses = sorted(r.status.value for r in results)
    assert statuses == ["applied"] + ["replayed"] * 19


# Model-based: random patches against a dict --------------------------------------------------------

NAMES = st.sampled_from(["a", "B", "_c", "d_e"])
PATCHES = st.lists(
    st.tuples(
        # TTLs of a second or more (the service's minimum): Redis expires the whole hash in real time, so
        # a TTL shorter than the test's own running time would let Redis drop it before the model does.
        st.dictionaries(NAMES, st.tuples(st.integers(0, 9), st.integers(1_000, 5_000)), max_size=3),
        st.lists(NAMES, max_size=2),
        st.integers(0, 3_000),  # how far the clock moves before the next step
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=PATCHES)
async def test_random_patches_match_a_dict_model(store: Store, steps: list[Any]) -> None:
    subject, t = new_subject(), now_ms()
    model: dict[str, StoredField] = {}
    for sets, deletes, advance in steps:
        deletes = [n for n in deletes if n not in sets]  # a name in both is not something the API sends
        stored = {name: field(v, t, ttl) for name, (v, ttl) in sets.items()}
        result = await store.patch_fields(CallerRef(PROJECT, subject), stored, deletes, t)
        model = {n: f for n, f in model.items() if f.expires_at > t and n not in deletes} | stored
        assert result.applied is True
        assert result.fields == model
        t += advance
        model = {n: f for n, f in model.items() if f.expires_at > t}
        assert await store.read_fields(CallerRef(PROJECT, subject), t) == model


# Redis only: what is left on the server --------------------------------------------------------------


async def test_redis_hash_expiry_and_index_score(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    subject, t = new_subject(), now_ms()
    hash_key, index_key = keys.memory_key(PROJECT, subject), keys.caller_index_key(subject)
    member = keys.index_member(PROJECT, subject)
    await redis_store.patch_fields(
        CallerRef(PROJECT, subject), {"a": field(1, t, 5_000), "b": field(2, t, 90_000)}, [], t
    )
    assert await redis_client.pexpiretime(hash_key) == t + 90_000
    assert await redis_client.zscore(index_key, member) == t + 5_000

    await redis_store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t + 1, 120_000)}, ["b"], t + 1)
    assert await redis_client.pexpiretime(hash_key) == t + 120_001
    assert await redis_client.zscore(index_key, member) == t + 120_001


async def test_redis_a_write_refused_for_an_erased_caller_leaves_no_claim(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    subject, t = new_subject(), now_ms()
    await redis_store.erase_caller(CallerRef(PROJECT, subject), t, t + 86_400_000)
    late = ending(subject, "late-call", t + 5, "f", {"a": field(1, t + 5)}, ttl=86_400_000, made_at=t - 1)
    ended = await redis_store.end_conversation(late, t + 5)
    assert ended.status is EndStatus.ERASED
    # The id's claim would name the erased caller's pseudonym for days.
    assert await redis_client.exists(keys.conversation_claim_key(PROJECT, "late-call")) == 0


async def test_redis_an_erasure_leaves_markers_that_name_nobody(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    subject, t = new_subject(), now_ms()
    ended = await redis_store.end_conversation(
        ending(subject, "c1", t, "f", {"a": field(1, t)}, ttl=86_400_000), t
    )
    assert ended.status is EndStatus.APPLIED
    await redis_store.erase_caller(CallerRef(PROJECT, subject), t + 1, t + 2 * 86_400_000)
    claim = keys.conversation_claim_key(PROJECT, "c1")
    marker = keys.conversation_record_key(PROJECT, subject, "c1")
    assert await redis_client.get(claim) == b"!|%d" % (t + 86_400_000)
    assert await redis_client.hgetall(marker) == {b"erased": b"1", b"expires_at": b"%d" % (t + 86_400_000)}
    for key in (claim, marker):  # gone with the record they replace
        assert await redis_client.pexpiretime(key) == t + 86_400_000
    # Nothing but the tombstone names the caller.
    for name in raws(await redis_client.keys("*")):
        if name != keys.tombstone_key(PROJECT, subject).encode():
            assert subject.encode() not in name
            if await redis_client.type(name) == b"string":
                assert subject.encode() not in raw(await redis_client.get(name))
    # A retry whose claim was taken before the erasure rewrote it (on a cluster the claim and the caller's
    # data are two steps): the marker in the caller's slot refuses it, and no claim naming them is left.
    await redis_client.set(claim, f"{subject}|{t + 86_400_000}")
    retry = ending(subject, "c1", t + 5, "f", {"a": field(1, t + 5)}, ttl=86_400_000 - 5)
    replay = await redis_store.end_conversation(retry, t + 5)
    assert replay.status is EndStatus.ERASED
    assert await redis_store.read_fields(CallerRef(PROJECT, subject), t + 5) == {}
    if redis_store._cluster:  # (on one server this cannot happen: one script checks both, marker first)
        assert await redis_client.exists(claim) == 0


async def test_redis_analytics_of_the_earlier_release_are_read_by_their_hour(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    """Entries stored as "<expires_at>|<json>" and first-interaction records without created_at (made before
    analytics kept their recording times) count as recorded at their hour."""

    t = now_ms()
    hour = t - t % HOUR_MS
    entry = ConversationEntry("old", hour, "voice", None, None, None, None)
    await redis_client.set(keys.analytics_entry_key(PROJECT, "old"), b"%d|" % (t + TTL) + encode_entry(entry))
    for repeat in (None, False):
        await redis_client.zadd(keys.analytics_index_key(PROJECT, repeat), {entry.sort_key: 0})

    async def listed(recorded_after: int) -> list[str]:
        got = await redis_store.list_conversations(
            PROJECT, ListingPage("0", "9", limit=10, recorded_after=recorded_after), t
        )
        return [e.conversation_id for e in got]

    assert await listed(hour - 1) == ["old"]
    assert await listed(hour) == []
    subject = new_subject()
    first = keys.first_interaction_key(PROJECT, subject)
    await redis_client.hset(first, mapping={"conversation_id": "c0", "hour": hour - HOUR_MS, "qa": "",
        "handoff_reason": "", "handoff_to": "", "expires_at": t + TTL, "seen_hour": hour - HOUR_MS,
        "seen_day": 0, "seen_week": 0})  # fmt: skip

    async def first_of(conv: str, first_after: int) -> Any:
        a = AnalyticsInput(hour, bucket_start("day", hour), bucket_start("week", hour), Outcome(), t + TTL,
                           first_after)  # fmt: skip
        ended = await redis_store.end_conversation(ending(subject, conv, t, conv, analytics=a), t)
        assert ended.analytics is not None
        return ended.analytics.first

    assert (await first_of("c1", hour - HOUR_MS - 1)).conversation_id == "c0"
    assert await first_of("c2", hour - HOUR_MS) is None  # created at its hour: at the cutoff, past it
    assert await redis_client.hget(first, "created_at") == b"%d" % t  # the new record keeps its time
    # The erasure of an entry in the earlier form works too.
    assert await redis_store.unlist_conversations(PROJECT, ["old"]) == 1


async def test_redis_over_a_unix_socket() -> None:
    with RedisServer(unix_socket=True) as server:
        assert server.url.startswith("unix://")
        store = RedisStore(server.url, socket_timeout=5.0)
        await store.open()
        try:
            subject, t = new_subject(), now_ms()
            await store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t)}, [], t)
            assert set(await store.read_fields(CallerRef(PROJECT, subject), t)) == {"a"}
        finally:
            await store.close()


async def test_redis_deleting_everything_leaves_no_key(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    subject, t = new_subject(), now_ms()
    await redis_store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t)}, [], t)
    assert await redis_client.exists(keys.memory_key(PROJECT, subject)) == 1
    await redis_store.patch_fields(CallerRef(PROJECT, subject), {}, ["a"], t + 1)
    assert await redis_client.exists(keys.memory_key(PROJECT, subject)) == 0
    assert (
        await redis_client.zscore(keys.caller_index_key(subject), keys.index_member(PROJECT, subject)) is None
    )
    assert await redis_client.keys("*") == []


async def test_redis_erase_leaves_no_key(redis_store: RedisStore, redis_client: redis.asyncio.Redis) -> None:
    subject, t = new_subject(), now_ms()
    await redis_store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t)}, [], t)
    assert (await redis_store.erase_caller(CallerRef(PROJECT, subject), now_ms(), now_ms() + TTL)).fields == 1
    # Only the tombstone is left, and it goes by itself.
    assert await redis_client.keys("*") == [keys.tombstone_key(PROJECT, subject).encode()]
    assert 0 < await redis_client.pttl(keys.tombstone_key(PROJECT, subject)) <= TTL


def test_redis_keys_of_one_caller_share_a_slot() -> None:
    for _ in range(200):
        subject = new_subject()
        bucket = keys.bucket_of(subject)
        assert 0 <= bucket < keys.N_BUCKETS
        assert key_slot(keys.memory_key(PROJECT, subject).encode()) == key_slot(
            keys.caller_index_key(subject).encode()
        )
    assert keys.bucket_of("00001001" + "0" * 24) == 0x1001 % 4096 == 1


async def test_redis_scripts_survive_a_script_flush(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    subject, t = new_subject(), now_ms()
    await redis_client.script_flush()  # what a restarted or failed-over server looks like
    result = await redis_store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t)}, [], t)
    assert values(result.fields) == {"a": 1}


def decimal(value: Any, at: int, ttl: int = TTL) -> bytes:
    """A field as releases before the base-36 times packed it: ``<expires_at>|<written_at>|<json>``."""
    return b"%d|%d|%s" % (at + ttl, at, json.dumps(value).encode())


async def test_redis_memory_packed_by_an_earlier_release_is_read_written_and_swept(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    """An upgrade finds fields with decimal times: every script and read takes them as they are."""
    subject, t = new_subject(), now_ms()
    caller, hash_key = CallerRef(PROJECT, subject), keys.memory_key(PROJECT, subject)
    old = {"name": decimal("Ada", t), "cheese": decimal("gouda", t, 5_000), "gone": decimal(1, t - TTL, 1)}
    await redis_client.hset(
        hash_key, mapping=cast(Any, old)
    )  # redis-py 8 types a mapping invariantly: str keys are refused
    await redis_client.pexpireat(hash_key, t + TTL)
    await redis_client.zadd(keys.caller_index_key(subject), {keys.index_member(PROJECT, subject): t + 1})

    read = await redis_store.read_fields(caller, t)
    assert values(read) == {"name": "Ada", "cheese": "gouda"}
    assert read["cheese"] == field("gouda", t, 5_000) and read["cheese"].packed() == old["cheese"]
    etag = compute_etag(read)  # what a client read before the upgrade was given
    assert etag == compute_etag({n: StoredField.unpack(v) for n, v in old.items() if n != "gone"})

    # patch.lua evaluates If-Match over the stored form, leaves an untouched field in it, writes the new one.
    written = await redis_store.patch_fields(
        caller,
        {"order": field("two", t + 1)},
        [],
        t + 1,
        WriteCondition((etag,), False, dict.fromkeys(old, TTL)),
    )
    assert written.applied and values(written.fields) == {"name": "Ada", "cheese": "gouda", "order": "two"}
    stored = await redis_client.hgetall(hash_key)
    assert stored[b"name"] == old["name"] and b"gone" not in stored  # dead on the way, as always
    assert stored[b"order"] == field("two", t + 1).packed() and stored[b"order"].startswith(b"~")
    assert await redis_client.zscore(keys.caller_index_key(subject), keys.index_member(PROJECT, subject)) == (
        t + 5_000
    )

    # An older checkpoint never overwrites a later write, whichever form the later one is in.
    checkpoint = dataclasses.replace(
        ending(subject, "c-old", t - 10, "fp", {"name": field("Bo", t - 10)}), written_at=t - 10
    )
    ended = await redis_store.end_conversation(checkpoint, t + 2)
    assert ended.status is EndStatus.APPLIED
    assert (await redis_client.hget(hash_key, "name")) == old["name"]

    # The sweep reads the decimal expiry of "cheese" and re-files the caller under the next one.
    counts, _ = await redis_store.sweep(t + 6_000, 100)
    assert counts["fields"] >= 1
    assert sorted(await redis_client.hkeys(hash_key)) == [b"name", b"order"]
    assert await redis_client.zscore(keys.caller_index_key(subject), keys.index_member(PROJECT, subject)) == (
        t + TTL
    )


async def test_redis_scripts_read_negative_base36_times(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    """field.lua's '-' branch (tonumber(s, 36) alone would wrap a sign around): a field written "before the
    epoch" is kept, compared and re-filed by its real times."""
    subject, t = new_subject(), now_ms()
    caller, hash_key = CallerRef(PROJECT, subject), keys.memory_key(PROJECT, subject)
    early = StoredField(b'"old"', t + TTL, -123_456)
    assert b"|-" in early.packed()
    assert (await redis_store.patch_fields(caller, {"a": early, "b": field(2, t, 5_000)}, [], t)).applied
    assert await redis_client.hget(hash_key, "a") == early.packed()
    # An end made at 0 is after the field's write: its checkpoint replaces it (a wrapped sign would not).
    later = field("new", 0, ttl=t + TTL)  # written at 0, expiring with the others
    checkpoint = dataclasses.replace(
        ending(subject, "c-neg", 0, "fp", {"a": later}, ttl=t + TTL), written_at=0
    )
    assert (await redis_store.end_conversation(checkpoint, t + 1)).status is EndStatus.APPLIED
    assert values(await redis_store.read_fields(caller, t + 1))["a"] == "new"
    assert await redis_client.zscore(keys.caller_index_key(subject), keys.index_member(PROJECT, subject)) == (
        t + 5_000
    )


async def test_redis_unreadable_field_is_store_corrupt(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis
) -> None:
    subject, t = new_subject(), now_ms()
    await redis_client.hset(keys.memory_key(PROJECT, subject), "a", b"not a packed field")
    with pytest.raises(StoreCorrupt):
        await redis_store.read_fields(CallerRef(PROJECT, subject), t)
    with pytest.raises(StoreCorrupt):
        await redis_store.patch_fields(CallerRef(PROJECT, subject), {"b": field(1, t)}, [], t)
    assert await redis_client.hkeys(keys.memory_key(PROJECT, subject)) == [b"a"]  # nothing written


async def test_redis_unreachable_and_hung_server_is_store_unavailable() -> None:
    with RedisServer() as server:
        store = RedisStore(server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
        await store.open()
        try:
            os.kill(server.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as hung:
                await store.read_fields(CallerRef(PROJECT, new_subject()), now_ms())
            assert time.monotonic() - started < 0.6  # bounded by the store timeout, not the driver's retries
            assert isinstance(hung.value.__cause__, TimeoutError)  # the call was bounded, and cancelled
            os.kill(server.pid, signal.SIGCONT)
            await store.ping()  # recovers once the server answers again

            server.stop()
            with pytest.raises(StoreUnavailable):
                await store.ping()
            server.start()
            await store.ping()  # same port: the pool reconnects by itself
        finally:
            await store.close()
            await store.close()  # closing twice is safe

        server.stop()
        closed = RedisStore(server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
        with pytest.raises(StoreUnavailable):
            await closed.open()


async def test_an_erasure_leaves_alone_a_reused_id_of_another_caller(store: Store) -> None:
    """c1 ended for A, its record expired, c1 reused for B: erasing A neither unlinks, unlists nor blocks B's."""
    a = new_subject()
    b = a[:8] + new_subject()[8:]  # the same bucket on Redis: the same record key for one id
    t = now_ms()

    async def end(who: str, at: int) -> EndStatus:
        hour = at - at % HOUR_MS
        analytics = AnalyticsInput(
            hour, bucket_start("day", hour), bucket_start("week", hour), Outcome(), at + 10 * TTL
        )
        write = ending(who, "c1", at, "f" + who, {"a": field(who, at)}, analytics=analytics)
        return (await store.end_conversation(write, at)).status

    assert await end(a, t) is EndStatus.APPLIED
    assert await end(b, t + TTL) is EndStatus.APPLIED  # A's record expired: the id is free
    erased = await store.erase_caller(CallerRef(PROJECT, a), t + TTL + 1, t + TTL + 1000)
    assert erased.conversations == 0
    assert await end(b, t + TTL + 2) is EndStatus.REPLAYED  # B's conversation is still B's
    assert values(await store.read_fields(CallerRef(PROJECT, b), t + TTL + 2)) == {"a": b}
