"""Telnyx's webhooks through a real server on every backend (SPEC section 15; docs/telnyx.md), signed as Telnyx
signs them (``telnyx-signature-ed25519``: the base64 Ed25519 signature of ``<telnyx-timestamp>|<raw body>``,
verified with the connection's public key): the AI Assistant's dynamic-variables webhook answers the caller's
memory as ``dynamic_variables``, with the call's attestation (the webhook's own verified flag, or the
``call.initiated`` of the same call, before or during the answer): an A-attested call gets its ``sensitive``
fields, a C-attested one does not. ``call.hangup``, ``call.conversation.ended`` and the insights in any order,
each delivered twice, make one end; forged, unsigned, stale and GET requests change nothing; no number
anywhere.

The same scenarios with payloads built by the telnyx package's own types and verified by its own helper:
tests/vendors/test_telnyx.py (which imports the fixture from here)."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import logging
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from caller_memory.service.app import scheduled_inactivity_ends
from caller_memory.service.domain.clock import FakeClock
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.conftest import OPERATOR_TOKEN, Api, Reply, canonical_digits, running_api
from tests.http.test_webhooks import Receiver, eventually, receiver
from tests.support.redis_server import RedisServer

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
SHOP_NUMBER = "+14155550199"
VARIABLES = f"{BASE}/platforms/telnyx/variables"
EVENTS = f"{BASE}/platforms/telnyx/events"
STATE_KEYS = ["caller_name", "cheese", "balance"]
CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": STATE_KEYS,
            "field_classes": {"balance": "sensitive"},
            "trust": {"sensitive": "A"},
            "retention": "P30D",
            "default_region": "US",
            "analytics_enabled": True,
        },
        "conversation": {"enabled": True},
    }
}
KEY = Ed25519PrivateKey.generate()
OTHER_KEY = Ed25519PrivateKey.generate()


def public_key(key: Ed25519PrivateKey = KEY) -> str:
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


CONNECTION = {
    "options": {"public_key": public_key()},
    "state_map": {"customer_name": "caller_name", "favourite_cheese": "cheese"},
    "analysis_qa_key": "resolved",
}
#: What was said (``messages``): the assistant's and the user's turns, and a system notice (not kept).
MESSAGES: list[dict[str, Any]] = [
    {"role": "assistant", "content": "Cheese shop, how can I help?", "timestamp": "2026-12-07T10:00:01Z"},
    {"role": "user", "content": "Hi, this is Ada. Do you have Brie?", "timestamp": "2026-12-07T10:00:04Z"},
    {"role": "system", "content": "Idle check-in.", "timestamp": "2026-12-07T10:00:06Z"},
    {"role": "assistant", "content": "We do, a ripe one.", "timestamp": "2026-12-07T10:00:07Z"},
]
INSIGHTS: list[dict[str, Any]] = [
    {
        "insight_id": "7b1f3a52-0c51-4c36-9a55-1d8e3a1e4a10",
        "result": {"customer_name": "Ada", "favourite_cheese": "Brie", "resolved": True},
    },
    {"insight_id": "a3c0e2d4-5b6f-4d7e-8f90-1a2b3c4d5e6f", "result": "Ada asked for Brie."},
]


def sign(body: bytes, key: Ed25519PrivateKey = KEY, at_s: int | None = None) -> dict[str, str]:
    """``telnyx-timestamp`` and ``telnyx-signature-ed25519`` for ``body``, signed at ``at_s``."""
    stamp = str(int(time.time()) if at_s is None else at_s)
    signature = key.sign(stamp.encode() + b"|" + body)
    return {"telnyx-timestamp": stamp, "telnyx-signature-ed25519": base64.b64encode(signature).decode()}


@dataclass
class Telnyx:
    api: Api
    admin: str
    agent: str
    hook: Receiver
    ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def clock(self) -> FakeClock:
        return self.api.clock

    async def post(
        self,
        path: str,
        document: Any,
        *,
        key: Ed25519PrivateKey = KEY,
        at_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        body = document if isinstance(document, bytes) else orjson.dumps(document)
        signed = sign(body, key, self.clock.now_ms() // 1000 if at_s is None else at_s)
        sent = {"Content-Type": "application/json"} | (signed if headers is None else headers)
        if len(body) < 1 << 16:
            return await self.api.call("POST", path, data=body, headers=sent)
        async with self.api.session.post(self.api.base_url + path, data=io.BytesIO(body), headers=sent) as r:
            return Reply(r.status, r.headers.copy(), await r.json(content_type=None), r.content_type)

    def event(self, kind: str, session: str, event_id: str | None = None, **payload: Any) -> dict[str, Any]:
        """A webhook as Telnyx sends it: ``{"data": {"record_type", "id", "event_type", "occurred_at",
        "payload"}}``, for the call ``session``."""
        return {
            "data": {
                "record_type": "event",
                "id": event_id or f"evt-{next(self.ids)}-{secrets.token_hex(4)}",
                "event_type": kind,
                "occurred_at": _iso(self.clock.now_ms()),
                "payload": {
                    "call_control_id": f"v3:{session}-leg",
                    "call_leg_id": f"{session}-leg",
                    "call_session_id": session,
                    "connection_id": "1289082222292239760",
                    **payload,
                },
            }
        }

    def initialization(self, session: str, caller: str = CALLER, verified: bool = False) -> dict[str, Any]:
        document = self.event(
            "assistant.initialization",
            session,
            telnyx_conversation_channel="phone_call",
            telnyx_agent_target=SHOP_NUMBER,
            telnyx_end_user_target=caller,
            telnyx_end_user_target_verified=verified,
            assistant_id="assistant-2f1c",
        )
        del document["data"]["payload"]["call_leg_id"], document["data"]["payload"]["connection_id"]
        return document

    async def variables(self, session: str, **options: Any) -> Reply:
        return await self.post(VARIABLES, self.initialization(session, **options))

    def initiated(
        self, session: str, attestation: str | None, validated: bool | None = True
    ) -> dict[str, Any]:
        return self.event(
            "call.initiated",
            session,
            direction="incoming",
            state="parked",
            to=SHOP_NUMBER,
            start_time=_iso(self.clock.now_ms()),
            shaken_stir_attestation=attestation,
            shaken_stir_validated=validated,
            **{"from": CALLER},
        )

    def hangup(self, session: str, cause: str = "normal_clearing") -> dict[str, Any]:
        return self.event(
            "call.hangup",
            session,
            to=SHOP_NUMBER,
            state="hangup",
            start_time=_iso(self.clock.now_ms() - 95_000),
            hangup_cause=cause,
            hangup_source="caller",
            sip_hangup_cause="200",
            **{"from": CALLER},
        )

    def conversation_ended(self, session: str, messages: list[dict[str, Any]] = MESSAGES) -> dict[str, Any]:
        return self.event(
            "call.conversation.ended",
            session,
            assistant_id="assistant-2f1c",
            calling_party_type="pstn",
            conversation_id="c0ffee00-0000-4000-8000-000000000001",
            duration_sec=94,
            messages=messages,
            reason="user_hangup",
            to=SHOP_NUMBER,
            **{"from": CALLER},
        )

    def insights(self, session: str) -> dict[str, Any]:
        return self.event(
            "call.conversation_insights.generated",
            session,
            calling_party_type="pstn",
            insight_group_id="d9a1b2c3-0000-4000-8000-000000000002",
            results=INSIGHTS,
        )

    async def get(self, path: str) -> Reply:
        # The admin's: an agent's read of an ended call's transcript is a call's, which the project's trust
        # settings hold to attestation A.
        return await self.api.call("GET", f"{BASE}{path}", token=self.admin)

    async def transcript(self, conversation: str) -> list[tuple[str, str]]:
        reply = await self.get(f"/conversations/{conversation}/history?format=openai")
        assert reply.status == 200, reply.body
        return [(m["role"], m["content"]) for m in reply.body["messages"]]

    async def status(self, conversation: str) -> dict[str, Any]:
        reply = await self.get(f"/conversations/{conversation}")
        assert reply.status == 200, reply.body
        found: dict[str, Any] = reply.body
        return found

    async def memory(self) -> dict[str, Any]:
        reply = await self.api.call("GET", f"{BASE}/callers/{CALLER}/memory", token=self.admin)
        assert reply.status == 200, reply.body
        found: dict[str, Any] = reply.body["fields"]
        return found

    async def remember(self, **fields: Any) -> None:
        reply = await self.api.call(
            "PATCH", f"{BASE}/callers/{CALLER}/memory", token=OPERATOR_TOKEN, json=fields
        )
        assert reply.status == 200, reply.body

    async def conversations(self) -> list[dict[str, Any]]:
        reply = await self.api.call("GET", f"{BASE}/callers/{CALLER}/conversations", token=self.admin)
        assert reply.status == 200, reply.body
        found: list[dict[str, Any]] = reply.body["conversations"]
        return found

    async def analytics(self) -> list[dict[str, Any]]:
        reply = await self.api.call(
            "GET", f"{BASE}/analytics/conversations?from=2000-01-01", token=self.admin
        )
        assert reply.status == 200, reply.body
        found: list[dict[str, Any]] = reply.body["conversations"]
        return found


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}000Z"


async def connected(api: Api, hook: Receiver) -> Telnyx:
    reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    admin, agent = await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent")
    reply = await api.call("PUT", f"{BASE}/platforms/telnyx", token=admin, json=CONNECTION)
    assert reply.status == 201, reply.body
    reply = await api.call(
        "POST", f"{BASE}/webhooks", token=admin, json={"url": hook.url, "events": ["conversation.ended"]}
    )
    assert reply.status == 201, reply.body
    return Telnyx(api, admin, agent, hook)


SETTINGS: dict[str, Any] = {
    "store_timeout": 5.0,
    "webhook_allow_hosts": ("127.0.0.1",),
    "webhook_interval": 0.05,
    "webhook_timeout": 1.0,
}


@pytest.fixture
async def telnyx(store_url: str, clock: FakeClock) -> AsyncIterator[Telnyx]:
    async with (
        receiver() as hook,
        running_api(store_url, clock, secret_key=secrets.token_bytes(32), **SETTINGS) as api,
    ):
        yield await connected(api, hook)


def variables_of(reply: Reply) -> dict[str, str]:
    """The answer's dynamic variables, checked to be Telnyx's shape (``{"dynamic_variables": {...}}``)."""
    assert reply.status == 200, reply.body
    assert set(reply.body) == {"dynamic_variables"}
    variables: dict[str, str] = reply.body["dynamic_variables"]
    assert all(isinstance(v, str) for v in variables.values())
    assert {"caller_memory", "returning_caller", "resume"} | {f"memory_{k}" for k in STATE_KEYS} <= set(
        variables
    )
    return variables


@pytest.mark.parametrize(
    ("how", "sensitive"),
    [
        ("verified flag", True),
        ("initiated A before", True),
        ("initiated A during the answer", True),
        ("initiated C before", False),
        ("initiated A not validated", False),
        ("no attestation", False),
    ],
)
async def test_an_a_attested_call_gets_its_sensitive_fields_and_others_do_not(
    telnyx: Telnyx, how: str, sensitive: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await telnyx.remember(caller_name="Ada", balance="42.10 EUR")
    session = "428c31b6-abf3-3bc1-b7f4-5013ef9657c1"
    if how == "initiated A before":
        assert (await telnyx.post(EVENTS, telnyx.initiated(session, "A"))).body == {"outcome": "attested"}
    elif how == "initiated C before":
        assert (await telnyx.post(EVENTS, telnyx.initiated(session, "C"))).body == {"outcome": "attested"}
    elif how == "initiated A not validated":
        assert (await telnyx.post(EVENTS, telnyx.initiated(session, "A", False))).body[
            "outcome"
        ] == "attested"

    async def late_initiated() -> Reply:
        await asyncio.sleep(0.05)
        return await telnyx.post(EVENTS, telnyx.initiated(session, "A"))

    began = time.monotonic()
    if how == "initiated A during the answer":
        reply, initiated = await asyncio.gather(telnyx.variables(session), late_initiated())
        assert initiated.body == {"outcome": "attested"}
    else:
        reply = await telnyx.variables(session, verified=how == "verified flag")
    assert time.monotonic() - began < 1.2
    variables = variables_of(reply)
    assert variables["memory_caller_name"] == "Ada" and variables["returning_caller"] == "true"
    if sensitive:
        assert variables["memory_balance"] == "42.10 EUR" and "42.10 EUR" in variables["caller_memory"]
    else:
        assert variables["memory_balance"] == "" and "42.10" not in variables["caller_memory"]
    (conversation,) = [c for c in await telnyx.conversations() if c["conversation_id"].startswith("telnyx:")]
    assert conversation["conversation_id"] == f"telnyx:{session}"
    assert canonical_digits(CALLER) not in caplog.text
    assert all(canonical_digits(CALLER) not in canonical_digits(v) for v in variables.values())


@pytest.mark.parametrize("order", list(itertools.permutations(["hangup", "ended", "insights"])))
async def test_the_three_end_events_in_any_order_and_retried_make_one_end(
    telnyx: Telnyx, order: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    session = "817f8c2a-728a-11ea-9cbe-02420a0f8969"
    conversation = f"telnyx:{session}"
    await telnyx.post(EVENTS, telnyx.initiated(session, "A"))
    variables = variables_of(await telnyx.variables(session))
    assert variables["returning_caller"] == "false" and variables["caller_memory"] == ""
    # Telnyx retries a webhook it saw no answer to: the same conversation, never a second one.
    telnyx.clock.advance(2)
    assert variables_of(await telnyx.variables(session)) == variables
    telnyx.clock.advance(95)
    events = {
        "hangup": telnyx.hangup(session),
        "ended": telnyx.conversation_ended(session),
        "insights": telnyx.insights(session),
    }
    outcomes = []
    for name in order:
        reply = await telnyx.post(EVENTS, events[name])
        assert reply.status == 200, reply.body
        outcomes.append(reply.body["outcome"])
        # Each delivered again: applied once.
        assert (await telnyx.post(EVENTS, events[name])).body == {"outcome": "duplicate"}
    insights_at = order.index("insights")
    assert outcomes[insights_at] == "ended"
    assert all(o == "held" for o in outcomes[:insights_at])
    assert all(o == "duplicate" for o in outcomes[insights_at + 1 :])
    status = await telnyx.status(conversation)
    assert status["ended_by"] == "explicit"
    if "hangup" in order[:insights_at]:
        assert status["end_reason"] == "completed"  # the hang-up's normal_clearing
    if "ended" in order[:insights_at]:
        assert await telnyx.transcript(conversation) == [
            ("assistant", "Cheese shop, how can I help?"),
            ("user", "Hi, this is Ada. Do you have Brie?"),
            ("assistant", "We do, a ripe one."),
        ]
    assert await telnyx.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    (row,) = await telnyx.analytics()
    assert row["qa"] == "true"
    await eventually(lambda: len(telnyx.hook.events("conversation.ended")) == 1)
    (event,) = telnyx.hook.events("conversation.ended")
    assert event["data"]["conversation_id"] == conversation and event["data"]["source"] == "telnyx"
    # The analysis grace passes: nothing more happens.
    telnyx.clock.advance(601)
    await scheduled_inactivity_ends(telnyx.api.app)
    assert len(await telnyx.analytics()) == 1 and len(telnyx.hook.events("conversation.ended")) == 1
    # The caller calls again: the first call's fields as variables.
    telnyx.clock.advance(3600)
    variables = variables_of(await telnyx.variables("5d1e0c7a-0000-4000-8000-000000000003"))
    assert variables["returning_caller"] == "true" and variables["memory_cheese"] == "Brie"
    digits = canonical_digits(CALLER)
    assert digits not in caplog.text and digits not in orjson.dumps(telnyx.hook.events()).decode()


async def test_a_hang_up_alone_ends_the_call_after_the_analysis_grace(telnyx: Telnyx) -> None:
    session = "c1a0b2d3-0000-4000-8000-000000000004"
    variables_of(await telnyx.variables(session))
    telnyx.clock.advance(60)
    assert (await telnyx.post(EVENTS, telnyx.hangup(session, "time_limit"))).body["outcome"] == "held"
    telnyx.clock.advance(599)
    await scheduled_inactivity_ends(telnyx.api.app)
    assert (await telnyx.status(f"telnyx:{session}"))["status"] != "ended"
    telnyx.clock.advance(2)
    await scheduled_inactivity_ends(telnyx.api.app)
    status = await telnyx.status(f"telnyx:{session}")
    assert status["ended_by"] == "explicit" and status["end_reason"] == "dropped"
    assert (await telnyx.post(EVENTS, telnyx.insights(session))).body["outcome"] == "duplicate"
    assert len(await telnyx.analytics()) == 1


async def test_a_call_whose_variables_webhook_named_no_session_is_found_by_its_leg(telnyx: Telnyx) -> None:
    """Telnyx's documented dynamic-variables payload names only ``call_control_id``: the conversation is the
    leg's, and the call's events (which name both) find it, with the attestation ``call.initiated`` kept."""
    session = "e2b3c4d5-0000-4000-8000-000000000005"
    await telnyx.remember(balance="7.00 EUR")
    assert (await telnyx.post(EVENTS, telnyx.initiated(session, "A"))).body == {"outcome": "attested"}
    document = telnyx.initialization(session)
    del document["data"]["payload"]["call_session_id"]
    variables = variables_of(await telnyx.post(VARIABLES, document))
    assert variables["memory_balance"] == "7.00 EUR"
    (started,) = await telnyx.conversations()
    leg = started["conversation_id"]
    assert leg.startswith("telnyx:leg:") and session not in leg
    telnyx.clock.advance(60)
    assert (await telnyx.post(EVENTS, telnyx.conversation_ended(session))).body == {
        "outcome": "held",
        "conversation_id": leg,
    }
    assert (await telnyx.post(EVENTS, telnyx.insights(session))).body == {
        "outcome": "ended",
        "conversation_id": leg,
    }
    assert len(await telnyx.transcript(leg)) == 3


async def test_an_end_whose_variables_webhook_never_arrived_starts_and_ends_one(telnyx: Telnyx) -> None:
    session = "f3c4d5e6-0000-4000-8000-000000000006"
    assert (await telnyx.post(EVENTS, telnyx.conversation_ended(session))).body["outcome"] == "held"
    reply = await telnyx.post(EVENTS, telnyx.insights(session))
    assert reply.body == {"outcome": "started_and_ended", "conversation_id": f"telnyx:{session}"}
    assert len(await telnyx.transcript(f"telnyx:{session}")) == 3
    assert await telnyx.memory() == {"caller_name": "Ada", "cheese": "Brie"}


async def test_forged_unsigned_stale_and_get_requests_change_nothing(telnyx: Telnyx) -> None:
    session = "0a1b2c3d-0000-4000-8000-000000000007"
    now_s = telnyx.clock.now_ms() // 1000
    body = orjson.dumps(telnyx.initialization(session))
    good = sign(body, at_s=now_s)
    refused = [
        await telnyx.post(VARIABLES, body, key=OTHER_KEY),
        await telnyx.post(VARIABLES, body, headers={}),
        await telnyx.post(
            VARIABLES, body, headers={"telnyx-signature-ed25519": good["telnyx-signature-ed25519"]}
        ),
        await telnyx.post(VARIABLES, body, headers=good | {"telnyx-signature-ed25519": "AAAA"}),
        await telnyx.post(VARIABLES, body, headers=good | {"telnyx-timestamp": str(now_s + 1)}),
        await telnyx.post(VARIABLES, body, at_s=now_s - 301),
        await telnyx.post(VARIABLES, body, at_s=now_s + 301),
        await telnyx.post(VARIABLES, body + b" ", headers=good),
        await telnyx.post(EVENTS, telnyx.insights(session), key=OTHER_KEY),
        await telnyx.post(EVENTS, telnyx.initiated(session, "A"), at_s=now_s - 400),
        await telnyx.post(EVENTS, telnyx.initiated(session, "A"), key=OTHER_KEY),
    ]
    for reply in refused:
        assert reply.status == 401, reply.body
        assert reply.content_type == "application/problem+json"
    for path in (VARIABLES, EVENTS):
        for method in ("GET", "PUT", "DELETE"):
            reply = await telnyx.api.call(method, path, headers=good)
            assert reply.status == 405, reply.body
            assert reply.content_type == "application/problem+json" and reply.body["status"] == 405
    assert await telnyx.conversations() == []
    assert len(await telnyx.analytics()) == 0
    # The forged call.initiated kept nothing: the genuine call is not A-attested.
    await telnyx.remember(balance="1.00 EUR")
    assert variables_of(await telnyx.post(VARIABLES, body, headers=good))["memory_balance"] == ""
    # The same signed webhook delivered again (a replay): answered without memory, nothing started.
    replayed = variables_of(await telnyx.post(VARIABLES, body, headers=good))
    assert replayed["caller_memory"] == "" and replayed["returning_caller"] == "false"
    assert len(await telnyx.conversations()) == 1
    # Signed bodies that are not Telnyx's are named, never echoed; events Caller Memory does not use are
    # acknowledged.
    reply = await telnyx.post(VARIABLES, {"data": {"payload": {"telnyx_end_user_target": [CALLER]}}})
    assert reply.status == 422 and CALLER not in orjson.dumps(reply.body).decode()
    reply = await telnyx.post(EVENTS, {"data": {"event_type": "call.hangup", "payload": {"from": [CALLER]}}})
    assert reply.status == 422 and CALLER not in orjson.dumps(reply.body).decode()
    assert (await telnyx.post(EVENTS, b"[1,2")).status == 400
    assert (await telnyx.post(EVENTS, telnyx.event("call.answered", session))).body == {"outcome": "ignored"}


async def test_a_one_mib_end_is_taken(telnyx: Telnyx) -> None:
    session = "1b2c3d4e-0000-4000-8000-000000000008"
    variables_of(await telnyx.variables(session))
    telnyx.clock.advance(60)
    messages = [
        {"role": "user" if i % 2 else "assistant", "content": f"Turn {i}: " + "more cheese " * 160}
        for i in range(560)
    ]
    messages[7]["content"] = "cheese " * 3000  # longer than a stored message may be: cut, never refused
    body = orjson.dumps(telnyx.conversation_ended(session, messages))
    assert len(body) >= 1 << 20
    reply = await telnyx.post(EVENTS, body)
    assert reply.status == 200 and reply.body["outcome"] == "held", reply.body
    assert (await telnyx.post(EVENTS, telnyx.insights(session))).body["outcome"] == "ended"
    assert (await telnyx.status(f"telnyx:{session}"))["messages"] == 560


async def test_the_answer_fails_open_within_the_deadline_while_the_store_is_down(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stopped (SIGSTOP) after the connection was read once: the webhook is still verified (the
    connection this process last read) and answered within 1.2 s, every variable there and empty; a forged
    one is still refused. A process that never read the connection answers without verifying: an answer
    that holds nothing."""
    caplog.set_level(logging.DEBUG)
    with RedisServer() as server:
        async with (
            receiver() as hook,
            running_api(
                server.url, clock, secret_key=secrets.token_bytes(32), **SETTINGS | {"store_timeout": 0.5}
            ) as api,
        ):
            telnyx = await connected(api, hook)
            variables_of(
                await telnyx.variables("2c3d4e5f-0000-4000-8000-000000000009", caller="+14155550111")
            )
            os.kill(server.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                variables = variables_of(await telnyx.variables("3d4e5f60-0000-4000-8000-00000000000a"))
                assert time.monotonic() - began < 1.5
                assert variables["caller_memory"] == "" and variables["memory_caller_name"] == ""
                assert variables["returning_caller"] == "false"
                forged = await telnyx.post(
                    VARIABLES, telnyx.initialization("4e5f6071-0000-4000-8000-00000000000b"), key=OTHER_KEY
                )
                assert forged.status == 401
            finally:
                os.kill(server.pid, signal.SIGCONT)
    with RedisServer() as down:
        async with running_api(down.url, clock, store_timeout=0.5) as api:
            os.kill(down.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                reply = await Telnyx(api, "", "", Receiver()).variables(
                    "5f607182-0000-4000-8000-00000000000c"
                )
                assert time.monotonic() - began < 1.5
            finally:
                os.kill(down.pid, signal.SIGCONT)
            assert reply.status == 200
            assert reply.body == {
                "dynamic_variables": {"caller_memory": "", "returning_caller": "false", "resume": ""}
            }
    assert canonical_digits(CALLER) not in caplog.text
