"""SQLite specifics of the webhook queue: the expiry sweep removes deliveries past their expiry, failed
ones included (no worker claims those), and leaves live ones."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

from caller_memory.service.domain.store.webhooks import (
    DELIVERED_KEPT_PER_ENDPOINT,
    Delivery,
    DeliveryStatus,
    Settlement,
)
from caller_memory.service.storage.sqlite.store import SQLiteStore


def delivery(delivery_id: str, now: int, ttl_ms: int) -> Delivery:
    return Delivery("shop", delivery_id, "wh_1", "conversation.ended", b"{}", "", now, now + ttl_ms)


async def test_the_sweep_removes_expired_deliveries_failed_ones_too(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "m.db")
    await store.open()
    try:
        now = 1_700_000_000_000
        queued = [
            delivery("msg_short", now, 1000),
            delivery("msg_failed", now, 1000),
            delivery("msg_long", now, 10**9),
        ]
        assert await store.enqueue_deliveries(queued, None, now, now)
        claimed = await store.claim_deliveries("shop", "wh_1", now, 3, owner="me", lease_until=now + 500)
        assert {d.delivery_id for d in claimed} == {"msg_short", "msg_failed", "msg_long"}
        assert await store.settle_delivery(
            "shop", "msg_failed", "me", Settlement.FAILED, now, error="HTTP 500"
        )
        counts, more = await store.sweep(now + 2000, 100)
        assert counts["webhook_deliveries"] == 2 and more is False
        assert await store.get_delivery("shop", "msg_long", now + 2000) is not None
        assert (await store.queue_stats(now + 2000)).failed == 0
    finally:
        await store.close()


async def test_an_endpoint_keeps_a_bounded_number_of_delivered_deliveries_the_newest(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "m.db")
    await store.open()
    try:
        now = 1_700_000_000_000
        made = [delivery(f"msg_{n:05d}", now, 10**9) for n in range(DELIVERED_KEPT_PER_ENDPOINT + 3)]
        other = dataclasses.replace(delivery("msg_other", now, 10**9), endpoint_id="wh_2")
        assert await store.enqueue_deliveries([*made, other], None, now, now)
        claimed = await store.claim_deliveries(
            "shop", "wh_1", now, len(made), owner="me", lease_until=now + 500
        )
        assert await store.claim_deliveries("shop", "wh_2", now, 1, owner="me", lease_until=now + 500)
        assert await store.settle_delivery("shop", "msg_other", "me", Settlement.DELIVERED, now)
        for n, d in enumerate(claimed):
            assert await store.settle_delivery("shop", d.delivery_id, "me", Settlement.DELIVERED, now + 1 + n)
        kept = await store.list_deliveries("shop", DeliveryStatus.DELIVERED, now + 10_000, limit=500)
        assert len(kept) == 500 and kept[0].delivery_id == claimed[-1].delivery_id
        rows = sqlite3.connect(tmp_path / "m.db").execute(
            "SELECT endpoint_id, count(*), min(delivery_id) FROM webhook_deliveries "
            "WHERE status = 'delivered' GROUP BY endpoint_id ORDER BY endpoint_id"
        )
        # wh_1 keeps its newest (the three settled first are gone); another endpoint's is not counted with them.
        assert rows.fetchall() == [
            ("wh_1", DELIVERED_KEPT_PER_ENDPOINT, claimed[3].delivery_id),
            ("wh_2", 1, "msg_other"),
        ]
    finally:
        await store.close()
