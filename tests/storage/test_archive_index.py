"""The archive index (service/domain/store/archive.py) on every backend: a caller's archived objects are
listed before they are written, never for a caller erased since, found until they expire, and unlisted."""

from __future__ import annotations

import uuid

from caller_memory.service.domain.store import CallerRef, Store

NOW = 1_800_000_000_000


def caller() -> CallerRef:
    return CallerRef("shop", uuid.uuid4().hex)


async def test_listed_objects_are_found_until_they_expire_in_key_order(store: Store) -> None:
    who, other = caller(), caller()
    assert await store.list_archived(who, "project=shop/date=2027-01-15/b.jsonl", NOW + 5000, NOW, NOW)
    assert await store.list_archived(who, "project=shop/date=2027-01-15/a.jsonl", NOW + 1000, NOW, NOW)
    assert await store.list_archived(other, "project=shop/date=2027-01-15/c.jsonl", NOW + 5000, NOW, NOW)
    assert await store.archived_objects(who, NOW) == [
        "project=shop/date=2027-01-15/a.jsonl",
        "project=shop/date=2027-01-15/b.jsonl",
    ]
    assert await store.archived_objects(who, NOW + 1000) == ["project=shop/date=2027-01-15/b.jsonl"]
    assert await store.archived_objects(who, NOW + 5000) == []
    assert await store.archived_objects(CallerRef("other-project", who.subject), NOW) == []


async def test_listing_again_keeps_the_later_expiry(store: Store) -> None:
    who = caller()
    assert await store.list_archived(who, "k", NOW + 5000, NOW, NOW)
    assert await store.list_archived(who, "k", NOW + 1000, NOW, NOW)
    assert await store.archived_objects(who, NOW + 2000) == ["k"]
    assert await store.list_archived(who, "k", NOW + 9000, NOW, NOW)
    assert await store.archived_objects(who, NOW + 6000) == ["k"]


async def test_a_caller_erased_since_the_end_gets_nothing_listed(store: Store) -> None:
    who = caller()
    await store.erase_caller(who, NOW, NOW + 3_600_000)
    assert not await store.list_archived(who, "made-before", NOW + 5000, NOW - 1, NOW + 10)
    assert not await store.list_archived(who, "made-at-the-erasure", NOW + 5000, NOW, NOW + 10)
    assert await store.archived_objects(who, NOW + 10) == []
    # An end made after the erasure is a new life of the caller: listed.
    assert await store.list_archived(who, "made-after", NOW + 5000, NOW + 1, NOW + 10)
    assert await store.archived_objects(who, NOW + 10) == ["made-after"]


async def test_unlisting_removes_what_was_listed_and_counts_it(store: Store) -> None:
    who = caller()
    for key in ("a", "b", "c"):
        assert await store.list_archived(who, key, NOW + 5000, NOW, NOW)
    assert await store.unlist_archived(who, ["a", "c", "c", "never"]) == 2
    assert await store.archived_objects(who, NOW) == ["b"]
    assert await store.unlist_archived(who, []) == 0
