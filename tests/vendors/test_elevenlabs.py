"""ElevenLabs Agents with the vendor's own SDK (``elevenlabs`` 2.78.0, pinned in scripts/vendors): the post-call
payloads are built with its types (``GetConversationResponseModel`` and its transcript, metadata, phone-call and
analysis models) and serialised as its own code does, the signature Caller Memory checks is checked by the SDK's
``client.webhooks.construct_event`` too (and what Caller Memory refuses beyond it: a time in the future); the
initiation's answer parses as the SDK's ``ConversationInitiationClientDataRequestInput``, also when memory fails
open; and the answer's ``custom_llm_extra_body``, sent back as ElevenLabs sends it (``elevenlabs_extra_body``),
binds a memory-proxy request to the call's conversation.

Run with ``.venv-vendors/bin/pytest -q -p no:cacheprovider tests/vendors/test_elevenlabs.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from caller_memory.service.domain.clock import FakeClock
from elevenlabs import ElevenLabs
from elevenlabs.errors import BadRequestError
from elevenlabs.types import (
    ConversationHistoryAnalysisCommonModel,
    ConversationHistoryMetadataCommonModel,
    ConversationHistoryMetadataCommonModelPhoneCall_Twilio,
    ConversationHistoryTranscriptResponseModel,
    ConversationInitiationClientDataRequestInput,
    ConversationInitiationClientDataRequestOutput,
    DataCollectionResultCommonModel,
    GetConversationResponseModel,
)

from tests.conftest import running_api
from tests.http.test_webhooks import receiver
from tests.platforms.test_elevenlabs_webhooks import (
    AGENT_NUMBER,
    AGENT_VARIABLES,
    BASE,
    CALLER,
    SECRET,
    Eleven,
    assert_initiation_answer,
    eleven_settings,
    open_eleven,
    sign,
)
from tests.proxy.upstream import upstream
from tests.support.redis_server import RedisServer


@pytest.fixture
async def eleven(store_url: str) -> AsyncIterator[Eleven]:
    # The SDK's helper reads the wall clock: the service's starts there too.
    clock = FakeClock()
    async with receiver() as hook, running_api(store_url, clock, **eleven_settings()) as api:
        yield await open_eleven(api, hook)


def conversation(conversation_id: str | None, *, start: int) -> GetConversationResponseModel:
    """A finished phone call as ElevenLabs' GET-conversation model (the post-call webhook's ``data``)."""
    client = None
    if conversation_id is not None:
        client = ConversationInitiationClientDataRequestOutput(
            dynamic_variables={"caller_memory_conversation": conversation_id, "store_hours": "9-5"},
            custom_llm_extra_body={"caller_memory_conversation": conversation_id},
        )
    return GetConversationResponseModel(
        agent_id="agent_01jz" + "a" * 22,
        conversation_id="conv_01jzsdk" + "0" * 16,
        status="done",
        has_audio=True,
        has_user_audio=True,
        has_response_audio=True,
        has_auxiliary_audio=False,
        transcript=[
            ConversationHistoryTranscriptResponseModel(
                role="agent", message="Cheese shop, how can I help?", time_in_call_secs=0
            ),
            ConversationHistoryTranscriptResponseModel(
                role="user", message="It's Ada, any Comté?", time_in_call_secs=2
            ),
            ConversationHistoryTranscriptResponseModel(
                role="agent",
                message="Yes, an eighteen",
                original_message="Yes, an eighteen-month one.",
                interrupted=True,
                time_in_call_secs=4,
            ),
        ],
        metadata=ConversationHistoryMetadataCommonModel(
            start_time_unix_secs=start,
            call_duration_secs=40,
            termination_reason="end_call tool was called.",
            phone_call=ConversationHistoryMetadataCommonModelPhoneCall_Twilio(
                type="twilio",
                direction="inbound",
                phone_number_id="phnum_01",
                agent_number=AGENT_NUMBER,
                external_number=CALLER,
                stream_sid="MZ" + "0" * 32,
                call_sid="CA" + "1" * 32,
                call_result="answered",
            ),
        ),
        analysis=ConversationHistoryAnalysisCommonModel(
            call_successful="success",
            transcript_summary="Ada asked for Comté.",
            data_collection_results={
                "customer_name": DataCollectionResultCommonModel(
                    data_collection_id="customer_name", value="Ada", rationale="She said so."
                ),
                "favourite_cheese": DataCollectionResultCommonModel(
                    data_collection_id="favourite_cheese", value="Comté", rationale="Asked."
                ),
            },
        ),
        conversation_initiation_client_data=client,
    )


def webhook_body(data: GetConversationResponseModel, kind: str = "post_call_transcription") -> bytes:
    """The envelope (the SDK has no type for it) around ``data`` as the SDK serialises it (its JSON dump goes
    through its own serializer: aliases, set fields only)."""
    return orjson.dumps(
        {"type": kind, "event_timestamp": int(time.time()), "data": data.model_dump(mode="json")}
    )


async def test_sdk_built_end_signed_and_cross_checked_by_the_sdk(eleven: Eleven) -> None:
    reply = await eleven.initiate()
    answer = reply.body
    variables = assert_initiation_answer(answer)
    # The answer is what the SDK's initiation-data model takes (it has no `type`: ElevenLabs' docs add it).
    parsed = ConversationInitiationClientDataRequestInput.model_validate(
        {k: v for k, v in answer.items() if k != "type"}
    )
    assert parsed.dynamic_variables is not None and set(AGENT_VARIABLES) <= set(parsed.dynamic_variables)
    assert parsed.custom_llm_extra_body == answer["custom_llm_extra_body"]
    named = variables["caller_memory_conversation"]

    body = webhook_body(conversation(named, start=int(time.time()) - 45))
    header = sign(body)
    # The SDK's own helper takes our signature (and our reading of what is signed).
    event = ElevenLabs(api_key="unused").webhooks.construct_event(body.decode(), header, SECRET)
    assert event["data"]["conversation_id"].startswith("conv_")
    reply = await eleven.send(body, signature=header)
    assert reply.status == 200 and reply.body == {"outcome": "ended", "conversation_id": named}
    said = await eleven.transcript(named)
    assert [(m["role"], m["content"]) for m in said] == [
        ("assistant", "Cheese shop, how can I help?"),
        ("user", "It's Ada, any Comté?"),
        ("assistant", "Yes, an eighteen"),
    ]
    assert said[2]["metadata"]["original"] == "Yes, an eighteen-month one."
    assert await eleven.memory() == {"caller_name": "Ada", "cheese": "Comté"}
    status = (await eleven.status(named)).body
    assert status["end_reason"] == "completed" and status["summary"] is not None

    again = assert_initiation_answer((await eleven.initiate()).body)
    assert again["memory_caller_name"] == "Ada" and again["returning_caller"] == "true"


async def test_what_the_sdk_and_caller_memory_refuse(eleven: Eleven) -> None:
    helper = ElevenLabs(api_key="unused").webhooks
    body = webhook_body(conversation(None, start=int(time.time()) - 45))
    now = int(time.time())
    stale, ahead, forged = sign(body, at=now - 31 * 60), sign(body, at=now + 3600), sign(body, "other-secret")
    for header in (stale, forged):
        with pytest.raises(BadRequestError):
            helper.construct_event(body.decode(), header, SECRET)
        assert (await eleven.send(body, signature=header)).status == 401
    # The SDK accepts a time an hour ahead; Caller Memory allows 5 minutes (SPEC 15).
    helper.construct_event(body.decode(), ahead, SECRET)
    assert (await eleven.send(body, signature=ahead)).status == 401
    # Nothing was stored: the genuine one starts and ends the call (its initiation never came).
    reply = await eleven.send(body)
    assert reply.body["outcome"] == "started_and_ended"
    assert (await eleven.send(body)).status == 401  # and again: a replay


async def test_the_initiation_answer_binds_the_memory_proxy(store_url: str) -> None:
    async with (
        upstream() as up,
        receiver() as hook,
        running_api(store_url, FakeClock(), **eleven_settings()) as api,
    ):
        eleven = await open_eleven(api, hook)
        reply = await api.call(
            "PUT",
            BASE + "/llm",
            token=eleven.admin,
            json={"base_url": up.url, "api_key": "sk-up-" + "k" * 20},
        )
        assert reply.status == 201, reply.body
        reply = await api.call(
            "PATCH", f"{BASE}/callers/{CALLER}/memory", token=eleven.admin, json={"cheese": "Brie"}
        )
        assert reply.status == 200, reply.body
        answer = (await eleven.initiate()).body
        named = answer["dynamic_variables"]["caller_memory_conversation"]
        # ElevenLabs' custom-LLM request: the prompt with the variables filled in, and the initiation's
        # custom_llm_extra_body sent back as elevenlabs_extra_body; the platform token as the API key.
        completion: dict[str, Any] = {
            "model": "gpt-4o-mini",
            "stream": False,
            "messages": [
                {"role": "system", "content": "You are the cheese shop's agent."},
                {"role": "user", "content": "Hello, it's me again"},
            ],
            "elevenlabs_extra_body": answer["custom_llm_extra_body"],
        }
        reply = await api.call("POST", f"{BASE}/llm/chat/completions", token=eleven.platform, json=completion)
        assert reply.status == 200, reply.body
        assert reply.headers["X-Caller-Memory"] == "bound"
        sent = up.got[-1].document
        assert "elevenlabs_extra_body" not in sent
        assert any('"cheese":"Brie"' in str(m.get("content")) for m in sent["messages"])
        # The turn is recorded in the initiation's conversation (after the answer: waited for).
        for _ in range(250):
            said = await eleven.transcript(named)
            if said:
                break
            await asyncio.sleep(0.02)
        assert [(m["role"], m["content"]) for m in said] == [("user", "Hello, it's me again")]


async def test_the_fail_open_answer_is_the_sdks_shape_while_the_store_is_down() -> None:
    with RedisServer() as server:
        async with (
            receiver() as hook,
            running_api(server.url, FakeClock(), **eleven_settings(store_timeout=0.3)) as api,
        ):
            eleven = await open_eleven(api, hook)
            assert_initiation_answer((await eleven.initiate()).body)
            server.stop()
            began = time.monotonic()
            reply = await eleven.initiate()
            assert time.monotonic() - began < 1.0 and reply.status == 200
            parsed = ConversationInitiationClientDataRequestInput.model_validate(
                {k: v for k, v in reply.body.items() if k != "type"}
            )
            assert parsed.dynamic_variables is not None
            assert set(AGENT_VARIABLES) <= set(parsed.dynamic_variables)
            assert all(v == "" for k, v in parsed.dynamic_variables.items() if k.startswith("memory_"))
