"""Webhooks through a real server on every backend (SPEC sections 11 and 14): registration and its secret,
deliveries verified by the Standard Webhooks library at a real receiver on loopback, retries through a
receiver that fails, hangs and recovers, the failed list and redelivery, rotation, SSRF refusals, erasure
with deliveries queued and failed, and two replicas sharing one queue."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from caller_memory.service.app import run_deliveries
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.webhooks.delivery import JITTER, MAX_ATTEMPTS, RETRY_DELAYS_S
from caller_memory.service.domain.webhooks.service import delivery_id_of
from caller_memory.service.http.app_keys import SERVICES, WEBHOOKS
from standardwebhooks.webhooks import Webhook

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.http.test_api import CALLER, assert_problem

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
SECRET_KEY = secrets.token_bytes(32)
REPEAT_CALLER = {"state_keys": ["caller_name"], "retention": "P30D", "default_region": "GB"}
#: Longer than the attempt schedule (about a day): a delivery is deleted when its transcript expires.
CONVERSATION = {"enabled": True, "transcript_retention": "P3D"}


def past_retry(attempts: int) -> float:
    """Seconds that surely pass the delay after ``attempts`` failed attempts (its jitter included)."""
    return RETRY_DELAYS_S[attempts - 1] * (1 + JITTER) + 1


@dataclass
class Receiver:
    """A webhook receiver on loopback: answers with ``answers`` in turn (then 200); an answer is a status,
    ``("hang", seconds)`` or ``("redirect", url)``. Keeps every request it got."""

    url: str = ""
    got: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    answers: list[Any] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    overlaps: int = 0
    delay: float = 0.0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = dict(request.headers)
        self.got.append((headers, body))
        webhook_id = headers.get("webhook-id", "")
        self.in_flight[webhook_id] = self.in_flight.get(webhook_id, 0) + 1
        self.overlaps += self.in_flight[webhook_id] > 1
        try:
            answer = self.answers.pop(0) if self.answers else 200
            if self.delay:
                await asyncio.sleep(self.delay)
            if isinstance(answer, tuple) and answer[0] == "hang":
                await asyncio.sleep(answer[1])
                return web.Response(status=200)
            if isinstance(answer, tuple) and answer[0] == "redirect":
                return web.Response(status=302, headers={"Location": answer[1]})
            return web.Response(status=answer, text="receiver body, never logged")
        finally:
            self.in_flight[webhook_id] -= 1

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        found = [orjson.loads(body) for _, body in self.got]
        return [e for e in found if kind is None or e["type"] == kind]


@contextlib.asynccontextmanager
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/hook", found.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)  # a hung answer is cut at the end, not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    found.url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    try:
        yield found
    finally:
        await runner.cleanup()


async def eventually(check: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def webhook_settings(**overrides: Any) -> dict[str, Any]:
    return {
        "store_timeout": 5.0,
        "secret_key": SECRET_KEY,
        "webhook_allow_hosts": ("127.0.0.1",),
        "webhook_interval": 0.05,
        "webhook_timeout": 1.0,
        **overrides,
    }


@pytest.fixture
async def api(store_url: str, clock: FakeClock) -> AsyncIterator[Api]:
    async with running_api(store_url, clock, **webhook_settings(webhook_history=True)) as api:
        yield api


@pytest.fixture
async def hook() -> AsyncIterator[Receiver]:
    async with receiver() as found:
        yield found


@dataclass
class Shop:
    api: Api
    admin: str
    agent: str

    async def register(self, url: str, **body: Any) -> Any:
        document = {"url": url, "events": ["conversation.ended", "caller.erased"], **body}
        reply = await self.api.call("POST", f"{BASE}/webhooks", token=self.admin, json=document)
        assert reply.status == 201, reply.body
        return reply.body

    async def end(self, conversation_id: str, *, messages: int = 2, caller: str = CALLER) -> Any:
        if messages:
            batch = [
                {"role": "user" if n % 2 == 0 else "assistant", "content": f"line {n}", "turn_id": n // 2}
                for n in range(messages)
            ]
            document = {"caller": caller, "channel": "voice", "messages": batch}
            path = f"{BASE}/conversations/{conversation_id}/messages"
            reply = await self.api.call("POST", path, token=self.agent, json=document)
            assert reply.status == 200, reply.body
        body = {"caller": caller, "state": {"caller_name": "Ada"}, "end_reason": "completed"}
        reply = await self.api.call(
            "POST", f"{BASE}/conversations/{conversation_id}/end", token=self.agent, json=body
        )
        assert reply.status == 200, reply.body
        return reply.body

    async def failed(self) -> list[dict[str, Any]]:
        reply = await self.api.call("GET", f"{BASE}/webhooks/deliveries", token=self.admin)
        assert reply.status == 200, reply.body
        found: list[dict[str, Any]] = reply.body["deliveries"]
        return found


@pytest.fixture
async def shop(api: Api) -> Shop:
    document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
    assert reply.status in (200, 201), reply.body
    return Shop(api, await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent"))


async def settled(shop: Shop, hook: Receiver, attempts: int) -> None:
    """Wait until the store counts ``attempts`` attempts of the last delivery the receiver got: the clock
    may move only then (the next attempt is due from the settlement's time)."""
    store, delivery_id = shop.api.app[SERVICES].store, hook.got[-1][0]["webhook-id"]
    for _ in range(500):
        found = await store.get_delivery(PROJECT, delivery_id, shop.api.clock.now_ms())
        if found is not None and found.attempts == attempts:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"attempt {attempts} of {delivery_id} was not settled")


async def fail_every_attempt(shop: Shop, hook: Receiver, first: int = 0) -> None:
    """Let the one delivery in flight fail at each attempt of its schedule, moving the clock past each
    delay, until it is failed; ``first``: what the receiver had got before that delivery was made (its
    first attempt may arrive before the request that made it is answered)."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        await eventually(lambda: len(hook.got) == first + attempt)  # noqa: B023 - awaited here
        await settled(shop, hook, attempt)
        if attempt < MAX_ATTEMPTS:
            shop.api.clock.advance(past_retry(attempt))


# Registration -----------------------------------------------------------------------------------------------


async def test_the_secret_is_shown_once_and_the_endpoints_are_listed_rotated_and_deleted(
    shop: Shop, hook: Receiver
) -> None:
    created = await shop.register(hook.url, description="CRM")
    assert created["secret"].startswith("whsec_") and created["webhook_id"].startswith("wh_")
    assert created["events"] == ["conversation.ended", "caller.erased"]
    listed = await shop.api.call("GET", f"{BASE}/webhooks", token=shop.admin)
    assert [w["webhook_id"] for w in listed.body["webhooks"]] == [created["webhook_id"]]
    assert "secret" not in listed.body["webhooks"][0] and listed.headers["Cache-Control"] == "no-store"
    path = f"{BASE}/webhooks/{created['webhook_id']}"
    rotated = await shop.api.call("POST", path + "/rotate", token=shop.admin, json={"grace_seconds": 60})
    assert rotated.status == 200 and rotated.body["secret"] != created["secret"]
    assert rotated.body["previous_secret_valid_until"] is not None
    agent = await shop.api.call("GET", f"{BASE}/webhooks", token=shop.agent)
    assert agent.status == 403
    assert (await shop.api.call("DELETE", path, token=shop.admin)).status == 204
    assert_problem(await shop.api.call("GET", path, token=shop.admin), 404, mentions="does not exist")
    assert_problem(await shop.api.call("DELETE", path, token=shop.admin), 404)
    audit = await shop.api.call("GET", f"{BASE}/audit", token=shop.admin)
    actions = [r["action"] for r in audit.body["records"] if r["action"].startswith("webhook.")]
    assert sorted(actions) == ["webhook.created", "webhook.deleted", "webhook.rotated"]


@pytest.mark.parametrize(
    ("url", "mentions"),
    [
        ("https://169.254.169.254/latest/meta-data/", "link-local"),
        ("https://127.0.0.2/hook", "loopback"),
        ("https://10.0.0.1/hook", "private"),
        ("https://[::ffff:127.0.0.1]/hook", "IPv4-mapped"),
        ("https://localhost/hook", "resolves to 127.0.0.1 is a loopback address"),
        ("http://localhost:9/hook", "https://"),
        ("https://no-such-host.invalid/hook", "does not resolve"),
        ("ftp://example.com/hook", "https://"),
    ],
)
async def test_destinations_that_would_be_ssrf_are_refused_at_registration(
    shop: Shop, url: str, mentions: str
) -> None:
    document = {"url": url, "events": ["conversation.ended"]}
    reply = await shop.api.call("POST", f"{BASE}/webhooks", token=shop.admin, json=document)
    assert_problem(reply, 422, mentions=mentions)
    assert (await shop.api.call("GET", f"{BASE}/webhooks", token=shop.admin)).body["webhooks"] == []


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"events": ["conversation.ended"]}, "url"),
        ({"url": "https://example.com/", "events": []}, "events"),
        ({"url": "https://example.com/", "events": ["call.started"]}, "events"),
        ({"url": "https://example.com/", "events": ["caller.erased", "caller.erased"]}, "events"),
        ({"url": "https://example.com/", "events": ["caller.erased"], "secret": "mine"}, "secret"),
    ],
)
async def test_a_bad_registration_is_422_naming_the_member(shop: Shop, body: Any, mentions: str) -> None:
    reply = await shop.api.call("POST", f"{BASE}/webhooks", token=shop.admin, json=body)
    assert_problem(reply, 422)
    assert mentions in orjson.dumps(reply.body).decode()


async def test_without_a_secret_key_webhooks_cannot_be_registered(store_url: str, clock: FakeClock) -> None:
    async with running_api(store_url, clock, **webhook_settings(secret_key=None)) as api:
        await api.put_project(PROJECT, REPEAT_CALLER)
        admin = await api.mint(PROJECT, "admin")
        document = {"url": "http://127.0.0.1:9/hook", "events": ["caller.erased"]}
        reply = await api.call("POST", f"{BASE}/webhooks", token=admin, json=document)
        assert_problem(reply, 503, mentions="CALLER_MEMORY_SECRET_KEY")


# Deliveries -------------------------------------------------------------------------------------------------


async def test_an_ended_call_reaches_the_receiver_signed_and_without_a_phone_number(
    shop: Shop, hook: Receiver
) -> None:
    created = await shop.register(hook.url, include_history=True)
    await shop.end("call-1")
    await eventually(lambda: len(hook.got) == 1)
    headers, body = hook.got[0]
    event = Webhook(created["secret"]).verify(body, headers)
    assert event["type"] == "conversation.ended" and event["id"] == headers["webhook-id"]
    data = event["data"]
    assert data["conversation_id"] == "call-1" and data["ended_by"] == "explicit"
    assert data["end_reason"] == "completed" and data["persisted"] == ["caller_name"]
    assert data["started_at"].endswith(":00:00Z")
    assert [m["content"] for m in data["history"]] == ["line 0", "line 1"]
    assert all(0 <= m["timestamp"] < 3_600_000 for m in data["history"])  # offsets from the start
    digits = CALLER.lstrip("+")
    assert digits not in body.decode() and digits[-9:] not in body.decode()
    assert await shop.failed() == []


async def test_history_needs_the_operators_allowance_and_the_endpoints_request(
    store_url: str, clock: FakeClock, hook: Receiver
) -> None:
    async with running_api(store_url, clock, **webhook_settings(webhook_history=False)) as api:
        document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
        await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
        shop = Shop(api, await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent"))
        await shop.register(hook.url, include_history=True)
        await shop.end("call-1")
        await eventually(lambda: len(hook.got) == 1)
        assert "history" not in hook.events()[0]["data"] and "summary" not in hook.events()[0]["data"]


async def test_a_receiver_that_fails_hangs_and_recovers_gets_it_with_the_same_id(
    shop: Shop, hook: Receiver
) -> None:
    created = await shop.register(hook.url)
    hook.answers = [500, ("hang", 3.0), 200]
    await shop.end("call-1")
    await eventually(lambda: len(hook.got) == 1)
    await settled(shop, hook, 1)  # the failure is settled (retry in 5 s of the service's clock)
    shop.api.clock.advance(7)  # past the first delay (5 s +- 20 %)
    await eventually(lambda: len(hook.got) == 2)  # hangs past the 1 s attempt timeout
    await settled(shop, hook, 2)
    shop.api.clock.advance(40)  # past the second delay (30 s +- 20 %)
    await eventually(lambda: len(hook.got) == 3)
    ids = {headers["webhook-id"] for headers, _ in hook.got}
    assert len(ids) == 1
    for headers, body in hook.got:
        assert Webhook(created["secret"]).verify(body, headers)["id"] in ids
    await asyncio.sleep(0.2)
    assert await shop.failed() == []


async def test_after_the_last_attempt_it_is_failed_and_can_be_redelivered(shop: Shop, hook: Receiver) -> None:
    await shop.register(hook.url)
    hook.answers = [503] * MAX_ATTEMPTS
    await shop.end("call-1")
    await fail_every_attempt(shop, hook)
    failed = await shop.failed()
    assert [(d["status"], d["attempts"], d["last_error"]) for d in failed] == [
        ("failed", MAX_ATTEMPTS, "HTTP 503")
    ]
    assert "receiver body" not in orjson.dumps(failed).decode()
    path = f"{BASE}/webhooks/deliveries/{failed[0]['delivery_id']}/redeliver"
    again = await shop.api.call("POST", path, token=shop.admin)
    assert again.status == 202 and again.body["status"] == "queued"
    await eventually(lambda: len(hook.got) == 11)
    await eventually(lambda: not hook.in_flight or not any(hook.in_flight.values()))
    await asyncio.sleep(0.2)
    assert await shop.failed() == []
    missing = await shop.api.call("POST", path, token=shop.admin)
    assert_problem(missing, 404, mentions="does not exist")


async def test_a_redirect_is_not_followed(shop: Shop, hook: Receiver) -> None:
    async with receiver() as elsewhere:
        await shop.register(hook.url)
        hook.answers = [("redirect", elsewhere.url)]
        await shop.end("call-1")
        await eventually(lambda: len(hook.got) == 1)
        await settled(shop, hook, 1)
        assert elsewhere.got == []
        shop.api.clock.advance(past_retry(1))
        await eventually(lambda: len(hook.got) == 2)  # retried at the registered URL


async def test_a_destination_is_checked_again_at_each_delivery(store_url: str, clock: FakeClock) -> None:
    """The policy applies at delivery too, not only at registration: a host may come to resolve elsewhere, or
    the operator take it off ``CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS``. Here an endpoint registered while its
    name was allowed, then the service restarted without that allowance: its name now resolves to a loopback
    address the policy refuses, so the attempt is refused before any connection, and recorded so."""
    async with receiver() as hook:
        by_name = hook.url.replace("127.0.0.1", "localhost")  # localhost resolves to 127.0.0.1
        allowed = webhook_settings(webhook_allow_hosts=("127.0.0.1", "localhost"))
        async with running_api(store_url, clock, **allowed) as api:
            document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
            assert (await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=document)).status == 201
            shop = Shop(api, await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent"))
            await shop.register(by_name, events=["conversation.ended"])
            await shop.end("call-1", messages=0)
            await eventually(lambda: len(hook.got) == 1)  # allowed: delivered by name
        async with running_api(store_url, clock, **webhook_settings()) as api:  # 127.0.0.1 alone allowed
            shop = Shop(api, shop.admin, shop.agent)
            await shop.end("call-2", messages=0)
            store = api.app[SERVICES].store
            (endpoint,) = await store.list_endpoints(PROJECT)
            delivery_id = delivery_id_of(endpoint, "conversation.ended", "call-2")
            for _ in range(500):  # until its first attempt is settled
                found = await store.get_delivery(PROJECT, delivery_id, clock.now_ms())
                if found is not None and found.attempts:
                    break
                await asyncio.sleep(0.02)
            assert found is not None and found.attempts == 1, found
            assert found.last_error.startswith("refused: localhost resolves to"), found.last_error
            assert "loopback" in found.last_error
            assert len(hook.got) == 1  # the refused attempt never reached it


async def test_rotation_signs_with_both_secrets_until_the_grace_period_ends(
    shop: Shop, hook: Receiver
) -> None:
    created = await shop.register(hook.url)
    path = f"{BASE}/webhooks/{created['webhook_id']}/rotate"
    rotated = (await shop.api.call("POST", path, token=shop.admin, json={"grace_seconds": 600})).body
    await shop.end("call-1")
    await eventually(lambda: len(hook.got) == 1)
    headers, body = hook.got[0]
    assert Webhook(created["secret"]).verify(body, headers) and Webhook(rotated["secret"]).verify(
        body, headers
    )
    shop.api.clock.advance(601)
    await shop.end("call-2")
    await eventually(lambda: len(hook.got) == 2)
    headers, body = hook.got[1]
    assert len(headers["webhook-signature"].split(" ")) == 1
    assert Webhook(rotated["secret"]).verify(body, headers)


async def test_erasure_drops_queued_and_failed_deliveries_and_sends_caller_erased(
    shop: Shop, hook: Receiver
) -> None:
    async with receiver() as crm:
        document = {"url": crm.url, "events": ["caller.erased"]}
        reply = await shop.api.call("POST", f"{BASE}/webhooks", token=shop.admin, json=document)
        assert reply.status == 201
        await shop.register(hook.url)
        hook.answers = [500] * 20
        await shop.end("call-1")
        await fail_every_attempt(shop, hook)  # call-1's delivery fails for good
        assert len(await shop.failed()) == 1
        await shop.end("call-2")  # queued, failing, waiting for its retry
        await eventually(lambda: len(hook.got) == 11)
        await settled(shop, hook, 1)
        erased = await shop.api.call("DELETE", f"{BASE}/callers/{CALLER}", token=shop.admin)
        assert erased.status == 200, erased.body
        assert erased.body["removed"]["webhook_deliveries"] == 2
        await eventually(lambda: len(crm.got) == 1)
        event = crm.events()[0]
        assert event["type"] == "caller.erased" and event["data"]["receipt_id"] == erased.body["receipt_id"]
        assert sorted(event["data"]["conversation_ids"]) == ["call-1", "call-2"]
        await eventually(lambda: len(hook.events("caller.erased")) == 1)  # hook takes caller.erased too
        shop.api.clock.advance(past_retry(1))
        await asyncio.sleep(0.5)
        assert len(hook.events("conversation.ended")) == 11
        assert [d["event"] for d in await shop.failed()] in ([], ["caller.erased"])


async def test_two_replicas_never_send_one_delivery_at_the_same_time(
    store_url: str, clock: FakeClock, hook: Receiver
) -> None:
    hook.delay = 0.2
    async with (
        running_api(store_url, clock, **webhook_settings(webhook_interval=0)) as one,
        running_api(store_url, clock, **webhook_settings(webhook_interval=0.01)) as two,
        running_api(store_url, clock, **webhook_settings(webhook_interval=0.01)) as three,
    ):
        document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
        await one.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
        shop = Shop(one, await one.mint(PROJECT, "admin"), await one.mint(PROJECT, "agent"))
        await shop.register(hook.url)
        for n in range(12):
            await shop.end(f"call-{n}", messages=0)
        await eventually(lambda: len({h["webhook-id"] for h, _ in hook.got}) == 12, seconds=20)
        await asyncio.sleep(0.5)
        assert hook.overlaps == 0
        assert len(hook.got) == 12  # each once: the leases held while the receiver was slow
        assert two.count("POST", "/end") == three.count("POST", "/end") == 0


async def test_after_the_secret_key_changed_a_rotation_signs_with_the_new_secret_alone(
    store_url: str, clock: FakeClock, hook: Receiver
) -> None:
    document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
    async with running_api(store_url, clock, **webhook_settings(webhook_interval=0)) as before:
        await before.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
        created = await Shop(before, await before.mint(PROJECT, "admin"), "").register(hook.url)
    changed = webhook_settings(secret_key=secrets.token_bytes(32))
    async with running_api(store_url, clock, **changed) as after:
        shop = Shop(after, await after.mint(PROJECT, "admin"), await after.mint(PROJECT, "agent"))
        path = f"{BASE}/webhooks/{created['webhook_id']}/rotate"
        rotated = await after.call("POST", path, token=shop.admin, json={})  # the default grace period
        assert rotated.status == 200 and rotated.body["previous_secret_valid_until"] is None
        await shop.end("call-1")
        await eventually(lambda: len(hook.got) == 1)
        headers, body = hook.got[0]
        assert len(headers["webhook-signature"].split(" ")) == 1
        assert Webhook(rotated.body["secret"]).verify(body, headers)["data"]["conversation_id"] == "call-1"


async def metrics_with(api: Api, *lines: str) -> str:
    """/metrics once it shows every one of ``lines`` (an attempt is counted just after it is settled)."""
    for _ in range(250):
        text: str = (await api.call("GET", "/metrics")).body
        if all(line in text for line in lines):
            return text
        await asyncio.sleep(0.02)
    raise AssertionError(f"/metrics never showed {lines}")


async def test_metrics_count_attempts_by_outcome_and_show_the_queue(shop: Shop, hook: Receiver) -> None:
    await shop.register(hook.url)
    hook.answers = [500]
    await shop.end("call-1")
    await eventually(lambda: len(hook.got) == 1)
    await settled(shop, hook, 1)
    attempts = 'caller_memory_webhook_attempts_total{event="conversation.ended",outcome="%s"} 1.0'
    # The queue's gauges too (the worker refreshes them every 10 s; its first look was at once).
    await metrics_with(
        shop.api,
        attempts % "retry",
        "caller_memory_webhook_attempt_duration_seconds_count 1.0",
        'caller_memory_webhook_deliveries{status="queued"}',
        "caller_memory_webhook_queue_age_seconds",
    )
    shop.api.clock.advance(past_retry(1))
    await eventually(lambda: len(hook.got) == 2)
    await metrics_with(
        shop.api, attempts % "delivered", "caller_memory_webhook_attempt_duration_seconds_count 2.0"
    )


async def test_a_hung_receiver_delays_neither_requests_nor_another_projects_deliveries(
    api: Api, shop: Shop, hook: Receiver
) -> None:
    """Project one's receiver hangs (past the attempt timeout) with more deliveries queued than its
    concurrency; project two's deliveries and every request go on as if it did not exist."""
    await shop.register(hook.url)
    hook.answers = [("hang", 5.0)] * 20
    for n in range(8):  # twice the per-endpoint concurrency
        await shop.end(f"hung-{n}", messages=0)
    await eventually(lambda: len(hook.got) == 4)  # its four slots are held
    document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
    assert (await api.call("PUT", "/v1/projects/other", token=OPERATOR_TOKEN, json=document)).status == 201
    async with receiver() as prompt:
        body = {"url": prompt.url, "events": ["conversation.ended"]}
        assert (
            await api.call("POST", "/v1/projects/other/webhooks", token=OPERATOR_TOKEN, json=body)
        ).status == 201
        began = time.monotonic()
        end = {"caller": CALLER, "state": {}}
        reply = await api.call(
            "POST", "/v1/projects/other/conversations/c-1/end", token=OPERATOR_TOKEN, json=end
        )
        assert reply.status == 200 and time.monotonic() - began < 0.5
        await eventually(lambda: len(prompt.got) == 1, seconds=0.9)  # well before the hung attempts end
        assert time.monotonic() - began < 1.0
        reply = await shop.api.call("GET", f"{BASE}/webhooks", token=shop.admin)
        assert reply.status == 200 and time.monotonic() - began < 1.2
    assert len(hook.got) == 4  # the hung endpoint got no more than its concurrency


async def test_the_inactivity_end_sends_ended_and_a_late_end_sends_updated(
    shop: Shop, hook: Receiver
) -> None:
    created = await shop.register(hook.url, events=["conversation.ended", "conversation.updated"])
    document = {
        "caller": CALLER,
        "channel": "voice",
        "messages": [{"role": "user", "content": "Hi", "turn_id": 1}],
    }
    path = f"{BASE}/conversations/drop-1"
    assert (await shop.api.call("POST", path + "/messages", token=shop.agent, json=document)).status == 200
    shop.api.clock.advance(31 * 60)  # past end_after_inactivity (PT30M)
    assert (await shop.api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)).status == 200
    await eventually(lambda: len(hook.got) == 1)
    late = await shop.api.call(
        "POST", path + "/end", token=shop.agent, json={"caller": CALLER, "state": {"caller_name": "Ada"}}
    )
    assert late.status == 200 and late.body["late"] is True
    await eventually(lambda: len(hook.got) == 2)
    events = [Webhook(created["secret"]).verify(body, headers) for headers, body in hook.got]
    assert [(e["type"], e["data"]["ended_by"]) for e in events] == [
        ("conversation.ended", "inactivity"),
        ("conversation.updated", "explicit"),
    ]
    assert events[1]["data"]["persisted"] == ["caller_name"] and events[0]["id"] != events[1]["id"]


async def test_the_delivery_worker_stops_when_cancelled_just_as_it_is_woken(store_url: str) -> None:
    """Shutdown cancels the worker; an attempt that ended (or an end that queued an event) may wake it in the
    same turn of the loop. Python 3.11's ``asyncio.wait_for`` then returned the wake-up and dropped the
    cancellation, so the worker ran on and the shutdown waited for it forever (it hung CI's teardown)."""
    async with running_api(store_url, FakeClock(), **webhook_settings()) as api:
        worker = asyncio.create_task(run_deliveries(api.app, 30.0))
        for _ in range(20):  # let it reach its wait (a store call first)
            await asyncio.sleep(0.01)
        api.app[WEBHOOKS].event.set()
        worker.cancel()
        done, _ = await asyncio.wait({worker}, timeout=2.0)
        assert worker in done and worker.cancelled()


async def test_the_worker_is_woken_by_an_end_only_when_a_slot_is_free(store_url: str) -> None:
    """At peak every slot of an endpoint is taken: an end that queues more must not wake the delivery worker
    for nothing (a round and a wait per end, on the request path's core); the attempt that ends and frees a
    slot wakes it. The interval here is 30 s, so every delivery below went out on a wake-up."""
    async with (
        running_api(store_url, FakeClock(), **webhook_settings(webhook_interval=30.0)) as api,
        receiver() as hook,
    ):
        document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
        assert (await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=document)).status == 201
        shop = Shop(api, await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent"))
        await shop.register(hook.url, events=["conversation.ended"])
        webhooks = api.app[WEBHOOKS]
        woken: list[str] = []
        wake = webhooks.event.set

        def counted() -> None:
            woken.append(f"after {len(woken)}")
            wake()

        webhooks.event.set = counted  # type: ignore[method-assign]
        hook.delay = 0.5
        concurrency = webhooks.deliverer.concurrency
        for n in range(concurrency):
            await shop.end(f"first-{n}", messages=0)
        await eventually(lambda: len(hook.got) == concurrency)  # every slot is taken
        before = len(woken)
        for n in range(6):
            await shop.end(f"more-{n}", messages=0)
        assert len(woken) == before  # no end woke it: no slot was free
        await eventually(lambda: len(hook.got) == concurrency + 6, seconds=5.0)  # woken as slots freed
        assert len(woken) > before
        await eventually(lambda: not webhooks.deliverer._tasks)  # every attempt settled
        await shop.end("idle", messages=0)  # a slot is free: this end wakes it
        await eventually(lambda: len(hook.got) == concurrency + 7, seconds=2.0)
