"""Vapi's server messages built with vapi-server-sdk 3.0.0's own types (SPEC section 15; docs/vapi.md): the
``assistant-request``, ``status-update`` and ``end-of-call-report`` a call makes, dumped as the SDK dumps them
(camelCase, its datetimes), signed as Vapi's HMAC credential signs by default (the SDK has no signing helper:
``x-signature`` is the hex HMAC-SHA256 of ``{x-timestamp}.{body}``), through the real service on SQLite and
Redis. The answer to ``assistant-request`` is read back with the SDK's ``ServerMessageResponseAssistantRequest``;
every ``endedReason`` the SDK knows is classified; and a custom-LLM request carrying the SDK's ``Call`` binds
to the conversation the ``assistant-request`` started (the memory proxy).

Run in .venv-vendors (scripts/vendors): the SDK caps pydantic-core below the main virtualenv's."""

from __future__ import annotations

import asyncio
import typing
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.platforms.vapi import end_reason
from vapi.types import (
    Analysis,
    Artifact,
    BotMessage,
    Call,
    CreateCustomerDto,
    ServerMessageAssistantRequest,
    ServerMessageEndOfCallReport,
    ServerMessageResponseAssistantRequest,
    ServerMessageStatusUpdate,
    SystemMessage,
    ToolCallMessage,
    ToolCallResultMessage,
    UserMessage,
)
from vapi.types.call_ended_reason import CallEndedReason
from vapi.types.server_message_end_of_call_report_ended_reason import ServerMessageEndOfCallReportEndedReason
from vapi.types.server_message_status_update_ended_reason import ServerMessageStatusUpdateEndedReason

from tests.conftest import TEST_NUMBERS, canonical_digits, running_api
from tests.http.test_webhooks import eventually, receiver
from tests.platforms.test_vapi_events import (
    ASSISTANT,
    BASE,
    CALLER,
    SAID,
    STRUCTURED,
    VARIABLES,
    Vapi,
    open_vapi,
    vapi_settings,
)
from tests.proxy.upstream import upstream


def literals(union: Any) -> list[str]:
    """The string values of one of the SDK's ``Union[Literal[...], Any]`` enums."""
    found: list[str] = []
    for arm in typing.get_args(union) or (union,):
        if typing.get_origin(arm) is typing.Literal:
            found.extend(typing.get_args(arm))
    return found


def test_every_ended_reason_the_sdk_knows_has_its_class() -> None:
    reasons = literals(ServerMessageEndOfCallReportEndedReason)
    assert len(reasons) == 604
    assert (
        set(reasons) == set(literals(ServerMessageStatusUpdateEndedReason)) == set(literals(CallEndedReason))
    )
    classes = {reason: end_reason(reason) for reason in reasons}
    assert Counter(classes.values()) == {"dropped": 577, "completed": 13, "transferred": 4, None: 10}
    assert all(classes[r] == "dropped" for r in reasons if "error" in r)
    assert all(classes[r] == "completed" for r in reasons if r.startswith("customer-ended-call"))
    assert {r for r in reasons if classes[r] == "transferred"} == {
        "assistant-forwarded-call",
        "assistant-request-returned-forwarding-phone-number",
        "call.ringing.hook-executed-transfer",
        "call.ending.hook-executed-transfer",
    }
    assert {r for r in reasons if classes[r] is None} == {
        "customer-busy",
        "customer-did-not-answer",
        "voicemail",
        "vonage-rejected",
        "twilio-reported-customer-misdialed",
        "sip-outbound-unallocated-number",
        "phone-call-provider-bypass-enabled-but-no-call-received",
        "manually-canceled",
        "call-deleted",
        "scheduled-call-deleted",
    }


class SdkVapi:
    """The messages of a call, made of the SDK's types."""

    def __init__(self, vapi: Vapi) -> None:
        self.vapi = vapi

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.vapi.api.clock.now_ms() / 1000, UTC)

    def call(self, call_id: str) -> Call:
        now = self.now()
        return Call(
            id=call_id,
            org_id="org-1",
            created_at=now,
            updated_at=now,
            type="inboundPhoneCall",
            customer=CreateCustomerDto(number=CALLER),
        )

    @staticmethod
    def dumped(message: Any) -> dict[str, Any]:
        return {"message": message.model_dump(mode="json")}

    def assistant_request(self, call_id: str) -> dict[str, Any]:
        return self.dumped(
            ServerMessageAssistantRequest(
                type="assistant-request",
                timestamp=float(self.vapi.api.clock.now_ms()),
                call=self.call(call_id),
                customer=CreateCustomerDto(number=CALLER),
            )
        )

    def status_ended(self, call_id: str, reason: str = "customer-ended-call") -> dict[str, Any]:
        return self.dumped(
            ServerMessageStatusUpdate(
                type="status-update",
                status="ended",
                ended_reason=reason,
                timestamp=float(self.vapi.api.clock.now_ms()),
                call=self.call(call_id),
            )
        )

    def report(self, call_id: str, reason: str = "customer-ended-call") -> dict[str, Any]:
        now = self.now()
        messages: list[UserMessage | SystemMessage | BotMessage | ToolCallMessage | ToolCallResultMessage] = [
            SystemMessage(
                role="system", message="You are the cheese shop's assistant.", time=1, seconds_from_start=0
            ),
            BotMessage(role="bot", message=SAID[0][1], time=2, end_time=3, seconds_from_start=0.5),
            UserMessage(role="user", message=SAID[1][1], time=4, end_time=5, seconds_from_start=2),
            ToolCallMessage(
                role="tool_calls",
                tool_calls=[
                    {"id": "t1", "type": "function", "function": {"name": "stock", "arguments": "{}"}}
                ],
                message="",
                time=6,
                seconds_from_start=3,
            ),
            ToolCallResultMessage(
                role="tool_call_result",
                tool_call_id="t1",
                name="stock",
                result=SAID[2][1],
                time=7,
                seconds_from_start=3.5,
            ),
            BotMessage(role="bot", message=SAID[3][1], time=8, end_time=9, seconds_from_start=4),
        ]
        return self.dumped(
            ServerMessageEndOfCallReport(
                type="end-of-call-report",
                ended_reason=reason,
                timestamp=float(self.vapi.api.clock.now_ms()),
                started_at=now - timedelta(seconds=90),
                ended_at=now - timedelta(seconds=1),
                artifact=Artifact(messages=messages, transcript="..."),
                analysis=Analysis(summary="Ada asked for Stilton; we have it.", structured_data=STRUCTURED),
                call=self.call(call_id),
                customer=CreateCustomerDto(number=CALLER),
            )
        )


@pytest.fixture
async def sdk(store_url: str, clock: FakeClock) -> AsyncIterator[SdkVapi]:
    async with receiver() as hook, running_api(store_url, clock, **vapi_settings()) as api:
        yield SdkVapi(await open_vapi(api, hook))


def answer_of(body: dict[str, Any]) -> dict[str, str]:
    """The answer read with the SDK's own type (nothing it does not know, the variables strings)."""
    answer = ServerMessageResponseAssistantRequest.model_validate(body)
    assert answer.assistant_id == ASSISTANT and answer.assistant_overrides is not None
    assert set(body) == {"assistantId", "assistantOverrides"}
    variables = answer.assistant_overrides.variable_values
    assert isinstance(variables, dict) and set(variables) == VARIABLES
    assert all(isinstance(v, str) for v in variables.values())
    return variables


async def test_a_returning_callers_second_call_gets_the_first_calls_fields(sdk: SdkVapi) -> None:
    vapi = sdk.vapi
    first = str(uuid.uuid4())
    # Vapi sending the start again (signed anew) gets the same conversation.
    for n in range(2):
        reply = await vapi.send(sdk.assistant_request(first), timestamp=str(vapi.api.clock.now_ms() + n))
        assert answer_of(reply.body)["returning_caller"] == "false"
    vapi.api.clock.advance(90)
    assert (await vapi.send(sdk.status_ended(first))).body["outcome"] == "held"
    assert (await vapi.send(sdk.report(first))).body["outcome"] == "ended"
    assert await vapi.transcript(first) == SAID
    assert await vapi.memory() == {"caller_name": "Ada", "cheese": "Stilton"}
    vapi.api.clock.advance(3600)
    reply = await vapi.send(sdk.assistant_request(str(uuid.uuid4())))
    variables = answer_of(reply.body)
    assert variables["returning_caller"] == "true" and variables["memory_caller_name"] == "Ada"
    assert not TEST_NUMBERS.search(canonical_digits(orjson.dumps(reply.body).decode()))


@pytest.mark.parametrize("report_first", [True, False])
async def test_either_order_and_an_end_without_a_start_make_one_end(sdk: SdkVapi, report_first: bool) -> None:
    vapi = sdk.vapi
    call_id = str(uuid.uuid4())  # never started: the end starts it
    status, report = sdk.status_ended(call_id), sdk.report(call_id)
    for message in (report, status) if report_first else (status, report):
        assert (await vapi.send(message)).status == 200
    assert (await vapi.status(call_id)).body["end_reason"] == "completed"
    assert await vapi.transcript(call_id) == SAID
    assert len(await vapi.analytics()) == 1
    await eventually(lambda: len(vapi.hook.events("conversation.ended")) == 1)


async def test_a_custom_llm_request_with_the_sdks_call_binds_the_conversation_the_start_made(
    store_url: str, clock: FakeClock
) -> None:
    async with (
        receiver() as hook,
        upstream() as up,
        running_api(store_url, clock, **vapi_settings()) as api,
    ):
        sdk = SdkVapi(await open_vapi(api, hook))
        vapi = sdk.vapi
        reply = await api.call(
            "PUT", BASE + "/llm", token=vapi.admin, json={"base_url": up.url, "api_key": "sk-up"}
        )
        assert reply.status == 201, reply.body
        await api.call(
            "PATCH", f"{BASE}/callers/{CALLER}/memory", token=vapi.admin, json={"cheese": "Stilton"}
        )
        platform = await api.mint("cheese-shop", "platform")
        call_id = str(uuid.uuid4())
        assert (await vapi.send(sdk.assistant_request(call_id))).status == 200
        # What Vapi's custom LLM posts: the OpenAI request with the call (the SDK's Call), customer and more.
        body = {
            "model": "gpt-4o",
            "stream": False,
            "messages": [
                {"role": "system", "content": "You are the cheese shop's assistant."},
                {"role": "user", "content": "Any Stilton left?"},
            ],
            "call": sdk.call(call_id).model_dump(mode="json"),
            "customer": CreateCustomerDto(number=CALLER).model_dump(mode="json"),
            "metadata": {},
        }
        reply = await api.call("POST", f"{BASE}/llm/chat/completions", token=platform, json=body)
        assert reply.status == 200, reply.body
        assert reply.headers["X-Caller-Memory"] == "bound"
        sent = up.got[-1].document
        assert any(m.get("name") == "caller_memory" and "Stilton" in m["content"] for m in sent["messages"])
        assert not {"call", "customer", "metadata"} & set(sent)
        assert not TEST_NUMBERS.search(canonical_digits(up.got[-1].body.decode()))

        # The turn is recorded in the call's conversation (after the answer: polled).
        async def said() -> list[tuple[str, str]]:
            reply = await api.call("GET", f"{BASE}/conversations/vapi:{call_id}/history", token=vapi.agent)
            return [(m["role"], m["content"]) for m in reply.body["contents"]]

        for _ in range(250):
            if await said():
                break
            await asyncio.sleep(0.02)
        assert (await said())[:1] == [("user", "Any Stilton left?")]
