"""What only the Redis backend's webhook queue has (service/storage/redis/webhooks.py), on a standalone server
and on a Redis Cluster: the key layout and its slots, expiry by PEXPIREAT, the caller's listing that an erasure
follows (also when it overtakes an enqueue), the round trips of an enqueue and of a settlement, claims racing
from several stores, and index entries whose delivery Redis expired first. The behaviour itself is the
contract suite's (test_webhooks.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import redis.asyncio
from caller_memory.service.domain.clock import DAY_MS, HOUR_MS
from caller_memory.service.domain.store import CallerRef, RecordStatus
from caller_memory.service.domain.store.webhooks import (
    DELIVERED_KEPT_PER_ENDPOINT,
    Delivery,
    DeliveryStatus,
    Settlement,
)
from caller_memory.service.storage.redis import keys, webhook_enqueue
from caller_memory.service.storage.redis.store import RedisStore
from caller_memory.service.storage.redis.transport import Command, RedisTransport
from caller_memory.service.storage.redis.webhooks import BATCH
from redis.crc import key_slot

from tests.storage.test_webhooks import (
    LEASE,
    P,
    delivery,
    endpoint,
    ids,
    new_caller,
    now_ms,
    recording_of,
)
from tests.support.replies import raw, raws

Client = redis.asyncio.Redis | redis.asyncio.RedisCluster


def slot(key: str | bytes) -> int:
    return key_slot(key if isinstance(key, bytes) else key.encode())


async def all_keys(client: Client) -> set[str]:
    return {k.decode() for k in raws(await client.keys("*"))}


def queue_keys(endpoint_id: str, *delivery_ids: str) -> set[str]:
    """Every key of an endpoint's queue holding these deliveries."""
    hashes = {keys.webhook_delivery_key(P, endpoint_id, i) for i in delivery_ids}
    return {*keys.webhook_queue_keys(P, endpoint_id), *hashes}


async def test_a_queue_is_one_slot_its_index_the_projects_and_its_listing_the_callers(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t, caller = now_ms(), new_caller()
    e = endpoint(t)
    await redis_store.put_endpoint(e)
    d = delivery(t, e.endpoint_id, subject=caller.subject)
    assert await redis_store.enqueue_deliveries([d], caller, t, t)
    assert await redis_store.claim_deliveries(P, e.endpoint_id, t, 10, owner="w", lease_until=t + LEASE) == [
        d
    ]
    assert await redis_store.settle_delivery(P, d.delivery_id, "w", Settlement.FAILED, t + 1, error="x")

    queue = queue_keys(e.endpoint_id, d.delivery_id)
    due, leased, _, _, created = keys.webhook_queue_keys(P, e.endpoint_id)
    index = keys.webhook_index_keys(P)
    listing = keys.caller_webhooks_key(P, caller.subject)
    assert len({slot(k) for k in queue}) == 1
    assert {slot(k) for k in index} == {slot(keys.webhook_endpoints_key(P))}
    # The caller's listing is with their tombstone and memory (erasure reads it there), not with the queue.
    assert slot(listing) == slot(keys.tombstone_key(P, caller.subject))
    assert slot(listing) == slot(keys.memory_key(P, caller.subject))
    expected = {
        # Empty sets are no keys: a failed delivery is in the failed set and the expiry index only.
        *(queue - {due, leased, created}),
        *index,
        listing,
        keys.webhook_endpoints_key(P),
        keys.WEBHOOK_PROJECTS,
        keys.WEBHOOK_WORK,
    }
    assert await all_keys(redis_client) == expected
    # The pseudonym is in the delivery (whom it is about) and in its listing's name; nowhere else.
    for name in expected - {listing, keys.webhook_delivery_key(P, e.endpoint_id, d.delivery_id)}:
        assert caller.subject not in name
        assert caller.subject.encode() not in await contents(redis_client, name)


async def contents(client: Client, name: str) -> bytes:
    """Everything a key holds, whatever its type."""
    kind = await client.type(name)
    if kind == b"set":
        return b"".join(raws(await client.smembers(name)))
    if kind == b"hash":
        return b"".join(raw(k) + raw(v) for k, v in (await client.hgetall(name)).items())
    assert kind == b"zset", kind
    return b"".join(raws(await client.zrange(name, 0, -1)))


async def test_every_key_expires_at_the_latest_expiry_it_holds(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t, caller = now_ms(), new_caller()
    short = delivery(t, "wh_1", subject=caller.subject, expires_at=t + HOUR_MS)
    long = delivery(t, "wh_1", subject=caller.subject, expires_at=t + DAY_MS)
    other = delivery(t, "wh_2", expires_at=t + 2 * HOUR_MS)
    assert await redis_store.enqueue_deliveries([short, long, other], caller, t, t)
    # The failed set is made by a settlement: it gets its expiry then.
    assert len(await redis_store.claim_deliveries(P, "wh_1", t, 10, owner="w", lease_until=t + LEASE)) == 2
    assert await redis_store.settle_delivery(P, short.delivery_id, "w", Settlement.FAILED, t + 1)

    for name in keys.webhook_queue_keys(P, "wh_1"):
        if await redis_client.exists(name):
            assert await redis_client.pexpiretime(name) == t + DAY_MS, name
    assert await redis_client.exists(keys.webhook_queue_keys(P, "wh_1")[2])  # failed
    assert await redis_client.pexpiretime(keys.webhook_queue_keys(P, "wh_2")[0]) == t + 2 * HOUR_MS
    for d in (short, long, other):
        assert await redis_client.pexpiretime(keys.webhook_delivery_key(P, d.endpoint_id, d.delivery_id)) == (
            d.expires_at
        )
    for name in (*keys.webhook_index_keys(P), keys.caller_webhooks_key(P, caller.subject), keys.WEBHOOK_WORK):
        assert await redis_client.pexpiretime(name) == t + DAY_MS, name
    # Configuration does not expire.
    await redis_store.put_endpoint(endpoint(t))
    assert await redis_client.pttl(keys.webhook_endpoints_key(P)) == -1
    assert await redis_client.pttl(keys.WEBHOOK_PROJECTS) == -1


async def test_an_erasure_leaves_no_delivery_of_the_caller(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t, caller, other = now_ms(), new_caller(), new_caller()
    mine = [delivery(t, f"wh_{i}", subject=caller.subject) for i in range(3)]
    theirs = [delivery(t, "wh_0", subject=other.subject), delivery(t, "wh_1", event="caller.erased")]
    assert await redis_store.enqueue_deliveries(mine, caller, t, t)
    assert await redis_store.enqueue_deliveries(theirs, None, t, t)
    assert (
        len(await redis_store.claim_deliveries(P, "wh_0", t, 10, owner="w", lease_until=t + LEASE)) == 2
    )  # leased
    assert mine[1] in await redis_store.claim_deliveries(P, "wh_1", t, 10, owner="w", lease_until=t + LEASE)
    assert await redis_store.settle_delivery(P, mine[1].delivery_id, "w", Settlement.FAILED, t + 1)

    await redis_store.erase_caller(caller, t + 2, t + DAY_MS)
    assert await redis_store.delete_caller_deliveries(caller) == 3
    left = await all_keys(redis_client)
    assert not any(caller.subject in name for name in left if ":t:" not in name)  # but the tombstone
    for d in mine:
        assert keys.webhook_delivery_key(P, d.endpoint_id, d.delivery_id) not in left
        assert not await redis_client.hexists(keys.webhook_index_keys(P)[0], d.delivery_id)
        for name in keys.webhook_queue_keys(P, d.endpoint_id):
            assert await redis_client.zscore(name, d.delivery_id) is None
    for d in theirs:
        assert keys.webhook_delivery_key(P, d.endpoint_id, d.delivery_id) in left
        assert await redis_store.get_delivery(P, d.delivery_id, t + 2) == d


class ErasedMidway(RedisStore):
    """A store whose enqueue is overtaken by a whole erasure of ``victim`` (by another store): on a cluster
    right after the deliveries were listed and indexed, before they are written to their queues; on one
    server, where the enqueue is one script, right before it."""

    victim: CallerRef
    eraser: RedisStore

    async def _erase(self, now_ms: int) -> None:
        await self.eraser.erase_caller(self.victim, now_ms + 1, now_ms + DAY_MS)
        assert await self.eraser.delete_caller_deliveries(self.victim) == 0  # nothing written yet

    async def _list(
        self, project: str, live: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> list[object] | None:
        flags = await super()._list(project, live, caller, made_at, now_ms)
        await self._erase(now_ms)
        return flags

    async def _enqueue_at_once(
        self, project: str, live: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> bool:
        await self._erase(now_ms)
        return await super()._enqueue_at_once(project, live, caller, made_at, now_ms)


async def test_an_erasure_overtaking_an_enqueue_wins(
    redis_url: str, redis_store: RedisStore, redis_client: Client
) -> None:
    t, caller = now_ms(), new_caller()
    store = ErasedMidway(redis_url)
    store.victim, store.eraser = caller, redis_store
    await store.open()
    try:
        about = [delivery(t, f"wh_{i}", subject=caller.subject) for i in range(2)]
        # On one server the script reads the tombstone before it writes anything; on a cluster the enqueue
        # reads it after writing and takes back what it wrote.
        assert not await store.enqueue_deliveries(about, caller, t, t)
    finally:
        await store.close()
    left = await all_keys(redis_client)
    for d in about:
        assert keys.webhook_delivery_key(P, d.endpoint_id, d.delivery_id) not in left
        assert await redis_store.get_delivery(P, d.delivery_id, t) is None
        assert (
            await redis_store.claim_deliveries(P, d.endpoint_id, t, 10, owner="w", lease_until=t + LEASE)
            == []
        )
    if not redis_store._cluster:  # one atomic step: not even a listing or an index entry was written
        assert not [k for k in left if "{wp:" in k or "{wq:" in k or ":wc:" in k or k == keys.WEBHOOK_WORK]


class Counted:
    """A transport that records each call it makes: in which round trip it went (one begins when a call starts
    while no other is in flight: the calls of one asyncio.gather all start before any reply can be read) and
    the commands sent in it, in one write."""

    def __init__(self, transport: RedisTransport) -> None:
        self.send, self.in_flight, self.trips = transport.run, 0, 0
        self.calls: list[tuple[int, tuple[str, ...]]] = []
        transport.run = self.run  # type: ignore[method-assign]

    async def run(self, *commands: Command, **options: Any) -> list[object]:
        if self.in_flight == 0:
            self.trips += 1
        self.in_flight += 1
        self.calls.append((self.trips, tuple(str(c[0]) for c in commands)))
        try:
            return await self.send(*commands, **options)
        finally:
            self.in_flight -= 1


async def test_an_enqueue_is_one_round_trip_on_one_server_and_three_on_a_cluster(
    redis_store: RedisStore,
) -> None:
    t, caller = now_ms(), new_caller()
    # Once the servers know the script (a flushed server gets its text at the first call).
    assert await redis_store.enqueue_deliveries([delivery(t, f"wh_{i}") for i in range(2)], caller, t, t)
    counted = Counted(redis_store._transport)
    about = [delivery(t, f"wh_{i}", subject=caller.subject) for i in range(2)]
    assert await redis_store.enqueue_deliveries(about, caller, t, t)
    if redis_store._cluster:
        # The listing and the index; the two queues and the work index; the tombstone again.
        script, work = ("EVALSHA",), ("ZADD", "PEXPIREAT", "PEXPIREAT")
        assert counted.calls == [
            (1, script),
            (1, script),
            (2, script),
            (2, script),
            (2, work),
            (3, ("HMGET",)),
        ]
    else:
        assert counted.calls == [(1, ("EVALSHA",))]
    for d in about:
        assert await redis_store.get_delivery(P, d.delivery_id, t) == d


async def test_an_ends_recording_and_its_events_are_one_round_trip_on_one_server(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t, caller = now_ms(), new_caller()
    # A server that lost its scripts (restarted, failed over): each refused call is sent again with its text.
    await redis_client.script_flush()
    first = [delivery(t, "wh_1", subject=caller.subject)]
    assert await redis_store.record_conversation(recording_of(caller, "c0", t, t), t, first) is (
        RecordStatus.RECORDED
    )
    assert await redis_store.get_delivery(P, first[0].delivery_id, t) == first[0]
    counted = Counted(redis_store._transport)
    about = [delivery(t, f"wh_{i}", subject=caller.subject) for i in range(2)]
    recorded = await redis_store.record_conversation(recording_of(caller, "c1", t, t), t, about)
    assert recorded is RecordStatus.RECORDED
    if redis_store._cluster:  # the record (and its tombstone check), then the enqueue's own steps
        assert counted.trips > 2
    else:  # the record, then (the write after it, before any reply) the events with those of the turn's ends
        assert counted.calls == [(1, ("EVALSHA",)), (1, ("EVALSHA",))]
    for d in about:
        assert await redis_store.get_delivery(P, d.delivery_id, t) == d


async def test_a_delivered_settlement_is_one_write_and_keeps_what_an_erasure_follows(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t, caller = now_ms(), new_caller()
    d = delivery(t, "wh_1", subject=caller.subject)
    assert await redis_store.enqueue_deliveries([d], caller, t, t)
    assert await redis_store.claim_deliveries(P, "wh_1", t, 10, owner="w", lease_until=t + LEASE) == [d]
    counted = Counted(redis_store._transport)
    assert await redis_store.settle_delivery(
        P, d.delivery_id, "w", Settlement.DELIVERED, t + 1, http_status=204
    )
    # Where it is, then the settlement (the attempt recorded, the payload dropped): one script.
    assert counted.calls == [(1, ("HGET",)), (2, ("EVALSHA",))]
    hash_key = keys.webhook_delivery_key(P, "wh_1", d.delivery_id)
    assert await redis_client.hget(hash_key, "payload") == b""
    assert await redis_client.hget(hash_key, "status") == b"delivered"
    # Kept in the index and the caller's listing, so that an erasure finds the record.
    assert await redis_client.hexists(keys.webhook_index_keys(P)[0], d.delivery_id)
    assert await redis_client.zscore(keys.caller_webhooks_key(P, caller.subject), d.delivery_id) is not None
    assert await redis_store.delete_caller_deliveries(caller) == 0  # sent: deleted, not counted
    assert not await redis_client.exists(hash_key)
    assert not await redis_client.hexists(keys.webhook_index_keys(P)[0], d.delivery_id)


async def test_claims_racing_from_several_stores_lease_each_delivery_once(
    redis_url: str, redis_store: RedisStore
) -> None:
    t = now_ms()
    queued = [delivery(t, "wh_1", next_attempt_at=t - i % 7) for i in range(150)]
    assert await redis_store.enqueue_deliveries(queued, None, t, t)
    stores = [redis_store]
    for _ in range(2):
        stores.append(RedisStore(redis_url, socket_timeout=5.0))
        await stores[-1].open()
    try:
        claimed: list[str] = []
        while True:
            rounds = await asyncio.gather(
                *(
                    s.claim_deliveries(P, "wh_1", t, 4, owner=f"w{i}", lease_until=t + LEASE)
                    for i in range(12)
                    for s in stores
                )
            )
            got = [d.delivery_id for batch in rounds for d in batch]
            if not got:
                break
            claimed += got
        assert sorted(claimed) == sorted(ids(queued))
        # Once every lease ran out, they are claimed again, each once still.
        later = t + LEASE
        rounds = await asyncio.gather(
            *(
                s.claim_deliveries(P, "wh_1", later, 200, owner=f"v{i}", lease_until=later + LEASE)
                for i, s in enumerate(stores)
            )
        )
        again = [d.delivery_id for batch in rounds for d in batch]
        assert sorted(again) == sorted(ids(queued))
    finally:
        for s in stores[1:]:
            await s.close()


async def test_a_lease_that_ran_out_is_claimed_in_due_order(redis_store: RedisStore) -> None:
    # A leased delivery waits in another set, scored by its lease's end; once that passed it is due again at
    # its own due time, before a delivery due after it though before the lease's end.
    t = now_ms()
    first, second = delivery(t, "wh_1", delivery_id="msg_b"), delivery(t + 1, "wh_1", next_attempt_at=t + 1)
    assert await redis_store.enqueue_deliveries([first], None, t, t)
    assert await redis_store.claim_deliveries(P, "wh_1", t, 1, owner="w1", lease_until=t + 10) == [first]
    assert await redis_store.enqueue_deliveries([second], None, t + 1, t + 1)
    assert await redis_store.claim_deliveries(P, "wh_1", t + 20, 1, owner="w2", lease_until=t + LEASE) == [
        first
    ]
    assert await redis_store.claim_deliveries(P, "wh_1", t + 20, 1, owner="w2", lease_until=t + LEASE) == [
        second
    ]


async def test_an_index_entry_whose_delivery_redis_expired_first_is_dropped(
    redis_store: RedisStore, redis_client: Client
) -> None:
    # Redis expires a delivery's hash at its expires_at by its own clock, which may run ahead of the
    # service's: the queue's entries for it are then dropped where they are met.
    t = now_ms()
    gone, kept = delivery(t, "wh_1", delivery_id="msg_a"), delivery(t, "wh_1", delivery_id="msg_b")
    failed = delivery(t, "wh_1", delivery_id="msg_c")
    assert await redis_store.enqueue_deliveries([gone, kept, failed], None, t, t)
    assert await redis_store.claim_deliveries(P, "wh_1", t, 3, owner="w", lease_until=t + 1) == [
        gone,
        kept,
        failed,
    ]
    assert await redis_store.settle_delivery(P, failed.delivery_id, "w", Settlement.FAILED, t)
    for d in (gone, failed):
        await redis_client.delete(keys.webhook_delivery_key(P, "wh_1", d.delivery_id))
    assert await redis_store.failed_deliveries(P, t) == []
    assert await redis_store.claim_deliveries(P, "wh_1", t + 1, 3, owner="w", lease_until=t + LEASE) == [kept]
    for name in keys.webhook_queue_keys(P, "wh_1"):
        for d in (gone, failed):
            assert await redis_client.zscore(name, d.delivery_id) is None
    assert await redis_store.get_delivery(P, gone.delivery_id, t) is None
    assert not await redis_store.settle_delivery(P, gone.delivery_id, "w", Settlement.DELIVERED, t + 2)
    assert (await redis_store.queue_stats(t + 2)).queued == 1


async def test_an_id_living_for_another_endpoint_is_left_as_it_is(redis_store: RedisStore) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    elsewhere = dataclasses.replace(d, endpoint_id="wh_2", payload=b"{}")
    assert await redis_store.enqueue_deliveries([d], None, t, t)
    assert await redis_store.enqueue_deliveries([elsewhere], None, t, t)
    assert await redis_store.get_delivery(P, d.delivery_id, t) == d
    assert await redis_store.claim_deliveries(P, "wh_2", t, 10, owner="w", lease_until=t + LEASE) == []
    # Once it is gone, the id is free for any endpoint.
    assert await redis_store.delete_delivery(P, d.delivery_id)
    assert await redis_store.enqueue_deliveries([elsewhere], None, t, t)
    assert await redis_store.get_delivery(P, d.delivery_id, t) == elsewhere


async def test_deleting_an_endpoint_with_many_deliveries_leaves_nothing_of_its_queue(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    e = endpoint(t)
    await redis_store.put_endpoint(e)
    many = [delivery(t, e.endpoint_id) for _ in range(2 * BATCH + 7)]
    assert await redis_store.enqueue_deliveries(many, None, t, t)
    kept = delivery(t, "wh_other")
    assert await redis_store.enqueue_deliveries([kept], None, t, t)
    assert await redis_store.delete_endpoint(P, e.endpoint_id)
    tag = keys.webhook_queue_keys(P, e.endpoint_id)[0].rpartition(":")[0]
    assert not [name for name in await all_keys(redis_client) if name.startswith(tag)]
    assert await redis_client.hkeys(keys.webhook_index_keys(P)[0]) == [kept.delivery_id.encode()]
    assert await redis_client.zscore(keys.webhook_index_keys(P)[2], e.endpoint_id) is None
    work = keys.webhook_work_member(P, e.endpoint_id)
    assert await redis_client.zscore(keys.WEBHOOK_WORK, work) is None
    assert (await redis_store.queue_stats(t)).queued == 1


async def test_endpoints_whose_deliveries_all_expired_leave_the_statistics_index(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    assert await redis_store.enqueue_deliveries([delivery(t, "wh_1", expires_at=t + HOUR_MS)], None, t, t)
    assert await redis_store.enqueue_deliveries([delivery(t, "wh_2")], None, t, t)
    assert (await redis_store.queue_stats(t + HOUR_MS)).queued == 1
    members = await redis_client.zrange(keys.WEBHOOK_WORK, 0, -1)
    assert members == [keys.webhook_work_member(P, "wh_2").encode()]


async def snapshot(client: redis.asyncio.Redis, *, webhooks_only: bool = False) -> dict[bytes, Any]:
    """Every key on the server (``webhooks_only``: but the analytics'): its type, everything it holds (scores
    too) and when it expires."""
    found: dict[bytes, Any] = {}
    for name in raws(await client.keys("*")):
        if webhooks_only and b"{a:" in name:
            continue
        kind = await client.type(name)
        if kind == b"hash":
            held: Any = await client.hgetall(name)
        elif kind == b"zset":
            held = await client.zrange(name, 0, -1, withscores=True)
        else:
            held = await client.dump(name)
        found[name] = (kind, held, await client.pexpiretime(name.decode()))
    return found


async def test_the_ends_of_one_turn_queue_their_events_in_one_call_and_an_erased_callers_alone_are_left_out(
    redis_server: Any,
) -> None:
    """On one server the ends recorded in one turn of the event loop queue their deliveries in one script call
    (the ``ends`` part), in the same round trip as their records; a caller erased before its end gets none,
    and the others are queued all the same. What it leaves is what the parts one by one leave, key by key."""
    store = RedisStore(redis_server.url, socket_timeout=5.0)
    await store.open()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        t = now_ms()
        callers = [new_caller() for _ in range(6)]
        erased = callers[2]

        def about(n: int, caller: CallerRef) -> list[Delivery]:
            ds = [delivery(t, "wh_a", delivery_id=f"msg_{n}a", subject=caller.subject)]
            if n % 2:  # and a second endpoint for some, with a later expiry
                ds.append(
                    delivery(
                        t, "wh_b", delivery_id=f"msg_{n}b", subject=caller.subject, expires_at=t + 2 * DAY_MS
                    )
                )
            return ds

        made = [(about(n, c), c) for n, c in enumerate(callers)]
        taken = delivery(t, "wh_b", delivery_id="msg_5b")  # lives for wh_b already, without a caller
        states = []
        for together in (True, False):
            await client.flushall()
            assert await store.enqueue_deliveries([taken], None, t, t)
            await store.erase_caller(erased, t, t + DAY_MS)
            if together:
                await client.script_load(store._transport.scripts["record"].script)  # steady state
                counted = Counted(store._transport)
                statuses = await asyncio.gather(
                    *(
                        store.record_conversation(recording_of(c, f"c{n}", t, t), t, ds)
                        for n, (ds, c) in enumerate(made)
                    )
                )
                assert [s is RecordStatus.ERASED for s in statuses] == [c is erased for c in callers]
                assert {trip for trip, _ in counted.calls} == {1}  # one round trip
                assert len(counted.calls) == len(callers) + 1  # the records, and one enqueue for them all
            else:  # the parts one by one, a call per caller
                for ds, c in made:
                    reply = await store._transport.script(
                        "webhook_enqueue", *store._parts_call(P, ds, c, t, t)
                    )
                    assert (reply != 0) is (c is not erased)
            states.append(await snapshot(client, webhooks_only=True))
        assert states[0] == states[1]
        for ds, c in made:
            for d in ds:
                kept = await store.get_delivery(P, d.delivery_id, t)
                if c is erased or d.delivery_id == "msg_5b":
                    assert (
                        kept is None or kept.subject != c.subject
                    )  # msg_5b is the earlier one, left as it was
                else:
                    assert kept == d
    finally:
        await client.aclose()
        await store.close()


async def test_an_ends_compact_enqueue_writes_what_the_parts_one_by_one_write(redis_server: Any) -> None:
    """On one server an end's deliveries (one caller's, just made) go as the enqueue script's ``ends`` part,
    with a fraction of the arguments; it must leave exactly what the parts one by one leave, key by key
    (contents and expiry): here an id that lives for another endpoint is left as it is, and an erased caller
    gets nothing written at all."""
    store = RedisStore(redis_server.url, socket_timeout=5.0)
    await store.open()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        t, caller = now_ms(), new_caller()
        taken = delivery(t, "wh_b", delivery_id="msg_taken")  # queued for wh_b, without a caller
        mine = {"subject": caller.subject}
        batch = [
            *(
                delivery(t, "wh_a", delivery_id=f"msg_{n}", expires_at=t + (n + 1) * HOUR_MS, **mine)
                for n in range(3)
            ),
            delivery(t, "wh_b", delivery_id="msg_b", **mine),
            delivery(t, "wh_a", delivery_id="msg_taken", **mine),
        ]
        fresh = webhook_enqueue._ends_call(P, [(batch, caller, t)], t)
        parts = store._parts_call(P, batch, caller, t, t)
        assert len(fresh[1]) * 2 < len(parts[1]) and sorted(fresh[0]) == sorted(parts[0])
        for erased in (False, True):
            found = []
            for script_keys, args in (fresh, parts):
                await client.flushall()
                assert await store.enqueue_deliveries([taken], None, t, t)
                if erased:
                    await client.hset(
                        keys.tombstone_key(P, caller.subject),
                        mapping={"erased_at": t, "expires_at": t + DAY_MS},
                    )
                before = await snapshot(client)
                reply = await store._transport.script("webhook_enqueue", script_keys, args)
                found.append((reply, before, await snapshot(client)))
            (ends_reply, before, after), (parts_reply, _, parts_after) = found
            assert after == parts_after
            if erased:
                assert ends_reply == [0] and parts_reply == 0 and after == before
            else:  # msg_taken lives for wh_b: left as it is (the parts' flags say so)
                assert ends_reply == [1] and parts_reply == [1, 1, 1, 1, 0]
                assert keys.webhook_delivery_key(P, "wh_a", "msg_2").encode() in after
                assert keys.webhook_delivery_key(P, "wh_a", "msg_taken").encode() not in after
    finally:
        await client.aclose()
        await store.close()


async def test_an_end_that_gives_up_leaves_the_enqueue_of_its_turn_to_the_others(redis_server: Any) -> None:
    """The ends of one turn share one enqueue call: one of them cancelled (its timeout, its client gone) while
    it waits must not cancel that call or fail the others; and a call that fails fails every end in it."""
    store = RedisStore(redis_server.url, socket_timeout=5.0)
    await store.open()
    try:
        t = now_ms()
        made = [(c, f"gives-up-{c.subject}") for c in (new_caller() for _ in range(4))]
        about = {c.subject: delivery(t, "wh_a", subject=c.subject) for c, _ in made}

        def ends() -> list[asyncio.Future[RecordStatus]]:
            return [
                asyncio.ensure_future(
                    store.record_conversation(recording_of(c, name, t, t), t, [about[c.subject]])
                )
                for c, name in made
            ]

        tasks = ends()
        await asyncio.sleep(0)  # each has joined the turn's enqueue and sent its record
        tasks[1].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[1], asyncio.CancelledError)
        assert [r for i, r in enumerate(results) if i != 1] == [RecordStatus.RECORDED] * 3
        for i, (c, _) in enumerate(made):
            kept = await store.get_delivery(P, about[c.subject].delivery_id, t)
            # The one that gave up before the call was sent is left out of it (it is redone whole).
            assert kept == (None if i == 1 else about[c.subject])
        # A call that fails (here the script refuses its arguments) fails every end of its turn.
        broken = webhook_enqueue._ends_call

        def refused(project: str, *rest: Any) -> Any:
            script_keys, args = broken(project, *rest)
            return script_keys, [*args, "junk"]

        webhook_enqueue._ends_call = refused  # type: ignore[assignment]
        try:
            results = await asyncio.gather(*ends(), return_exceptions=True)
        finally:
            webhook_enqueue._ends_call = broken
        assert all(isinstance(r, Exception) and "webhook_enqueue" in str(r) for r in results), results
    finally:
        await store.close()


async def test_the_ends_of_a_turn_are_sent_in_calls_of_bounded_size_that_purge_for_each_end(
    redis_server: Any,
) -> None:
    """Ends whose payloads are large (history) go in several calls, none much over MAX_BYTES_TOGETHER; and a
    call for several ends deletes as many expired index entries as their calls one by one would have."""
    store = RedisStore(redis_server.url, socket_timeout=5.0)
    await store.open()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await client.flushall()
        t = now_ms()
        # 600 entries of a failing endpoint that expire at t + 1000 (three ends' worth of purges).
        old = [delivery(t, "wh_x", delivery_id=f"msg_old{n}", expires_at=t + 1000) for n in range(600)]
        assert await store.enqueue_deliveries(old, None, t, t)
        later = t + 2000
        big = b"x" * (webhook_enqueue.MAX_BYTES_TOGETHER * 2 // 3)
        made = [new_caller() for _ in range(3)]
        ends = {
            c.subject: delivery(later, "wh_a", delivery_id=f"msg_{n}", subject=c.subject, payload=big)
            for n, c in enumerate(made)
        }
        await client.script_load(store._transport.scripts["record"].script)
        counted = Counted(store._transport)
        statuses = await asyncio.gather(
            *(
                store.record_conversation(recording_of(c, f"c{n}", later, later), later, [ends[c.subject]])
                for n, c in enumerate(made)
            )
        )
        assert statuses == [RecordStatus.RECORDED] * 3
        assert len(counted.calls) == 3 + 3  # each end's payload is two thirds of the bound: a call each
        for d in ends.values():
            assert await store.get_delivery(P, d.delivery_id, later) == d
        # Three calls of one end each: 3 x 200 deleted, all 600.
        assert await client.zcard(keys.webhook_index_keys(P)[1]) == 3
        # One call of three ends deletes as much.
        old = [
            delivery(later, "wh_x", delivery_id=f"msg_older{n}", expires_at=later + 1000) for n in range(600)
        ]
        assert await store.enqueue_deliveries(old, None, later, later)
        last = later + 2000
        small = [new_caller() for _ in range(3)]
        statuses = await asyncio.gather(
            *(
                store.record_conversation(
                    recording_of(c, f"d{n}", last, last),
                    last,
                    [delivery(last, "wh_a", delivery_id=f"msg_d{n}", subject=c.subject)],
                )
                for n, c in enumerate(small)
            )
        )
        assert statuses == [RecordStatus.RECORDED] * 3
        assert await client.zcard(keys.webhook_index_keys(P)[1]) == 3 + 3
    finally:
        await client.aclose()
        await store.close()


async def test_closing_the_store_sends_and_answers_the_enqueue_of_its_last_turn(redis_server: Any) -> None:
    """An end that joined its turn's enqueue just before the store closes: the close sends that call and waits
    for it, so the end is answered and its delivery is queued (not failed by a closed connection)."""
    store = RedisStore(redis_server.url, socket_timeout=5.0)
    await store.open()
    t, caller = now_ms(), new_caller()
    d = delivery(t, "wh_a", subject=caller.subject)
    recording = recording_of(caller, f"closing-{caller.subject}", t, t)  # (the server is shared: a new id)
    end = asyncio.ensure_future(store.record_conversation(recording, t, [d]))
    await asyncio.sleep(0)  # it has joined the turn's enqueue, which is not sent yet
    assert store._ends_together
    await store.close()
    assert await end is RecordStatus.RECORDED
    reopened = RedisStore(redis_server.url, socket_timeout=5.0)
    await reopened.open()
    try:
        assert await reopened.get_delivery(P, d.delivery_id, t) == d
    finally:
        await reopened.close()


async def test_an_endpoint_keeps_a_bounded_number_of_delivered_deliveries_the_newest(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    made = [delivery(t, "wh_1") for _ in range(DELIVERED_KEPT_PER_ENDPOINT + 3)]
    assert await redis_store.enqueue_deliveries(made, None, t, t)
    claimed = await redis_store.claim_deliveries(P, "wh_1", t, len(made), owner="w", lease_until=t + LEASE)
    assert len(claimed) == len(made)
    for n, d in enumerate(claimed):
        assert await redis_store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t + 1 + n)
    delivered = keys.webhook_queue_keys(P, "wh_1")[0][:-1] + "v"
    assert await redis_client.zcard(delivered) == DELIVERED_KEPT_PER_ENDPOINT
    # The three settled first are gone, hash and listing; the newest are kept.
    for d in claimed[:3]:
        assert not await redis_client.exists(keys.webhook_delivery_key(P, "wh_1", d.delivery_id))
        assert await redis_client.zscore(delivered, d.delivery_id) is None
    assert await redis_client.exists(keys.webhook_delivery_key(P, "wh_1", claimed[3].delivery_id))
    listed = await redis_store.list_deliveries(P, DeliveryStatus.DELIVERED, t + 2 + len(made), limit=1)
    assert [d.delivery_id for d in listed] == [claimed[-1].delivery_id]
