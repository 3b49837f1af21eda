"""Debugging a webhook receiver through a real server on every backend: each failed attempt is in the
service's log (the webhook, the delivery, the attempt, what it got, when the next one is due, or that it
gave up), with nothing of the payload, the receiver's body, the URL's query or the secret in it; and the
deliveries listing by state (pending, failed, delivered) with each delivery's latest attempts, a bad state
refused, another project's deliveries never shown."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.webhooks.delivery import MAX_ATTEMPTS
from caller_memory.service.http.app_keys import SERVICES
from caller_memory.service.logs import MaskingFormatter

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.http.test_api import CALLER, assert_problem
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

#: A query and a secret the receiver's URL carries: never in a log line.
QUERY = "?token=query-secret-abc"
LOGGER = "caller_memory.webhooks"
ATTEMPT_LINE = re.compile(
    r"^(INFO|WARNING) caller_memory\.webhooks: webhook (wh_[0-9a-f]{16}) delivery (msg_[a-z2-7]{32}): "
    r"attempt (\d+) failed: (.+?); (next attempt at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(in \d+ s\)|"
    r"no attempt left, the delivery is failed \(it can be redelivered\))$"
)


@pytest.fixture
async def api(store_url: str, clock: FakeClock) -> AsyncIterator[Api]:
    async with running_api(store_url, clock, **webhook_settings(webhook_history=True)) as api:
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


def attempt_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The service's webhook log records as its formatter writes them."""
    formatter = MaskingFormatter("%(levelname)s %(name)s: %(message)s")
    return [formatter.format(r) for r in caplog.records if r.name == LOGGER]


def assert_nothing_private(lines: list[str], *secrets: str) -> None:
    text = "\n".join(lines)
    for secret in ("receiver body", "query-secret", "line 0", "line 1", "Ada", CALLER.lstrip("+"), *secrets):
        assert secret not in text, secret


async def deliveries(shop: Shop, query: str = "") -> list[dict[str, Any]]:
    reply = await shop.api.call("GET", f"{BASE}/webhooks/deliveries{query}", token=shop.admin)
    assert reply.status == 200, reply.body
    found: list[dict[str, Any]] = reply.body["deliveries"]
    return found


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_a_receiver_that_fails_then_takes_it_is_in_the_log_and_the_listing(
    shop: Shop, hook: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    created = await shop.register(hook.url + QUERY)
    hook.answers = [500, 200]
    await shop.end("call-1")
    await eventually(lambda: len(hook.got) == 1)
    await settled(shop, hook, 1)
    delivery_id = hook.got[0][0]["webhook-id"]
    (pending,) = await deliveries(shop, "?state=pending")
    assert pending["delivery_id"] == delivery_id and pending["status"] == "queued"
    assert [(a["number"], a["http_status"], a["error"]) for a in pending["recent_attempts"]] == [
        (1, 500, "HTTP 500")
    ]
    shop.api.clock.advance(7)  # past the first delay (5 s +- 20 %)
    await eventually(lambda: len(hook.got) == 2)

    async def delivered() -> list[dict[str, Any]]:
        return await deliveries(shop, "?state=delivered")

    for _ in range(500):
        if await delivered():
            break
        await asyncio.sleep(0.02)
    (done,) = await delivered()
    assert done["delivery_id"] == delivery_id and done["status"] == "delivered"
    assert done["attempts"] == 2 and done["next_attempt_at"] is None and done["last_error"] == ""
    assert [(a["number"], a["http_status"], a["error"]) for a in done["recent_attempts"]] == [
        (1, 500, "HTTP 500"),
        (2, 200, ""),
    ]
    assert await deliveries(shop, "?state=pending") == [] and await deliveries(shop) == []
    # One line, for the one failed attempt: which webhook and delivery, what it got, when the next one is.
    lines = attempt_lines(caplog)
    assert len(lines) == 1, lines
    found = ATTEMPT_LINE.match(lines[0])
    assert found is not None, lines[0]
    assert found.groups()[:5] == ("INFO", created["webhook_id"], delivery_id, "1", "HTTP 500")
    assert found.group(6).startswith("next attempt at")
    assert_nothing_private(lines, created["secret"], created["secret"].removeprefix("whsec_"))


async def test_a_receiver_that_is_down_is_in_the_log_and_the_listing(
    shop: Shop, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    down = await shop.register(f"http://127.0.0.1:{free_port()}/hook{QUERY}")
    await shop.end("call-1")
    store = shop.api.app[SERVICES].store

    async def attempted() -> list[dict[str, Any]]:
        return await deliveries(shop, f"?state=pending&webhook_id={down['webhook_id']}")

    for _ in range(500):
        found = await attempted()
        if found and found[0]["recent_attempts"]:
            break
        await asyncio.sleep(0.02)
    (pending,) = await attempted()
    (first,) = pending["recent_attempts"]
    assert first["number"] == 1 and first["http_status"] is None
    assert first["error"].startswith("cannot connect"), first
    await eventually(lambda: bool(attempt_lines(caplog)))
    lines = attempt_lines(caplog)
    found_line = ATTEMPT_LINE.match(lines[0])
    assert found_line is not None, lines
    assert found_line.group(2, 3, 4) == (down["webhook_id"], pending["delivery_id"], "1")
    assert found_line.group(5) == first["error"]
    assert_nothing_private(lines, down["secret"])
    assert await store.get_delivery(PROJECT, pending["delivery_id"], shop.api.clock.now_ms()) is not None


async def test_the_attempt_that_gives_up_is_logged_as_such(
    shop: Shop, hook: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    created = await shop.register(hook.url)
    hook.answers = [503] * MAX_ATTEMPTS
    await shop.end("call-1")
    await fail_every_attempt(shop, hook)
    # The line follows the settlement the helper waited for.
    await eventually(lambda: len(attempt_lines(caplog)) == MAX_ATTEMPTS)
    lines = [ATTEMPT_LINE.match(line) for line in attempt_lines(caplog)]
    assert all(lines) and len(lines) == MAX_ATTEMPTS
    numbers = [int(m.group(4)) for m in lines if m is not None]
    assert numbers == list(range(1, MAX_ATTEMPTS + 1))
    last = lines[-1]
    assert last is not None and last.group(1) == "WARNING" and last.group(6).startswith("no attempt left")
    assert all(m is not None and m.group(1) == "INFO" for m in lines[:-1])
    # The listing without a state is the failed one, with the latest ten attempts.
    (failed,) = await deliveries(shop)
    assert failed == (await deliveries(shop, "?state=failed"))[0]
    assert [a["number"] for a in failed["recent_attempts"]] == list(range(1, MAX_ATTEMPTS + 1))
    assert {a["error"] for a in failed["recent_attempts"]} == {"HTTP 503"}
    assert_nothing_private(attempt_lines(caplog), created["secret"])


@pytest.mark.parametrize("state", ["queued", "bogus", "FAILED", ""])
async def test_a_bad_state_is_422_naming_the_states(shop: Shop, state: str) -> None:
    reply = await shop.api.call("GET", f"{BASE}/webhooks/deliveries?state={state}", token=shop.admin)
    assert_problem(reply, 422, mentions="state")
    for allowed in ("pending", "failed", "delivered"):
        assert allowed in reply.body["detail"], reply.body
    twice = await shop.api.call(
        "GET", f"{BASE}/webhooks/deliveries?state=failed&state=pending", token=shop.admin
    )
    assert_problem(twice, 422, mentions="state")


async def test_another_projects_deliveries_are_never_listed(shop: Shop, hook: Receiver, api: Api) -> None:
    other = "other-shop"
    document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
    reply = await api.call("PUT", f"/v1/projects/{other}", token=OPERATOR_TOKEN, json=document)
    assert reply.status in (200, 201), reply.body
    theirs = Shop(api, await api.mint(other, "admin"), await api.mint(other, "agent"))
    mine = await shop.register(hook.url)
    hook.answers = [500, 500]
    await shop.end("call-1")
    await eventually(lambda: len(hook.got) == 1)
    # Their project, their endpoint: their deliveries alone, in every state.
    reply = await api.call(
        "POST",
        f"/v1/projects/{other}/webhooks",
        token=theirs.admin,
        json={"url": hook.url, "events": ["conversation.ended"]},
    )
    assert reply.status == 201, reply.body
    for state in ("pending", "failed", "delivered"):
        listed = await api.call(
            "GET", f"/v1/projects/{other}/webhooks/deliveries?state={state}", token=theirs.admin
        )
        assert listed.status == 200 and listed.body == {"deliveries": []}, listed.body
    # Nor through their token, nor by naming our webhook in their project.
    refused = await api.call("GET", f"{BASE}/webhooks/deliveries?state=pending", token=theirs.admin)
    assert refused.status in (401, 403, 404), refused.body
    named = await api.call(
        "GET",
        f"/v1/projects/{other}/webhooks/deliveries?state=pending&webhook_id={mine['webhook_id']}",
        token=theirs.admin,
    )
    assert_problem(named, 404)
    assert [d["webhook_id"] for d in await deliveries(shop, "?state=pending")] == [mine["webhook_id"]]
