"""The webhook part of the Store contract (service/domain/store/webhooks.py): endpoints and the delivery queue,
identical on every backend that implements it (today SQLite; Redis and Redis Cluster join by themselves once
their store class is a WebhookStore).

Times are a base from the real clock (Redis may expire keys in its own time) plus explicit offsets passed as
``now_ms``; nothing sleeps. A second store opened on the same URL plays another replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
from caller_memory.service.domain.clock import DAY_MS, HOUR_MS
from caller_memory.service.domain.store import (
    CallerRef,
    ConversationEntry,
    ListingPage,
    Recording,
    RecordStatus,
    Store,
)
from caller_memory.service.domain.store.webhooks import (
    Attempt,
    Delivery,
    DeliveryStatus,
    QueueStats,
    Settlement,
    WebhookEndpoint,
    WebhookStore,
)
from caller_memory.service.storage import open_store
from caller_memory.service.storage.redis.store import RedisStore
from caller_memory.service.storage.sqlite.store import SQLiteStore

from tests.conftest import empty_store_url
from tests.storage.conftest import REDIS_BACKENDS

#: Each backend's store class: only those that implement the port are tested (no skipped params).
CLASSES: dict[str, type] = {"sqlite": SQLiteStore, **dict.fromkeys(REDIS_BACKENDS, RedisStore)}
BACKENDS = [name for name, cls in CLASSES.items() if issubclass(cls, WebhookStore)]

P, Q = "shop", "clinic"
LEASE = 60_000


class Backend(Store, WebhookStore):
    """For type checkers only: what the fixture yields."""


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_store_url(request, request.param, tmp_path)


async def opened(url: str) -> Backend:
    backend = open_store(url, timeout=5.0)
    assert isinstance(backend, WebhookStore)
    await backend.open()
    return cast(Backend, backend)


@pytest.fixture
async def store(url: str) -> AsyncIterator[Backend]:
    backend = await opened(url)
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture
async def replica(url: str, store: Backend) -> AsyncIterator[Backend]:
    """Another store on the same data, as a second replica of the service has."""
    backend = await opened(url)
    try:
        yield backend
    finally:
        await backend.close()


# Helpers ----------------------------------------------------------------------------------------------------


def now_ms() -> int:
    return int(time.time() * 1000)


def new_caller(project: str = P) -> CallerRef:
    return CallerRef(project, uuid.uuid4().hex)


def endpoint(t: int, project: str = P, endpoint_id: str | None = None, **changes: object) -> WebhookEndpoint:
    record = WebhookEndpoint(
        project=project,
        endpoint_id=endpoint_id or f"wh_{uuid.uuid4().hex}",
        url="https://receiver.example/hooks",
        events=("conversation.ended", "caller.erased"),
        include_history=False,
        created_at=t,
        secret=b"\x00sealed\xff" + uuid.uuid4().bytes,
    )
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def delivery(
    t: int, endpoint_id: str, project: str = P, delivery_id: str | None = None, **changes: object
) -> Delivery:
    """A queued delivery created at ``t``, due at ``t``, living a day."""
    record = Delivery(
        project=project,
        delivery_id=delivery_id or f"msg_{uuid.uuid4().hex}",
        endpoint_id=endpoint_id,
        event="conversation.ended",
        payload=b'{"type":"conversation.ended","data":{"id":"%s"}}' % uuid.uuid4().hex.encode(),
        subject="",
        created_at=t,
        expires_at=t + DAY_MS,
        next_attempt_at=t,
    )
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


async def queue(store: WebhookStore, t: int, *deliveries: Delivery) -> None:
    assert await store.enqueue_deliveries(deliveries, None, t, t)


async def failed(store: WebhookStore, t: int, d: Delivery, error: str = "HTTP 503") -> Delivery:
    """``d`` queued, claimed at ``t`` and settled FAILED at ``t``."""
    await queue(store, t, d)
    assert d.delivery_id in ids(
        await store.claim_deliveries(d.project, d.endpoint_id, t, 10, owner="w", lease_until=t + 1)
    )
    assert await store.settle_delivery(d.project, d.delivery_id, "w", Settlement.FAILED, t, error=error)
    got = await store.get_delivery(d.project, d.delivery_id, t)
    assert got is not None and got.status is DeliveryStatus.FAILED
    return got


def ids(deliveries: list[Delivery]) -> list[str]:
    return [d.delivery_id for d in deliveries]


# Endpoints --------------------------------------------------------------------------------------------------


async def test_an_endpoint_reads_back_as_it_was_put(store: Backend) -> None:
    t = now_ms()
    e = endpoint(
        t, include_history=True, previous_secret=b"\x01old", previous_until=t + DAY_MS, description="CRM sync"
    )
    await store.put_endpoint(e)
    assert await store.get_endpoint(P, e.endpoint_id) == e
    plain = endpoint(t, events=("caller.erased",))
    await store.put_endpoint(plain)
    assert await store.get_endpoint(P, plain.endpoint_id) == plain
    assert await store.get_endpoint(P, "wh_missing") is None
    assert await store.get_endpoint(Q, e.endpoint_id) is None


async def test_putting_an_endpoint_again_replaces_it(store: Backend) -> None:
    t = now_ms()
    e = endpoint(t)
    await store.put_endpoint(e)
    rotated = dataclasses.replace(
        e, secret=b"new", previous_secret=e.secret, previous_until=t + DAY_MS, url="https://other.example/"
    )
    await store.put_endpoint(rotated)
    assert await store.get_endpoint(P, e.endpoint_id) == rotated
    assert await store.list_endpoints(P) == [rotated]


async def test_endpoints_are_listed_by_creation_then_id(store: Backend) -> None:
    t = now_ms()
    late, b, a = endpoint(t + 5, P, "wh_a"), endpoint(t, P, "wh_b"), endpoint(t, P, "wh_a0")
    other = endpoint(t + 1, Q, "wh_c")
    for e in (late, b, other, a):
        await store.put_endpoint(e)
    assert await store.list_endpoints(P) == [a, b, late]
    assert await store.list_endpoints(Q) == [other]
    assert await store.list_endpoints("empty") == []
    assert await store.list_endpoints() == [a, b, other, late]
    assert await store.list_endpoints(None) == [a, b, other, late]


async def test_deleting_an_endpoint_deletes_its_deliveries(store: Backend) -> None:
    t = now_ms()
    gone, kept = endpoint(t), endpoint(t)
    for e in (gone, kept):
        await store.put_endpoint(e)
    queued, kept_one = delivery(t, gone.endpoint_id), delivery(t, kept.endpoint_id)
    dead = await failed(store, t, delivery(t, gone.endpoint_id))
    await queue(store, t, queued, kept_one)

    assert await store.delete_endpoint(P, gone.endpoint_id)
    assert await store.get_endpoint(P, gone.endpoint_id) is None
    assert await store.list_endpoints(P) == [kept]
    for d in (queued, dead):
        assert await store.get_delivery(P, d.delivery_id, t) is None
    assert await store.claim_deliveries(P, gone.endpoint_id, t, 10, owner="w", lease_until=t + LEASE) == []
    assert await store.failed_deliveries(P, t) == []
    assert await store.get_delivery(P, kept_one.delivery_id, t) == kept_one
    assert await store.queue_stats(t) == QueueStats(queued=1, failed=0, oldest_queued_at=t)
    assert not await store.delete_endpoint(P, gone.endpoint_id)
    assert not await store.delete_endpoint(Q, kept.endpoint_id)
    assert await store.get_endpoint(P, kept.endpoint_id) == kept


# Enqueue ----------------------------------------------------------------------------------------------------


async def test_queued_deliveries_read_back_and_are_seen_by_every_replica(
    store: Backend, replica: Backend
) -> None:
    t = now_ms()
    a = delivery(t, "wh_1")
    b = delivery(t, "wh_1", subject=new_caller().subject, event="conversation.updated")
    assert await store.enqueue_deliveries([a, b], None, t, t)
    assert await store.get_delivery(P, a.delivery_id, t) == a
    assert await replica.get_delivery(P, b.delivery_id, t) == b
    assert await store.get_delivery(Q, a.delivery_id, t) is None
    assert await store.get_delivery(P, "msg_missing", t) is None
    assert ids(await replica.claim_deliveries(P, "wh_1", t, 10, owner="w", lease_until=t + LEASE)) == sorted(
        ids([a, b])
    )


async def test_enqueue_is_idempotent_while_the_delivery_lives(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    await queue(store, t, d)
    await queue(store, t + 1, dataclasses.replace(d, payload=b"{}", created_at=t + 1))
    assert await store.get_delivery(P, d.delivery_id, t + 1) == d
    # A failed one stays failed, as it was.
    f = await failed(store, t, delivery(t, "wh_1"))
    await queue(store, t + 2, dataclasses.replace(f, status=DeliveryStatus.QUEUED, attempts=0, payload=b"{}"))
    assert await store.get_delivery(P, f.delivery_id, t + 2) == f
    # The same id in another project is another delivery.
    elsewhere = dataclasses.replace(d, project=Q, payload=b"{}")
    await queue(store, t, elsewhere)
    assert await store.get_delivery(Q, d.delivery_id, t) == elsewhere
    assert await store.get_delivery(P, d.delivery_id, t) == d
    # An expired one is gone, whatever a backend still holds of it: its id is queued afresh.
    old = delivery(t, "wh_1", expires_at=t + HOUR_MS)
    await queue(store, t, old)
    new = dataclasses.replace(old, payload=b"{}", created_at=t + HOUR_MS, expires_at=t + DAY_MS)
    await queue(store, t + HOUR_MS, new)
    assert await store.get_delivery(P, old.delivery_id, t + HOUR_MS) == new


async def test_a_delivered_delivery_may_be_queued_again(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    await queue(store, t, d)
    assert ids(await store.claim_deliveries(P, "wh_1", t, 1, owner="w", lease_until=t + LEASE)) == [
        d.delivery_id
    ]
    assert await store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t + 1)
    again = dataclasses.replace(d, created_at=t + 2, next_attempt_at=t + 2)
    await queue(store, t + 2, again)
    assert await store.get_delivery(P, d.delivery_id, t + 2) == again


async def test_enqueue_for_an_erased_caller_queues_nothing(store: Backend) -> None:
    t = now_ms()
    caller, other = new_caller(), new_caller()
    await store.erase_caller(caller, t, t + DAY_MS)
    about = [delivery(t, "wh_1", subject=caller.subject), delivery(t, "wh_2", subject=caller.subject)]
    for made_at in (t - 1, t):  # made before the erasure, or at its very moment
        assert not await store.enqueue_deliveries(about, caller, made_at, t + 10)
    assert not await store.enqueue_deliveries([], caller, t, t + 10)
    for d in about:
        assert await store.get_delivery(P, d.delivery_id, t + 10) is None
    assert await store.claim_deliveries(P, "wh_1", t + 10, 10, owner="w", lease_until=t + LEASE) == []
    assert await store.queue_stats(t + 10) == QueueStats(0, 0, 0)
    # The tombstone is the caller's alone, in its project.
    theirs = delivery(t, "wh_1", subject=other.subject)
    assert await store.enqueue_deliveries([theirs], other, t - 1, t + 10)
    same_subject = CallerRef(Q, caller.subject)
    assert await store.enqueue_deliveries([delivery(t, "wh_1", Q)], same_subject, t - 1, t + 10)
    # Made after the erasure: a new conversation of the caller, queued.
    assert await store.enqueue_deliveries(about, caller, t + 1, t + 10)
    assert await store.get_delivery(P, about[1].delivery_id, t + 10) == about[1]
    assert await store.enqueue_deliveries([], caller, t + 1, t + 10)
    assert await store.enqueue_deliveries([], None, t, t + 10)
    # Without a caller, no tombstone is looked at (a caller.erased notice is about nobody).
    notice = delivery(t, "wh_1", event="caller.erased")
    assert await store.enqueue_deliveries([notice], None, t - 1, t + 10)
    assert await store.get_delivery(P, notice.delivery_id, t + 10) == notice


def recording_of(caller: CallerRef, conversation_id: str, t: int, made_at: int) -> Recording:
    entry = ConversationEntry(conversation_id, t - t % HOUR_MS, None, None, None, None, None)
    return Recording(caller, entry, [], t + DAY_MS, made_at)


async def test_an_ends_recording_queues_its_deliveries_with_it(store: Backend) -> None:
    """Store.record_conversation with an end's deliveries: recorded and queued (one round trip on one Redis
    server, one transaction in SQLite), idempotent, and nothing queued nor listed for an erased caller."""
    t = now_ms()
    caller = new_caller()
    about = [delivery(t, "wh_1", subject=caller.subject), delivery(t, "wh_2", subject=caller.subject)]
    gone = delivery(t, "wh_1", subject=caller.subject, expires_at=t + 1)  # expired by now: never queued
    recording = recording_of(caller, "c1", t, t)
    assert await store.record_conversation(recording, t + 10, [*about, gone]) is RecordStatus.RECORDED
    for d in about:
        assert await store.get_delivery(P, d.delivery_id, t + 10) == d
    assert await store.get_delivery(P, gone.delivery_id, t + 10) is None
    listed = await store.list_conversations(P, ListingPage("0", "9", limit=10), t + 10)
    assert [e.conversation_id for e in listed] == ["c1"]
    # The end's retry: nothing recorded or queued twice.
    assert await store.record_conversation(recording, t + 11, about) is RecordStatus.DUPLICATE
    assert ids(await store.claim_deliveries(P, "wh_1", t + 11, 10, owner="w", lease_until=t + LEASE)) == [
        about[0].delivery_id
    ]
    # An end made before the caller's erasure: neither listed nor queued.
    erased = new_caller()
    await store.erase_caller(erased, t + 20, t + DAY_MS)
    late = [delivery(t, "wh_1", subject=erased.subject)]
    assert await store.record_conversation(recording_of(erased, "c2", t, t + 20), t + 30, late) is (
        RecordStatus.ERASED
    )
    assert await store.get_delivery(P, late[0].delivery_id, t + 30) is None
    listed = await store.list_conversations(P, ListingPage("0", "9", limit=10), t + 30)
    assert [e.conversation_id for e in listed] == ["c1"]
    with pytest.raises(ValueError, match="one project"):
        await store.record_conversation(recording_of(new_caller(Q), "c3", t, t), t + 30, late)


async def test_expired_deliveries_are_not_queued(store: Backend) -> None:
    t = now_ms()
    # Live for a minute: Redis expires keys on its own clock, which a loaded machine moves on meanwhile.
    live, at_expiry, past = (delivery(t, "wh_1", expires_at=t + n) for n in (60_000, 10, 1))
    assert await store.enqueue_deliveries([past, live, at_expiry], None, t, t + 10)
    assert await store.get_delivery(P, live.delivery_id, t + 10) == live
    for d in (at_expiry, past):  # not there even for a clock before their expiry: never queued
        assert await store.get_delivery(P, d.delivery_id, t) is None
    assert ids(await store.claim_deliveries(P, "wh_1", t + 10, 10, owner="w", lease_until=t + LEASE)) == [
        live.delivery_id
    ]
    assert await store.queue_stats(t + 10) == QueueStats(1, 0, t)


# Claims -----------------------------------------------------------------------------------------------------


async def test_a_claim_leases_due_deliveries_earliest_first(store: Backend) -> None:
    t = now_ms()
    later = delivery(t, "wh_1", P, "msg_a", next_attempt_at=t + 5)
    second, first = delivery(t, "wh_1", P, "msg_c"), delivery(t, "wh_1", P, "msg_b")
    early = delivery(t, "wh_1", P, "msg_z", next_attempt_at=t - 5)
    not_due = delivery(t, "wh_1", P, "msg_0", next_attempt_at=t + 6)
    await queue(store, t, later, second, not_due, first, early)
    await queue(store, t, delivery(t, "wh_2"))  # another endpoint
    await queue(store, t, delivery(t, "wh_1", Q))  # another project

    claimed = await store.claim_deliveries(P, "wh_1", t + 5, 3, owner="w1", lease_until=t + LEASE)
    assert claimed == [early, first, second]
    assert await store.claim_deliveries(P, "wh_1", t + 5, 3, owner="w1", lease_until=t + LEASE) == [later]
    assert await store.claim_deliveries(P, "wh_1", t + 5, 3, owner="w2", lease_until=t + LEASE) == []
    assert await store.claim_deliveries(P, "wh_1", t + 6, 3, owner="w2", lease_until=t + LEASE) == [not_due]
    assert await store.claim_deliveries(P, "wh_1", t + 6, 0, owner="w2", lease_until=t + LEASE) == []


async def test_a_lease_keeps_others_away_until_it_ends(store: Backend, replica: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    await queue(store, t, d)
    assert await store.claim_deliveries(P, "wh_1", t, 10, owner="w1", lease_until=t + 100) == [d]
    assert await replica.claim_deliveries(P, "wh_1", t + 99, 10, owner="w2", lease_until=t + 200) == []
    assert await store.claim_deliveries(P, "wh_1", t + 99, 10, owner="w1", lease_until=t + 200) == []
    # The lease ended (lease_until <= now): another worker takes it over, and the first one's word is void.
    assert await replica.claim_deliveries(P, "wh_1", t + 100, 10, owner="w2", lease_until=t + 200) == [d]
    assert not await store.settle_delivery(P, d.delivery_id, "w1", Settlement.DELIVERED, t + 101)
    assert await store.get_delivery(P, d.delivery_id, t + 101) == d
    assert await replica.settle_delivery(P, d.delivery_id, "w2", Settlement.DELIVERED, t + 102)
    assert await store.get_delivery(P, d.delivery_id, t + 102) is None


async def test_a_claim_deletes_expired_deliveries(store: Backend) -> None:
    t = now_ms()
    short = delivery(t, "wh_1", delivery_id="msg_a", expires_at=t + HOUR_MS)
    long = delivery(t, "wh_1", delivery_id="msg_b", expires_at=t + DAY_MS)
    await queue(store, t, short, long)
    # However many others expired (a backend may delete them in batches).
    await queue(store, t, *(delivery(t, "wh_2", expires_at=t + HOUR_MS - 1) for _ in range(150)))
    assert await store.claim_deliveries(
        P, "wh_1", t + HOUR_MS, 10, owner="w", lease_until=t + HOUR_MS + LEASE
    ) == [long]
    # Deleted, not merely hidden: not there even for a clock behind the claim's, and it can be queued afresh.
    assert await store.get_delivery(P, short.delivery_id, t + HOUR_MS - 1) is None
    assert await store.queue_stats(t + HOUR_MS - 1) == QueueStats(1, 0, t)
    fresh = dataclasses.replace(short, created_at=t + HOUR_MS, expires_at=t + DAY_MS)
    await queue(store, t + HOUR_MS, fresh)
    assert await store.get_delivery(P, short.delivery_id, t + HOUR_MS) == fresh


async def test_failed_deliveries_are_never_claimed(store: Backend) -> None:
    t = now_ms()
    await failed(store, t, delivery(t, "wh_1"))
    assert (
        await store.claim_deliveries(P, "wh_1", t + DAY_MS - 1, 10, owner="w2", lease_until=t + DAY_MS) == []
    )


async def test_concurrent_claims_never_share_a_delivery(store: Backend, replica: Backend) -> None:
    t = now_ms()
    queued = [delivery(t, "wh_1", next_attempt_at=t - i) for i in range(60)]
    await queue(store, t, *queued)
    claimed: list[str] = []
    # Two workers of one replica, then workers of two replicas, claiming at the same moment.
    for first, second in ((store, store), (store, replica), (replica, replica)):
        a, b = await asyncio.gather(
            first.claim_deliveries(P, "wh_1", t, 10, owner="w1", lease_until=t + LEASE),
            second.claim_deliveries(P, "wh_1", t, 10, owner="w2", lease_until=t + LEASE),
        )
        assert len(a) == len(b) == 10
        claimed += ids(a) + ids(b)
    assert len(set(claimed)) == len(claimed) and set(claimed) == set(ids(queued))
    assert await store.claim_deliveries(P, "wh_1", t, 30, owner="w3", lease_until=t + LEASE) == []


# Settlements ------------------------------------------------------------------------------------------------


async def test_delivered_deletes_the_delivery(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    await queue(store, t, d)
    await store.claim_deliveries(P, "wh_1", t, 1, owner="w", lease_until=t + LEASE)
    assert await store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t + 1)
    assert await store.get_delivery(P, d.delivery_id, t + 1) is None
    assert await store.claim_deliveries(P, "wh_1", t + LEASE, 10, owner="w", lease_until=t + 2 * LEASE) == []
    assert await store.failed_deliveries(P, t + 1) == []
    assert await store.queue_stats(t + 1) == QueueStats(0, 0, 0)
    assert not await store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t + 2)


async def test_retry_queues_the_delivery_again_at_its_time(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1")
    await queue(store, t, d)
    await store.claim_deliveries(P, "wh_1", t, 1, owner="w1", lease_until=t + LEASE)
    assert await store.settle_delivery(
        P, d.delivery_id, "w1", Settlement.RETRY, t + 2, next_attempt_at=t + 5000, error="HTTP 503"
    )
    first = Attempt(1, t + 2, 0, "HTTP 503")
    retried = dataclasses.replace(
        d,
        attempts=1,
        next_attempt_at=t + 5000,
        last_attempt_at=t + 2,
        last_error="HTTP 503",
        recent_attempts=(first,),
    )
    assert await store.get_delivery(P, d.delivery_id, t + 2) == retried
    # The lease ended with the attempt; the delivery is due again at its time, to any worker.
    assert await store.claim_deliveries(P, "wh_1", t + 4999, 10, owner="w2", lease_until=t + LEASE) == []
    assert await store.claim_deliveries(P, "wh_1", t + 5000, 10, owner="w2", lease_until=t + LEASE) == [
        retried
    ]
    assert not await store.settle_delivery(P, d.delivery_id, "w1", Settlement.RETRY, t + 5001)
    assert await store.settle_delivery(
        P, d.delivery_id, "w2", Settlement.RETRY, t + 5001, next_attempt_at=t + 9000, error="timeout"
    )
    again = await store.get_delivery(P, d.delivery_id, t + 5001)
    assert again == dataclasses.replace(
        retried,
        attempts=2,
        next_attempt_at=t + 9000,
        last_attempt_at=t + 5001,
        last_error="timeout",
        recent_attempts=(first, Attempt(2, t + 5001, 0, "timeout")),
    )
    assert await store.queue_stats(t + 5001) == QueueStats(1, 0, t)


async def test_failed_marks_the_delivery_failed(store: Backend) -> None:
    t = now_ms()
    d = delivery(t, "wh_1", attempts=9)
    await queue(store, t, d)
    await store.claim_deliveries(P, "wh_1", t, 1, owner="w", lease_until=t + LEASE)
    assert await store.settle_delivery(P, d.delivery_id, "w", Settlement.FAILED, t + 3, error="refused: x")
    got = await store.get_delivery(P, d.delivery_id, t + 3)
    assert got is not None  # its next_attempt_at, no longer used, is left unspecified
    assert dataclasses.replace(got, next_attempt_at=t) == dataclasses.replace(
        d,
        status=DeliveryStatus.FAILED,
        attempts=10,
        last_attempt_at=t + 3,
        last_error="refused: x",
        recent_attempts=(Attempt(10, t + 3, 0, "refused: x"),),
    )
    assert await store.failed_deliveries(P, t + 3) == [got]
    assert await store.queue_stats(t + 3) == QueueStats(0, 1, 0)
    assert not await store.settle_delivery(P, d.delivery_id, "w", Settlement.FAILED, t + 4)
    assert not await store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t + 4)
    assert await store.get_delivery(P, d.delivery_id, t + 4) == got


async def test_a_settlement_without_the_lease_changes_nothing(store: Backend) -> None:
    t = now_ms()
    unclaimed, claimed = delivery(t, "wh_1", next_attempt_at=t + 10), delivery(t, "wh_1")
    await queue(store, t, unclaimed, claimed)
    assert await store.claim_deliveries(P, "wh_1", t, 10, owner="w1", lease_until=t + LEASE) == [claimed]
    for outcome in Settlement:
        assert not await store.settle_delivery(P, claimed.delivery_id, "w2", outcome, t + 1)
        assert not await store.settle_delivery(P, claimed.delivery_id, "", outcome, t + 1)
        assert not await store.settle_delivery(P, unclaimed.delivery_id, "w1", outcome, t + 1)
        assert not await store.settle_delivery(Q, claimed.delivery_id, "w1", outcome, t + 1)
        assert not await store.settle_delivery(P, "msg_missing", "w1", outcome, t + 1)
    assert await store.get_delivery(P, claimed.delivery_id, t + 1) == claimed
    assert await store.get_delivery(P, unclaimed.delivery_id, t + 1) == unclaimed
    # Still leased by w1 alone.
    assert await store.claim_deliveries(P, "wh_1", t + 10, 10, owner="w2", lease_until=t + LEASE) == [
        unclaimed
    ]
    assert await store.settle_delivery(P, claimed.delivery_id, "w1", Settlement.DELIVERED, t + 11)


async def test_a_lease_that_ran_out_unclaimed_still_settles(store: Backend) -> None:
    # Reading of the port: "no longer leased by owner" is another worker's claim; until then the attempt's
    # outcome is the latest there is (refusing it would only send the delivery once more).
    t = now_ms()
    d = delivery(t, "wh_1")
    await queue(store, t, d)
    await store.claim_deliveries(P, "wh_1", t, 1, owner="w", lease_until=t + 100)
    assert await store.settle_delivery(P, d.delivery_id, "w", Settlement.DELIVERED, t + 500)
    assert await store.get_delivery(P, d.delivery_id, t + 500) is None


async def test_a_settlement_of_a_gone_delivery_is_refused(store: Backend) -> None:
    t = now_ms()
    caller = new_caller()
    deleted, erased = delivery(t, "wh_1"), delivery(t, "wh_1", subject=caller.subject)
    expiring = delivery(t, "wh_1", expires_at=t + HOUR_MS)
    await queue(store, t, deleted, erased, expiring)
    assert len(await store.claim_deliveries(P, "wh_1", t, 10, owner="w", lease_until=t + 2 * HOUR_MS)) == 3
    assert await store.delete_delivery(P, deleted.delivery_id)
    assert await store.delete_caller_deliveries(caller) == 1
    assert await store.queue_stats(t + 1) == QueueStats(1, 0, t)
    for outcome in Settlement:
        for d in (deleted, erased):
            assert not await store.settle_delivery(P, d.delivery_id, "w", outcome, t + 1, next_attempt_at=t)
            assert await store.get_delivery(P, d.delivery_id, t + 2) is None
        assert not await store.settle_delivery(P, expiring.delivery_id, "w", outcome, t + HOUR_MS)


# Failed deliveries, redelivery, deletion --------------------------------------------------------------------


async def test_failed_deliveries_are_listed_latest_attempt_first(store: Backend) -> None:
    t = now_ms()
    b = await failed(store, t + 3, delivery(t, "wh_1", delivery_id="msg_b"))
    a = await failed(store, t + 3, delivery(t, "wh_2", delivery_id="msg_a"))
    c = await failed(store, t + 5, delivery(t, "wh_1", delivery_id="msg_c"))
    old = await failed(store, t + 1, delivery(t, "wh_2", delivery_id="msg_d"))
    short = await failed(store, t + 9, delivery(t, "wh_1", delivery_id="msg_e", expires_at=t + HOUR_MS))
    await failed(store, t + 9, delivery(t, "wh_1", Q))
    await queue(store, t, delivery(t, "wh_1", next_attempt_at=t + 100))  # queued: never listed

    assert await store.failed_deliveries(P, t + 10) == [short, c, a, b, old]
    assert await store.failed_deliveries(P, t + 10, limit=2) == [short, c]
    assert await store.failed_deliveries(P, t + 10, limit=0) == []
    assert await store.failed_deliveries(P, t + 10, "wh_1") == [short, c, b]
    assert await store.failed_deliveries(P, t + 10, endpoint_id="wh_2", limit=1) == [a]
    assert await store.failed_deliveries(P, t + 10, "wh_none") == []
    # Expired: neither listed nor read nor counted.
    assert await store.failed_deliveries(P, t + HOUR_MS) == [c, a, b, old]
    assert await store.get_delivery(P, short.delivery_id, t + HOUR_MS) is None
    assert await store.queue_stats(t + HOUR_MS) == QueueStats(1, 5, t)


async def test_redelivery_queues_a_failed_delivery_now(store: Backend) -> None:
    t = now_ms()
    f = await failed(store, t + 1, delivery(t, "wh_1", attempts=9), error="timeout")
    again = await store.redeliver(P, f.delivery_id, t + 50)
    expected = dataclasses.replace(f, status=DeliveryStatus.QUEUED, attempts=0, next_attempt_at=t + 50)
    assert again == expected
    assert again.last_error == "timeout" and again.last_attempt_at == t + 1
    assert await store.get_delivery(P, f.delivery_id, t + 50) == expected
    assert await store.failed_deliveries(P, t + 50) == []
    assert await store.queue_stats(t + 50) == QueueStats(1, 0, t)
    assert await store.claim_deliveries(P, "wh_1", t + 49, 10, owner="w", lease_until=t + LEASE) == []
    assert await store.claim_deliveries(P, "wh_1", t + 50, 10, owner="w", lease_until=t + LEASE) == [expected]


async def test_redelivery_of_a_queued_delivery_changes_nothing(store: Backend) -> None:
    t = now_ms()
    d, leased = delivery(t, "wh_1", next_attempt_at=t + 500), delivery(t, "wh_1")
    await queue(store, t, d, leased)
    await store.claim_deliveries(P, "wh_1", t, 10, owner="w1", lease_until=t + LEASE)
    assert await store.redeliver(P, d.delivery_id, t + 1) == d
    assert await store.redeliver(P, leased.delivery_id, t + 1) == leased
    assert await store.get_delivery(P, d.delivery_id, t + 1) == d
    # Neither due earlier nor freed from its lease.
    assert await store.claim_deliveries(P, "wh_1", t + 499, 10, owner="w2", lease_until=t + LEASE) == []
    assert await store.settle_delivery(P, leased.delivery_id, "w1", Settlement.DELIVERED, t + 2)


async def test_redelivery_of_no_live_delivery_is_none(store: Backend) -> None:
    t = now_ms()
    f = await failed(store, t, delivery(t, "wh_1", expires_at=t + HOUR_MS))
    assert await store.redeliver(P, "msg_missing", t) is None
    assert await store.redeliver(Q, f.delivery_id, t) is None
    assert await store.redeliver(P, f.delivery_id, t + HOUR_MS) is None
    assert (
        await store.claim_deliveries(P, "wh_1", t + HOUR_MS, 10, owner="w", lease_until=t + 2 * HOUR_MS) == []
    )


async def test_deleting_one_delivery(store: Backend) -> None:
    t = now_ms()
    q, kept = delivery(t, "wh_1"), delivery(t, "wh_1")
    f = await failed(store, t, delivery(t, "wh_1"))
    await queue(store, t, q, kept)
    assert not await store.delete_delivery(Q, q.delivery_id)
    assert await store.delete_delivery(P, q.delivery_id)
    assert await store.delete_delivery(P, f.delivery_id)
    assert not await store.delete_delivery(P, q.delivery_id)
    assert not await store.delete_delivery(P, "msg_missing")
    assert await store.get_delivery(P, q.delivery_id, t) is None
    assert await store.failed_deliveries(P, t) == []
    assert await store.claim_deliveries(P, "wh_1", t, 10, owner="w", lease_until=t + LEASE) == [kept]


async def test_deleting_a_callers_deliveries(store: Backend) -> None:
    t = now_ms()
    caller, other = new_caller(), new_caller()
    mine = [
        delivery(t, "wh_1", subject=caller.subject),
        delivery(t, "wh_2", subject=caller.subject, next_attempt_at=t + DAY_MS - 1),
    ]
    leased = delivery(t, "wh_3", subject=caller.subject)
    dead = await failed(store, t, delivery(t, "wh_2", subject=caller.subject))
    theirs = [
        delivery(t, "wh_1", subject=other.subject),
        delivery(t, "wh_1", Q, subject=caller.subject),  # the same pseudonym in another project
        delivery(t, "wh_1", event="caller.erased"),
    ]
    await queue(store, t, *mine, leased, *theirs[::2])
    await queue(store, t, theirs[1])
    assert await store.claim_deliveries(P, "wh_3", t, 10, owner="w", lease_until=t + LEASE) == [leased]

    assert await store.delete_caller_deliveries(caller) == 4
    for d in (*mine, leased, dead):
        assert await store.get_delivery(P, d.delivery_id, t + 1) is None
    assert not await store.settle_delivery(P, leased.delivery_id, "w", Settlement.DELIVERED, t + 1)
    assert await store.failed_deliveries(P, t + 1) == []
    for d in theirs:
        assert await store.get_delivery(d.project, d.delivery_id, t + 1) == d
    assert await store.delete_caller_deliveries(caller) == 0
    assert await store.delete_caller_deliveries(CallerRef(P, new_caller().subject)) == 0
    assert await store.queue_stats(t + 1) == QueueStats(3, 0, t)


# Statistics -------------------------------------------------------------------------------------------------


async def test_queue_stats_count_live_deliveries_of_every_project(store: Backend) -> None:
    t = now_ms()
    assert await store.queue_stats(t) == QueueStats(queued=0, failed=0, oldest_queued_at=0)
    await failed(store, t, delivery(t - 900, "wh_1"))  # older, but failed: not the oldest queued
    await queue(store, t, delivery(t - 50, "wh_1", Q, expires_at=t + HOUR_MS), delivery(t - 20, "wh_1", Q))
    await queue(store, t, delivery(t - 10, "wh_2", next_attempt_at=t + 10))
    leased = delivery(t - 30, "wh_3")
    await queue(store, t, leased)
    await store.claim_deliveries(P, "wh_3", t, 10, owner="w", lease_until=t + LEASE)  # leased is still queued
    assert await store.queue_stats(t) == QueueStats(queued=4, failed=1, oldest_queued_at=t - 50)
    assert await store.queue_stats(t + HOUR_MS) == QueueStats(queued=3, failed=1, oldest_queued_at=t - 30)
    assert await store.queue_stats(t - 900 + DAY_MS) == QueueStats(3, 0, t - 30)  # the failed one expired
    assert await store.queue_stats(t + DAY_MS) == QueueStats(queued=0, failed=0, oldest_queued_at=0)
