"""Vapi's server messages through a real server on every backend (SPEC section 15; docs/vapi.md): signed as
Vapi's HMAC credential signs them by default (``x-signature``: the hex HMAC-SHA256 of ``{x-timestamp}.{body}``),
``assistant-request`` answered with the connection's assistant and the caller's memory as variables, the
``status-update`` (ended) and the ``end-of-call-report`` in either order making one end with the transcript,
the summary and the extracted state, one analytics record and one ``conversation.ended``; forged, unsigned,
stale and replayed messages are 401 and store nothing; the bearer mode takes a platform token only. The
payloads here are plain JSON in the shape of vapi-server-sdk 3.0.0's types (tests/vendors/test_vapi.py builds
them with the SDK itself)."""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, TEST_NUMBERS, Api, Reply, canonical_digits, running_api
from tests.http.test_webhooks import Receiver, eventually, receiver

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
SECRET = "vapi-hmac-secret-" + "v" * 16
ASSISTANT = "asst-5b1e9c"
EVENTS = f"{BASE}/platforms/vapi/events"
CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name", "cheese"],
            "retention": "P30D",
            "default_region": "US",
            "analytics_enabled": True,
        },
        "conversation": {"enabled": True},
    }
}
CONNECTION = {
    "secret": SECRET,
    "state_map": {"customerName": "caller_name", "order.cheese": "cheese"},
    "options": {"auth": "hmac", "assistant_id": ASSISTANT},
}
VARIABLES = {"caller_memory", "returning_caller", "resume", "memory_caller_name", "memory_cheese"}
#: ``artifact.messages`` of a call, as Vapi lists them (``bot`` for the assistant, text in ``message``).
ARTIFACT: list[dict[str, Any]] = [
    {"role": "system", "message": "You are the cheese shop's assistant.", "time": 1, "secondsFromStart": 0},
    {
        "role": "bot",
        "message": "Cheese shop, how can I help?",
        "time": 2,
        "endTime": 3,
        "secondsFromStart": 0.5,
    },
    {"role": "user", "message": "This is Ada, any Stilton?", "time": 4, "endTime": 5, "secondsFromStart": 2},
    {
        "role": "tool_calls",
        "toolCalls": [{"id": "t1", "type": "function", "function": {"name": "stock", "arguments": "{}"}}],
        "message": "",
        "time": 6,
        "secondsFromStart": 3,
    },
    {
        "role": "tool_call_result",
        "toolCallId": "t1",
        "name": "stock",
        "result": "in stock",
        "time": 7,
        "secondsFromStart": 3.5,
    },
    {"role": "bot", "message": "Yes, a ripe one.", "time": 8, "endTime": 9, "secondsFromStart": 4},
]
SAID = [
    ("assistant", "Cheese shop, how can I help?"),
    ("user", "This is Ada, any Stilton?"),
    ("tool", "in stock"),
    ("assistant", "Yes, a ripe one."),
]
STRUCTURED = {"customerName": "Ada", "order": {"cheese": "Stilton"}}


def sign(body: bytes, timestamp: str, secret: str = SECRET) -> str:
    """Vapi's HMAC credential's default: hex HMAC-SHA256 of ``{timestamp}.{body}``."""
    return hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def iso(ms: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class Vapi:
    api: Api
    admin: str
    agent: str
    hook: Receiver
    calls: list[str] = field(default_factory=list)

    # Payloads ----------------------------------------------------------------------------------------------

    def call(self, call_id: str, number: str | None = CALLER) -> dict[str, Any]:
        now = iso(self.api.clock.now_ms())
        made: dict[str, Any] = {
            "id": call_id,
            "orgId": "org-1",
            "createdAt": now,
            "updatedAt": now,
            "type": "inboundPhoneCall",
        }
        if number is not None:
            made["customer"] = {"number": number}
        return made

    def assistant_request(self, call_id: str, number: str | None = CALLER) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": "assistant-request",
            "timestamp": self.api.clock.now_ms(),
            "call": self.call(call_id, number),
            "phoneNumber": {"id": "pn-1", "number": "+14155550199", "provider": "vapi"},
        }
        if number is not None:
            message["customer"] = {"number": number}
        return {"message": message}

    def status_ended(self, call_id: str, reason: str = "customer-ended-call") -> dict[str, Any]:
        return {
            "message": {
                "type": "status-update",
                "status": "ended",
                "endedReason": reason,
                "timestamp": self.api.clock.now_ms(),
                "call": self.call(call_id),
                "customer": {"number": CALLER},
            }
        }

    def report(
        self,
        call_id: str,
        reason: str = "customer-ended-call",
        *,
        messages: list[dict[str, Any]] | None = None,
        destination: dict[str, Any] | None = None,
        structured: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        now = self.api.clock.now_ms()
        message: dict[str, Any] = {
            "type": "end-of-call-report",
            "endedReason": reason,
            "timestamp": now,
            "startedAt": iso(now - 90_000),
            "endedAt": iso(now - 1_000),
            "artifact": {"messages": ARTIFACT if messages is None else messages, "transcript": "..."},
            "analysis": {
                "summary": "Ada asked for Stilton; we have it.",
                "structuredData": STRUCTURED if structured is None else structured,
            },
            "call": self.call(call_id),
            "customer": {"number": CALLER},
        }
        if destination is not None:
            message["destination"] = destination
        return {"message": message}

    # Sending -----------------------------------------------------------------------------------------------

    async def send(
        self,
        payload: dict[str, Any] | bytes,
        *,
        secret: str = SECRET,
        timestamp: str | None = None,
        signature: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        stamp = str(self.api.clock.now_ms()) if timestamp is None else timestamp
        sent = {"Content-Type": "application/json", "x-timestamp": stamp}
        sent["x-signature"] = sign(body, stamp, secret) if signature is None else signature
        if len(body) < 256 * 1024:
            return await self.api.call("POST", EVENTS, data=body, headers=sent | (headers or {}))
        # A large body streamed (aiohttp's client warns of one sent as bytes).
        url = self.api.base_url + EVENTS
        async with self.api.session.post(url, data=io.BytesIO(body), headers=sent) as resp:
            return Reply(resp.status, resp.headers.copy(), orjson.loads(await resp.read()), resp.content_type)

    # Reading -----------------------------------------------------------------------------------------------

    async def transcript(self, call_id: str) -> list[tuple[str, str]]:
        reply = await self.api.call(
            "GET", f"{BASE}/conversations/vapi:{call_id}/history?limit=1000", token=self.agent
        )
        assert reply.status == 200, reply.body
        return [(m["role"], m["content"]) for m in reply.body["contents"]]

    async def status(self, call_id: str) -> Reply:
        return await self.api.call("GET", f"{BASE}/conversations/vapi:{call_id}", token=self.agent)

    async def memory(self) -> dict[str, Any]:
        reply = await self.api.call("GET", f"{BASE}/callers/{CALLER}/memory", token=self.agent)
        if reply.status == 404:
            return {}
        assert reply.status == 200, reply.body
        fields: dict[str, Any] = reply.body["fields"]
        return fields

    async def analytics(self) -> list[dict[str, Any]]:
        reply = await self.api.call(
            "GET", f"{BASE}/analytics/conversations?from=2000-01-01", token=self.admin
        )
        assert reply.status == 200, reply.body
        found: list[dict[str, Any]] = reply.body["conversations"]
        return found


async def open_vapi(api: Api, hook: Receiver, connection: dict[str, Any] | None = None) -> Vapi:
    reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    admin, agent = await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent")
    reply = await api.call("PUT", f"{BASE}/platforms/vapi", token=admin, json=connection or CONNECTION)
    assert reply.status == 201, reply.body
    reply = await api.call(
        "POST", f"{BASE}/webhooks", token=admin, json={"url": hook.url, "events": ["conversation.ended"]}
    )
    assert reply.status == 201, reply.body
    return Vapi(api, admin, agent, hook)


def vapi_settings(**overrides: Any) -> dict[str, Any]:
    return {
        "store_timeout": 5.0,
        "secret_key": secrets.token_bytes(32),
        "webhook_allow_hosts": ("127.0.0.1",),
        "webhook_interval": 0.05,
        "webhook_timeout": 1.0,
        **overrides,
    }


@pytest.fixture
async def vapi(store_url: str, clock: FakeClock) -> AsyncIterator[Vapi]:
    async with receiver() as hook, running_api(store_url, clock, **vapi_settings()) as api:
        yield await open_vapi(api, hook)


def no_number(*documents: Any) -> bool:
    text = orjson.dumps(documents).decode()
    return not TEST_NUMBERS.search(canonical_digits(text))


# ------------------------------------------------------------------------------------------------------------


async def test_a_returning_callers_second_call_gets_the_first_calls_fields(
    vapi: Vapi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    first = str(uuid.uuid4())
    reply = await vapi.send(vapi.assistant_request(first))
    assert reply.status == 200, reply.body
    assert reply.body["assistantId"] == ASSISTANT
    variables = reply.body["assistantOverrides"]["variableValues"]
    assert set(variables) == VARIABLES
    assert variables["returning_caller"] == "false" and variables["memory_cheese"] == ""
    vapi.api.clock.advance(90)
    assert (await vapi.send(vapi.status_ended(first))).body == {
        "outcome": "held",
        "conversation_id": f"vapi:{first}",
    }
    reply = await vapi.send(vapi.report(first))
    assert reply.body == {"outcome": "ended", "conversation_id": f"vapi:{first}"}, reply.body
    assert await vapi.transcript(first) == SAID  # no system message, no tool call; bot -> assistant
    status = (await vapi.status(first)).body
    assert status["ended_by"] == "explicit" and status["end_reason"] == "completed"
    assert await vapi.memory() == {"caller_name": "Ada", "cheese": "Stilton"}

    vapi.api.clock.advance(3600)
    second = str(uuid.uuid4())
    reply = await vapi.send(vapi.assistant_request(second))
    variables = reply.body["assistantOverrides"]["variableValues"]
    assert variables["returning_caller"] == "true"
    assert variables["memory_caller_name"] == "Ada" and variables["memory_cheese"] == "Stilton"
    assert '"cheese":"Stilton"' in variables["caller_memory"]
    assert no_number(reply.body)
    assert CALLER[2:] not in caplog.text


async def test_the_summary_is_the_conversations_and_a_number_never_a_handoff_label(vapi: Vapi) -> None:
    call_id = str(uuid.uuid4())
    await vapi.send(vapi.assistant_request(call_id))
    destination = {"type": "number", "number": "+14155550142"}
    reply = await vapi.send(vapi.report(call_id, "assistant-forwarded-call", destination=destination))
    assert reply.body["outcome"] == "ended"
    reply = await vapi.api.call("GET", f"{BASE}/conversations/vapi:{call_id}/context", token=vapi.agent)
    assert reply.status == 200, reply.body
    assert reply.body["sections"]["summary"]["text"] == "Ada asked for Stilton; we have it.", reply.body
    status = (await vapi.status(call_id)).body
    assert status["end_reason"] == "transferred"
    (record,) = await vapi.analytics()
    assert record.get("handoff_to") is None and no_number(record)


@pytest.mark.parametrize("status_first", [True, False])
async def test_both_orders_of_the_end_messages_make_one_end(vapi: Vapi, status_first: bool) -> None:
    call_id = str(uuid.uuid4())
    await vapi.send(vapi.assistant_request(call_id))
    vapi.api.clock.advance(60)
    status, report = vapi.status_ended(call_id), vapi.report(call_id)
    first, second = (status, report) if status_first else (report, status)
    assert (await vapi.send(first)).body["outcome"] == ("held" if status_first else "ended")
    assert (await vapi.send(second)).body["outcome"] == ("ended" if status_first else "duplicate")
    # Vapi sending either again (signed anew): nothing twice.
    for again in (status, report):
        assert (await vapi.send(again, timestamp=str(vapi.api.clock.now_ms() + 1))).body[
            "outcome"
        ] == "duplicate"
    assert await vapi.transcript(call_id) == SAID
    assert len(await vapi.analytics()) == 1
    await eventually(lambda: len(vapi.hook.events("conversation.ended")) == 1)
    (event,) = vapi.hook.events("conversation.ended")
    assert event["data"]["conversation_id"] == f"vapi:{call_id}" and event["data"]["source"] == "vapi"
    assert no_number(vapi.hook.events())


async def test_a_status_update_alone_ends_the_call_after_the_analysis_grace(vapi: Vapi) -> None:
    from caller_memory.service.app import scheduled_inactivity_ends

    call_id = str(uuid.uuid4())
    await vapi.send(vapi.assistant_request(call_id))
    assert (await vapi.send(vapi.status_ended(call_id, "silence-timed-out"))).body["outcome"] == "held"
    vapi.api.clock.advance(601)
    await scheduled_inactivity_ends(vapi.api.app)
    status = (await vapi.status(call_id)).body
    assert status["ended_by"] == "explicit" and status["end_reason"] == "dropped"
    assert len(await vapi.analytics()) == 1


async def test_retried_call_starts_make_one_conversation(vapi: Vapi) -> None:
    call_id = str(uuid.uuid4())
    request = vapi.assistant_request(call_id)
    answers = [await vapi.send(request, timestamp=str(vapi.api.clock.now_ms() + n)) for n in range(3)]
    assert all(a.status == 200 for a in answers)
    assert answers[0].body == answers[1].body == answers[2].body
    reply = await vapi.send(vapi.report(call_id))
    assert reply.body["outcome"] == "ended"
    assert len(await vapi.analytics()) == 1


async def test_an_end_with_no_start_starts_and_ends_one_conversation(vapi: Vapi) -> None:
    call_id = str(uuid.uuid4())
    assert (await vapi.send(vapi.status_ended(call_id))).body["outcome"] == "held"
    reply = await vapi.send(vapi.report(call_id))
    assert reply.body["outcome"] == "started_and_ended", reply.body
    assert await vapi.transcript(call_id) == SAID
    assert await vapi.memory() == {"caller_name": "Ada", "cheese": "Stilton"}
    assert len(await vapi.analytics()) == 1
    await eventually(lambda: len(vapi.hook.events("conversation.ended")) == 1)


async def test_a_one_mib_end_of_call_report_is_taken(vapi: Vapi) -> None:
    call_id = str(uuid.uuid4())
    await vapi.send(vapi.assistant_request(call_id))
    line = "We have Stilton, Brie and Gouda today. " * 25
    messages = [
        {"role": "user" if n % 2 else "bot", "message": f"{n} {line}", "time": n, "secondsFromStart": n}
        for n in range(1100)
    ]
    payload = vapi.report(call_id, messages=messages)
    assert len(orjson.dumps(payload)) > 1024 * 1024
    reply = await vapi.send(payload)
    assert reply.status == 200 and reply.body["outcome"] == "ended", reply.body
    assert (await vapi.status(call_id)).body["messages"] == 1100


@pytest.mark.parametrize(
    ("ended_reason", "expected"),
    [
        ("customer-ended-call", "completed"),
        ("assistant-said-end-call-phrase", "completed"),
        ("call.in-progress.twilio-completed-call", "completed"),
        ("assistant-forwarded-call", "transferred"),
        ("call.ending.hook-executed-transfer", "transferred"),
        ("silence-timed-out", "dropped"),
        ("pipeline-error-openai-llm-failed", "dropped"),
        ("phone-call-provider-closed-websocket", "dropped"),
        ("voicemail", None),
        ("hangup", None),  # the docs' example, not in the enum: no class
    ],
)
async def test_each_class_of_ended_reason(vapi: Vapi, ended_reason: str, expected: str | None) -> None:
    call_id = str(uuid.uuid4())
    await vapi.send(vapi.assistant_request(call_id))
    destination = {"type": "sip", "sipUri": "sip:desk@example.com", "name": "billing desk"}
    reply = await vapi.send(vapi.report(call_id, ended_reason, destination=destination))
    assert reply.body["outcome"] == "ended"
    status = (await vapi.status(call_id)).body
    assert status.get("end_reason") == expected, status
    (record,) = await vapi.analytics()
    assert record["handoff_to"] == "billing desk", record


async def test_forged_unsigned_stale_and_replayed_messages_are_refused_and_change_nothing(vapi: Vapi) -> None:
    call_id = str(uuid.uuid4())
    now = vapi.api.clock.now_ms()
    request = vapi.assistant_request(call_id)
    refused = [
        await vapi.send(request, secret="another-secret-entirely-0000"),
        await vapi.send(request, signature=""),
        await vapi.send(request, signature="zz" * 32),
        await vapi.send(request, timestamp=str(now - 6 * 60_000)),
        await vapi.send(request, timestamp=str(now + 6 * 60_000)),
        await vapi.send(request, timestamp=str((now - 6 * 60_000) // 1000)),  # seconds, too old
        await vapi.send(request, timestamp="not a time"),
        await vapi.send(vapi.report(call_id), secret="another-secret-entirely-0000"),
    ]
    for reply in refused:
        assert reply.status == 401, reply.body
        assert SECRET not in orjson.dumps(reply.body).decode() and no_number(reply.body)
    assert (await vapi.status(call_id)).status == 404 and await vapi.memory() == {}
    # The same time in seconds and as ISO 8601 are Vapi's too; a message sent twice exactly is a replay.
    assert (await vapi.send(request, timestamp=str(now // 1000))).status == 200
    stamp = str(now + 5)
    assert (await vapi.send(request, timestamp=stamp)).status == 200
    replayed = await vapi.send(request, timestamp=stamp)
    assert replayed.status == 401 and "replay" in replayed.body["detail"]
    assert (await vapi.send(request, timestamp=iso(now + 7))).status == 200
    # A signed body that is not a server message is named, never echoed; one Caller Memory does not use is
    # acknowledged.
    reply = await vapi.send({"message": {"call": {"customer": {"number": CALLER}}}})
    assert reply.status == 422 and no_number(reply.body)
    reply = await vapi.send({"message": {"type": "end-of-call-report", "call": {"id": "a b/c"}}})
    assert reply.status == 422 and reply.body["errors"][0]["field"] == "message.call.id", reply.body
    for kind in ("conversation-update", "speech-update", "transcript", "hang", "tool-calls"):
        assert (await vapi.send({"message": {"type": kind, "call": {"id": call_id}}})).body == {
            "outcome": "ignored"
        }
    status = vapi.status_ended(call_id)
    status["message"]["status"] = "in-progress"
    assert (await vapi.send(status)).body == {"outcome": "ignored"}


async def test_a_web_call_without_a_number_gets_the_variables_without_memory(vapi: Vapi) -> None:
    reply = await vapi.send(vapi.assistant_request(str(uuid.uuid4()), number=None))
    assert reply.status == 200
    assert reply.body["assistantId"] == ASSISTANT
    assert set(reply.body["assistantOverrides"]["variableValues"]) == VARIABLES


async def test_the_bearer_mode_takes_a_platform_token_only(store_url: str, clock: FakeClock) -> None:
    bearer = {"state_map": CONNECTION["state_map"], "options": {"auth": "bearer", "assistant_id": ASSISTANT}}
    async with receiver() as hook, running_api(store_url, clock, **vapi_settings()) as api:
        vapi = await open_vapi(api, hook, bearer)
        platform = await api.mint(PROJECT, "platform")
        call_id = str(uuid.uuid4())
        body = orjson.dumps(vapi.assistant_request(call_id))
        json = {"Content-Type": "application/json"}
        assert (await api.call("POST", EVENTS, data=body, headers=json)).status == 401
        assert (await api.call("POST", EVENTS, data=body, headers=json, token=vapi.agent)).status == 403
        assert (await api.call("POST", EVENTS, data=body, headers=json, token=vapi.admin)).status == 403
        reply = await api.call("POST", EVENTS, data=body, headers=json, token=platform)
        assert reply.status == 200 and reply.body["assistantId"] == ASSISTANT
        # A fixed credential: the same request again is taken (replayable, as documented).
        again = await api.call("POST", EVENTS, data=body, headers=json, token=platform)
        assert again.status == 200 and again.body == reply.body
        reply = await api.call(
            "POST", EVENTS, data=orjson.dumps(vapi.report(call_id)), headers=json, token=platform
        )
        assert reply.body["outcome"] == "ended"
        assert await vapi.memory() == {"caller_name": "Ada", "cheese": "Stilton"}


async def test_a_project_without_a_vapi_connection_is_404(vapi: Vapi) -> None:
    assert (await vapi.api.call("DELETE", f"{BASE}/platforms/vapi", token=vapi.admin)).status == 204
    assert (await vapi.send(vapi.assistant_request(str(uuid.uuid4())))).status == 404
