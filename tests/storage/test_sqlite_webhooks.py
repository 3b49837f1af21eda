"""SQLite specifics of the webhook queue: the expiry sweep removes deliveries past their expiry, failed
ones included (no worker claims those), and leaves live ones."""

from __future__ import annotations

from pathlib import Path

from caller_memory.service.domain.store.webhooks import Delivery, Settlement
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
