"""The attempts each webhook delivery keeps and the listing by state, on every backend (SQLite, Redis, Redis
Cluster): the latest ten attempts with their HTTP status or error, delivered deliveries kept without their
payload for a bounded time, queued ones listed under a lease too, each project's own only, a delivered one
queued again from scratch, erasure, endpoint deletion and expiry taking the attempts with their delivery,
and records stored before attempts were kept (a rolling upgrade) read as having none."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio
from caller_memory.service.domain.clock import HOUR_MS
from caller_memory.service.domain.store.webhooks import (
    DELIVERED_KEPT_MS,
    KEPT_ATTEMPTS,
    MAX_ERROR_CHARS,
    Attempt,
    Delivery,
    DeliveryStatus,
    QueueStats,
    Settlement,
    WebhookStore,
)
from caller_memory.service.storage.redis import keys
from caller_memory.service.storage.redis.store import RedisStore
from caller_memory.service.storage.sqlite.store import SQLiteStore

from tests.conftest import empty_store_url
from tests.storage.test_webhooks import (
    BACKENDS,
    LEASE,
    Backend,
    P,
    Q,
    delivery,
    endpoint,
    ids,
    new_caller,
    now_ms,
    opened,
    queue,
)

QUEUED, FAILED, DELIVERED = DeliveryStatus.QUEUED, DeliveryStatus.FAILED, DeliveryStatus.DELIVERED


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_store_url(request, request.param, tmp_path)


@pytest.fixture
async def store(url: str) -> AsyncIterator[Backend]:
    backend = await opened(url)
    try:
        yield backend
    finally:
        await backend.close()


async def attempt(
    store: WebhookStore, d: Delivery, at: int, outcome: Settlement, *, status: int = 0, error: str = ""
) -> None:
    """One attempt of ``d`` (due by ``at``): claimed at ``at`` and settled with ``outcome`` then."""
    claimed = await store.claim_deliveries(
        d.project, d.endpoint_id, at, 10, owner="w", lease_until=at + LEASE
    )
    assert d.delivery_id in ids(claimed)
    assert await store.settle_delivery(
        d.project, d.delivery_id, "w", outcome, at, next_attempt_at=at, error=error, http_status=status
    )


async def delivered(store: Backend, d: Delivery, at: int) -> Delivery:
    """``d`` queued, failed once (HTTP 503) at ``at`` and delivered (204) at ``at + 10``; as listed then."""
    await queue(store, d.created_at, d)
    await attempt(store, d, at, Settlement.RETRY, status=503, error="HTTP 503")
    await attempt(store, d, at + 10, Settlement.DELIVERED, status=204)
    found = [
        x
        for x in await store.list_deliveries(d.project, DELIVERED, at + 10)
        if x.delivery_id == d.delivery_id
    ]
    assert len(found) == 1
    return found[0]


async def listed(
    store: Backend, status: DeliveryStatus, at: int, project: str = P, **options: object
) -> list[str]:
    return ids(await store.list_deliveries(project, status, at, **options))  # type: ignore[arg-type]


async def test_each_attempt_is_kept_the_latest_ten_with_status_and_error(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    await queue(store, t, d)
    errors = ["HTTP 500", "timeout after 10 s", "cannot\tconnect\n(ConnectionRefusedError)", "x" * 500]
    for n in range(1, KEPT_ATTEMPTS + 3):
        error = errors[n % len(errors)]
        await attempt(
            store, d, t + n, Settlement.RETRY, status=500 if error == "HTTP 500" else 0, error=error
        )
    got = await store.get_delivery(P, d.delivery_id, t + 100)
    assert got is not None and got.attempts == KEPT_ATTEMPTS + 2
    assert [a.number for a in got.recent_attempts] == list(range(3, KEPT_ATTEMPTS + 3))
    by_number = {a.number: a for a in got.recent_attempts}
    assert by_number[4] == Attempt(4, t + 4, 500, "HTTP 500")
    assert by_number[5] == Attempt(5, t + 5, 0, "timeout after 10 s")
    # Tabs and line breaks become spaces (a kept attempt is one line), and a long error is cut.
    assert by_number[6].error == "cannot connect (ConnectionRefusedError)"
    assert by_number[7].error == "x" * MAX_ERROR_CHARS
    # The last one failing for good keeps its attempts too.
    await attempt(store, d, t + 50, Settlement.FAILED, status=502, error="HTTP 502")
    (failed,) = await store.list_deliveries(P, FAILED, t + 50)
    assert failed.recent_attempts[-1] == Attempt(KEPT_ATTEMPTS + 3, t + 50, 502, "HTTP 502")
    assert len(failed.recent_attempts) == KEPT_ATTEMPTS


async def test_a_delivered_delivery_is_listed_without_its_payload_then_goes(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    got = await delivered(store, d, t)
    assert got == dataclasses.replace(
        d,
        payload=b"",
        status=DELIVERED,
        attempts=2,
        next_attempt_at=got.next_attempt_at,  # no longer used: left unspecified
        last_attempt_at=t + 10,
        last_error="",
        expires_at=got.expires_at,
        recent_attempts=(Attempt(1, t, 503, "HTTP 503"), Attempt(2, t + 10, 204, "")),
    )
    # Kept a day at most (the delivery would have lived a day more here), then gone.
    assert got.expires_at == min(d.expires_at, t + 10 + DELIVERED_KEPT_MS)
    # Neither queued nor failed: not found, claimed, redelivered or counted as such.
    assert await store.get_delivery(P, d.delivery_id, t + 11) is None
    assert await store.redeliver(P, d.delivery_id, t + 11) is None
    assert await store.claim_deliveries(P, "wh_1", t + 11, 10, owner="w", lease_until=t + LEASE) == []
    assert not await store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t + 12)
    assert await store.queue_stats(t + 12) == QueueStats(0, 0, 0)
    assert await listed(store, QUEUED, t + 12) == [] and await listed(store, FAILED, t + 12) == []
    assert await listed(store, DELIVERED, got.expires_at - 1) == [d.delivery_id]
    assert await listed(store, DELIVERED, got.expires_at) == []


async def test_a_delivered_delivery_goes_at_its_own_expiry_when_that_comes_first(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1", expires_at=t + HOUR_MS)
    got = await delivered(store, d, t)
    assert got.expires_at == t + HOUR_MS
    assert await listed(store, DELIVERED, t + HOUR_MS - 1) == [d.delivery_id]
    assert await listed(store, DELIVERED, t + HOUR_MS) == []


async def test_the_listing_by_state_in_its_order_per_endpoint_and_project(store: Backend) -> None:
    t = now_ms()
    await store.put_endpoint(endpoint(t, endpoint_id="wh_1"))
    old = delivery(t, "wh_1", delivery_id="msg_old")
    new = delivery(t + 1, "wh_2", delivery_id="msg_new")
    later = delivery(t + 2, "wh_1", delivery_id="msg_later", next_attempt_at=t + HOUR_MS)
    other = delivery(t, "wh_1", project=Q, delivery_id="msg_other")
    await queue(store, t, old, new, later)
    await queue(store, t, other)
    # Under a lease (its attempt running) a queued delivery is still pending.
    assert ids(await store.claim_deliveries(P, "wh_1", t + 5, 1, owner="w", lease_until=t + LEASE)) == [
        "msg_old"
    ]
    assert await listed(store, QUEUED, t + 5) == ["msg_old", "msg_new", "msg_later"]
    assert await listed(store, QUEUED, t + 5, endpoint_id="wh_1") == ["msg_old", "msg_later"]
    assert await listed(store, QUEUED, t + 5, limit=2) == ["msg_old", "msg_new"]
    assert await listed(store, QUEUED, t + 5, limit=0) == []
    assert await listed(store, QUEUED, t + 5, project=Q) == ["msg_other"]
    # Failed and delivered: the most recent attempt first.
    first = delivery(t, "wh_1", delivery_id="msg_d1")
    second = delivery(t, "wh_2", delivery_id="msg_d2")
    await delivered(store, first, t + 20)
    await delivered(store, second, t + 40)
    assert await listed(store, DELIVERED, t + 60) == ["msg_d2", "msg_d1"]
    assert await listed(store, DELIVERED, t + 60, endpoint_id="wh_1") == ["msg_d1"]
    assert await listed(store, DELIVERED, t + 60, project=Q) == []
    failing = delivery(t, "wh_2", delivery_id="msg_f")
    await queue(store, t, failing)
    await attempt(store, failing, t + 70, Settlement.FAILED, status=500, error="HTTP 500")
    assert await listed(store, FAILED, t + 70) == ["msg_f"]
    assert await listed(store, FAILED, t + 70, project=Q) == []
    assert await listed(store, FAILED, t + 70, endpoint_id="wh_1") == []


async def test_a_delivered_delivery_queued_again_starts_afresh(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    await delivered(store, d, t)
    again = dataclasses.replace(d, created_at=t + 100, next_attempt_at=t + 100)
    await queue(store, t + 100, again)
    assert await store.get_delivery(P, d.delivery_id, t + 100) == again
    assert await listed(store, DELIVERED, t + 100) == []
    assert await listed(store, QUEUED, t + 100) == [d.delivery_id]
    assert await store.queue_stats(t + 100) == QueueStats(1, 0, t + 100)


async def test_erasure_and_endpoint_deletion_take_every_state_with_its_attempts(store: Backend) -> None:
    t = now_ms()
    caller = new_caller()
    sent = delivery(t, "wh_1", subject=caller.subject)
    failing = delivery(t, "wh_1", subject=caller.subject)
    waiting = delivery(t, "wh_2", subject=caller.subject)
    someone_else = delivery(t, "wh_1", subject=new_caller().subject)
    await delivered(store, sent, t)
    await queue(store, t, failing, waiting, someone_else)
    await attempt(store, failing, t + 1, Settlement.FAILED, status=500, error="HTTP 500")
    # Counted: what was never sent now (the delivered one's record goes too, uncounted).
    assert await store.delete_caller_deliveries(caller) == 2
    assert await listed(store, DELIVERED, t + 20) == []
    assert await listed(store, FAILED, t + 20) == []
    assert await listed(store, QUEUED, t + 20) == [someone_else.delivery_id]
    # A delivered record of a deleted endpoint goes with it.
    await store.put_endpoint(endpoint(t, endpoint_id="wh_9"))
    gone = delivery(t, "wh_9")
    await delivered(store, gone, t + 30)
    assert await store.delete_endpoint(P, "wh_9")
    assert await listed(store, DELIVERED, t + 50) == []
    # Nothing is left to be queued again as it was: the same id queues afresh.
    await queue(store, t + 60, dataclasses.replace(sent, created_at=t + 60, next_attempt_at=t + 60))
    got = await store.get_delivery(P, sent.delivery_id, t + 60)
    assert got is not None and got.recent_attempts == () and got.attempts == 0


async def test_a_delivery_stored_without_attempts_reads_as_having_none(store: Backend) -> None:
    """What an earlier release queued (no attempts kept, some made): listed, and the next attempt is kept."""
    t = now_ms()
    d = delivery(t, "wh_1", attempts=3, last_attempt_at=t - 1, last_error="HTTP 500")
    await queue(store, t, d)
    (listed_one,) = await store.list_deliveries(P, QUEUED, t)
    assert listed_one.attempts == 3 and listed_one.recent_attempts == ()
    await attempt(store, d, t + 1, Settlement.RETRY, error="timeout after 10 s")
    got = await store.get_delivery(P, d.delivery_id, t + 1)
    assert got is not None and got.recent_attempts == (Attempt(4, t + 1, 0, "timeout after 10 s"),)


# What each backend keeps -------------------------------------------------------------------------------------

#: The webhook_deliveries table as releases before attempts were kept made it.
OLD_DELIVERIES_TABLE = """
CREATE TABLE webhook_deliveries (
    id INTEGER PRIMARY KEY, project TEXT NOT NULL, delivery_id TEXT NOT NULL, endpoint_id TEXT NOT NULL,
    event TEXT NOT NULL, payload BLOB NOT NULL, subject TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL,
    next_attempt_at INTEGER NOT NULL, last_attempt_at INTEGER NOT NULL, last_error TEXT NOT NULL,
    lease_owner TEXT, lease_until INTEGER NOT NULL, UNIQUE (project, delivery_id)
)
"""


async def test_a_sqlite_file_of_an_earlier_release_lists_its_failed_deliveries(tmp_path: Path) -> None:
    t = now_ms()
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(OLD_DELIVERIES_TABLE)
        conn.execute(
            "INSERT INTO webhook_deliveries VALUES "
            "(1, ?, 'msg_old', 'wh_1', 'conversation.ended', x'7b7d', '', ?, ?, 'failed', 10, 0, ?, 'HTTP 500', "
            "NULL, 0)",
            (P, t, t + HOUR_MS, t - 5),
        )
    conn.close()
    store = SQLiteStore(path)
    await store.open()
    try:
        (old,) = await store.list_deliveries(P, FAILED, t)
        assert (old.delivery_id, old.attempts, old.last_error, old.recent_attempts) == (
            "msg_old",
            10,
            "HTTP 500",
            (),
        )
        again = await store.redeliver(P, "msg_old", t)
        assert again is not None and again.status is QUEUED
    finally:
        await store.close()


async def test_the_sqlite_sweep_removes_a_delivered_record_once_kept_long_enough(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "m.db")
    await store.open()
    try:
        t = now_ms()
        d = delivery(t, "wh_1", expires_at=t + 3 * DELIVERED_KEPT_MS)
        await queue(store, t, d)
        await attempt(store, d, t, Settlement.DELIVERED, status=200)
        counts, _ = await store.sweep(t + DELIVERED_KEPT_MS - 1, 100)
        assert counts.get("webhook_deliveries", 0) == 0
        counts, _ = await store.sweep(t + DELIVERED_KEPT_MS, 100)
        assert counts["webhook_deliveries"] == 1
    finally:
        await store.close()


async def test_a_delivered_redis_record_drops_its_payload_and_expires_by_itself(
    redis_store: RedisStore, redis_client: redis.asyncio.Redis | redis.asyncio.RedisCluster
) -> None:
    t = now_ms()
    d = delivery(t, "wh_1", expires_at=t + 3 * DELIVERED_KEPT_MS)
    assert await redis_store.enqueue_deliveries([d], None, t, t)
    claimed = await redis_store.claim_deliveries(P, "wh_1", t, 1, owner="w", lease_until=t + LEASE)
    assert ids(claimed) == [d.delivery_id]
    assert await redis_store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t, http_status=200)
    key = keys.webhook_delivery_key(P, "wh_1", d.delivery_id)
    assert await redis_client.hget(key, "payload") == b""
    # Redis deletes it at the end of its keeping even if nothing reads the queue again.
    assert abs(await redis_client.pexpiretime(key) - (t + DELIVERED_KEPT_MS)) <= 1
    delivered_set = keys.webhook_queue_keys(P, "wh_1")[0][:-1] + "v"
    assert await redis_client.zscore(delivered_set, d.delivery_id) == -t
    assert 0 < await redis_client.pexpiretime(delivered_set) <= t + 3 * DELIVERED_KEPT_MS
