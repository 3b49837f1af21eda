"""Telnyx's webhooks built with the telnyx package's own types (``telnyx.types.CallInitiatedWebhookEvent``,
``CallHangupWebhookEvent``, ``CallConversationEndedWebhookEvent``, ``CallConversationInsightsGeneratedWebhookEvent``
and their payloads), signed with a generated Ed25519 key, through a real server on SQLite and Redis; whether a
signature is good is cross-checked with the package's own ``webhooks.unwrap`` (docs/telnyx.md; the server-side
tests with hand-built payloads: tests/platforms/test_telnyx_webhooks.py, whose fixture this file uses).

Run in .venv-vendors (scripts/vendors): ``.venv-vendors/bin/pytest -q -p no:cacheprovider
tests/vendors/test_telnyx.py``."""

from __future__ import annotations

import base64
import time
import typing
from datetime import UTC, datetime
from typing import Any
from unittest import mock

import orjson
import pytest
from caller_memory.service.domain.platforms.verification import SignatureRefused
from caller_memory.service.platforms import telnyx as adapter
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from telnyx import Telnyx as TelnyxClient
from telnyx.types import (
    CallConversationEnded,
    CallConversationEndedWebhookEvent,
    CallConversationInsightsGenerated,
    CallConversationInsightsGeneratedWebhookEvent,
    CallHangup,
    CallHangupWebhookEvent,
    CallInitiated,
    CallInitiatedWebhookEvent,
)
from telnyx.types import call_conversation_ended as ended_types
from telnyx.types import call_conversation_insights_generated as insight_types
from telnyx.types import call_hangup as hangup_types
from telnyx.types import call_initiated as initiated_types

from tests.conftest import Reply, canonical_digits
from tests.http.test_webhooks import eventually
from tests.platforms.test_telnyx_webhooks import (
    CALLER,
    EVENTS,
    INSIGHTS,
    KEY,
    MESSAGES,
    OTHER_KEY,
    SHOP_NUMBER,
    VARIABLES,
    Telnyx,
    public_key,
    sign,
    telnyx,
    variables_of,
)

__all__ = ["telnyx"]  # the fixture, used by name

CLIENT = TelnyxClient(api_key="KEY-not-used", public_key=public_key())


def telnyx_accepts(body: bytes, headers: dict[str, str], now_s: float) -> bool:
    """What the telnyx package's ``webhooks.unwrap`` says of the delivery at ``now_s`` (it reads the wall
    clock: set to the service's)."""
    with mock.patch("time.time", return_value=now_s):
        try:
            CLIENT.webhooks.unwrap(body.decode(), headers=headers)
        except ValueError:
            return False
    return True


async def send(
    telnyx: Telnyx, path: str, body: bytes, *, key: Ed25519PrivateKey = KEY, at_s: int | None = None
) -> Reply:
    """``body`` signed (at the service's time unless ``at_s``); what the service answers agrees with what the
    telnyx package's ``unwrap`` says of the same delivery at that time."""
    now_ms = telnyx.clock.now_ms()
    headers = sign(body, key, now_ms // 1000 if at_s is None else at_s)
    reply = await telnyx.post(path, body, headers=headers)
    # At the same instant as the service (the SDK compares its float seconds with the whole ones sent).
    assert (reply.status != 401) == telnyx_accepts(body, headers, now_ms / 1000), reply.body
    return reply


def _iso(telnyx: Telnyx) -> datetime:
    """The service's now, as the events' ``occurred_at`` (whole seconds, UTC)."""
    return datetime.fromtimestamp(telnyx.clock.now_ms() // 1000, tz=UTC)


def initiated(telnyx: Telnyx, session: str, attestation: str, validated: bool = True) -> bytes:
    payload = initiated_types.Payload(
        call_control_id=f"v3:{session}-leg",
        call_leg_id=f"{session}-leg",
        call_session_id=session,
        connection_id="1289082222292239760",
        direction="incoming",
        state="parked",
        to=SHOP_NUMBER,
        shaken_stir_attestation=attestation,
        shaken_stir_validated=validated,
    ).model_copy(update={"from_": CALLER})  # `from` by its Python name
    event = CallInitiatedWebhookEvent(
        data=CallInitiated(
            id=f"init-{session}-{attestation}",
            event_type="call.initiated",
            occurred_at=_iso(telnyx),
            payload=payload,
            record_type="event",
        )
    )
    return event.to_json(indent=None).encode()


def hangup(telnyx: Telnyx, session: str, cause: Any = "normal_clearing") -> bytes:
    payload = hangup_types.Payload(
        call_control_id=f"v3:{session}-leg",
        call_session_id=session,
        hangup_cause=cause,
        hangup_source="caller",
        sip_hangup_cause="unspecified",
        state="hangup",
        to=SHOP_NUMBER,
    ).model_copy(update={"from_": CALLER})  # `from` by its Python name
    event = CallHangupWebhookEvent(
        data=CallHangup(
            id=f"hangup-{session}",
            event_type="call.hangup",
            occurred_at=_iso(telnyx),
            payload=payload,
            record_type="event",
        )
    )
    return event.to_json(indent=None).encode()


def conversation_ended(telnyx: Telnyx, session: str, messages: list[dict[str, Any]] = MESSAGES) -> bytes:
    payload = ended_types.Payload(
        assistant_id="assistant-2f1c",
        call_control_id=f"v3:{session}-leg",
        call_session_id=session,
        calling_party_type="pstn",
        duration_sec=94,
        messages=[ended_types.PayloadMessage(**m) for m in messages],
        reason="user_hangup",
        to=SHOP_NUMBER,
    ).model_copy(update={"from_": CALLER})  # `from` by its Python name
    event = CallConversationEndedWebhookEvent(
        data=CallConversationEnded(
            id=f"ended-{session}",
            event_type="call.conversation.ended",
            occurred_at=_iso(telnyx),
            payload=payload,
            record_type="event",
        )
    )
    return event.to_json(indent=None).encode()


def insights(telnyx: Telnyx, session: str) -> bytes:
    payload = insight_types.Payload(
        call_control_id=f"v3:{session}-leg",
        call_session_id=session,
        calling_party_type="pstn",
        results=[insight_types.PayloadResult(**r) for r in INSIGHTS],
    )
    event = CallConversationInsightsGeneratedWebhookEvent(
        data=CallConversationInsightsGenerated(
            id=f"insights-{session}",
            event_type="call.conversation_insights.generated",
            occurred_at=_iso(telnyx),
            payload=payload,
            record_type="event",
        )
    )
    return event.to_json(indent=None).encode()


def initialization(telnyx: Telnyx, session: str) -> bytes:
    """The dynamic-variables webhook (the telnyx package has no type for it: Telnyx's "Dynamic Variables"
    guide documents it)."""
    return orjson.dumps(telnyx.initialization(session))


@pytest.mark.parametrize(("attestation", "sensitive"), [("A", True), ("B", False), ("C", False)])
async def test_a_call_attested_by_telnyx_gets_its_sensitive_fields_only_at_a(
    telnyx: Telnyx, attestation: str, sensitive: bool
) -> None:
    await telnyx.remember(caller_name="Ada", balance="42.10 EUR")
    session = "428c31b6-abf3-3bc1-b7f4-5013ef9657c1"
    assert (await send(telnyx, EVENTS, initiated(telnyx, session, attestation))).body == {
        "outcome": "attested"
    }
    variables = variables_of(await send(telnyx, VARIABLES, initialization(telnyx, session)))
    assert variables["memory_caller_name"] == "Ada"
    assert variables["memory_balance"] == ("42.10 EUR" if sensitive else "")
    assert ("42.10 EUR" in variables["caller_memory"]) is sensitive


async def test_a_call_built_by_the_telnyx_package_is_remembered_once(telnyx: Telnyx) -> None:
    session = "817f8c2a-728a-11ea-9cbe-02420a0f8969"
    conversation = f"telnyx:{session}"
    await send(telnyx, EVENTS, initiated(telnyx, session, "A"))
    variables_of(await send(telnyx, VARIABLES, initialization(telnyx, session)))
    telnyx.clock.advance(95)
    for body, outcome in (
        (conversation_ended(telnyx, session), "held"),
        (hangup(telnyx, session), "held"),
        (insights(telnyx, session), "ended"),
        (hangup(telnyx, session), "duplicate"),
    ):
        assert (await send(telnyx, EVENTS, body)).body["outcome"] == outcome
    assert await telnyx.transcript(conversation) == [
        ("assistant", "Cheese shop, how can I help?"),
        ("user", "Hi, this is Ada. Do you have Brie?"),
        ("assistant", "We do, a ripe one."),
    ]
    status = await telnyx.status(conversation)
    assert status["ended_by"] == "explicit" and status["end_reason"] == "completed"
    assert await telnyx.memory() == {"caller_name": "Ada", "cheese": "Brie"}
    (row,) = await telnyx.analytics()
    assert row["qa"] == "true"
    await eventually(lambda: len(telnyx.hook.events("conversation.ended")) == 1)
    assert canonical_digits(CALLER) not in orjson.dumps(telnyx.hook.events()).decode()


def test_the_end_reason_table_covers_every_value_of_the_telnyx_package() -> None:
    cause = typing.get_args(hangup_types.Payload.model_fields["hangup_cause"].annotation)
    (literal,) = [a for a in cause if typing.get_origin(a) is typing.Literal]
    values = set(typing.get_args(literal))
    assert values - {"unspecified"} == set(adapter.END_REASONS)
    assert "unspecified" not in adapter.END_REASONS


def test_the_roles_kept_are_the_telnyx_packages_conversation_roles() -> None:
    role = typing.get_args(ended_types.PayloadMessage.model_fields["role"].annotation)
    (literal,) = [a for a in role if typing.get_origin(a) is typing.Literal]
    assert set(typing.get_args(literal)) - {"system", "developer"} == set(adapter.ROLES)


@pytest.mark.parametrize("cause", ["time_limit", "call_rejected", "unspecified"])
async def test_one_hang_up_per_end_reason_class(telnyx: Telnyx, cause: str) -> None:
    session = f"c1a0b2d3-0000-4000-8000-{abs(hash(cause)) % 10**12:012d}"
    variables_of(await send(telnyx, VARIABLES, initialization(telnyx, session)))
    telnyx.clock.advance(60)
    assert (await send(telnyx, EVENTS, hangup(telnyx, session, cause))).body["outcome"] == "held"
    assert (await send(telnyx, EVENTS, insights(telnyx, session))).body["outcome"] == "ended"
    assert (await telnyx.status(f"telnyx:{session}")).get("end_reason") == adapter.END_REASONS.get(cause)


async def test_forged_and_expired_signatures_are_refused_as_the_telnyx_package_refuses_them(
    telnyx: Telnyx,
) -> None:
    session = "0a1b2c3d-0000-4000-8000-000000000007"
    now_s = telnyx.clock.now_ms() // 1000
    body = initiated(telnyx, session, "A")
    assert (await send(telnyx, EVENTS, body, key=OTHER_KEY)).status == 401
    assert (await send(telnyx, EVENTS, body, at_s=now_s - 301)).status == 401
    assert (await send(telnyx, EVENTS, body, at_s=now_s + 301)).status == 401
    assert (await send(telnyx, EVENTS, body, at_s=now_s - 299)).status == 200
    assert (await send(telnyx, VARIABLES, initialization(telnyx, session), key=OTHER_KEY)).status == 401
    assert await telnyx.conversations() == []


def test_our_verification_agrees_with_the_telnyx_packages_unwrap() -> None:
    body = b'{"data": {"event_type": "call.hangup", "id": "e-1", "payload": {}}}'
    now_s = int(time.time())
    good = sign(body, KEY, now_s)
    cases: list[tuple[bytes, dict[str, str]]] = [
        (body, good),
        (body + b" ", good),
        (body, sign(body, OTHER_KEY, now_s)),
        (body, sign(body, KEY, now_s - 300)),
        (body, sign(body, KEY, now_s - 301)),
        (body, sign(body, KEY, now_s + 301)),
        (body, good | {"telnyx-timestamp": str(now_s + 1)}),
        (body, good | {"telnyx-signature-ed25519": "not base64!"}),
        (body, good | {"telnyx-signature-ed25519": base64.b64encode(b"\0" * 63).decode()}),
        (body, good | {"telnyx-timestamp": "soon"}),
        ('{"x": "é"}'.encode(), sign('{"x": "é"}'.encode(), KEY, now_s)),
    ]
    for sent, headers in cases:
        try:
            adapter.verify(
                public_key(),
                sent,
                headers.get(adapter.SIGNATURE_HEADER),
                headers.get(adapter.TIMESTAMP_HEADER),
                now_s * 1000,
            )
            ours = True
        except SignatureRefused:
            ours = False
        assert ours == telnyx_accepts(sent, headers, now_s), (sent, headers)


async def test_a_one_mib_conversation_built_by_the_telnyx_package_is_taken(telnyx: Telnyx) -> None:
    session = "1b2c3d4e-0000-4000-8000-000000000008"
    variables_of(await send(telnyx, VARIABLES, initialization(telnyx, session)))
    telnyx.clock.advance(60)
    messages = [
        {"role": "user" if i % 2 else "assistant", "content": f"Turn {i}: " + "more cheese " * 160}
        for i in range(560)
    ]
    body = conversation_ended(telnyx, session, messages)
    assert len(body) >= 1 << 20
    assert (await send(telnyx, EVENTS, body)).body["outcome"] == "held"
    assert (await send(telnyx, EVENTS, insights(telnyx, session))).body["outcome"] == "ended"
    assert (await telnyx.status(f"telnyx:{session}"))["messages"] == 560
