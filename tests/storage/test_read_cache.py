"""The read cache of one Redis server (client-side caching, RESP3 CLIENT TRACKING): a hit makes no round
trip, this process's writes are read back at once, a write through another connection is seen within the
bound, an expired field is never served, and a lost connection takes its cache with it. (The whole storage
contract also runs with the cache on: the ``redis-cached`` backend of the ``store`` fixture.)"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from caller_memory.service.config import Settings, SettingsError
from caller_memory.service.domain.errors import InvalidInput
from caller_memory.service.domain.store import CallerRef
from caller_memory.service.storage import open_store
from caller_memory.service.storage.redis import keys
from caller_memory.service.storage.redis.read_cache import ReadCache, Waiting
from caller_memory.service.storage.redis.store import RedisStore

from tests.storage.test_contract import PROJECT, field, new_subject, now_ms, values
from tests.support.redis_server import RedisServer

BOUND_S = 0.2


def memory_reads(server: RedisServer) -> int:
    """HGETALL calls the server has run (a memory read that reached Redis)."""
    with server.client() as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


@pytest.fixture
async def cached(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    with redis_server.client() as client:
        client.flushall()
        client.config_resetstat()
    store = RedisStore(redis_server.url, socket_timeout=5.0, cache_seconds=BOUND_S)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def other(redis_server: RedisServer, cached: RedisStore) -> AsyncIterator[RedisStore]:
    """Another process's store on the same server (no cache)."""
    store = RedisStore(redis_server.url, socket_timeout=5.0)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def held(redis_server: RedisServer, cached: RedisStore) -> AsyncIterator[RedisStore]:
    """A store whose cache holds an entry for a minute: what a hit saves, apart from how long an entry lives
    (with the 0.2 s bound, a loaded machine that pauses the loop between two reads turns a hit into a miss)."""
    store = RedisStore(redis_server.url, socket_timeout=5.0, cache_seconds=60.0)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def test_a_hit_makes_no_round_trip_and_this_process_reads_its_own_writes(
    held: RedisStore, redis_server: RedisServer
) -> None:
    cached = held
    caller, t = CallerRef(PROJECT, new_subject()), now_ms()
    await cached.patch_fields(caller, {"a": field(0, t)}, [], t)
    assert values(await cached.read_fields(caller, t)) == {"a": 0}  # a miss: it fills the cache
    before = memory_reads(redis_server)
    for _ in range(50):
        assert values(await cached.read_fields(caller, t)) == {"a": 0}
    assert memory_reads(redis_server) == before  # fifty hits, no HGETALL
    # Every write of this store is read back by the next read, whatever was cached.
    for i in range(1, 101):
        await cached.patch_fields(caller, {"a": field(i, t + i)}, [], t + i)
        assert values(await cached.read_fields(caller, t + i)) == {"a": i}
        assert values(await cached.read_fields(caller, t + i)) == {"a": i}
    await cached.erase_caller(caller, t + 200, t + 10_000)
    assert await cached.read_fields(caller, t + 200) == {}


async def test_a_write_through_another_connection_is_seen_within_the_bound(
    cached: RedisStore, other: RedisStore
) -> None:
    caller, t = CallerRef(PROJECT, new_subject()), now_ms()
    await other.patch_fields(caller, {"a": field(0, t)}, [], t)
    windows = []
    for i in range(1, 201):
        assert values(await cached.read_fields(caller, t)) == {"a": i - 1}  # cached now
        await other.patch_fields(caller, {"a": field(i, t + i)}, [], t + i)
        acknowledged = time.monotonic()
        last_stale = acknowledged
        while True:
            sent = time.monotonic()
            seen = values(await cached.read_fields(caller, t + i))["a"]
            if seen == i:
                break
            assert seen == i - 1
            last_stale = sent
            await asyncio.sleep(0.0005)
        windows.append(last_stale - acknowledged)
    assert max(windows) < BOUND_S  # the last stale read was sent within the bound of the write's answer
    # And Redis's invalidation, not the bound, is what ends it as a rule (without it, about the bound each).
    assert statistics.median(windows) < BOUND_S / 10


async def test_an_expired_field_is_never_served_from_the_cache(
    cached: RedisStore, redis_server: RedisServer
) -> None:
    caller, t = CallerRef(PROJECT, new_subject()), now_ms()
    await cached.patch_fields(caller, {"short": field(1, t, 1_000), "long": field(2, t)}, [], t)
    assert values(await cached.read_fields(caller, t)) == {"short": 1, "long": 2}
    before = memory_reads(redis_server)
    assert values(await cached.read_fields(caller, t + 999)) == {"short": 1, "long": 2}
    assert values(await cached.read_fields(caller, t + 1_000)) == {
        "long": 2
    }  # from the cache, expired dropped
    assert memory_reads(redis_server) == before


async def test_a_lost_connection_takes_its_cache_with_it(
    cached: RedisStore, other: RedisStore, redis_server: RedisServer
) -> None:
    caller, t = CallerRef(PROJECT, new_subject()), now_ms()
    await cached.patch_fields(caller, {"a": field(1, t)}, [], t)
    assert values(await cached.read_fields(caller, t)) == {"a": 1}
    with redis_server.client() as client:
        client.client_kill_filter(_type="normal", skipme=True)  # every connection but this one
    await asyncio.sleep(0.05)  # the lane's reader sees the connection closed
    await other.patch_fields(caller, {"a": field(2, t + 1)}, [], t + 1)  # no invalidation can reach it
    assert values(await cached.read_fields(caller, t + 1)) == {"a": 2}
    # A flush of the database empties the cache (an invalidation with no keys).
    assert values(await cached.read_fields(caller, t + 1)) == {"a": 2}
    with redis_server.client() as client:
        client.flushall()
    deadline = time.monotonic() + BOUND_S
    while await cached.read_fields(caller, t + 1) != {}:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)


async def test_the_store_counts_its_hits_and_misses_across_connections(
    cached: RedisStore, other: RedisStore, redis_server: RedisServer
) -> None:
    assert other.read_cache_counts() is None  # no cache, nothing to count
    assert cached.read_cache_counts() == (0, 0)
    caller, t = CallerRef(PROJECT, new_subject()), now_ms()
    await cached.patch_fields(caller, {"a": field(1, t)}, [], t)
    await cached.read_fields(caller, t)  # after a write: read from Redis
    for _ in range(10):
        await cached.read_fields(caller, t)
    assert cached.read_cache_counts() == (10, 1)
    # A lost connection takes its cache, not its counts: the totals never go back.
    with redis_server.client() as client:
        client.client_kill_filter(_type="normal", skipme=True)
    await asyncio.sleep(0.05)
    assert cached.read_cache_counts() == (10, 1)
    await cached.read_fields(caller, t)  # a new connection, an empty cache: a miss
    await cached.read_fields(caller, t)
    assert cached.read_cache_counts() == (11, 2)


def test_the_cache_is_refused_on_a_cluster_and_bounded_in_the_settings() -> None:
    with pytest.raises(InvalidInput, match="one Redis server, not on a Redis Cluster"):
        open_store("redis+cluster://127.0.0.1:7000/", cache_seconds=0.05)
    base = {"CALLER_MEMORY_PSEUDONYM_KEY": "k" * 32}
    assert Settings.from_env(base).read_cache_seconds == 0.0  # off unless asked for
    on = Settings.from_env(base | {"CALLER_MEMORY_READ_CACHE_SECONDS": "0.05"})
    assert (on.read_cache_seconds, on.read_cache_entries) == (0.05, 10_000)
    for text, message in [
        ("6", "at most 5"),
        ("-1", "non-negative"),
        ("soon", "number of seconds"),
    ]:
        with pytest.raises(SettingsError, match=message):
            Settings.from_env(base | {"CALLER_MEMORY_READ_CACHE_SECONDS": text})
    with pytest.raises(SettingsError, match="at least 1"):
        Settings.from_env(base | {"CALLER_MEMORY_READ_CACHE_ENTRIES": "0"})


def test_after_a_call_that_may_have_written_nothing_is_served_until_a_later_reply() -> None:
    """The rule behind reading this process's writes, whatever the order in which its invalidation comes: a
    call that is not a cached read (a write) makes the cache wait for the reply of a command sent after it
    ended; and nothing is served once the last reply read is older than the bound."""

    class Clock:
        now = 100.0

        def time(self) -> float:
            return self.now

    loop: Any = Clock()
    cache = ReadCache(bound=0.5, limit=2)

    def ended(sent: float, track: tuple[str, ...] | None, replies: list[Any]) -> None:
        call = Waiting(cast(Any, None), len(replies), sent, track)
        call.replies = replies
        cache.ended(call, loop)

    ended(100.0, ("m", "a"), [b"OK", {b"f": b"1"}, b"OK", None])
    assert cache.get(("m", "a"), 100.1) == [{b"f": b"1"}, None]
    loop.now = 100.2
    ended(100.15, None, [1])  # a write, sent before and answered now
    assert cache.get(("m", "a"), 100.2) is None
    ended(100.19, ("x",), [b"OK", {}])  # sent before the write ended: not enough
    assert cache.get(("m", "a"), 100.25) is None
    ended(100.21, ("y",), [b"OK", {}])  # sent after it: its invalidations came first
    assert cache.get(("m", "a"), 100.3) is None  # "m" went for "x" and "y" (two keys at most)
    assert cache.get(("y",), 100.3) == [{}]
    assert cache.get(("y",), 100.72) is None  # the last reply read is older than the bound
    cache.invalidate([b"invalidate", [b"y"]])
    assert "y" not in cache.entries and "x" in cache.entries
    cache.invalidate([b"invalidate", None])
    assert cache.entries == {}


def test_what_a_hit_derives_from_an_entry_is_made_once_and_goes_with_the_entry() -> None:
    """A cached memory hash is decoded on its first hit only; a new reply of the key, its invalidation, its
    eviction and a flush each drop what was made of the old one."""
    cache = ReadCache(bound=10.0, limit=2)
    made: list[Any] = []

    def derive(reply: Any) -> Any:
        made.append(reply)
        return ("decoded", reply)

    def hit(key: str) -> Any:
        found = cache.get((key,), 1.0)
        return None if found is None else cache.derive(key, found[0], derive)

    cache.synced = 1.0
    cache.fill(("m", "a"), [{b"f": b"1"}, None])
    assert hit("m") == ("decoded", {b"f": b"1"})
    assert hit("m") == ("decoded", {b"f": b"1"})
    assert cache.get(("m", "a"), 1.0) == [{b"f": b"1"}, None]  # the entry itself is kept as it came
    assert made == [{b"f": b"1"}]
    cache.fill(("m",), [{b"f": b"2"}])  # a later reply of the key
    assert hit("m") == ("decoded", {b"f": b"2"})
    cache.invalidate([b"invalidate", [b"m"]])
    assert hit("m") is None and "m" not in cache.derived
    cache.fill(("m",), [{b"f": b"3"}])
    hit("m")
    cache.fill(("b",), [{}])  # a third key: "a" (the oldest filled) goes, "m" stays
    cache.fill(("c",), [{}])  # and now "m"
    assert "m" not in cache.entries and "m" not in cache.derived
    hit("b")
    # Made of a value that is not (or no longer) the entry: made, never kept.
    assert cache.derive("b", {b"f": b"old"}, derive) == ("decoded", {b"f": b"old"})
    assert cache.derived["b"][1] == ("decoded", {})
    cache.invalidate([b"invalidate", None])
    assert cache.entries == {} and cache.derived == {}
    assert made == [{b"f": b"1"}, {b"f": b"2"}, {b"f": b"3"}, {}, {b"f": b"old"}]


async def test_a_hit_through_an_alias_decodes_the_profiles_hash_only(
    cached: RedisStore, redis_server: RedisServer
) -> None:
    """A linked identifier's own hash is not what a read of it returns, so a hit does not decode it: an
    unreadable leftover there fails neither the miss nor the hit."""
    alias, profile, t = new_subject(), new_subject(), now_ms()
    await cached.patch_fields(CallerRef(PROJECT, profile), {"name": field("Ada", t)}, [], t)
    with redis_server.client() as client:
        client.hset(keys.memory_key(PROJECT, alias), "left", b"not a packed field")
        client.set(keys.alias_key(PROJECT, alias), f"{t + 60_000}|{profile}|link-1", pxat=t + 60_000)
    caller = CallerRef(PROJECT, alias)
    assert values(await cached.read_fields(caller, t)) == {"name": "Ada"}  # a miss
    before = memory_reads(redis_server)
    assert values(await cached.read_fields(caller, t)) == {"name": "Ada"}  # a hit
    assert memory_reads(redis_server) == before
