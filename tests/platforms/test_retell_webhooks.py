"""Retell's webhooks through a real server on every backend (SPEC section 15; docs/retell.md), signed as Retell
signs them (``x-retell-signature: v=<ms>,d=<hex HMAC-SHA256 of the raw body followed by v>``, the API key as the
key): the inbound webhook answers the caller's memory as dynamic variables and names the conversation in the
call's metadata; ``call_ended`` and ``call_analyzed`` in either order make one end with the transcript, the
summary and the mapped analysis, one analytics record and one ``conversation.ended``; retries are applied
once; forged, unsigned, stale and replayed webhooks change nothing; no number anywhere.

The same scenarios with payloads built by retell-sdk's own types and signed by its own helper:
tests/vendors/test_retell.py (which imports the fixture from here)."""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from caller_memory.service.app import scheduled_inactivity_ends
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, Api, Reply, canonical_digits, running_api
from tests.http.test_webhooks import Receiver, eventually, receiver
from tests.support.redis_server import RedisServer

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
SHOP_NUMBER = "+14155550199"
API_KEY = "key_" + "a1b2c3d4" * 4
INBOUND = f"{BASE}/platforms/retell/inbound"
EVENTS = f"{BASE}/platforms/retell/events"
STATE_KEYS = ["caller_name", "cheese"]
CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": STATE_KEYS,
            "retention": "P30D",
            "default_region": "US",
            "analytics_enabled": True,
        },
        "conversation": {"enabled": True},
    }
}
CONNECTION = {
    "secret": API_KEY,
    "state_map": {"customer_name": "caller_name", "favourite_cheese": "cheese"},
    "analysis_qa_key": "call_analysis.call_successful",
}
#: What was said (``transcript_object``): the agent's and the user's turns, and a transfer target's words
#: (not kept).
UTTERANCES: list[dict[str, Any]] = [
    {"role": "agent", "content": "Cheese shop, how can I help?", "words": []},
    {
        "role": "user",
        "content": "Hi, this is Ada. Do you have Brie?",
        "words": [{"word": "Hi", "start": 1.2, "end": 1.4}],
        "metadata": {"response_id": 1},
    },
    {"role": "agent", "content": "We do, a ripe one.", "words": [], "metadata": {"response_id": 2}},
    {"role": "transfer_target", "content": "Cellar desk.", "words": []},
]
ANALYSIS = {
    "call_summary": "Ada asked for Brie; it is in stock.",
    "call_successful": True,
    "user_sentiment": "Positive",
    "in_voicemail": False,
    "custom_analysis_data": {"customer_name": "Ada", "favourite_cheese": "Brie"},
}


def signature(body: bytes, key: str = API_KEY, at_ms: int | None = None) -> str:
    """``x-retell-signature`` for ``body``, signed at ``at_ms`` (now by default)."""
    at = int(time.time() * 1000) if at_ms is None else at_ms
    digest = hmac.new(key.encode(), body + str(at).encode(), hashlib.sha256).hexdigest()
    return f"v={at},d={digest}"


@dataclass
class Retell:
    api: Api
    admin: str
    agent: str
    hook: Receiver

    @property
    def clock(self) -> FakeClock:
        return self.api.clock

    async def post(
        self,
        path: str,
        document: Any,
        *,
        key: str = API_KEY,
        at_ms: int | None = None,
        sig: str | None = None,
    ) -> Reply:
        body = document if isinstance(document, bytes) else orjson.dumps(document)
        sent = signature(body, key, self.clock.now_ms() if at_ms is None else at_ms) if sig is None else sig
        headers = {"Content-Type": "application/json"} | ({"x-retell-signature": sent} if sent else {})
        if len(body) < 1 << 16:
            return await self.api.call("POST", path, data=body, headers=headers)
        # A large body as a stream (aiohttp warns of one sent as bytes).
        async with self.api.session.post(
            self.api.base_url + path, data=io.BytesIO(body), headers=headers
        ) as r:
            return Reply(r.status, r.headers.copy(), await r.json(content_type=None), r.content_type)

    async def inbound(self, caller: str = CALLER, **signing: Any) -> Reply:
        document = {
            "event": "call_inbound",
            "call_inbound": {
                "agent_id": "agent_9f2c",
                "agent_version": 3,
                "from_number": caller,
                "to_number": SHOP_NUMBER,
            },
        }
        return await self.post(INBOUND, document, **signing)

    def call(self, call_id: str, conversation: str | None, **fields: Any) -> dict[str, Any]:
        """A phone call object as Retell sends it in its events (``PhoneCallResponse``)."""
        now = self.clock.now_ms()
        call: dict[str, Any] = {
            "call_id": call_id,
            "call_type": "phone_call",
            "agent_id": "agent_9f2c",
            "agent_version": 3,
            "call_status": "ended",
            "direction": "inbound",
            "from_number": CALLER,
            "to_number": SHOP_NUMBER,
            "start_timestamp": now - 95_000,
            "end_timestamp": now - 1_000,
            "duration_ms": 94_000,
            "disconnection_reason": "user_hangup",
            "transcript": "Agent: Cheese shop, how can I help?\nUser: Hi ...",
            "transcript_object": UTTERANCES,
            "retell_llm_dynamic_variables": {"returning_caller": "false"},
        }
        if conversation is not None:
            call["metadata"] = {"caller_memory_conversation": conversation}
        call.update(fields)
        return call

    async def event(self, kind: str, call: dict[str, Any], **signing: Any) -> Reply:
        document: dict[str, Any] = {"event": kind, "call": call}
        if kind == "call_analyzed":
            document["call"] = {"call_analysis": ANALYSIS} | call
        return await self.post(EVENTS, document, **signing)

    async def get(self, path: str) -> Reply:
        return await self.api.call("GET", f"{BASE}{path}", token=self.agent)

    async def transcript(self, conversation: str) -> list[tuple[str, str]]:
        reply = await self.get(f"/conversations/{conversation}/history?format=openai")
        assert reply.status == 200, reply.body
        return [(m["role"], m["content"]) for m in reply.body["messages"]]

    async def status(self, conversation: str) -> dict[str, Any]:
        reply = await self.get(f"/conversations/{conversation}")
        assert reply.status == 200, reply.body
        found: dict[str, Any] = reply.body
        return found

    async def summary(self, conversation: str) -> str | None:
        reply = await self.get(f"/conversations/{conversation}/context")
        assert reply.status == 200, reply.body
        section = reply.body["sections"]["summary"]
        return None if section is None else str(section["text"])

    async def memory(self, caller: str = CALLER) -> dict[str, Any]:
        reply = await self.get(f"/callers/{caller}/memory")
        assert reply.status == 200, reply.body
        found: dict[str, Any] = reply.body["fields"]
        return found

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


async def connected(api: Api, hook: Receiver) -> Retell:
    reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    admin, agent = await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent")
    reply = await api.call("PUT", f"{BASE}/platforms/retell", token=admin, json=CONNECTION)
    assert reply.status == 201, reply.body
    reply = await api.call(
        "POST", f"{BASE}/webhooks", token=admin, json={"url": hook.url, "events": ["conversation.ended"]}
    )
    assert reply.status == 201, reply.body
    return Retell(api, admin, agent, hook)


SETTINGS: dict[str, Any] = {
    "store_timeout": 5.0,
    "webhook_allow_hosts": ("127.0.0.1",),
    "webhook_interval": 0.05,
    "webhook_timeout": 1.0,
}


@pytest.fixture
async def retell(store_url: str, clock: FakeClock) -> AsyncIterator[Retell]:
    async with (
        receiver() as hook,
        running_api(store_url, clock, secret_key=secrets.token_bytes(32), **SETTINGS) as api,
    ):
        yield await connected(api, hook)


def variables_of(reply: Reply) -> tuple[dict[str, str], str | None]:
    """The inbound answer's dynamic variables and conversation, checked to be Retell's shape."""
    assert reply.status == 200, reply.body
    assert set(reply.body) == {"call_inbound"}
    inbound = reply.body["call_inbound"]
    assert set(inbound) <= {"dynamic_variables", "metadata"}
    variables = inbound["dynamic_variables"]
    assert all(isinstance(v, str) for v in variables.values())  # Retell's Dict[str, str]
    assert {"caller_memory", "returning_caller", "resume"} | {f"memory_{k}" for k in STATE_KEYS} <= set(
        variables
    )
    metadata = inbound.get("metadata")
    return variables, None if metadata is None else metadata["caller_memory_conversation"]


async def started(retell: Retell) -> str:
    """A call's inbound webhook answered: its conversation."""
    _, conversation = variables_of(await retell.inbound())
    assert conversation is not None
    return conversation


@pytest.mark.parametrize("analysis_first", [False, True])
async def test_a_call_is_remembered_and_the_next_call_gets_it(
    retell: Retell, analysis_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    variables, conversation = variables_of(await retell.inbound())
    assert conversation is not None and conversation.startswith("retell:")
    assert variables["returning_caller"] == "false" and variables["caller_memory"] == ""
    # Retell retries an inbound webhook it saw no answer to (signed anew): the same conversation.
    retell.clock.advance(3)
    again, retried = variables_of(await retell.inbound())
    assert retried == conversation and again == variables
    retell.clock.advance(95)
    call = retell.call("call_5dd1", conversation)
    assert (await retell.event("call_started", call)).body == {"outcome": "ignored"}
    ended, analyzed = ("call_ended", call), ("call_analyzed", call)
    first, second = (analyzed, ended) if analysis_first else (ended, analyzed)
    reply = await retell.event(*first)
    assert reply.status == 200
    assert reply.body == {"outcome": "ended" if analysis_first else "held", "conversation_id": conversation}
    # Retell retries an event whose answer it did not get: applied once.
    assert (await retell.event(*first)).body == {"outcome": "duplicate"}
    reply = await retell.event(*second)
    assert reply.body == {
        "outcome": "duplicate" if analysis_first else "ended",
        "conversation_id": conversation,
    }
    assert await retell.transcript(conversation) == [
        ("assistant", "Cheese shop, how can I help?"),
        ("user", "Hi, this is Ada. Do you have Brie?"),
        ("assistant", "We do, a ripe one."),
    ]
    status = await retell.status(conversation)
    assert status["ended_by"] == "explicit" and status["end_reason"] == "completed"
    assert await retell.summary(conversation) == ANALYSIS["call_summary"]
    assert await retell.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    (row,) = await retell.analytics()
    assert row["qa"] == "true"
    await eventually(lambda: len(retell.hook.events("conversation.ended")) == 1)
    (event,) = retell.hook.events("conversation.ended")
    assert event["data"]["conversation_id"] == conversation and event["data"]["source"] == "retell"
    # The analysis grace passes: nothing more happens.
    retell.clock.advance(601)
    await scheduled_inactivity_ends(retell.api.app)
    assert len(await retell.analytics()) == 1 and len(retell.hook.events("conversation.ended")) == 1
    # The caller calls again: the first call's fields as variables.
    retell.clock.advance(3600)
    variables, later = variables_of(await retell.inbound())
    assert later not in (None, conversation)
    assert variables["returning_caller"] == "true"
    assert variables["memory_caller_name"] == "Ada" and variables["memory_cheese"] == "Brie"
    assert '"caller_name":"Ada"' in variables["caller_memory"]
    digits = canonical_digits(CALLER)
    assert digits not in caplog.text and digits not in orjson.dumps(retell.hook.events()).decode()
    assert all(digits not in canonical_digits(v) for v in variables.values())


async def test_call_ended_alone_ends_the_call_after_the_analysis_grace(retell: Retell) -> None:
    conversation = await started(retell)
    retell.clock.advance(60)
    call = retell.call("call_a11", conversation, disconnection_reason="inactivity")
    assert (await retell.event("call_ended", call)).body["outcome"] == "held"
    retell.clock.advance(599)
    await scheduled_inactivity_ends(retell.api.app)
    assert (await retell.status(conversation))["status"] != "ended"
    retell.clock.advance(2)
    await scheduled_inactivity_ends(retell.api.app)
    status = await retell.status(conversation)
    assert status["ended_by"] == "explicit" and status["end_reason"] == "dropped"
    assert len(await retell.transcript(conversation)) == 3
    assert await retell.memory() == {}  # no analysis: nothing extracted
    # The analysis after the end: a duplicate, nothing twice.
    assert (await retell.event("call_analyzed", call)).body["outcome"] == "duplicate"
    assert len(await retell.analytics()) == 1


async def test_an_end_whose_inbound_never_arrived_starts_and_ends_one(retell: Retell) -> None:
    """An outbound call (no inbound webhook; the person is ``to_number``), and a call whose metadata was
    lost: the conversation is ``retell:<call_id>``."""
    call = retell.call("call_out7", None, direction="outbound", from_number=SHOP_NUMBER, to_number=CALLER)
    assert (await retell.event("call_ended", call)).body["outcome"] == "held"
    reply = await retell.event("call_analyzed", call)
    assert reply.body == {"outcome": "started_and_ended", "conversation_id": "retell:call_out7"}
    assert len(await retell.transcript("retell:call_out7")) == 3
    assert await retell.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    await eventually(lambda: len(retell.hook.events("conversation.ended")) == 1)


@pytest.mark.parametrize(
    ("reason", "destination", "end_reason", "handoff"),
    [
        ("agent_hangup", None, "completed", None),
        ("voicemail_reached", None, "completed", None),
        ("max_duration_reached", None, "dropped", None),
        ("error_llm_websocket_lost_connection", None, "dropped", None),
        ("call_transfer", "sip:cellar@shop.example;transport=tls", "transferred", "sip:cellar@shop.example"),
        ("call_transfer", "+14155550142", "transferred", None),
        ("a_reason_retell_adds_later", None, None, None),
    ],
)
async def test_each_class_of_disconnection_reason(
    retell: Retell, reason: str, destination: str | None, end_reason: str | None, handoff: str | None
) -> None:
    conversation = await started(retell)
    retell.clock.advance(60)
    call = retell.call("call_r1", conversation, disconnection_reason=reason, transfer_destination=destination)
    assert (await retell.event("call_analyzed", call)).body["outcome"] == "ended"
    assert (await retell.status(conversation)).get("end_reason") == end_reason
    (row,) = await retell.analytics()
    assert row["handoff_to"] == handoff


async def test_forged_unsigned_stale_and_replayed_webhooks_change_nothing(retell: Retell) -> None:
    now = retell.clock.now_ms()
    refused = [
        await retell.inbound(key="key_another_" + "0" * 20),
        await retell.inbound(sig=""),
        await retell.inbound(sig="v=1,d=" + "zz" * 32),
        await retell.inbound(at_ms=now - 5 * 60_000 - 1),
        await retell.inbound(at_ms=now + 5 * 60_000 + 1),
        await retell.event("call_analyzed", retell.call("call_f1", None), key="key_another_" + "0" * 20),
        await retell.event("call_analyzed", retell.call("call_f1", None), at_ms=now - 6 * 60_000),
    ]
    for reply in refused:
        assert reply.status == 401, reply.body
        assert API_KEY not in orjson.dumps(reply.body).decode()
    # An uppercase digest is refused, as retell-sdk's verify refuses it.
    body = orjson.dumps({"event": "call_analyzed", "call": retell.call("call_f1", None)})
    at, digest = signature(body, at_ms=now).split(",d=")
    assert (await retell.post(EVENTS, body, sig=f"{at},d={digest.upper()}")).status == 401
    assert await retell.conversations() == []
    assert len(await retell.analytics()) == 0
    # The event's id was not remembered: the genuine one is taken.
    assert (await retell.event("call_analyzed", retell.call("call_f1", None))).body["outcome"] == (
        "started_and_ended"
    )
    # The same signed inbound delivered again (a replay): answered without memory, nothing started.
    document = {"event": "call_inbound", "call_inbound": {"from_number": CALLER, "to_number": SHOP_NUMBER}}
    body = orjson.dumps(document)
    sent = signature(body, at_ms=retell.clock.now_ms())
    first, _ = variables_of(await retell.post(INBOUND, body, sig=sent))
    assert first["memory_caller_name"] == "Ada"
    replayed, none = variables_of(await retell.post(INBOUND, body, sig=sent))
    assert none is None and replayed["caller_memory"] == "" and replayed["memory_caller_name"] == ""
    assert len(await retell.conversations()) == 2  # the ended call and the first delivery's
    # Signed bodies that are not Retell's are named, never echoed; events Caller Memory does not use are
    # acknowledged.
    reply = await retell.post(INBOUND, {"event": "call_inbound", "call_inbound": {"from_number": [CALLER]}})
    assert reply.status == 422 and CALLER not in orjson.dumps(reply.body).decode()
    reply = await retell.post(EVENTS, {"event": "call_analyzed", "call": {"from_number": CALLER}})
    assert reply.status == 422 and CALLER not in orjson.dumps(reply.body).decode()
    assert (await retell.post(EVENTS, b"[1,2")).status == 400
    transcript_updated = {"event": "transcript_updated", "call": retell.call("call_f1", None)}
    assert (await retell.post(EVENTS, transcript_updated)).body == {"outcome": "ignored"}


async def test_a_one_mib_end_is_taken(retell: Retell) -> None:
    conversation = await started(retell)
    retell.clock.advance(60)
    words = [{"word": "cheese", "start": i / 10, "end": i / 10 + 0.05} for i in range(40)]
    utterances = [
        {"role": "user" if i % 2 else "agent", "content": f"Turn {i}: " + "more cheese " * 20, "words": words}
        for i in range(560)
    ]
    # One of them longer than a stored message may be: cut, never the end refused.
    utterances[7]["content"] = "cheese " * 3000
    call = retell.call("call_big", conversation, transcript_object=utterances)
    body = orjson.dumps({"event": "call_analyzed", "call": {"call_analysis": ANALYSIS} | call})
    assert len(body) >= 1 << 20
    reply = await retell.post(EVENTS, body)
    assert reply.status == 200 and reply.body["outcome"] == "ended", reply.body
    assert (await retell.status(conversation))["messages"] == 560


async def test_a_project_without_a_retell_connection_is_404(retell: Retell) -> None:
    reply = await retell.api.call("DELETE", f"{BASE}/platforms/retell", token=retell.admin)
    assert reply.status == 204
    assert (await retell.event("call_analyzed", retell.call("call_x", None))).status == 404


async def test_the_inbound_answer_fails_open_within_a_second_while_the_store_is_down(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stopped (SIGSTOP) after the connection was read once: the inbound webhook is still verified (the
    connection this process last read) and answered within a second, every variable there and empty; a
    forged one is still refused. A process that never read the connection answers without verifying: an
    answer that holds nothing."""
    caplog.set_level(logging.DEBUG)
    with RedisServer() as server:
        async with (
            receiver() as hook,
            running_api(
                server.url, clock, secret_key=secrets.token_bytes(32), **SETTINGS | {"store_timeout": 0.5}
            ) as api,
        ):
            retell = await connected(api, hook)
            variables_of(await retell.inbound("+14155550111"))  # reads the connection (and the project)
            os.kill(server.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                variables, conversation = variables_of(await retell.inbound())
                assert time.monotonic() - began < 1.0
                assert variables["caller_memory"] == "" and variables["memory_caller_name"] == ""
                assert variables["returning_caller"] == "false"
                assert conversation is not None and conversation.startswith("retell:")
                assert (await retell.inbound(key="key_another_" + "0" * 20)).status == 401
            finally:
                os.kill(server.pid, signal.SIGCONT)
    with RedisServer() as down:
        async with running_api(down.url, clock, store_timeout=0.5) as api:
            os.kill(down.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                reply = await Retell(api, "", "", Receiver()).inbound()
                assert time.monotonic() - began < 1.0
            finally:
                os.kill(down.pid, signal.SIGCONT)
            assert reply.status == 200
            assert reply.body == {
                "call_inbound": {
                    "dynamic_variables": {"caller_memory": "", "returning_caller": "false", "resume": ""}
                }
            }
    assert canonical_digits(CALLER) not in caplog.text
