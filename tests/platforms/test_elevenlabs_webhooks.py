"""ElevenLabs Agents' webhooks through a real server on every backend (SPEC section 15; docs/elevenlabs.md): the
initiation webhook answers every agent variable with the caller's memory within its second, a retried
initiation makes one conversation; the post-call webhooks, signed as ElevenLabs signs them, end the call once
with its transcript, summary and data collection (one analytics record, one ``conversation.ended``), an end
with no start starts one; forged, replayed, stale and future signatures are 401 and store nothing; the
initiation fails open with every variable while the store is down; no number anywhere.

:class:`Eleven` builds ElevenLabs' payloads as plain JSON; tests/vendors/test_elevenlabs.py builds them with
the ``elevenlabs`` SDK's own types and checks the signature with its own helper."""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, TEST_NUMBERS, Api, Reply, canonical_digits, running_api
from tests.http.test_webhooks import Receiver, eventually, receiver
from tests.support.redis_server import RedisServer

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
AGENT_NUMBER = "+14155550199"
SECRET = "wsec_" + "e" * 40
INITIATION = f"{BASE}/platforms/elevenlabs/initiation"
EVENTS = f"{BASE}/platforms/elevenlabs/events"
#: The variables the agent defines (its prompt's {{...}}): ours, and one of the business's own.
AGENT_VARIABLES = ["caller_memory", "memory_caller_name", "returning_caller", "store_hours"]
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
    "state_map": {"customer_name": "caller_name", "favourite_cheese": "cheese"},
    "options": {"agent_variables": AGENT_VARIABLES},
}
TRANSCRIPT: list[dict[str, Any]] = [
    {"role": "agent", "message": "Cheese shop, how can I help?", "time_in_call_secs": 0},
    {"role": "user", "message": "This is Ada. Do you have Brie?", "time_in_call_secs": 3},
    {
        "role": "agent",
        "message": None,
        "time_in_call_secs": 5,
        "tool_calls": [{"tool_name": "lookup", "params_as_json": '{"number": "+14155550100"}'}],
    },
    {
        "role": "agent",
        "message": "We do, a ripe",
        "original_message": "We do, a ripe one from Meaux.",
        "interrupted": True,
        "time_in_call_secs": 7,
    },
    {"role": "user", "message": "Great, I'll come by.", "time_in_call_secs": 9},
]


def sign(body: bytes, secret: str = SECRET, at: int | None = None) -> str:
    """``ElevenLabs-Signature`` as ElevenLabs makes it: t=<unix s>,v0=<hex HMAC-SHA256 of '<t>.<body>'>."""
    stamp = str(int(time.time()) if at is None else at)
    digest = hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={stamp},v0={digest}"


@dataclass
class Eleven:
    api: Api
    admin: str
    agent: str
    platform: str
    hook: Receiver

    async def initiate(self, caller: str = CALLER, *, token: str | None = None) -> Any:
        body = {
            "caller_id": caller,
            "agent_id": "agent_01jz" + "a" * 22,
            "called_number": AGENT_NUMBER,
            "call_sid": "CA" + uuid.uuid4().hex,
        }
        return await self.api.call("POST", INITIATION, token=token or self.platform, json=body)

    def conversation_data(
        self,
        conversation: str | None,
        *,
        transcript: list[dict[str, Any]] | None = None,
        termination_reason: str | None = "Call ended by remote party",
        status: str = "done",
        call_result: str | None = None,
        caller: str = CALLER,
    ) -> dict[str, Any]:
        """``GetConversationResponseModel`` as JSON (the post-call webhook's ``data``)."""
        start = self.api.clock.now_ms() // 1000 - 60
        phone_call: dict[str, Any] = {
            "type": "twilio",
            "direction": "inbound",
            "phone_number_id": "phnum_01",
            "agent_number": AGENT_NUMBER,
            "external_number": caller,
            "stream_sid": "MZ" + "0" * 32,
            "call_sid": "CA" + "1" * 32,
        }
        if call_result is not None:
            phone_call["call_result"] = call_result
        metadata: dict[str, Any] = {
            "start_time_unix_secs": start,
            "call_duration_secs": 55,
            "phone_call": phone_call,
        }
        if termination_reason is not None:
            metadata["termination_reason"] = termination_reason
        data: dict[str, Any] = {
            "agent_id": "agent_01jz" + "a" * 22,
            "conversation_id": "conv_" + uuid.uuid4().hex,
            "status": status,
            "has_audio": True,
            "has_user_audio": True,
            "has_response_audio": True,
            "has_auxiliary_audio": False,
            "transcript": TRANSCRIPT if transcript is None else transcript,
            "metadata": metadata,
            "analysis": {
                "call_successful": "success",
                "transcript_summary": "Ada asked for Brie and will come by.",
                "data_collection_results": {
                    "customer_name": {
                        "data_collection_id": "customer_name",
                        "value": "Ada",
                        "rationale": "She said so.",
                    },
                    "favourite_cheese": {
                        "data_collection_id": "favourite_cheese",
                        "value": "Brie",
                        "rationale": "Asked for it.",
                    },
                },
            },
        }
        if conversation is not None:
            data["conversation_initiation_client_data"] = {
                "dynamic_variables": {"caller_memory_conversation": conversation, "store_hours": ""},
                "custom_llm_extra_body": {"caller_memory_conversation": conversation},
            }
        return data

    def event(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "event_timestamp": self.api.clock.now_ms() // 1000, "data": data}

    async def send(
        self, event: dict[str, Any] | bytes, *, signature: str | None = None, at: int | None = None
    ) -> Any:
        body = event if isinstance(event, bytes) else orjson.dumps(event)
        sent = sign(body, at=at if at is not None else self.api.clock.now_ms() // 1000)
        headers = {"Content-Type": "application/json"}
        if signature != "":
            headers["ElevenLabs-Signature"] = sent if signature is None else signature
        if len(body) < 512 * 1024:
            return await self.api.call("POST", EVENTS, data=body, headers=headers)
        # A large body as a stream (aiohttp warns of raw bytes that size).
        async with self.api.session.post(
            self.api.base_url + EVENTS, data=io.BytesIO(body), headers=headers
        ) as r:
            return Reply(r.status, r.headers.copy(), orjson.loads(await r.read()), r.content_type)

    async def transcript(self, conversation: str) -> list[dict[str, Any]]:
        """Every message of the conversation's history (its pages followed)."""
        found: list[dict[str, Any]] = []
        after = ""
        while True:
            path = f"{BASE}/conversations/{conversation}/history?limit=500{after}"
            reply = await self.api.call("GET", path, token=self.agent)
            assert reply.status == 200, reply.body
            found.extend(reply.body["contents"])
            if reply.body["next_after_turn"] is None:
                return found
            after = f"&after_turn={reply.body['next_after_turn']}"

    async def status(self, conversation: str) -> Any:
        return await self.api.call("GET", f"{BASE}/conversations/{conversation}", token=self.agent)

    async def memory(self) -> dict[str, Any]:
        reply = await self.api.call("GET", f"{BASE}/callers/{CALLER}/memory", token=self.agent)
        assert reply.status == 200, reply.body
        found: dict[str, Any] = reply.body["fields"]
        return found

    async def analytics(self) -> list[dict[str, Any]]:
        reply = await self.api.call(
            "GET", f"{BASE}/analytics/conversations?from=2000-01-01", token=self.admin
        )
        assert reply.status == 200, reply.body
        found: list[dict[str, Any]] = reply.body["conversations"]
        return found


async def open_eleven(api: Api, hook: Receiver) -> Eleven:
    reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    admin, agent = await api.mint(PROJECT, "admin"), await api.mint(PROJECT, "agent")
    platform = await api.mint(PROJECT, "platform")
    reply = await api.call("PUT", f"{BASE}/platforms/elevenlabs", token=admin, json=CONNECTION)
    assert reply.status == 201, reply.body
    reply = await api.call(
        "POST", f"{BASE}/webhooks", token=admin, json={"url": hook.url, "events": ["conversation.ended"]}
    )
    assert reply.status == 201, reply.body
    return Eleven(api, admin, agent, platform, hook)


def eleven_settings(**overrides: Any) -> dict[str, Any]:
    return {
        "store_timeout": 5.0,
        "secret_key": secrets.token_bytes(32),
        "webhook_allow_hosts": ("127.0.0.1",),
        "webhook_interval": 0.05,
        "webhook_timeout": 1.0,
        **overrides,
    }


@pytest.fixture
async def eleven(store_url: str, clock: FakeClock) -> AsyncIterator[Eleven]:
    async with receiver() as hook, running_api(store_url, clock, **eleven_settings()) as api:
        yield await open_eleven(api, hook)


def assert_initiation_answer(body: Any, conversation: str | None = None) -> dict[str, str]:
    """The shape ElevenLabs reads, with every agent variable, all strings."""
    assert set(body) == {"type", "dynamic_variables", "custom_llm_extra_body"}
    assert body["type"] == "conversation_initiation_client_data"
    variables: dict[str, str] = body["dynamic_variables"]
    assert set(AGENT_VARIABLES) <= set(variables)
    assert {"caller_memory", "returning_caller", "resume", "memory_caller_name", "memory_cheese"} <= set(
        variables
    )
    assert all(isinstance(v, str) for v in variables.values())
    named = variables["caller_memory_conversation"]
    assert named.startswith("elevenlabs:") and (conversation is None or named == conversation)
    assert body["custom_llm_extra_body"] == {"caller_memory_conversation": named}
    assert not TEST_NUMBERS.search(canonical_digits(orjson.dumps(body).decode()))
    return variables


async def test_a_returning_caller_gets_the_first_calls_fields_as_variables(
    eleven: Eleven, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    reply = await eleven.initiate()
    assert reply.status == 200, reply.body
    first = assert_initiation_answer(reply.body)
    conversation = first["caller_memory_conversation"]
    assert (
        first["returning_caller"] == "false"
        and first["memory_caller_name"] == ""
        and first["store_hours"] == ""
    )
    eleven.api.clock.advance(60)
    reply = await eleven.send(eleven.event("post_call_transcription", eleven.conversation_data(conversation)))
    assert reply.status == 200 and reply.body == {"outcome": "ended", "conversation_id": conversation}
    # The transcript: agent -> assistant, the tool call never, the interrupted turn with what was meant.
    said = await eleven.transcript(conversation)
    assert [(m["role"], m["content"]) for m in said] == [
        ("assistant", "Cheese shop, how can I help?"),
        ("user", "This is Ada. Do you have Brie?"),
        ("assistant", "We do, a ripe"),
        ("user", "Great, I'll come by."),
    ]
    assert (
        said[2]["metadata"] | {"interrupted": True, "original": "We do, a ripe one from Meaux."}
        == said[2]["metadata"]
    )
    status = (await eleven.status(conversation)).body
    assert status["ended_by"] == "explicit" and status["end_reason"] == "completed"
    assert status["summary"]["through_turn"] == 2  # the summary, of the call's turns
    assert await eleven.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    assert len(await eleven.analytics()) == 1
    await eventually(lambda: len(eleven.hook.events("conversation.ended")) == 1)
    (ended,) = eleven.hook.events("conversation.ended")
    assert ended["data"]["conversation_id"] == conversation and ended["data"]["source"] == "elevenlabs"

    eleven.api.clock.advance(3600)
    reply = await eleven.initiate()
    second = assert_initiation_answer(reply.body)
    assert second["caller_memory_conversation"] != conversation
    assert second["returning_caller"] == "true" and second["memory_caller_name"] == "Ada"
    assert '"caller_name":"Ada"' in second["caller_memory"] and second["memory_cheese"] == "Brie"
    digits = canonical_digits(CALLER)
    assert digits not in canonical_digits(caplog.text)
    assert digits not in canonical_digits(orjson.dumps(eleven.hook.events()).decode())


async def test_a_retried_initiation_is_answered_from_the_same_conversation(eleven: Eleven) -> None:
    first = assert_initiation_answer((await eleven.initiate()).body)
    eleven.api.clock.advance(20)
    again = assert_initiation_answer((await eleven.initiate()).body)
    assert again["caller_memory_conversation"] == first["caller_memory_conversation"]
    eleven.api.clock.advance(61)
    later = assert_initiation_answer((await eleven.initiate()).body)
    assert later["caller_memory_conversation"] != first["caller_memory_conversation"]


async def test_an_end_with_no_start_starts_and_ends_one_and_a_1_mib_end_is_taken(eleven: Eleven) -> None:
    long_turns = [
        {"role": "user" if i % 2 else "agent", "message": f"turn {i} " + "x" * 1000, "time_in_call_secs": i}
        for i in range(1100)
    ]
    data = eleven.conversation_data(None, transcript=long_turns)
    event = orjson.dumps(eleven.event("post_call_transcription", data))
    assert len(event) > 1024 * 1024
    reply = await eleven.send(event)
    conversation = f"elevenlabs:{data['conversation_id']}"
    assert reply.status == 200 and reply.body == {
        "outcome": "started_and_ended",
        "conversation_id": conversation,
    }
    assert len(await eleven.transcript(conversation)) == 1100
    assert await eleven.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    assert len(await eleven.analytics()) == 1
    await eventually(lambda: len(eleven.hook.events("conversation.ended")) == 1)


async def test_forged_replayed_stale_and_future_signatures_are_refused_and_change_nothing(
    eleven: Eleven,
) -> None:
    conversation = assert_initiation_answer((await eleven.initiate()).body)["caller_memory_conversation"]
    event = eleven.event("post_call_transcription", eleven.conversation_data(conversation))
    body = orjson.dumps(event)
    now = eleven.api.clock.now_ms() // 1000
    refused = [
        await eleven.send(body, signature=""),
        await eleven.send(body, signature=sign(body, "another-secret-entirely")),
        await eleven.send(body, signature=f"t={now},v0=" + "0" * 64),
        await eleven.send(body, signature="v0=" + sign(body).split("v0=")[1]),
        await eleven.send(body, signature="garbage"),
        await eleven.send(body, at=now - 31 * 60),
        await eleven.send(body, at=now + 6 * 60),
        await eleven.send(body + b" ", signature=sign(body, at=now)),
    ]
    for reply in refused:
        assert reply.status == 401, reply.body
        assert SECRET not in orjson.dumps(reply.body).decode()
    assert (await eleven.status(conversation)).body["status"] != "ended"
    # Within the window (29 minutes old, 4 minutes ahead), and then the same event again: a replay.
    assert (await eleven.send(body, at=now - 29 * 60)).body["outcome"] == "ended"
    replay = await eleven.send(body, at=now + 4 * 60)
    assert replay.status == 401
    assert len(await eleven.analytics()) == 1
    # Signed, but not an ElevenLabs webhook: named, never echoed.
    reply = await eleven.send(orjson.dumps({"data": {"x": CALLER}}))
    assert reply.status == 422 and CALLER not in orjson.dumps(reply.body).decode()
    reply = await eleven.send(b"[1, 2]")
    assert reply.status == 422


async def test_call_initiation_failure_ends_a_started_call_as_dropped(eleven: Eleven) -> None:
    conversation = assert_initiation_answer((await eleven.initiate()).body)["caller_memory_conversation"]
    data = {
        "agent_id": "agent_01jz" + "a" * 22,
        "conversation_id": "conv_" + uuid.uuid4().hex,
        "failure_reason": "no-answer",
        "metadata": {"type": "twilio", "body": {"From": CALLER, "CallStatus": "no-answer"}},
        "conversation_initiation_client_data": {
            "dynamic_variables": {"caller_memory_conversation": conversation}
        },
    }
    reply = await eleven.send(eleven.event("call_initiation_failure", data))
    assert reply.status == 200 and reply.body == {"outcome": "ended", "conversation_id": conversation}
    status = (await eleven.status(conversation)).body
    assert status["ended_by"] == "explicit" and status["end_reason"] == "dropped"
    assert await eleven.transcript(conversation) == []
    # A failure naming no conversation Caller Memory started: nothing made (no number to start one with).
    stranger = {**data, "conversation_id": "conv_x", "conversation_initiation_client_data": None}
    reply = await eleven.send(eleven.event("call_initiation_failure", stranger))
    assert reply.body["outcome"] == "ignored"
    assert (await eleven.status("elevenlabs:conv_x")).status == 404
    # Audio (sent in chunks) and unknown events: acknowledged, nothing stored.
    audio = {"type": "post_call_audio", "data": {"conversation_id": "conv_x", "full_audio": "AAAA"}}
    assert (await eleven.send(audio)).body == {"outcome": "ignored"}
    assert (await eleven.send(audio)).body == {"outcome": "ignored"}
    assert (await eleven.send({"type": "something_new", "data": {}})).body == {"outcome": "ignored"}
    assert len(await eleven.analytics()) == 1


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"termination_reason": "Call ended by remote party"}, "completed"),
        ({"termination_reason": "end_call tool was called."}, "completed"),
        ({"termination_reason": "transfer_to_number tool was called."}, "transferred"),
        ({"termination_reason": "Ending conversation after 40 seconds of silence."}, "dropped"),
        ({"termination_reason": None, "call_result": "voicemail"}, "dropped"),
        ({"termination_reason": None, "status": "failed"}, "dropped"),
        ({"termination_reason": "Something new"}, None),
    ],
)
async def test_each_end_reason_class_through_the_server(
    eleven: Eleven, kwargs: dict[str, Any], expected: str | None
) -> None:
    conversation = assert_initiation_answer((await eleven.initiate()).body)["caller_memory_conversation"]
    reply = await eleven.send(
        eleven.event("post_call_transcription", eleven.conversation_data(conversation, **kwargs))
    )
    assert reply.body["outcome"] == "ended", reply.body
    assert (await eleven.status(conversation)).body.get("end_reason") == expected


async def test_the_initiation_takes_a_platform_token_of_its_project(eleven: Eleven) -> None:
    assert (await eleven.initiate(token=eleven.agent)).status == 403
    reply = await eleven.api.call("POST", INITIATION, json={"caller_id": CALLER})
    assert reply.status == 401
    reply = await eleven.api.call(
        "POST", INITIATION, token=eleven.platform, data=b"[]", headers={"Content-Type": "application/json"}
    )
    assert reply.status == 422
    reply = await eleven.api.call("POST", INITIATION, token=eleven.platform, json={"caller_id": 415})
    assert reply.status == 422 and "415" not in orjson.dumps(reply.body).decode()
    # A caller withheld: a call without memory, every variable there all the same.
    variables = assert_initiation_answer((await eleven.initiate("anonymous")).body)
    assert variables["returning_caller"] == "false"
    # The platform token may not read memory; no connection: 404.
    reply = await eleven.api.call("GET", f"{BASE}/callers/{CALLER}/memory", token=eleven.platform)
    assert reply.status == 403
    assert (await eleven.api.call("DELETE", f"{BASE}/platforms/elevenlabs", token=eleven.admin)).status == 204
    assert (await eleven.initiate()).status == 404
    assert (
        await eleven.send(eleven.event("post_call_transcription", eleven.conversation_data(None)))
    ).status == 404


async def test_the_initiation_fails_open_with_every_variable_while_the_store_is_down(
    clock: FakeClock,
) -> None:
    with RedisServer() as server:
        async with (
            receiver() as hook,
            running_api(server.url, clock, **eleven_settings(store_timeout=0.3)) as api,
        ):
            eleven = await open_eleven(api, hook)
            assert_initiation_answer((await eleven.initiate()).body)  # the connection seen once
            server.stop()
            for _ in range(3):
                began = time.monotonic()
                reply = await eleven.initiate()
                assert time.monotonic() - began < 1.0
                assert reply.status == 200, reply.body
                variables = assert_initiation_answer(reply.body)
                assert variables["caller_memory"] == "" and variables["memory_caller_name"] == ""
