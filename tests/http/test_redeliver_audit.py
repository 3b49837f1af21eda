"""Issue 27, item 13: a redelivery that changes nothing (the delivery is queued already) answers as before and
writes no audit record; a redelivery of a failed delivery queues it again and is audited once. Through a real
server and a real receiver on loopback, on every backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.webhooks.delivery import MAX_ATTEMPTS

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.http.test_api import assert_problem
from tests.http.test_webhooks import (
    BASE,
    CONVERSATION,
    PROJECT,
    REPEAT_CALLER,
    Receiver,
    Shop,
    eventually,
    fail_every_attempt,
    receiver,
    settled,
    webhook_settings,
)


@pytest.fixture
async def api(store_url: str, clock: FakeClock) -> AsyncIterator[Api]:
    async with running_api(store_url, clock, **webhook_settings()) as api:
        yield api


@pytest.fixture
async def hook() -> AsyncIterator[Receiver]:
    async with receiver() as found:
        yield found


@pytest.fixture
async def shop(api: Api) -> Shop:
    document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
    assert reply.status in (200, 201), reply.body
    return Shop(api, await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent"))


async def redelivered_records(shop: Shop) -> list[dict[str, Any]]:
    audit = await shop.api.call("GET", f"{BASE}/audit", token=shop.admin)
    assert audit.status == 200, audit.body
    return [r for r in audit.body["records"] if r["action"] == "webhook.redelivered"]


async def test_redelivering_a_queued_delivery_changes_nothing_and_is_not_audited(
    shop: Shop, hook: Receiver
) -> None:
    await shop.register(hook.url)
    hook.answers = [503]  # the first attempt fails: the delivery waits for its second, 5 s on
    await shop.end("call-1")
    await eventually(lambda: len(hook.got) == 1)
    await settled(shop, hook, 1)
    delivery_id = hook.got[0][0]["webhook-id"]
    path = f"{BASE}/webhooks/deliveries/{delivery_id}/redeliver"
    for _ in range(3):
        again = await shop.api.call("POST", path, token=shop.admin)
        assert again.status == 202, again.body
        assert again.body["status"] == "queued" and again.body["attempts"] == 1  # left as it was
    assert await redelivered_records(shop) == []
    assert len(hook.got) == 1  # and nothing was sent early
    # Nothing to redeliver at all: a 404, not audited either.
    missing = await shop.api.call(
        "POST", f"{BASE}/webhooks/deliveries/msg_nothing/redeliver", token=shop.admin
    )
    assert_problem(missing, 404, mentions="does not exist")
    assert await redelivered_records(shop) == []


async def test_a_failed_delivery_redelivered_is_audited_once_and_a_repeat_is_not(
    shop: Shop, hook: Receiver
) -> None:
    await shop.register(hook.url)
    hook.answers = [503] * (MAX_ATTEMPTS + 1)  # every attempt of the schedule, and the redelivered one
    await shop.end("call-1")
    await fail_every_attempt(shop, hook)
    failed = await shop.failed()
    assert [d["status"] for d in failed] == ["failed"]
    path = f"{BASE}/webhooks/deliveries/{failed[0]['delivery_id']}/redeliver"
    again = await shop.api.call("POST", path, token=shop.admin)
    assert again.status == 202 and again.body["status"] == "queued" and again.body["attempts"] == 0
    records = await redelivered_records(shop)
    assert [r["details"] for r in records] == [{"delivery_id": failed[0]["delivery_id"]}]
    # Its new attempt fails too: it is queued for the next one. Asked again, nothing changes.
    await eventually(lambda: len(hook.got) == MAX_ATTEMPTS + 1)
    await settled(shop, hook, 1)
    repeat = await shop.api.call("POST", path, token=shop.admin)
    assert repeat.status == 202 and repeat.body["status"] == "queued" and repeat.body["attempts"] == 1
    assert len(await redelivered_records(shop)) == 1
