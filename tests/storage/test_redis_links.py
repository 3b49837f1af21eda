"""What only the Redis backend's linked identifiers have (service/storage/redis/links.py), on a standalone
server and on a Redis Cluster: the keys and their slots, a link made in steps (and finished when it is made
again after a crash between them), expiry by PEXPIREAT, nothing left after erasure, and the round trips of a
read. The behaviour itself is the contract suite's (test_links.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import redis.asyncio
from caller_memory.service.domain.store.links import Link, LinkStatus, ProfileMoved
from caller_memory.service.storage.redis import keys
from caller_memory.service.storage.redis.cluster import slot_of
from caller_memory.service.storage.redis.store import RedisStore
from redis.crc import key_slot

from tests.storage.test_contract import PROJECT, TTL, decimal, ending, field, new_subject, now_ms, values
from tests.storage.test_links import MAX, first_interaction, link, link_to, ref, remember

Client = redis.asyncio.Redis | redis.asyncio.RedisCluster


def slot(key: str) -> int:
    return key_slot(key.encode())


async def cut_short(store: RedisStore, profile: str, new: Link, at: int, steps: int) -> Link:
    """The first ``steps`` steps of a merging link, as a service that died after them left it."""
    found = await store._reserve(ref(profile), new, MAX, at)
    assert isinstance(found, tuple)
    reserved, mark = found
    if steps >= 2:
        status, memory = await store._make_alias(ref(profile), reserved, True, at)
        assert status == 0
        if steps >= 3:
            assert await store._absorb(ref(profile), reserved, memory, at, mark) is not None
    return reserved


def test_link_keys_live_in_their_subjects_slots() -> None:
    alias, profile = new_subject(), new_subject()
    # The alias record beside the alias's memory (a write script on it reads it atomically), the list of
    # links beside the profile's.
    assert slot(keys.alias_key(PROJECT, alias)) == slot(keys.memory_key(PROJECT, alias))
    assert slot(keys.links_key(PROJECT, profile)) == slot(keys.memory_key(PROJECT, profile))
    for subject in (alias, profile):
        caller = [
            keys.alias_key(PROJECT, subject),
            keys.links_key(PROJECT, subject),
            keys.memory_key(PROJECT, subject),
            keys.caller_index_key(subject),
            keys.first_interaction_key(PROJECT, subject),
            keys.tombstone_key(PROJECT, subject),
        ]
        assert slot_of([("EVALSHA", "0" * 40, len(caller), *caller)]) == slot(caller[0])
    assert keys.alias_key(PROJECT, alias) != keys.alias_key("bakery", alias)  # projects do not share links


async def test_a_merge_cut_short_once_the_alias_is_set_is_finished_by_linking_again(
    redis_store: RedisStore, redis_client: Client
) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(redis_store, p, {"of": field("p", t)}, t)
    await remember(redis_store, a, {"of": field("a", t + 1), "mine": field("a", t)}, t + 1)
    reserved = await cut_short(redis_store, p, link_to(a, t + 2), t + 2, steps=2)
    # Linked, not merged: listed as merging; the alias is read as the profile and refuses writes.
    assert await redis_store.list_links(ref(p), t + 2) == [dataclasses.replace(reserved, merging=True)]
    assert await redis_store.resolve_profile(ref(a), t + 2) == p
    assert values(await redis_store.read_fields(ref(a), t + 2)) == {"of": "p"}
    with pytest.raises(ProfileMoved):
        await redis_store.patch_fields(ref(a), {"x": field(1, t + 2)}, [], t + 2)
    assert await redis_client.exists(keys.memory_key(PROJECT, a)) == 1  # its memory waits for the merge
    # The same link again (a new id, and without merge: the cut-short one had it) finishes it.
    again = await link(redis_store, p, a, t + 3)
    assert again.status is LinkStatus.RENEWED and again.link is not None
    assert (again.link.link_id, again.link.linked_at, again.link.merging) == (reserved.link_id, t + 2, False)
    assert again.fields_merged == 2
    assert values(await redis_store.read_fields(ref(p), t + 3)) == {"of": "a", "mine": "a"}
    assert [x.merging for x in await redis_store.list_links(ref(p), t + 3)] == [False]
    assert await redis_client.exists(keys.memory_key(PROJECT, a)) == 0


async def test_a_merge_cut_short_before_the_alias_is_emptied_does_not_merge_twice(
    redis_store: RedisStore, redis_client: Client
) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(redis_store, a, {"mine": field("a", t), "kept": field("a", t)}, t)
    await first_interaction(redis_store, a, "a-first", t)
    await cut_short(redis_store, p, link_to(a, t + 1), t + 1, steps=3)
    assert [x.merging for x in await redis_store.list_links(ref(p), t + 1)] == [False]
    for name in (keys.memory_key(PROJECT, a), keys.first_interaction_key(PROJECT, a)):
        assert await redis_client.exists(name) == 1  # merged into the profile, not yet removed here
    # The profile deletes a merged field; finishing the link must not bring it back.
    await redis_store.patch_fields(ref(p), {}, ["mine"], t + 2)
    again = await link(redis_store, p, a, t + 3, merge=True)
    assert (again.status, again.fields_merged, again.first_interaction_merged) == (
        LinkStatus.RENEWED,
        0,
        False,
    )
    assert values(await redis_store.read_fields(ref(p), t + 3)) == {"kept": "a"}
    for name in (keys.memory_key(PROJECT, a), keys.first_interaction_key(PROJECT, a)):
        assert await redis_client.exists(name) == 0
    assert (await redis_store.erase_caller(ref(a), t + 4, t + TTL)).first_interaction is False


async def test_a_reservation_cut_short_holds_its_place_until_the_link_is_made(
    redis_store: RedisStore,
) -> None:
    p, q, a, t = new_subject(), new_subject(), new_subject(), now_ms()
    reserved = await cut_short(redis_store, p, link_to(a, t), t, steps=1)
    assert [x.merging for x in await redis_store.list_links(ref(p), t)] == [True]
    assert await redis_store.resolve_profile(ref(a), t) == a  # not an alias yet
    # It counts: toward the limit, and as a link of the profile's (which is then not made an alias).
    assert (await link(redis_store, p, new_subject(), t, max_links=1)).status is LinkStatus.TOO_MANY
    assert (await link(redis_store, q, p, t)).status is LinkStatus.HAS_LINKS
    made = await link(redis_store, p, a, t + 1)
    assert made.status is LinkStatus.LINKED and made.link is not None
    assert made.link.link_id == reserved.link_id
    assert await redis_store.resolve_profile(ref(a), t + 1) == p


async def test_unlinking_a_link_cut_short_before_its_merge_leaves_the_identifier_its_memory(
    redis_store: RedisStore,
) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(redis_store, a, {"mine": field("a", t)}, t)
    reserved = await cut_short(redis_store, p, link_to(a, t + 1), t + 1, steps=2)
    removed = await redis_store.unlink_identifier(ref(p), t + 2, subject=a)
    assert removed is not None and removed.link_id == reserved.link_id and removed.merging
    # Nothing was merged: its memory is still its own.
    assert values(await redis_store.read_fields(ref(a), t + 2)) == {"mine": "a"}
    assert await redis_store.read_fields(ref(p), t + 2) == {}


async def test_an_erasure_of_the_profile_while_a_link_is_made_wins(
    redis_store: RedisStore, redis_client: Client
) -> None:
    """The profile's erasure lands between the steps of a link made before it (here: an erasure stamped after
    the link's time): nothing of the identifier's memory reaches the profile, and no link is left."""
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(redis_store, a, {"mine": field("a", t)}, t)
    await redis_store.erase_caller(ref(p), t + 1, t + TTL)
    result = await link(redis_store, p, a, t, merge=True)
    assert result.status is LinkStatus.LINKED and result.fields_merged == 0
    assert await redis_store.read_fields(ref(p), t + 2) == {}
    assert await redis_store.list_links(ref(p), t + 2) == []
    assert await redis_store.resolve_profile(ref(a), t + 2) == a
    for name in (keys.alias_key(PROJECT, a), keys.links_key(PROJECT, p), keys.memory_key(PROJECT, p)):
        assert await redis_client.exists(name) == 0


async def test_a_merge_takes_fields_packed_by_an_earlier_release(
    redis_store: RedisStore, redis_client: Client
) -> None:
    """Decimal times (before the base-36 form) on either side of a merge: the later write of a name wins, the
    dead one is not taken, and what moves keeps its stored form."""
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(redis_store, p, {"name": field("Bo", t + 5), "cheese": field("brie", t + 5)}, t + 5)
    older = decimal("Ada", t + 10)
    await redis_client.hset(
        keys.memory_key(PROJECT, p), "cheese", decimal("stilton", t)
    )  # the profile's own older field, from before the upgrade
    await redis_client.hset(
        keys.memory_key(PROJECT, a),
        mapping={"name": older, "cheese": decimal("gouda", t + 1), "gone": decimal(1, t - TTL, 1)},
    )
    await redis_client.pexpireat(keys.memory_key(PROJECT, a), t + 10 + TTL)
    result = await link(redis_store, p, a, t + 20, merge=True)
    assert result.status is LinkStatus.LINKED and result.fields_merged == 2
    merged = await redis_store.read_fields(ref(p), t + 21)
    assert values(merged) == {"name": "Ada", "cheese": "gouda"}
    assert (await redis_client.hget(keys.memory_key(PROJECT, p), "name")) == older


async def test_link_keys_expire_with_their_links(redis_store: RedisStore, redis_client: Client) -> None:
    p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
    await link(redis_store, p, a, t)
    await link(redis_store, p, b, t, ttl=2 * TTL)
    assert await redis_client.pexpiretime(keys.alias_key(PROJECT, a)) == t + TTL
    assert await redis_client.pexpiretime(keys.alias_key(PROJECT, b)) == t + 2 * TTL
    assert await redis_client.pexpiretime(keys.links_key(PROJECT, p)) == t + 2 * TTL  # its latest link
    # The latest one unlinked: the list lives as long as the one left.
    await redis_store.unlink_identifier(ref(p), t + 1, subject=b)
    assert await redis_client.exists(keys.alias_key(PROJECT, b)) == 0
    assert await redis_client.pexpiretime(keys.links_key(PROJECT, p)) == t + TTL
    # A renewal moves both.
    assert (await link(redis_store, p, a, t + 2, ttl=3 * TTL)).status is LinkStatus.RENEWED
    assert await redis_client.pexpiretime(keys.alias_key(PROJECT, a)) == t + 2 + 3 * TTL
    assert await redis_client.pexpiretime(keys.links_key(PROJECT, p)) == t + 2 + 3 * TTL
    # An expired entry (before Redis's clock gets there) is dropped by the next link to the profile.
    c = new_subject()
    await link(redis_store, p, b, t + 3, ttl=1_000)
    await link(redis_store, p, c, t + 1_003)
    assert set(await redis_client.hkeys(keys.links_key(PROJECT, p))) == {a.encode(), c.encode()}


async def test_erasure_leaves_no_link_behind(redis_store: RedisStore, redis_client: Client) -> None:
    p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
    await remember(redis_store, b, {"mine": field("b", t)}, t)
    await link(redis_store, p, a, t)
    await link(redis_store, p, b, t, merge=True)
    # As the domain erases a profile: the profile, then each identifier its list named.
    linked = [x.subject for x in await redis_store.list_links(ref(p), t + 1)]
    assert (await redis_store.erase_caller(ref(p), t + 1, t + TTL)).links == 2
    for subject in linked:
        assert (await redis_store.erase_caller(ref(subject), t + 1, t + TTL)).links == 1
    left = [k for k in await redis_client.keys("cm:*") if b":la:" in k or b":ll:" in k or b":m:" in k]
    assert left == []


async def test_a_read_is_one_round_trip_unless_through_an_alias(
    redis_store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(redis_store, p, {"of": field("p", t)}, t)
    await link(redis_store, p, a, t)
    # A cluster node runs a script by its SHA only once it has seen its text: the first refused write on
    # a's node is EVALSHA, NOSCRIPT, then EVAL. Counted here is the steady state, so that node sees it first.
    with pytest.raises(ProfileMoved):
        await redis_store.patch_fields(ref(a), {"x": field(1, t)}, [], t)
    transport = redis_store._transport
    sent: list[tuple[Any, ...]] = []
    run = transport.run

    async def counted(*commands: Any, **options: Any) -> list[Any]:
        sent.append(commands)
        return await run(*commands, **options)

    monkeypatch.setattr(transport, "run", counted)
    assert values(await redis_store.read_fields(ref(p), t)) == {"of": "p"}
    assert [[c[0] for c in call] for call in sent] == [["HGETALL", "GET"]]
    sent.clear()
    assert values(await redis_store.read_fields(ref(a), t)) == {"of": "p"}
    assert [[c[0] for c in call] for call in sent] == [["HGETALL", "GET"], ["HGETALL"]]
    sent.clear()
    assert await redis_store.resolve_profile(ref(a), t) == p
    assert len(sent) == 1
    sent.clear()
    with pytest.raises(ProfileMoved):
        await redis_store.patch_fields(ref(a), {"x": field(1, t)}, [], t)
    assert len(sent) == 1  # the refusal is the write script's own answer


async def test_an_end_refused_for_an_alias_leaves_no_claim(
    redis_store: RedisStore, redis_client: Client
) -> None:
    """On a cluster the service claims the conversation id before the script (another slot): the script's
    "moved" makes it take the claim back (on one server the script claims after its alias check)."""
    p, a, t = new_subject(), new_subject(), now_ms()
    await link(redis_store, p, a, t)
    with pytest.raises(ProfileMoved):
        await redis_store.end_conversation(ending(a, "conv-1", t + 1, sets={"x": field(1, t + 1)}), t + 1)
    assert await redis_client.exists(keys.conversation_claim_key(PROJECT, "conv-1")) == 0
    assert await redis_client.exists(keys.conversation_record_key(PROJECT, a, "conv-1")) == 0
