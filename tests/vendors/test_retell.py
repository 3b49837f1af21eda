"""Retell's webhooks built with retell-sdk 6.2.13's own types (``retell.types.PhoneCallResponse``,
``WebCallResponse`` and their nested models) and signed with its own helper
(``retell.lib.webhook_auth.symmetric["sign"]``), through a real server on SQLite and Redis; whether a signature
is good is cross-checked with retell-sdk's ``verify`` (docs/retell.md; the server-side tests with hand-built
payloads: tests/platforms/test_retell_webhooks.py, whose fixture this file uses).

Run in .venv-vendors (scripts/vendors): ``.venv-vendors/bin/pytest -q -p no:cacheprovider
tests/vendors/test_retell.py``."""

from __future__ import annotations

import time
import typing
from typing import Any

import orjson
import pytest
from caller_memory.service.app import scheduled_inactivity_ends
from caller_memory.service.domain.platforms.verification import SignatureRefused
from caller_memory.service.platforms import retell as adapter
from retell.lib.webhook_auth import symmetric, verify
from retell.types import PhoneCallResponse, WebCallResponse
from retell.types import web_call_response as web
from retell.types.phone_call_response import CallAnalysis, TranscriptObject, TranscriptObjectWord

from tests.conftest import Reply, canonical_digits
from tests.http.test_webhooks import eventually
from tests.platforms.test_retell_webhooks import (
    API_KEY,
    CALLER,
    EVENTS,
    INBOUND,
    SHOP_NUMBER,
    Retell,
    retell,
    started,
    variables_of,
)

__all__ = ["retell"]  # the fixture, used by name

SUMMARY = "Ada asked for Brie; it is in stock."


def sign(body: bytes, at_ms: int, key: str = API_KEY) -> str:
    """retell-sdk's own signature of ``body`` (its signer takes the body as text, as Retell's docs verify it)."""
    signature: str = symmetric["sign"](body.decode(), key, at_ms)
    return signature


def retell_accepts(body: bytes, signature: str, now_ms: int, key: str = API_KEY) -> bool:
    accepted: bool = symmetric["verify"](body.decode(), key, signature, {"timestamp": now_ms})
    return accepted


async def send(
    retell: Retell, path: str, document: dict[str, Any], *, key: str = API_KEY, at_ms: int | None = None
) -> Reply:
    """``document`` signed by retell-sdk (at the service's time unless ``at_ms``); what the service answers
    agrees with what retell-sdk's ``verify`` says of the same signature at that time."""
    body = orjson.dumps(document)
    now = retell.clock.now_ms()
    signature = sign(body, now if at_ms is None else at_ms, key)
    reply = await retell.post(path, body, sig=signature)
    assert (reply.status != 401) == retell_accepts(body, signature, now), reply.body
    return reply


def inbound_document(caller: str = CALLER) -> dict[str, Any]:
    """Retell's inbound webhook (retell-sdk has no type for it: docs.retellai.com/features/inbound-call-webhook)."""
    return {
        "event": "call_inbound",
        "call_inbound": {
            "agent_id": "agent_9f2c",
            "agent_version": 3,
            "from_number": caller,
            "to_number": SHOP_NUMBER,
        },
    }


def phone_call(retell: Retell, call_id: str, conversation: str | None, **fields: Any) -> PhoneCallResponse:
    now = retell.clock.now_ms()
    words = [TranscriptObjectWord(word="Brie", start=2.0, end=2.3)]
    values: dict[str, Any] = {
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
        "transcript_object": [
            TranscriptObject(role="agent", content="Cheese shop, how can I help?", words=[]),
            TranscriptObject(role="user", content="Hi, this is Ada. Do you have Brie?", words=words),
            TranscriptObject(role="agent", content="We do, a ripe one.", words=[]),
        ],
        "metadata": None if conversation is None else {"caller_memory_conversation": conversation},
    }
    values.update(fields)
    return PhoneCallResponse(**values)


def analysis() -> CallAnalysis:
    return CallAnalysis(
        call_summary=SUMMARY,
        call_successful=True,
        user_sentiment="Positive",
        in_voicemail=False,
        custom_analysis_data={"customer_name": "Ada", "favourite_cheese": "Brie"},
    )


def event(kind: str, call: PhoneCallResponse | WebCallResponse) -> dict[str, Any]:
    """Retell's envelope: ``call_ended`` carries the call without ``call_analysis``, ``call_analyzed`` with it."""
    dumped = call.to_dict(mode="json", exclude_none=True)
    if kind != "call_analyzed":
        dumped.pop("call_analysis", None)
    return {"event": kind, "call": dumped}


@pytest.mark.parametrize("analysis_first", [False, True])
async def test_a_call_built_by_retell_sdk_is_remembered_for_the_next(
    retell: Retell, analysis_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    variables, conversation = variables_of(await send(retell, INBOUND, inbound_document()))
    assert conversation is not None and variables["returning_caller"] == "false"
    retell.clock.advance(2)
    _, retried = variables_of(await send(retell, INBOUND, inbound_document()))
    assert retried == conversation  # Retell's retry of the inbound webhook: one conversation
    retell.clock.advance(95)
    call = phone_call(retell, "call_5dd1", conversation, call_analysis=analysis())
    kinds = ["call_analyzed", "call_ended"] if analysis_first else ["call_ended", "call_analyzed"]
    outcomes = [(await send(retell, EVENTS, event(kind, call))).body["outcome"] for kind in kinds]
    assert outcomes == (["ended", "duplicate"] if analysis_first else ["held", "ended"])
    assert (await send(retell, EVENTS, event(kinds[0], call))).body == {"outcome": "duplicate"}
    assert await retell.transcript(conversation) == [
        ("assistant", "Cheese shop, how can I help?"),
        ("user", "Hi, this is Ada. Do you have Brie?"),
        ("assistant", "We do, a ripe one."),
    ]
    assert await retell.summary(conversation) == SUMMARY
    assert await retell.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    (row,) = await retell.analytics()
    assert row["qa"] == "true"
    await eventually(lambda: len(retell.hook.events("conversation.ended")) == 1)
    retell.clock.advance(601)
    await scheduled_inactivity_ends(retell.api.app)
    assert len(await retell.analytics()) == 1 and len(retell.hook.events("conversation.ended")) == 1
    retell.clock.advance(3600)
    variables, _ = variables_of(await send(retell, INBOUND, inbound_document()))
    assert variables["returning_caller"] == "true"
    assert (variables["memory_caller_name"], variables["memory_cheese"]) == ("Ada", "Brie")
    assert canonical_digits(CALLER) not in caplog.text


async def test_an_outbound_call_with_no_inbound_starts_and_ends_one(retell: Retell) -> None:
    call = phone_call(
        retell,
        "call_out7",
        None,
        direction="outbound",
        from_number=SHOP_NUMBER,
        to_number=CALLER,
        call_analysis=analysis(),
    )
    assert (await send(retell, EVENTS, event("call_ended", call))).body["outcome"] == "held"
    reply = await send(retell, EVENTS, event("call_analyzed", call))
    assert reply.body == {"outcome": "started_and_ended", "conversation_id": "retell:call_out7"}
    assert await retell.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    assert len(await retell.analytics()) == 1


async def test_a_web_call_naming_no_started_conversation_is_acknowledged(retell: Retell) -> None:
    call = WebCallResponse(
        access_token="eyJ.web.token",
        agent_id="agent_9f2c",
        agent_version=3,
        call_id="call_web1",
        call_status="ended",
        call_type="web_call",
        disconnection_reason="user_hangup",
        transcript_object=[web.TranscriptObject(role="user", content="Hello?", words=[])],
        call_analysis=web.CallAnalysis(call_summary=SUMMARY, custom_analysis_data={"customer_name": "Ada"}),
    )
    assert (await send(retell, EVENTS, event("call_analyzed", call))).body["outcome"] == "ignored"


def test_the_end_reason_table_covers_every_value_of_retell_sdk() -> None:
    for model in (PhoneCallResponse, WebCallResponse):
        annotation = model.model_fields["disconnection_reason"].annotation
        (literal,) = (a for a in typing.get_args(annotation) if a is not type(None))
        assert set(typing.get_args(literal)) == set(adapter.END_REASONS), model.__name__
    roles = typing.get_args(TranscriptObject.model_fields["role"].annotation)
    assert set(roles) == {*adapter.ROLES, "transfer_target"}


@pytest.mark.parametrize(
    ("reason", "end_reason"),
    [("agent_hangup", "completed"), ("error_asr", "dropped"), ("transfer_bridged", "transferred")],
)
async def test_one_event_per_end_reason_class(retell: Retell, reason: str, end_reason: str) -> None:
    conversation = await started(retell)
    retell.clock.advance(60)
    call = phone_call(
        retell,
        "call_r1",
        conversation,
        disconnection_reason=reason,
        transfer_destination="sip:cellar@shop.example;transport=tls",
        call_analysis=analysis(),
    )
    assert (await send(retell, EVENTS, event("call_analyzed", call))).body["outcome"] == "ended"
    assert (await retell.status(conversation))["end_reason"] == end_reason
    (row,) = await retell.analytics()
    assert row["handoff_to"] == "sip:cellar@shop.example"


async def test_forged_and_expired_signatures_are_refused_as_retell_sdk_refuses_them(retell: Retell) -> None:
    now = retell.clock.now_ms()
    call = phone_call(retell, "call_f1", None, call_analysis=analysis())
    attempts = [
        await send(retell, INBOUND, inbound_document(), key="key_another_" + "0" * 20),
        await send(retell, INBOUND, inbound_document(), at_ms=now - 5 * 60_000 - 1),
        await send(retell, EVENTS, event("call_analyzed", call), at_ms=now + 5 * 60_000 + 1),
        await send(retell, EVENTS, event("call_analyzed", call), key="key_another_" + "0" * 20),
    ]
    assert [reply.status for reply in attempts] == [401] * 4
    assert await retell.conversations() == [] and await retell.analytics() == []
    # Replayed: the same signed event again is a duplicate, applied once.
    body = orjson.dumps(event("call_analyzed", call))
    signature = sign(body, now)
    assert (await retell.post(EVENTS, body, sig=signature)).body["outcome"] == "started_and_ended"
    assert (await retell.post(EVENTS, body, sig=signature)).body == {"outcome": "duplicate"}
    assert len(await retell.analytics()) == 1


def test_our_verification_agrees_with_retell_sdks_verify() -> None:
    """What retell-sdk signs passes ours; ours and its ``verify`` refuse the same tampered signatures, the
    module's ``verify`` (the wall clock) included."""
    now = int(time.time() * 1000)
    body = orjson.dumps(event("call_analyzed", PhoneCallResponse.construct(**phone_call_fields(now))))
    good = sign(body, now)
    assert verify(body.decode(), API_KEY, good)
    assert adapter.verify(API_KEY, body, good, now) == now
    at, digest = good.split(",d=")
    variants = [
        sign(body, now, "key_other"),
        sign(body, now - 300_001),
        sign(body, now + 300_001),
        f"{at},d={digest.upper()}",
        f"{at},d={digest[:-1]}",
        f"v={int(at[2:]) + 1},d={digest}",
        digest,
    ]
    for signature in variants:
        assert not retell_accepts(body, signature, now), signature
        with pytest.raises(SignatureRefused):
            adapter.verify(API_KEY, body, signature, now)
    with pytest.raises(SignatureRefused):
        adapter.verify(API_KEY, body + b"\n", good, now)
    assert not retell_accepts(body + b"\n", good, now)


def phone_call_fields(now: int) -> dict[str, Any]:
    return {
        "call_id": "call_v1",
        "call_type": "phone_call",
        "agent_id": "agent_9f2c",
        "agent_version": 1,
        "call_status": "ended",
        "direction": "inbound",
        "from_number": CALLER,
        "to_number": SHOP_NUMBER,
        "end_timestamp": now,
        "transcript_object": [{"role": "user", "content": "Crème fraîche?", "words": []}],
    }


async def test_a_one_mib_call_built_by_retell_sdk_is_taken(retell: Retell) -> None:
    conversation = await started(retell)
    retell.clock.advance(60)
    words = [TranscriptObjectWord(word="cheese", start=i / 10, end=i / 10 + 0.05) for i in range(40)]
    utterances = [
        TranscriptObject(
            role="user" if i % 2 else "agent", content=f"Turn {i}: " + "more cheese " * 20, words=words
        )
        for i in range(560)
    ]
    call = phone_call(
        retell, "call_big", conversation, transcript_object=utterances, call_analysis=analysis()
    )
    document = event("call_analyzed", call)
    assert len(orjson.dumps(document)) >= 1 << 20
    reply = await send(retell, EVENTS, document)
    assert reply.status == 200 and reply.body["outcome"] == "ended", reply.body
    assert (await retell.status(conversation))["messages"] == 560
