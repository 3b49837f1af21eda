"""Agora ConvoAI's notifications through a real server on every backend (SPEC section 15; docs/agora.md):
signed as Agora signs them (``Agora-Signature-V2``, the hex HMAC-SHA256 of the raw body), the agent-left
(102) and the history (103) in either order make one end with the full transcript, one analytics record and
one ``conversation.ended``; a retried notice is applied once; forged, unsigned and stale notices are 401 and
store nothing; no number anywhere."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from caller_memory.service.app import scheduled_inactivity_ends
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.http.app_keys import SERVICES

from tests.conftest import OPERATOR_TOKEN, Api, canonical_digits, running_api
from tests.http.test_webhooks import Receiver, eventually, receiver

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
SECRET = "agora-webhook-secret-" + "s" * 11
CONVERSATION = "agora:7f3a9c"
NOTIFICATIONS = f"{BASE}/platforms/agora/notifications"
CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name"],
            "retention": "P30D",
            "default_region": "US",
            "analytics_enabled": True,
        },
        "conversation": {"enabled": True},
    }
}
#: What the memory proxy recorded of the call (the greeting and the question: the answer has no next turn).
RECORDED = [
    {"message_id": "px-1", "role": "assistant", "content": "Cheese shop, how can I help?", "turn_id": 0},
    {"message_id": "px-2", "role": "user", "content": "Do you have Brie?", "turn_id": 1},
]
#: Agora's history of the same call (103 ``contents``).
CONTENTS: list[dict[str, Any]] = [
    {"role": "assistant", "content": "Cheese shop, how can I help?"},
    {"role": "user", "content": "Do you have Brie?", "speech_start_ms": 1200, "speech_end_ms": 2100},
    {"role": "assistant", "content": "We do, a ripe one."},
]


@dataclass
class Agora:
    api: Api
    admin: str
    agent: str
    hook: Receiver
    start_ts: int

    def notice(self, event_type: int, payload: dict[str, Any], **envelope: Any) -> dict[str, Any]:
        return {
            "noticeId": f"{uuid.uuid4().int % 10**10}:4330:{event_type}",
            "productId": 17,
            "eventType": event_type,
            "notifyMs": self.api.clock.now_ms(),
            "sid": uuid.uuid4().hex.upper()[:16],
            "payload": payload,
            **envelope,
        }

    def agent_left(self, message: str = "OK", status: str = "STOPPED") -> dict[str, Any]:
        return self.notice(
            102,
            {
                "agent_id": "A42AF88DJ88MK93HD82DK48DJ84L",
                "start_ts": self.start_ts,
                "stop_ts": self.start_ts + 95,
                "status": status,
                "message": message,
                "channel": "room-8812",
                "labels": {"caller_memory_conversation": CONVERSATION},
            },
        )

    def history(self, contents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self.notice(
            103,
            {
                "agent_id": "A42AF88DJ88MK93HD82DK48DJ84L",
                "channel": "room-8812",
                "start_ts": self.start_ts,
                "stop_ts": self.start_ts + 95,
                "contents": CONTENTS if contents is None else contents,
                "labels": {"caller_memory_conversation": CONVERSATION},
            },
        )

    async def send(
        self, notice: dict[str, Any], *, secret: str = SECRET, signature: str | None = None
    ) -> Any:
        body = orjson.dumps(notice)
        sent = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest() if signature is None else signature
        headers = {"Content-Type": "application/json"} | ({"Agora-Signature-V2": sent} if sent else {})
        return await self.api.call("POST", NOTIFICATIONS, data=body, headers=headers)

    async def transcript(self) -> list[tuple[str, str]]:
        reply = await self.api.call(
            "GET", f"{BASE}/conversations/{CONVERSATION}/history?format=openai", token=self.agent
        )
        assert reply.status == 200, reply.body
        return [(m["role"], m["content"]) for m in reply.body["messages"]]

    async def status(self) -> dict[str, Any]:
        reply = await self.api.call("GET", f"{BASE}/conversations/{CONVERSATION}", token=self.agent)
        assert reply.status == 200, reply.body
        found: dict[str, Any] = reply.body
        return found

    async def analytics(self) -> list[dict[str, Any]]:
        reply = await self.api.call(
            "GET", f"{BASE}/analytics/conversations?from=2000-01-01", token=self.admin
        )
        assert reply.status == 200, reply.body
        found: list[dict[str, Any]] = reply.body["conversations"]
        return found


@pytest.fixture
async def agora(store_url: str, clock: FakeClock) -> AsyncIterator[Agora]:
    settings = {
        "store_timeout": 5.0,
        "secret_key": secrets.token_bytes(32),
        "webhook_allow_hosts": ("127.0.0.1",),
        "webhook_interval": 0.05,
        "webhook_timeout": 1.0,
    }
    async with receiver() as hook, running_api(store_url, clock, **settings) as api:
        reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
        assert reply.status in (200, 201), reply.body
        admin, agent = await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent")
        reply = await api.call("PUT", f"{BASE}/platforms/agora", token=admin, json={"secret": SECRET})
        assert reply.status == 201, reply.body
        reply = await api.call(
            "POST", f"{BASE}/webhooks", token=admin, json={"url": hook.url, "events": ["conversation.ended"]}
        )
        assert reply.status == 201, reply.body
        # The join helper's start, then what the memory proxy recorded during the call.
        reply = await api.call(
            "POST",
            f"{BASE}/conversations/{CONVERSATION}/start",
            token=agent,
            json={"caller": CALLER, "channel": "phone"},
        )
        assert reply.status == 200, reply.body
        reply = await api.call(
            "POST", f"{BASE}/conversations/{CONVERSATION}/messages", token=agent, json={"messages": RECORDED}
        )
        assert reply.status == 200, reply.body
        clock.advance(95)
        yield Agora(api, admin, agent, hook, clock.now_ms() // 1000 - 95)


@pytest.mark.parametrize("left_first", [True, False])
async def test_agent_left_and_history_in_either_order_make_one_end(
    agora: Agora, left_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    left, history = agora.agent_left(), agora.history()
    first, second = (left, history) if left_first else (history, left)
    reply = await agora.send(first)
    assert reply.status == 200 and reply.body == {"outcome": "held", "conversation_id": CONVERSATION}
    assert (await agora.status())["status"] != "ended"
    # Agora retries a notice whose answer it did not get: applied once.
    assert (await agora.send(first)).body == {"outcome": "duplicate"}
    reply = await agora.send(second)
    assert reply.status == 200 and reply.body["outcome"] == "ended", reply.body
    assert (await agora.send(second)).body == {"outcome": "duplicate"}
    expected = [(m["role"], m["content"]) for m in CONTENTS]
    assert await agora.transcript() == expected  # the proxy's turns once, and the answer it could not see
    status = await agora.status()
    assert status["ended_by"] == "explicit" and status["end_reason"] == "completed"
    assert len(await agora.analytics()) == 1
    await eventually(lambda: len(agora.hook.events("conversation.ended")) == 1)
    (event,) = agora.hook.events("conversation.ended")
    assert event["data"]["conversation_id"] == CONVERSATION and event["data"]["source"] == "agora"
    # The 30 s after the agent-left pass: nothing more happens.
    agora.api.clock.advance(31)
    await scheduled_inactivity_ends(agora.api.app)
    assert len(await agora.analytics()) == 1 and len(agora.hook.events("conversation.ended")) == 1
    digits = canonical_digits(CALLER)
    assert digits not in caplog.text and digits not in orjson.dumps(agora.hook.events()).decode()


async def test_agent_left_alone_ends_the_call_30_s_later_with_its_reason(agora: Agora) -> None:
    reply = await agora.send(agora.agent_left("Idle for too long"))
    assert reply.body["outcome"] == "held"
    agora.api.clock.advance(29)
    await scheduled_inactivity_ends(agora.api.app)
    assert (await agora.status())["status"] != "ended"
    agora.api.clock.advance(2)
    await scheduled_inactivity_ends(agora.api.app)
    status = await agora.status()
    assert status["ended_by"] == "explicit" and status["end_reason"] == "dropped"
    assert len(await agora.transcript()) == 2  # what the proxy recorded
    # The history after the end: a duplicate (the call ended), nothing twice.
    assert (await agora.send(agora.history())).body["outcome"] == "duplicate"


async def test_forged_unsigned_and_stale_notices_are_refused_and_change_nothing(agora: Agora) -> None:
    now = agora.api.clock.now_ms()
    left = agora.agent_left()
    refused = [
        await agora.send(left, secret="another-secret-entirely-0000"),
        await agora.send(left, signature=""),
        await agora.send(left, signature="zz" * 32),
        await agora.send({**left, "notifyMs": now - 11 * 60_000}),
        await agora.send({**left, "notifyMs": now + 11 * 60_000}),
    ]
    for reply in refused:
        assert reply.status == 401, reply.body
        assert SECRET not in orjson.dumps(reply.body).decode()
    # Nothing was held, and the notice's id was not remembered: the genuine one is taken.
    assert (await agora.send(left)).body["outcome"] == "held"
    # A notice signed but not one Agora sends is named, never echoed; one Caller Memory does not use, and one
    # naming no conversation it started, are acknowledged.
    reply = await agora.send({"noticeId": "x", "payload": {"labels": {"x": CALLER}}})
    assert reply.status == 422 and CALLER not in orjson.dumps(reply.body).decode()
    assert (await agora.send(agora.notice(111, {"metrics": []}))).body == {"outcome": "ignored"}
    unlabelled = agora.notice(102, {"status": "STOPPED", "labels": {"other": "x"}})
    assert (await agora.send(unlabelled)).body == {"outcome": "ignored"}
    stranger = agora.notice(
        103, {"contents": CONTENTS, "labels": {"caller_memory_conversation": "agora:nobody"}}
    )
    assert (await agora.send(stranger)).body["outcome"] == "held"
    agora.api.clock.advance(601)
    await scheduled_inactivity_ends(agora.api.app)
    reply = await agora.api.call("GET", f"{BASE}/conversations/agora:nobody", token=agora.agent)
    assert reply.status == 404  # no number to start one with: nothing made


async def test_a_project_without_an_agora_connection_is_404(agora: Agora) -> None:
    reply = await agora.api.call("DELETE", f"{BASE}/platforms/agora", token=agora.admin)
    assert reply.status == 204
    assert (await agora.send(agora.agent_left())).status == 404
    services = agora.api.app[SERVICES]
    assert await services.store.due_platform_ends(agora.api.clock.now_ms() + 10**9, 10) == []


async def test_the_businesss_end_after_agoras_is_late_and_its_state_applies(agora: Agora) -> None:
    """The call ended by Agora's agent-left (its 30 s passed), then the business's code ends it with the state
    it gathered: no 409, the state is written (a late end), and the call still counts once."""
    await agora.send(agora.agent_left())
    agora.api.clock.advance(31)
    await scheduled_inactivity_ends(agora.api.app)
    assert (await agora.status())["ended_by"] == "explicit"
    body = {"caller": CALLER, "state": {"caller_name": "Ada"}, "end_reason": "completed"}
    reply = await agora.api.call(
        "POST", f"{BASE}/conversations/{CONVERSATION}/end", token=agora.agent, json=body
    )
    assert reply.status == 200 and reply.body["late"] is True, reply.body
    reply = await agora.api.call("GET", f"{BASE}/callers/{CALLER}/memory", token=agora.agent)
    assert reply.body["fields"] == {"caller_name": "Ada"}
    assert len(await agora.analytics()) == 1
    await eventually(lambda: len(agora.hook.events("conversation.ended")) == 1)
    # A retry of the business's end: the same answer, nothing twice.
    again = await agora.api.call(
        "POST", f"{BASE}/conversations/{CONVERSATION}/end", token=agora.agent, json=body
    )
    assert again.status == 200 and again.body["late"] is True
    assert len(await agora.analytics()) == 1 and len(agora.hook.events("conversation.ended")) == 1
