"""What only a Redis Cluster has: single-slot calls, scripts on every node, writes acknowledged once on a
replica, and the store URL. (The whole contract suite also runs on the cluster: the ``store`` fixture.)"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from caller_memory.service.domain.errors import StoreUnavailable
from caller_memory.service.domain.store import CallerRef, EndStatus
from caller_memory.service.storage import open_store
from caller_memory.service.storage.redis import keys
from caller_memory.service.storage.redis.cluster import parse_cluster_url, slot_of
from caller_memory.service.storage.redis.store import RedisStore
from redis.crc import key_slot

from tests.storage.test_contract import PROJECT, ending, field, new_subject, now_ms, values
from tests.support.redis_cluster import ClusterNodeServer, RedisCluster
from tests.support.redis_server import RedisServer
from tests.test_cli import CONFIG, run_cli


@pytest.fixture
async def cluster_store(redis_cluster: RedisCluster) -> AsyncIterator[RedisStore]:
    redis_cluster.flushall()
    store = RedisStore(redis_cluster.url)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def subjects_on_every_primary(cluster: RedisCluster, per_primary: int = 2) -> list[str]:
    """Caller pseudonyms whose keys live on each primary of the cluster."""
    owners = {node.port: 0 for node in cluster.primaries()}
    slots = {node.port: node for node in cluster.primaries()}
    chosen = []
    while min(owners.values()) < per_primary:
        subject = new_subject()
        port = cluster.primary_of(keys.memory_key(PROJECT, subject)).port
        if owners[port] < per_primary:
            owners[port] += 1
            chosen.append(subject)
    assert set(owners) == set(slots)
    return chosen


@pytest.fixture
def paused(redis_cluster: RedisCluster) -> Iterator[list[ClusterNodeServer]]:
    """Nodes the test pauses with SIGSTOP; resumed afterwards, whatever happens."""
    nodes: list[ClusterNodeServer] = []
    yield nodes
    for node in nodes:
        os.kill(node.pid, signal.SIGCONT)
    redis_cluster.wait_until_ready()


async def test_scripts_are_reloaded_on_nodes_that_lost_them(
    cluster_store: RedisStore, redis_cluster: RedisCluster
) -> None:
    """A node that never ran a script (a replica just promoted, a restarted node) answers NOSCRIPT: every
    operation still works, on every primary."""
    subjects = subjects_on_every_primary(redis_cluster)
    t = now_ms()
    for node in redis_cluster.running_nodes():  # primaries and replicas alike
        with node.client() as client:
            client.script_flush()
    for i, subject in enumerate(subjects):
        result = await cluster_store.patch_fields(
            CallerRef(PROJECT, subject), {"a": field(i, t, 60_000)}, [], t
        )
        assert values(result.fields) == {"a": i}
        ended = await cluster_store.end_conversation(ending(subject, f"conv-{i}", t, f"f{i}"), t)
        assert ended.status is EndStatus.APPLIED
    for node in redis_cluster.running_nodes():
        with node.client() as client:
            client.script_flush()
    counts, more = await cluster_store.sweep(t + 120_000, 1_000)  # a script in every bucket of every primary
    assert (counts["fields"], counts["callers"], more) == (len(subjects), len(subjects), False)
    erased = await cluster_store.erase_caller(CallerRef(PROJECT, subjects[0]), t + 3_000, t + 60_000)
    assert erased.conversations == 1


async def test_a_write_is_acknowledged_only_once_a_replica_has_it(
    cluster_store: RedisStore, redis_cluster: RedisCluster, paused: list[ClusterNodeServer]
) -> None:
    subject, t = new_subject(), now_ms()
    key = keys.memory_key(PROJECT, subject)
    await cluster_store.patch_fields(CallerRef(PROJECT, subject), {"a": field(1, t)}, [], t)
    primary = redis_cluster.primary_of(key)
    replica = redis_cluster.replica_of(primary)
    # A conversation id whose claim is on another primary: the first attempt gets as far as the memory write.
    conversation = next(
        f"conv-{n}"
        for n in range(1000)
        if redis_cluster.primary_of(keys.conversation_claim_key(PROJECT, f"conv-{n}")).port != primary.port
    )
    with replica.client() as client:
        client.execute_command("READONLY")
        assert client.hkeys(key) == [b"a"]  # acknowledged: already on the replica

        # A replica that does not confirm (paused) makes the write fail instead of being acknowledged.
        os.kill(replica.pid, signal.SIGSTOP)
        paused.append(replica)
        with pytest.raises(StoreUnavailable, match=r"reached 0 of the 1 replica"):
            await cluster_store.patch_fields(CallerRef(PROJECT, subject), {"b": field(2, t)}, [], t)
        # Reads do not wait for replicas.
        assert set(await cluster_store.read_fields(CallerRef(PROJECT, subject), t)) == {"a", "b"}

        # The retry of an end of a conversation whose first answer was lost is a replay; it is acknowledged
        # only once the replica has the original write too.
        write = ending(subject, conversation, t, "f", {"c": field(3, t)})
        with pytest.raises(StoreUnavailable):
            await cluster_store.end_conversation(write, t)
        with pytest.raises(StoreUnavailable):  # a replay now: it waits for the replica too
            await cluster_store.end_conversation(write, t)
        os.kill(replica.pid, signal.SIGCONT)
        paused.remove(replica)
        replay = await cluster_store.end_conversation(write, t)
        assert replay.status is EndStatus.REPLAYED
        assert sorted(client.hkeys(key)) == [b"a", b"b", b"c"]


async def test_a_write_that_changes_nothing_waits_for_the_replica_too(
    redis_cluster: RedisCluster, paused: list[ClusterNodeServer]
) -> None:
    # A retry of a write that landed but was not confirmed changes nothing; it must not be acknowledged
    # while the replica may still lack the first attempt's change. WAIT alone would confirm it at once on a
    # fresh connection (nothing written on it yet): hence a store of its own here.
    store = RedisStore(redis_cluster.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    await store.open()
    try:
        primary = redis_cluster.primary_of(keys.analytics_index_key(PROJECT, None))
        replica = redis_cluster.replica_of(primary)
        os.kill(replica.pid, signal.SIGSTOP)
        paused.append(replica)
        with pytest.raises(StoreUnavailable):
            await store.unlist_conversations(PROJECT, ["never-listed"])
        os.kill(replica.pid, signal.SIGCONT)
        paused.remove(replica)
        assert await store.unlist_conversations(PROJECT, ["never-listed"]) == 0
    finally:
        await store.close()


def test_every_call_touches_one_slot() -> None:
    subject = new_subject()
    caller = [("HGETALL", keys.memory_key(PROJECT, subject)), ("HMGET", keys.tombstone_key(PROJECT, subject))]
    assert slot_of(caller) == key_slot(keys.memory_key(PROJECT, subject).encode())
    caller_keys = [keys.memory_key(PROJECT, subject), keys.caller_index_key(subject)]
    script: tuple[str | int, ...] = ("EVALSHA", "0" * 40, 2, *caller_keys, "arg")
    assert slot_of([script]) == slot_of(caller)
    with pytest.raises(ValueError, match="span 2 slots"):
        slot_of([("GET", keys.project_key(PROJECT)), ("SADD", keys.PROJECTS, PROJECT)])
    # The markers that make a WAIT cover a slot's earlier writes are in that slot.
    for key in (
        *caller_keys,
        keys.conversation_claim_key(PROJECT, "c-1"),
        keys.analytics_entry_key(PROJECT, "c"),
    ):
        assert key_slot(keys.sync_key(key).encode()) == key_slot(key.encode())
    assert key_slot(keys.sync_key(keys.PROJECTS).encode()) == key_slot(keys.PROJECTS.encode())
    with pytest.raises(ValueError, match="span 2 slots"):
        slot_of([("EVALSHA", "0" * 40, 2, keys.memory_key(PROJECT, subject), keys.PROJECTS)])


def test_the_store_url() -> None:
    address = parse_cluster_url("redis+cluster://user:p%40ss@10.0.0.1:7000,10.0.0.2:7001/")
    assert address.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert (address.username, address.password, address.ssl, address.replicas) == ("user", "p@ss", False, 1)
    assert parse_cluster_url("rediss+cluster://h:1/0?replicas=2").replicas == 2
    assert parse_cluster_url("redis+cluster://h:1?replicas=0").ssl is False
    for url, message in [
        ("redis+cluster://h:1/3", "a cluster has one database, 0, not '3'"),
        ("redis+cluster://h:1,h2/", "'h2' is not host:port"),
        ("redis+cluster://h:1/?wait=1", "unknown option wait"),
        ("redis+cluster://h:1/?replicas=one", "replicas must be a whole number"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_cluster_url(url)
    # A '#' in a password cuts the URL in two: refused without quoting any part of the password.
    with pytest.raises(ValueError, match="holds a '#'") as cut:
        parse_cluster_url("redis+cluster://:s3cr#et@h:1/")
    assert "s3cr" not in str(cut.value) and "et@" not in str(cut.value)
    with pytest.raises(ValueError, match="a cluster has one database"):
        open_store("redis+cluster://127.0.0.1:7000/1")


async def test_a_standalone_server_is_not_taken_for_a_cluster(redis_server: RedisServer) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_server.port}/"
    store = RedisStore(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    with pytest.raises(StoreUnavailable, match=r"[Cc]luster mode is not enabled"):
        await store.open()
    await store.close()


async def test_a_cluster_node_is_not_taken_for_a_standalone_server(redis_cluster: RedisCluster) -> None:
    node = redis_cluster.primaries()[0]
    store = RedisStore(node.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    with pytest.raises(StoreUnavailable, match=r"node of a Redis Cluster: use a redis\+cluster://"):
        await store.open()
    await store.close()


def test_the_command_line_takes_a_cluster_url(redis_cluster: RedisCluster, tmp_path: Path) -> None:
    redis_cluster.flushall()
    config = tmp_path / "cheese-shop.json"
    config.write_text(json.dumps(CONFIG))
    store = {"CALLER_MEMORY_STORE": redis_cluster.url}
    applied = run_cli(tmp_path, "project", "apply", str(config), env=store)
    assert applied.returncode == 0, applied.stderr
    created = run_cli(tmp_path, "token", "create", "cheese-shop", "--role", "admin", env=store)
    assert created.returncode == 0, created.stderr
    listed = json.loads(run_cli(tmp_path, "token", "list", "cheese-shop", env=store).stdout)
    assert [t["token_id"] for t in listed["tokens"]] == [json.loads(created.stdout)["token_id"]]

    not_zero = run_cli(
        tmp_path, "project", "show", "cheese-shop", env={"CALLER_MEMORY_STORE": f"{redis_cluster.url}1"}
    )
    assert not_zero.returncode == 1
    assert "error: store URL: Redis Cluster URL: a cluster has one database, 0, not '1'" in not_zero.stderr
    assert "Traceback" not in not_zero.stderr
